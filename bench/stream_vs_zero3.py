"""`stream` against `zero3_offload_params` on the same job, side by side.

    python -m bench.stream_vs_zero3 [--cpu-smoke] [--json PATH]

Each rung trains the same job through the real CLI (`launcher.cli.main(["train", ...])`), one
after another in one fresh interpreter, and the table gives tokens/s (median over the steps after
the first), the device peak (the run's `peak_device_bytes`; on CPU processes the resident set)
and the host peak (the rise of the process's high-water mark, VmHWM, over its resident set when
the rung started). On CPU (`--cpu-smoke`): a tiny
Llama in fp32, a few steps, and `stream`'s losses are checked against `zero3_offload_params`'s
(1e-4: the same math, another reduction order). On a GPU: a Llama-3.2-3B-shaped model in bf16,
2,048 tokens, and the measured pinned host-to-device copy
rate (what `hardware.pcie_bandwidth` and launcher/plan/cost.py's PCIE_BYTES_S stand for) and
torch's fused AdamW rate on this host's cores (TORCH_HOST_ADAM_PARAMS_S in
trainer/core/strategies.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import demo_job_file

REPO = Path(__file__).resolve().parent.parent
TINY = {"model_type": "llama", "vocab_size": 45, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}  # fmt: skip
LLAMA_3B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
            "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "tie_word_embeddings": True}  # fmt: skip


def _job(tmp: Path, cpu: bool) -> Path:
    train = {"steps": 2 if cpu else 6, "global_batch_size": 8 if cpu else 16,
             "micro_batch_size": 4 if cpu else 8, "lr": 1e-3}  # fmt: skip
    hardware = {"device": "cpu" if cpu else "cuda", "devices_per_node": 1}
    return demo_job_file(tmp, TINY if cpu else LLAMA_3B, 32 if cpu else 2048, train,
                         precision="fp32" if cpu else "bf16", hardware=hardware,
                         memory={"activation_checkpointing": "full"})  # fmt: skip


def run_rungs(job: Path, rungs: list[str], tmp: Path) -> list[dict]:
    """Each rung's run, one after another in ONE fresh interpreter (`--child`): the imports are
    paid once; each rung's host peak is its own rise of the process's high-water mark."""
    argv = [sys.executable, "-m", "bench.stream_vs_zero3", "--child", str(job), str(tmp),
            ",".join(rungs)]  # fmt: skip
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    rows = [json.loads(x.removeprefix(_ROW)) for x in r.stdout.splitlines() if x.startswith(_ROW)]
    for row in rows:
        lines = (tmp / row["strategy"] / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(x) for x in lines]
        later = [m["tokens_per_s"] for m in metrics[1:]] or [metrics[0]["tokens_per_s"]]
        row |= {
            "tokens_per_s": statistics.median(later),
            "device_peak_bytes": max(m["peak_device_bytes"] for m in metrics),
            "losses": [m["loss"] for m in metrics],
        }
    return rows


_ROW = "stream_vs_zero3 row: "


def _child(job: str, tmp: str, rungs: str) -> int:
    """The rungs in this process (the CLI runs a one-rank job in its own process with
    run.max_restarts=0), each one's host peak above the resident set it started from."""
    from launcher.cli import main as oomless
    from trainer.core import host_memory

    for rung in rungs.split(","):
        start = host_memory.rss_bytes()
        host_memory.reset_peak()
        code = oomless(["train", job, f"strategy={rung}", f"run.dir={tmp}/{rung}",
                        "run.max_restarts=0"])  # fmt: skip
        if code != 0:
            return code
        row = {"strategy": rung, "host_peak_bytes": host_memory.rss_peak_bytes() - start}
        print(_ROW + json.dumps(row), flush=True)
    return 0


def host_adam_params_s(num_params: int = 50_000_000, repeats: int = 3) -> float:
    """torch's fused AdamW on this host's CPU tensors, parameters per second."""
    import torch

    p = torch.nn.Parameter(torch.randn(num_params))
    p.grad = torch.randn(num_params)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    start = time.perf_counter()
    for _ in range(repeats):
        opt.step()
    return num_params * repeats / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(*args.child)
    cpu = args.cpu_smoke
    rungs = ["stream", "zero3_offload_params"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        job = _job(tmp, cpu)
        rows = run_rungs(job, rungs, tmp)
    adam_s = host_adam_params_s(5_000_000 if cpu else 50_000_000)
    result = {"device": "cpu" if cpu else "cuda", "rows": rows, "host_adam_params_s": adam_s}
    if not cpu:
        import torch

        from bench.common import copy_bandwidth

        result["transfer"] = copy_bandwidth(torch.device("cuda"))
    stream, zero3 = rows[0], rows[1]
    result["speedup_vs_zero3_offload_params"] = stream["tokens_per_s"] / zero3["tokens_per_s"]
    if cpu:  # the same math: stream learns what ZeRO-3 learns
        diffs = [abs(a - b) / b for a, b in zip(stream["losses"], zero3["losses"], strict=True)]
        result["max_relative_loss_difference"] = max(diffs)
        if max(diffs) > 1e-4:
            print(f"stream's losses differ from zero3_offload_params': {diffs}", file=sys.stderr)
            return 1
    print("| rung | tokens/s | device peak GiB | host peak GiB |\n|---|---|---|---|")
    for row in rows:
        host = row["host_peak_bytes"] or 0
        print(f"| {row['strategy']} | {row['tokens_per_s']:.0f} | "
              f"{row['device_peak_bytes'] / 2**30:.2f} | {host / 2**30:.2f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
