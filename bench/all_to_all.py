"""The all-to-all of Ulysses sequence parallelism on CPU: seconds per exchange vs bytes.

Two gloo ranks (one process each, on this machine) exchange a tensor with the engine's own
`trainer.parallel.sequence.all_to_all` (all_to_all_single in equal chunks), as each layer's
attention does four times forward and four times backward. The effective bandwidth is what
the cost model's `hardware.intra_node_bandwidth` stands for (launcher/plan/cost.py: 2 GB/s for CPU
ranks by default).

    python -m bench.all_to_all [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MIB = (0.25, 1, 4, 16, 64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, repeats: int, out: dict) -> None:
    from trainer.parallel.sequence import all_to_all

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    rows = []
    for mib in SIZES_MIB:
        t = torch.ones(int(mib * 2**20) // 2, dtype=torch.bfloat16).reshape(world, -1)
        all_to_all(t, group)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            all_to_all(t, group)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        sent = t.numel() * t.element_size() * (world - 1) / world  # what leaves each rank
        rows.append({"mib": mib, "seconds": seconds, "sent_bytes_per_s": sent / seconds})
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, _free_port(), args.repeats, out), nprocs=2)
        rows = list(out["rows"])
    print("| tensor per rank | median s per all-to-all | sent GB/s per rank |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['mib']:g} MiB | {r['seconds'] * 1e3:.2f} ms | "
              f"{r['sent_bytes_per_s'] / 1e9:.2f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
