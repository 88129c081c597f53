"""Peak device memory and step time of the exact memory levers against none, on `single`.

One model and optimizer on the `single` backend (the engine's `train_step`), the levers switched
on the running model between rounds, as the OOM back-off switches them: `off`, `chunked_loss`,
`offload_activations`, `both`; each variant's steps alternate with the others', the order shuffled
every round. Per variant: the median step time and the largest `torch.cuda.max_memory_allocated`
over its steps (on a CPU there is no device peak to read: `null`), and the bytes activation
offload moved per step.

    python -m bench.levers [--model llama3-1b] [--seq 4096] [--micro 1] [--accum 2] \
        [--rounds 3] [--steps 2] [--checkpointing none] [--device auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    alternate,
    count_parameters,
    job_config,
    machine,
    make_batches,
    medians,
    resolve_device,
    timed,
)
from trainer.backends import BackendContext, OptimizerSpec, build_backend
from trainer.core.strategies import AC_LEVELS
from trainer.core.units import GIB, MIB
from trainer.memory.levers import MemoryLevers
from trainer.model.build import HFModelFactory
from trainer.step import train_step

OPTIM = OptimizerSpec(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
VARIANTS = {
    "off": {"chunked_loss": False, "offload_activations": False},
    "chunked_loss": {"chunked_loss": True, "offload_activations": False},
    "offload_activations": {"chunked_loss": False, "offload_activations": True},
    "both": {"chunked_loss": True, "offload_activations": True},
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = job_config(
            Path(tmp), args.model, "single", args.precision, args.micro, args.accum, args.seq,
            device, activation_checkpointing=args.checkpointing,
        )  # fmt: skip
        ctx = BackendContext(
            cfg, device, 0, 0, 1, args.precision, args.checkpointing, args.micro, args.accum
        )
        backend = build_backend("single", ctx)
        model = backend.setup(HFModelFactory(cfg.model, seed=0), OPTIM)
    levers = MemoryLevers(model, device, chunked_loss=False, offload_activations=False)
    batches = make_batches(args.model, args.accum, args.micro, args.seq)
    peaks: dict[str, int | None] = {name: None for name in VARIANTS}
    moved: dict[str, int] = {name: 0 for name in VARIANTS}

    def contender(name: str):
        def one_round() -> float:
            for lever, on in VARIANTS[name].items():
                levers.set(lever, on)
            backend.reset_peak()
            levers.record()  # zero the offload counts
            seconds = timed(lambda: _steps(model, backend, batches, device, args.steps), device)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
                peaks[name] = max(peaks[name] or 0, peak)
            moved[name] = levers.record().get("offloaded_bytes", 0) // args.steps
            return seconds / args.steps

        return one_round

    contenders = {name: contender(name) for name in VARIANTS}
    for one_round in contenders.values():  # warm-up: allocator, kernels, pinned host pool
        one_round()
    peaks.update(dict.fromkeys(VARIANTS))
    step_s = medians(alternate(contenders, args.rounds))
    return {
        "model": args.model,
        "num_params": count_parameters(model),
        "device": device.type,
        "precision": args.precision,
        "seq_len": args.seq,
        "micro_batch_size": args.micro,
        "grad_accum": args.accum,
        "activation_checkpointing": args.checkpointing,
        "step_s": step_s,
        "peak_device_bytes": peaks,
        "offloaded_bytes_per_step": moved,
        "over_off": {
            "step_time": {name: step_s[name] / step_s["off"] for name in VARIANTS},
            "peak": {
                name: (peaks[name] / peaks["off"] if peaks[name] and peaks["off"] else None)
                for name in VARIANTS
            },
        },
        "machine": machine(),
    }


def _steps(model, backend, batches, device: torch.device, num_steps: int) -> None:
    for _ in range(num_steps):
        train_step(model, backend, batches, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per variant per round")
    p.add_argument("--checkpointing", default="none", choices=AC_LEVELS)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", type=Path, help="write the numbers here")
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    moved = result["offloaded_bytes_per_step"]
    idle = [name for name, on in VARIANTS.items() if on["offload_activations"] and not moved[name]]
    for name in VARIANTS:
        peak = result["peak_device_bytes"][name]
        print(
            f"{name:>20}: {result['step_s'][name]:.3f} s/step "
            f"({result['over_off']['step_time'][name]:.3f} of off), peak "
            + (f"{peak / GIB:.2f} GiB" if peak else "n/a (cpu)")
            + f", offloaded {result['offloaded_bytes_per_step'][name] / MIB:.1f} MiB/step"
        )
    if idle:
        sys.exit(f"activation offload moved nothing to the host in {', '.join(idle)}")


if __name__ == "__main__":
    main()
