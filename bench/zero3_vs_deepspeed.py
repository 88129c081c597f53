"""Tokens/s of oomless `zero3_offload` vs DeepSpeed driven directly, side by side, same ranks.

    torchrun --standalone --nproc_per_node 2 -m bench.zero3_vs_deepspeed \
        [--model llama-20m|largest] [--candidates llama-1b,llama-3b,llama-8b] [--rounds 8] \
        [--precision bf16] [--device auto] [--bandwidth] [--json out.json]

The hand-written side is what a DeepSpeed user writes: the HF model, `DeepSpeedCPUAdam` (AdamW
mode), `deepspeed.initialize` with a ZeRO-3 + optimizer-offload config (DeepSpeed's defaults for
everything else) and the loop `loss = engine(..., labels=ids).loss; engine.backward(loss);
engine.step()`. Both sides compute in the same precision: fp32 parameters with the engine's
`torch_autocast` section, fp32 gathers and reductions (`lower_precision_safe_modules: []`). The
oomless side is `train_step` through `DeepSpeedBackend` (model built under `zero.Init`, our config
from `trainer/backends/deepspeed_config.py`). Steps alternate barrier to barrier; rank 0 prints
the medians and the ratio.

`--model largest` takes the largest of `--candidates` that the planner says fits on
`zero3_offload` with half of this device and half of the host (both contenders live in the
process). `--bandwidth` also measures pinned copies between host and device and reports the
transfer floor of a step: what `zero3_offload` moves over PCIe (fp32 gradient partitions to the
host every micro-batch, the updated fp32 parameters back once per step, as in the planner's cost
model) divided by the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import (
    add_step_args,
    alternate,
    build_hf_model,
    copy_bandwidth,
    init_torchrun_rank,
    job_config,
    largest_model_that_fits,
    make_batches,
    num_parameters,
    step_run_result,
    timed,
)
from bench.engine_vs_plain import OPTIM
from trainer.backends import BackendContext, build_backend
from trainer.model.build import HFModelFactory
from trainer.step import train_step

AUTOCAST = {"bf16": "bfloat16"}


def hand_config(args: argparse.Namespace, world: int, device: torch.device) -> dict[str, Any]:
    """The config a DeepSpeed user writes for ZeRO-3 with the optimizer on the host."""
    config: dict[str, Any] = {
        "train_batch_size": args.micro * args.accum * world,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": OPTIM.grad_clip,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": device.type == "cuda"},
        },
        "steps_per_print": 10**9,
    }
    if args.precision in AUTOCAST:
        config["torch_autocast"] = {
            "enabled": True,
            "dtype": AUTOCAST[args.precision],
            "lower_precision_safe_modules": [],
        }
    return config


def build_hand_deepspeed(args: argparse.Namespace, world: int, device: torch.device):
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = build_hf_model(args.model)
    optimizer = DeepSpeedCPUAdam(
        model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
        weight_decay=OPTIM.weight_decay, adamw_mode=True,
    )  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=hand_config(args, world, device)
    )
    return engine


def hand_step(engine, batches, device: torch.device) -> None:
    for b in batches:
        ids = b["input_ids"].to(device)
        out = engine(input_ids=ids, position_ids=b["position_ids"].to(device), labels=ids)
        engine.backward(out.loss)
        engine.step()
    float(out.loss.detach())


def transfer_floor(
    num_params: int, accum: int, world: int, device: torch.device
) -> dict[str, float]:
    """Measured copy bandwidth and the step time the PCIe traffic of zero3_offload alone needs."""
    bandwidth = copy_bandwidth(device)
    to_host = 4 * num_params / world * accum  # fp32 gradient partitions, every micro-batch
    to_device = 4 * num_params / world  # updated fp32 parameter partitions, once per step
    floor = to_host / bandwidth["d2h_bytes_per_s"] + to_device / bandwidth["h2d_bytes_per_s"]
    return bandwidth | {
        "bytes_to_host_per_step": to_host,
        "bytes_to_device_per_step": to_device,
        "floor_step_s": floor,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-20m", help="a bench.common shape, or 'largest'")
    p.add_argument("--candidates", default="llama-1b,llama-3b,llama-8b")
    p.add_argument("--bandwidth", action="store_true", help="measure host<->device copies")
    add_step_args(p, rounds=8)
    args = p.parse_args()
    device, rank, world = init_torchrun_rank(args.device, "cpu:gloo,cuda:nccl")
    if args.model == "largest":
        args.model = largest_model_that_fits(
            args.candidates.split(","), "zero3_offload", device, args.micro, args.accum,
            args.seq, args.precision, num_copies=2,
        )  # fmt: skip
        if args.model is None:
            raise SystemExit(f"none of {args.candidates} fits on zero3_offload here")
    batches = make_batches(args.model, args.accum, args.micro, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = job_config(
            Path(tmp), args.model, "zero3_offload", args.precision, args.micro, args.accum,
            args.seq, device, world_size=world,
        )  # fmt: skip
        ctx = BackendContext(
            cfg, device, rank, rank, world, args.precision, "none", args.micro, args.accum
        )
        backend = build_backend("zero3_offload", ctx)
        ours = backend.setup(HFModelFactory(cfg.model, seed=0), OPTIM)
    hand = build_hand_deepspeed(args, world, device)

    def oomless_step() -> None:
        backend.set_lr(OPTIM.lr)
        train_step(ours, backend, batches, device)

    oomless_step()  # warm-up both
    hand_step(hand, batches, device)
    times = alternate(
        {
            "oomless": lambda: timed(oomless_step, device, barrier=True),
            "deepspeed": lambda: timed(lambda: hand_step(hand, batches, device), device, True),
        },
        args.rounds,
    )
    if rank == 0:
        num_params = num_parameters(args.model)
        result = step_run_result(args, device, world, num_params, times)
        med, tokens = result["median_step_s"], args.micro * args.accum * args.seq * world
        result |= {
            "hand_config": hand_config(args, world, device),
            "oomless_over": {"deepspeed": med["oomless"] / med["deepspeed"]},
        }
        if args.bandwidth:
            result["transfer"] = transfer_floor(num_params, args.accum, world, device)
            result["transfer"]["floor_tokens_per_s"] = tokens / result["transfer"]["floor_step_s"]
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"zero3_offload x{world} {args.precision}, {args.model} ({num_params / 1e6:,.0f}M): "
            f"oomless {med['oomless'] * 1e3:.0f} ms/step, "
            f"DeepSpeed by hand {med['deepspeed'] * 1e3:.0f} ms/step, "
            f"ratio {result['oomless_over']['deepspeed']:.3f}"
            + (
                f"; transfer floor {result['transfer']['floor_step_s'] * 1e3:.0f} ms/step"
                if args.bandwidth
                else ""
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from trainer.runtime.dist import exit_without_teardown

    exit_without_teardown(0)  # a torchrun worker: gloo can abort at interpreter teardown
