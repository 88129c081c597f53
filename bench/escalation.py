"""Escalation on a real out-of-memory: `oomless train` on a card smaller than the planner thinks.

    python -m bench.escalation [--device auto|cuda|cpu] [--model llama-1b] [--steps 6] \
        [--seq 1024] [--out DIR]

On a GPU, `debug.device_memory_fraction` caps the CUDA allocator below what `single` needs and
above what the offload rungs need (the estimator's peaks at micro-batch 1 with full activation
checkpointing, the only split this job allows), while the planner still plans for the whole card.
It picks `single`, which runs out of memory for real; the supervisor climbs rung by rung,
resuming from the newest checkpoint, until one fits and the run completes. On a CPU (the smoke
path) there is no allocator to cap, so `debug.inject_oom` raises the out-of-memory on `single`
instead; everything after it is the same code.

Writes DIR/escalation.json (exit code, the cap, the rungs in order, escalations.jsonl, the final
loss) and DIR/escalation-train.log (the run's output); the run directory is DIR/escalation-run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.common import MODELS, resolve_device

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo"
# every rung of one device that keeps all training state on it: runs out of memory under the cap
ON_DEVICE = ("single", "fsdp", "zero1", "zero2", "zero3")
OFFLOAD = ("fsdp_offload", "zero3_offload", "zero3_offload_params")


def job_tree(args: argparse.Namespace, device: torch.device, run_dir: Path) -> dict[str, Any]:
    """The job: a Llama shape learning the demo's additions, micro-batch 1, full checkpointing."""
    return {
        "model": {"config": MODELS[args.model], "tokenizer": str(DEMO / "tokenizer")},
        "data": {
            "path": str(DEMO / "train.jsonl"),
            "format": "prompt_completion",
            "seq_len": args.seq,
        },
        "train": {
            "steps": args.steps,
            "global_batch_size": args.global_batch,
            "micro_batch_size": 1,
            "lr": 1e-4,
            "eval_every": 0,
            "log_every": 1,
        },
        "precision": "bf16" if device.type == "cuda" else "fp32",
        "memory": {"activation_checkpointing": "full"},
        "strategy": "auto",
        "hardware": {"device": device.type, "devices_per_node": 1},
        # the OOM comes at step 1, so the climb starts over from step 0 anyway; on a GPU a 1.1B
        # checkpoint (fp32 weights and moments, ~13 GB a write) took the part past its limit
        "run": {
            "dir": str(run_dir),
            "checkpoint_every": 2 if device.type == "cpu" else args.steps + 1,
            "save_final": False,
        },
        "escalation": {"max_attempts": len(ON_DEVICE) + 1},
    }


def oomless(*argv: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def memory_cap(config: Path, device_memory_bytes: int) -> dict[str, Any]:
    """The allocator cap halfway between the offload rungs' and the on-device rungs' peaks."""
    r = oomless("estimate", str(config), "--json", timeout_s=300)
    if r.returncode != 0:
        raise SystemExit(f"oomless estimate failed ({r.returncode}): {r.stderr.strip()}")
    rows = json.loads(r.stdout)["strategies"]
    peaks = {row["name"]: row["device"]["peak_tensor_bytes"] for row in rows}
    fails = min(peaks[name] for name in ON_DEVICE if name in peaks)
    fits = max(peaks[name] for name in OFFLOAD if name in peaks)
    if fails < 1.2 * fits:
        raise SystemExit(f"no room for a cap: on-device rungs need {fails}, offload {fits} bytes")
    cap = (fails + fits) // 2
    return {
        "estimated_peak_bytes": peaks,
        "cap_bytes": cap,
        "device_memory_bytes": device_memory_bytes,
        "device_memory_fraction": round(cap / device_memory_bytes, 4),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = resolve_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.out / "escalation-run"
    config = args.out / "escalation-job.yaml"
    tree = job_tree(args, device, run_dir)
    config.write_text(yaml.safe_dump(tree, sort_keys=False))
    result: dict[str, Any] = {"device": device.type, "model": args.model, "seq_len": args.seq}
    if device.type == "cuda":
        result |= memory_cap(config, torch.cuda.get_device_properties(device).total_memory)
        tree["debug"] = {"device_memory_fraction": result["device_memory_fraction"]}
        result["device_name"] = torch.cuda.get_device_name(device)
    else:  # nothing to cap: the OOM is injected, at every attempt of `single` from step 3 on
        tree["debug"] = {
            "inject_oom": {"step": 3, "times": 0, "where": "backward", "strategies": ["single"]}
        }
    result["oom"] = "real (allocator cap)" if device.type == "cuda" else "injected"
    config.write_text(yaml.safe_dump(tree, sort_keys=False))
    start = time.perf_counter()
    try:
        r = oomless("train", str(config), timeout_s=args.timeout)
        result["exit_code"], output = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as err:
        result["exit_code"], output = "timeout", _text(err.stdout) + _text(err.stderr)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    (args.out / "escalation-train.log").write_text(output)
    escalations = _jsonl(run_dir / "escalations.jsonl")
    metrics = _jsonl(run_dir / "metrics.jsonl")
    result["escalations"] = escalations
    result["rungs"] = [e["from"] for e in escalations] + (
        [escalations[-1]["to"]] if escalations else []
    )
    result["steps_done"] = metrics[-1]["step"] if metrics else 0
    result["final_loss"] = metrics[-1]["loss"] if metrics else None
    result["final_strategy"] = metrics[-1]["strategy"] if metrics else None
    result["completed"] = result["exit_code"] == 0 and result["steps_done"] == args.steps
    if not result["completed"]:  # what stopped it: the last line of the traceback or log
        lines = [line for line in output.splitlines() if line.strip()]
        result["error"] = lines[-1] if lines else None
    return result


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=600, help="seconds for `oomless train`")
    p.add_argument("--out", type=Path, default=Path("runs/bench-escalation"))
    args = p.parse_args()
    result = run(args)
    (args.out / "escalation.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"escalation ({result['oom']} OOM), {args.model}: exit {result['exit_code']}, rungs "
        f"{' -> '.join(result['rungs']) or 'none'}, {result['steps_done']}/{args.steps} steps, "
        f"final loss {result['final_loss']}"
    )
    if not result["completed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
