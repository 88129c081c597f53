"""Long context on one device: measured peak against the estimate, and tokens/s.

Llama-3.1-8B's layer shape (hidden 4,096, intermediate 14,336, 32 heads, 8 key/value heads,
vocabulary 128,256) with `--layers` decoder layers, on the `single` rung as the engine builds
it: bf16 autocast over fp32 weights, full activation checkpointing, chunked loss and the tiled
MLP with its recomputed norms (`trainer/memory/tiled_mlp.py`), fused AdamW. One sequence per step
at each of `--seqs`; packed (two documents) up to `--packed-max` tokens, under `--attention`
(flex_attention: its block mask; sdpa: the dense block-causal mask), one causal document above
(no mask: the estimate is told which). Each length runs with the checkpoints on the device and
offloaded to host memory (ALST's offloaded checkpoints: only each layer's input moves), and with
`--rope-factor` yarn over the 131,072 positions (lengths beyond them need it). The second step
is measured from `torch.cuda.reset_peak_memory_stats`: `max_memory_allocated` vs the estimate's
`peak_tensor_bytes`, the bytes offloaded, and the step's tokens/s.

    python -m bench.long_context_gpu [--seqs 32768,65536,131072] [--layers 2] [--json out.json]
        [--attention flex_attention] [--rope-factor 4]
    python -m bench.long_context_gpu --cpu-smoke      # the same code path, tiny, on the CPU
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from launcher.estimate.peak import estimate
from launcher.estimate.shape import shape_of
from trainer.backends import OptimizerSpec
from trainer.backends.common import build_adamw
from trainer.core.config import ModelConfig
from trainer.core.step_spec import StepSpec
from trainer.loss import compute_loss
from trainer.memory.levers import MemoryLevers
from trainer.memory.tiled_mlp import apply_tiled_mlp
from trainer.model.build import HFModelFactory, apply_activation_checkpointing

LLAMA_8B_LAYER = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
TINY = {**LLAMA_8B_LAYER, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip


def _batch(seq: int, packed: bool, device: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 500, (1, seq), device=device)
    positions = torch.arange(seq, device=device)
    if packed:
        positions = positions % (seq // 2)
    return {"input_ids": ids, "labels": ids, "position_ids": positions[None]}


def measure(
    config: dict[str, Any], seq: int, packed: bool, device: torch.device, offload: bool,
    attention: str = "sdpa", rope: dict[str, Any] | None = None,
) -> dict:  # fmt: skip
    model_cfg = ModelConfig(config=config, attn_implementation=attention, rope_scaling=rope)
    model = HFModelFactory(model_cfg, seed=0).build(device)
    apply_activation_checkpointing(model, "full")
    apply_tiled_mlp(model, None)
    levers = MemoryLevers(model, device, True, offload)
    model.train()
    optimizer = build_adamw(model.parameters(), OptimizerSpec(1e-5, (0.9, 0.95), 1e-8, 0.0, 1.0))
    batch = _batch(seq, packed, device)
    peak, seconds = 0, 0.0
    for _ in range(2):  # the second step is measured
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        levers.offload.reset_counts()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compute_loss(model, batch) / seq
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        seconds = time.perf_counter() - start
    dense = packed and attention in ("sdpa", "eager")
    flash = device.type == "cuda" and not packed and attention == "sdpa"  # SDPA's flash kernel
    spec = StepSpec("single", 1, 1, seq, "full", device=device.type, packed=dense,
                    block_mask=packed and attention == "flex_attention", chunked_loss=True,
                    offload_activations=offload, tiled_mlp=True,
                    flash_attention=flash)  # fmt: skip
    est = estimate(shape_of(json.dumps(config, sort_keys=True)), spec)
    offloaded = levers.offload.offloaded_bytes
    del model, optimizer, levers
    return {"seq": seq, "packed": packed, "attention": attention, "offload": offload,
            "measured_peak": peak, "estimated_peak": est.peak_tensor_bytes,
            "offloaded_bytes": offloaded, "estimated_offloaded_bytes": est.offloaded_bytes,
            "tokens_per_s": seq / seconds}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="32768,65536,131072")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--packed-max", type=int, default=32768)
    parser.add_argument("--attention", default="flex_attention", help="for packed windows")
    parser.add_argument("--rope-factor", type=float, default=None, help="yarn over the positions")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    config = {**(TINY if args.cpu_smoke else LLAMA_8B_LAYER), "num_hidden_layers": args.layers}
    seqs = [512, 1024] if args.cpu_smoke else [int(s) for s in args.seqs.split(",")]
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    attention = "sdpa" if args.cpu_smoke else args.attention  # no flex backward on CPU
    rope = None
    if args.rope_factor:
        rope = {"rope_type": "yarn", "factor": args.rope_factor,
                "original_max_position_embeddings": config["max_position_embeddings"]}  # fmt: skip
    rows = []
    print("| tokens | mask | checkpoints | measured peak | estimated peak | estimate / measured "
          "| offloaded (estimated) | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for seq in seqs:
        for offload in (False, True):
            packed = seq <= args.packed_max
            row = measure(config, seq, packed, device, offload, attention if packed else "sdpa",
                          rope)  # fmt: skip
            rows.append(row)
            _print_row(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _print_row(row: dict) -> None:
    measured, estimated = row["measured_peak"], row["estimated_peak"]
    ratio = f"{estimated / measured:.3f}" if measured else "n/a"
    mask = row["attention"] if row["packed"] else "causal"
    print(f"| {row['seq']:,} | {mask} | {'offloaded' if row['offload'] else 'on device'} | "
          f"{measured / 2**30:.2f} GiB | {estimated / 2**30:.2f} GiB | {ratio} | "
          f"{row['offloaded_bytes'] / 2**30:.2f} ({row['estimated_offloaded_bytes'] / 2**30:.2f})"
          f" GiB | {row['tokens_per_s']:,.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
