"""Step time of oomless `fsdp` vs a minimal hand-written FSDP2 loop, side by side, same ranks.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/fsdp_vs_plain.py \
        [--rounds 10] [--precision bf16] [--json out.json]

Both sides shard the same ~20M-parameter Llama shape per decoder layer and then the root, with the
same mixed-precision policy, AdamW and clipping, on the same batches; their steps alternate, and
rank 0 prints the medians and the ratio. The oomless side is `train_step` through `FsdpBackend`
(the engine's per-step path: token-weighted accumulation, OOM agreement points, no_sync).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_vs_plain import MODEL, OPTIM, make_batches  # noqa: E402
from launcher.config import build_config  # noqa: E402
from trainer.backends import BackendContext, build_backend  # noqa: E402
from trainer.backends.common import COMPUTE_DTYPES  # noqa: E402
from trainer.model import HFModelFactory, decoder_layers  # noqa: E402
from trainer.step import train_step  # noqa: E402


def plain_fsdp(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"})
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    kwargs = {}
    if precision in COMPUTE_DTYPES:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=COMPUTE_DTYPES[precision], reduce_dtype=torch.float32
        )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
        weight_decay=OPTIM.weight_decay, foreach=True,
    )  # fmt: skip
    return model, opt


def plain_step(model, opt, batches) -> None:
    for i, b in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), b["input_ids"][:, 1:].reshape(-1)
        )
        (loss / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    batches = make_batches(args.accum, args.micro, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "d.jsonl"
        data.write_text('{"text": "x"}\n')
        cfg = build_config(
            {
                "model": {"config": MODEL, "tokenizer": tmp},
                "data": {"path": str(data), "seq_len": args.seq},
                "train": {
                    "global_batch_size": args.micro * args.accum * world,
                    "micro_batch_size": args.micro,
                },
                "precision": args.precision,
                "strategy": "fsdp",
                "hardware": {"device": "cpu", "devices_per_node": world},
            }
        )
        ctx = BackendContext(
            cfg, device, rank, rank, world, args.precision, "none", args.micro, args.accum
        )
        backend = build_backend("fsdp", ctx)
        ours = backend.setup(HFModelFactory(cfg.model, seed=0), OPTIM)
    plain, opt = plain_fsdp(args.precision)
    train_step(ours, backend, batches, device)  # warm-up both
    plain_step(plain, opt, batches)
    ours_s, plain_s = [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for is_ours in order:
            dist.barrier()
            start = time.perf_counter()
            if is_ours:
                backend.set_lr(OPTIM.lr)
                train_step(ours, backend, batches, device)
            else:
                plain_step(plain, opt, batches)
            dist.barrier()
            (ours_s if is_ours else plain_s).append(time.perf_counter() - start)
    if rank == 0:
        result = {
            "world_size": world,
            "precision": args.precision,
            "micro_batch_size": args.micro,
            "grad_accum": args.accum,
            "seq_len": args.seq,
            "rounds": args.rounds,
            "oomless_step_s": ours_s,
            "plain_step_s": plain_s,
            "oomless_median_s": statistics.median(ours_s),
            "plain_median_s": statistics.median(plain_s),
            "ratio": statistics.median(ours_s) / statistics.median(plain_s),
            "torch": torch.__version__,
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        }
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"fsdp x{world} {args.precision}: oomless {result['oomless_median_s'] * 1e3:.0f} "
            f"ms/step, plain FSDP2 {result['plain_median_s'] * 1e3:.0f} ms/step, "
            f"ratio {result['ratio']:.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
