"""The memory estimate against real steps of the engine: peak allocated and reserved bytes.

    python -m bench.estimate_gpu                 # the GPU grid (CUDA required), ~3-5 min on an H100
    python -m bench.estimate_gpu --cpu-smoke     # the same code path on a tiny grid on the CPU
    python -m bench.estimate_gpu --only 3,7      # some runs of the grid (numbers as printed)

Every run is a fresh process (`--run JSON`): one rank (a process group of one), the engine's own
backend for the strategy (`single`, `fsdp`, `zero3_offload`, ...), two micro-batches per
optimizer step (the planner's accumulation case) and two steps; the second step is measured from
`torch.cuda.reset_peak_memory_stats` to its end, so AdamW's state already exists, as in the
estimate. Compared: the estimate's `peak_tensor_bytes` with `torch.cuda.max_memory_allocated`
and its `total_bytes` with `max_memory_reserved` plus the CUDA context (measured once per run as
the device's used memory before the model, `torch.cuda.mem_get_info`), with the caching allocator
as the launcher gives CUDA ranks (expandable segments, unless PYTORCH_CUDA_ALLOC_CONF or
PYTORCH_ALLOC_CONF is set: the estimate then counts the default allocator's reserve). The table
prints last; with `$OUT` set, `$OUT/estimate_gpu.json` holds every run's details. Target: the
estimate within +-10% of the measured peak and never more than 5% under it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import MODELS, machine
from launcher.estimate.peak import ALLOC_CONF_VARS, CUDA_CONTEXT_BYTES
from launcher.run.launch import EXPANDABLE_SEGMENTS
from trainer.core.step_spec import StepSpec
from trainer.core.units import GIB


@dataclass(frozen=True)
class Run:
    model: str  # a key of bench.common.MODELS
    strategy: str
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str
    grad_accum: int = 2
    precision: str = "bf16"
    compile: bool = False  # train.compile: the estimate counts the compiled layers' saved set


# >= 12 real runs: two sizes, micro-batch 1..4, seq 1024..4096, every checkpointing level,
# single / fsdp / zero3_offload at world 1 (and zero3 once).
GPU_GRID = (
    Run("llama-1b", "single", 1, 2048, "none"),
    Run("llama-1b", "single", 4, 2048, "full"),
    Run("llama-1b", "single", 2, 4096, "selective"),
    Run("llama-1b", "single", 4, 1024, "none"),
    Run("llama-1b", "fsdp", 1, 4096, "none"),
    Run("llama-1b", "fsdp", 4, 2048, "full"),
    Run("llama-1b", "fsdp", 2, 2048, "selective"),
    Run("llama-1b", "zero3_offload", 1, 2048, "none"),
    Run("llama-1b", "zero3_offload", 4, 2048, "full"),
    Run("llama-1b", "zero3", 2, 2048, "full"),
    Run("llama-3b", "single", 1, 1024, "full"),
    Run("llama-3b", "fsdp", 2, 2048, "full"),
    Run("llama-3b", "zero3_offload", 2, 4096, "full"),
    # the first runs again with train.compile (launcher/estimate/compiled_layers.py)
    Run("llama-1b", "single", 1, 2048, "none", compile=True),
    Run("llama-1b", "fsdp", 1, 4096, "none", compile=True),
)
CPU_SMOKE_GRID = (
    Run("llama-tiny", "single", 2, 128, "none"),
    Run("llama-tiny", "fsdp", 1, 128, "full"),
    Run("llama-tiny", "zero3_offload", 1, 128, "full"),
)


def estimate_for(run: Run, device_type: str, device_memory_bytes: int) -> dict[str, Any]:
    """What `oomless estimate` says for this run (pure; no device touched)."""
    from launcher.estimate.peak import estimate
    from launcher.estimate.shape import model_shape

    with tempfile.TemporaryDirectory() as tmp:
        shape = model_shape(_job(run, device_type, Path(tmp)).model)
    est = estimate(
        shape,
        StepSpec(
            strategy=run.strategy,
            world_size=1,
            devices_per_node=1,
            micro_batch_size=run.micro_batch_size,
            seq_len=run.seq_len,
            activation_checkpointing=run.activation_checkpointing,
            precision=run.precision,
            device=device_type,
            grad_accum=run.grad_accum,
            compiled_layers=run.compile,
        ),
    )
    return {
        "peak_tensor_bytes": est.peak_tensor_bytes,
        "total_bytes": est.device_total_bytes,
        "breakdown": est.device_breakdown,
        "peak_phase": max(est.phases, key=est.phases.get),
        "device_memory_bytes": device_memory_bytes,
    }


def _job(run: Run, device_type: str, tmp: Path) -> Any:
    from trainer.core.config import build_config

    data = tmp / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    return build_config(
        {
            "model": {"config": MODELS[run.model], "tokenizer": str(tmp)},
            "data": {"path": str(data), "seq_len": run.seq_len},
            "train": {
                "global_batch_size": run.micro_batch_size * run.grad_accum,
                "micro_batch_size": run.micro_batch_size,
                "compile": run.compile,
            },
            "precision": run.precision,
            "memory": {"activation_checkpointing": run.activation_checkpointing},
            "strategy": run.strategy,
            "hardware": {"device": device_type, "devices_per_node": 1},
        }
    )


def measure(
    run: Run, device_type: str, cap_bytes: int | None = None, history: bool = False
) -> dict[str, Any]:
    """Two optimizer steps of the engine in this process; the second one's peaks; on CUDA, the
    caching allocator's segments by stream after it and a third step's peaks after the cache
    is emptied (what the step itself reserves, without what the setup left cached). With
    `cap_bytes` the allocator may hold no more than that (`set_per_process_memory_fraction`;
    it frees its cache and retries before an out-of-memory error): whether the steps run. With
    `history` (CUDA), `reserve_causes`: which code made the allocator reserve what, per stream,
    from the setup to the measured step's end (recording slows the steps)."""
    import torch
    import torch.distributed as dist

    from bench.common import make_batches
    from bench.engine_vs_plain import OPTIM
    from trainer.backends import BackendContext, build_backend
    from trainer.model.build import HFModelFactory
    from trainer.step import train_step

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.zeros(1, device=device)  # the CUDA context, before anything of ours
        free, total = torch.cuda.mem_get_info()
        context_bytes = total - free
        if cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
        if history:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    else:
        context_bytes = 0
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _job(run, device.type, Path(tmp))
        ctx = BackendContext(
            cfg, device, 0, 0, 1, run.precision, run.activation_checkpointing,
            run.micro_batch_size, run.grad_accum,
        )  # fmt: skip
        backend = build_backend(run.strategy, ctx)
        model = backend.setup(HFModelFactory(cfg.model, seed=0), OPTIM)
        batches = make_batches(run.model, run.grad_accum, run.micro_batch_size, run.seq_len)
        # where the allocator's cache comes from (reserved minus allocated was ~5 GB for 1.1B
        # runs on an H200, docs/gpu.md): after the setup, and the first step's peaks
        first: dict[str, Any] = {}
        if device.type == "cuda":
            first["reserved_after_setup_bytes"] = torch.cuda.memory_reserved(device)
        try:
            train_step(model, backend, batches, device)  # creates the optimizer state
            if device.type == "cuda":
                first["step1_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
                first["step1_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
            backend.reset_peak()
            start = time.perf_counter()
            train_step(model, backend, batches, device)
            step_s = time.perf_counter() - start
        except torch.OutOfMemoryError as err:
            dist.destroy_process_group()
            return {"context_bytes": context_bytes, "cap_bytes": cap_bytes, "fits_cap": False,
                    "oom": str(err).splitlines()[0][:300], **first}  # fmt: skip
        out: dict[str, Any] = {"step_s": round(step_s, 3), "context_bytes": context_bytes, **first}
        if device.type == "cuda":
            out["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            out["max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
            out["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            out["segments_by_stream"] = _segments_by_stream(torch.cuda.memory_snapshot())
            if history:
                out["reserve_causes"] = reserve_causes(torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.empty_cache()  # what the setup and earlier steps left cached goes
            torch.cuda.reset_peak_memory_stats(device)
            train_step(model, backend, batches, device)
            out["clean_step_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            out["clean_step_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
            if cap_bytes is not None:
                out |= {"cap_bytes": cap_bytes, "fits_cap": True}
    dist.destroy_process_group()
    return out


def _segments_by_stream(snapshot: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The caching allocator's segments after a step, per CUDA stream: bytes reserved, and of
    them allocated (blocks of one stream's segments serve that stream only)."""
    streams: dict[str, dict[str, int]] = {}
    for segment in snapshot:
        mine = streams.setdefault(str(segment.get("stream", 0)), {"reserved": 0, "allocated": 0})
        mine["reserved"] += int(segment.get("total_size", 0))
        mine["allocated"] += int(segment.get("allocated_size", 0))
    return streams


RESERVE_SITES = 8  # causes of reserved growth reported per stream, the largest
_OWN_FRAMES = ("/trainer/", "/bench/", "/torch/distributed/", "/torch/optim/", "/transformers/")


def reserve_causes(snapshot: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """What made the caching allocator reserve memory, per stream: the bytes of every segment it
    allocated or mapped (expandable segments grow by mapping pages), summed by the frame that
    asked, largest first. `snapshot`: `torch.cuda.memory._snapshot()` after
    `_record_memory_history(stacks="python")`."""
    sites: dict[str, dict[str, int]] = {}
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if event.get("action") not in ("segment_alloc", "segment_map"):
                continue
            per_stream = sites.setdefault(str(event.get("stream", 0)), {})
            site = _site(event.get("frames", []))
            per_stream[site] = per_stream.get(site, 0) + int(event.get("size", 0))
    return {
        stream: [
            {"site": site, "bytes": size}
            for site, size in sorted(by_site.items(), key=lambda kv: -kv[1])[:RESERVE_SITES]
        ]
        for stream, by_site in sites.items()
    }


def _site(frames: list[dict[str, Any]]) -> str:
    """The file name, line and function of the innermost frame in oomless, torch.distributed,
    torch.optim or transformers (frames run innermost first); else of the innermost frame."""
    picked = next(
        (f for f in frames if any(k in f.get("filename", "") for k in _OWN_FRAMES)),
        frames[0] if frames else None,
    )
    if picked is None:
        return "?"
    where = Path(picked.get("filename", "?")).name
    return f"{where}:{picked.get('line', '?')} {picked.get('name', '?')}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(
    index: int,
    run: Run,
    device_type: str,
    timeout_s: float,
    capped: bool = False,
    history: bool = False,
) -> dict[str, Any]:
    """`measure` in a fresh process (ZeRO-3 patches torch.nn.functional.linear for good, and
    every run starts from an empty allocator), then the estimate beside it; with `capped`, on
    CUDA, the same steps again in a process whose allocator may hold only the estimate's total
    less its CUDA context: `capped.fits_cap` says whether the job ran in what the plan counts."""
    started = time.perf_counter()
    result: dict[str, Any] = {"index": index, "run": asdict(run)}
    measured = _measure_in_child(run, device_type, timeout_s, history=history)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if "error" in measured:
        return result | measured
    result["measured"] = measured
    device_memory = 0
    if device_type == "cuda":
        import torch

        device_memory = torch.cuda.get_device_properties(0).total_memory
    result["estimate"] = estimate_for(run, device_type, device_memory)
    if capped and device_type == "cuda":
        cap = result["estimate"]["total_bytes"] - CUDA_CONTEXT_BYTES
        result["capped"] = _measure_in_child(run, device_type, timeout_s, cap)
    return result


def _measure_in_child(
    run: Run,
    device_type: str,
    timeout_s: float,
    cap_bytes: int | None = None,
    history: bool = False,
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.estimate_gpu", "--run", json.dumps(asdict(run))]
    argv += ["--device", device_type]
    if cap_bytes is not None:
        argv += ["--cap-bytes", str(cap_bytes)]
    if history and device_type == "cuda":
        argv.append("--history")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def errors(result: dict[str, Any]) -> dict[str, float | None]:
    """Relative errors of the estimate: peak vs max allocated, total vs reserved + context."""
    est, got = result.get("estimate"), result.get("measured", {})
    if not est or "max_allocated_bytes" not in got:
        return {"peak": None, "total": None}
    allocated = got["max_allocated_bytes"]
    reserved = got["max_reserved_bytes"] + got["context_bytes"]
    return {
        "peak": (est["peak_tensor_bytes"] - allocated) / allocated,
        "total": (est["total_bytes"] - reserved) / reserved,
    }


def table(results: list[dict[str, Any]]) -> str:
    def gib(n: int | None) -> str:
        return f"{n / GIB:7.2f}" if n is not None else "    n/a"

    def pct(x: float | None) -> str:
        return f"{x:+7.1%}" if x is not None else "    n/a"

    lines = [
        f"{'#':>2} {'model':<10} {'strategy':<14}{'mb':>3}{'seq':>6} {'ckpt':<13}"
        f"{'est peak':>9}{'alloc':>8}{'err':>8}{'est tot':>9}{'resv+ctx':>9}{'err':>8}",
    ]
    for r in results:
        k, run = r["index"], r["run"]
        compiled = "+compile" if run.get("compile") else ""
        est, got = r.get("estimate") or {}, r.get("measured") or {}
        err = errors(r)
        reserved = got.get("max_reserved_bytes")
        if reserved is not None:
            reserved += got["context_bytes"]
        line = (
            f"{k:>2} {run['model']:<10} {run['strategy']:<14}{run['micro_batch_size']:>3}"
            f"{run['seq_len']:>6} {run['activation_checkpointing'] + compiled:<13}"
            f"{gib(est.get('peak_tensor_bytes'))} {gib(got.get('max_allocated_bytes'))}"
            f"{pct(err['peak'])} {gib(est.get('total_bytes'))}  {gib(reserved)}{pct(err['total'])}"
        )
        if "capped" in r:
            capped = r["capped"]
            line += "  capped: " + (
                "fits" if capped.get("fits_cap") else capped.get("oom") or capped.get("error", "?")
            )
        if "error" in r:
            line += f"  FAILED: {r['error']}"
        lines.append(line)
        for stream, causes in got.get("reserve_causes", {}).items():
            top = ", ".join(f"{c['site']} {c['bytes'] / GIB:.2f}" for c in causes[:3])
            lines.append(f"     reserved on stream {stream} by: {top}")
    peaks = [e for r in results if (e := errors(r)["peak"]) is not None]
    if peaks:
        lines.append(
            f"peak vs max_memory_allocated over {len(peaks)} runs: median |error| "
            f"{statistics.median(abs(e) for e in peaks):.1%}, max |error| "
            f"{max(abs(e) for e in peaks):.1%}, most under {min(peaks):+.1%} "
            f"(target: within 10%, never more than 5% under)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.estimate_gpu", description=__doc__)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny grid on the CPU")
    parser.add_argument("--only", default="", help="comma-separated run numbers of the grid")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one run, in-process
    parser.add_argument("--cap-bytes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--capped", action="store_true",
        help="also run each job with the allocator capped at the estimate's total (CUDA)",
    )  # fmt: skip
    parser.add_argument(
        "--history", action="store_true",
        help="record which code makes the allocator reserve memory, per stream (CUDA; slower)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not any(k in os.environ for k in ALLOC_CONF_VARS):  # as the launcher gives CUDA ranks;
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS  # the estimate reads it too
    if args.run:
        run = Run(**json.loads(args.run))
        print(json.dumps(measure(run, args.device or "cuda", args.cap_bytes, args.history)))
        return 0
    device_type = "cpu" if args.cpu_smoke else "cuda"
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-smoke for the CPU path", file=sys.stderr)
            return 2
    grid = CPU_SMOKE_GRID if args.cpu_smoke else GPU_GRID
    picked = [int(k) for k in args.only.split(",") if k] or range(len(grid))
    results = []
    out_dir = os.environ.get("OUT")
    for k in picked:
        results.append(run_one(k, grid[k], device_type, args.timeout, args.capped, args.history))
        print(f"run {k}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
        if out_dir:  # after every run: a part stopped at its time limit keeps what it measured
            path = Path(out_dir) / "estimate_gpu.json"
            path.write_text(json.dumps({"machine": machine(), "runs": results}, indent=2))
    print(table(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
