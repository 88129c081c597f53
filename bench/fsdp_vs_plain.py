"""Tokens/s of oomless `fsdp` vs a minimal hand-written FSDP2 loop, side by side, same ranks.

    torchrun --standalone --nproc_per_node 2 -m bench.fsdp_vs_plain \
        [--model llama-20m] [--rounds 16] [--precision bf16] [--device auto] [--json out.json]

Both sides shard the same Llama shape per decoder layer and then the root, with the same
mixed-precision policy, AdamW (the engine's own `build_adamw`: fused) and clipping, on the same
batches; their steps alternate (barrier to barrier), and rank 0 prints the medians and the ratio.
The oomless side is `train_step` through `FsdpBackend` (the engine's per-step path:
token-weighted accumulation, OOM agreement points, no_sync).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import (
    add_step_args,
    alternate,
    build_hf_model,
    init_torchrun_rank,
    job_config,
    make_batches,
    mfu,
    num_parameters,
    step_run_result,
    timed,
)
from bench.engine_vs_plain import OPTIM
from trainer.backends import BackendContext, build_backend
from trainer.backends.common import COMPUTE_DTYPES, build_adamw
from trainer.model.build import HFModelFactory, decoder_layers
from trainer.step import train_step


def build_plain_fsdp(model_name: str, precision: str, device: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_hf_model(model_name).to(device)
    kwargs = {}
    if precision in COMPUTE_DTYPES:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=COMPUTE_DTYPES[precision], reduce_dtype=torch.float32
        )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model, build_adamw(model.parameters(), OPTIM)  # the engine's AdamW


def plain_step(model, opt, batches, device: torch.device) -> None:
    for i, b in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)
        ids = b["input_ids"].to(device)
        logits = model(input_ids=ids, position_ids=b["position_ids"].to(device)).logits
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
        )
        (loss / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    float(loss.detach())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-20m")
    add_step_args(p, rounds=16)
    args = p.parse_args()
    device, rank, world = init_torchrun_rank(args.device, "nccl")
    batches = make_batches(args.model, args.accum, args.micro, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = job_config(
            Path(tmp), args.model, "fsdp", args.precision, args.micro, args.accum, args.seq,
            device, world_size=world,
        )  # fmt: skip
        ctx = BackendContext(
            cfg, device, rank, rank, world, args.precision, "none", args.micro, args.accum
        )
        backend = build_backend("fsdp", ctx)
        ours = backend.setup(HFModelFactory(cfg.model, seed=0), OPTIM)
    plain, opt = build_plain_fsdp(args.model, args.precision, device)
    num_params = num_parameters(args.model)

    def oomless_step() -> None:
        backend.set_lr(OPTIM.lr)
        train_step(ours, backend, batches, device)

    oomless_step()  # warm-up both
    plain_step(plain, opt, batches, device)
    times = alternate(
        {
            "oomless": lambda: timed(oomless_step, device, barrier=True),
            "plain": lambda: timed(lambda: plain_step(plain, opt, batches, device), device, True),
        },
        args.rounds,
    )
    if rank == 0:
        result = report(args, device, world, num_params, times)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


def report(
    args: argparse.Namespace,
    device: torch.device,
    world: int,
    num_params: int,
    times: dict[str, list[float]],
) -> dict[str, Any]:
    result = step_run_result(args, device, world, num_params, times)
    med = result["median_step_s"]
    result["oomless_over"] = {"plain": med["oomless"] / med["plain"]}
    result |= mfu(args.model, num_params, args.seq, device, result["tokens_per_s"], world)
    print(
        f"fsdp x{world} {args.precision}, {num_params / 1e6:.1f}M params: oomless "
        f"{med['oomless'] * 1e3:.0f} ms/step, plain FSDP2 {med['plain'] * 1e3:.0f} ms/step, "
        f"ratio {result['oomless_over']['plain']:.3f}"
    )
    return result


if __name__ == "__main__":
    main()
    from trainer.runtime.dist import exit_without_teardown

    exit_without_teardown(0)  # a torchrun worker: gloo can abort at interpreter teardown
