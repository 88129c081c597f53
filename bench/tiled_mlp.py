"""The tiled MLP on CPU: step time and what backward keeps, tiled vs not.

A Llama of 2 layers (hidden 256, intermediate 1,024, vocabulary 1,024) in fp32, one sequence
of `--seq` tokens; forward and backward timed with the MLPs plain and then tiled by the engine's
`trainer.memory.tiled_mlp.apply_tiled_mlp` (chunks of the hidden size, 256 tokens), alternating
rounds. Saved bytes: the tensors autograd keeps for backward (saved_tensors_hooks), by storage.

    python -m bench.tiled_mlp [--seq 4096] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.memory.tiled_mlp import apply_tiled_mlp


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                      max_position_embeddings=65536)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, int]:
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, sum(saved.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plain, tiled = _model(), _model()
    apply_tiled_mlp(tiled, None)
    ids = torch.randint(0, 1024, (1, args.seq))
    _step(plain, ids), _step(tiled, ids)  # warm-up
    times: dict[str, list[float]] = {"plain": [], "tiled": []}
    kept = {}
    for _ in range(args.rounds):
        for name, model in (("plain", plain), ("tiled", tiled)):
            seconds, kept[name] = _step(model, ids)
            times[name].append(seconds)
    p, t = statistics.median(times["plain"]), statistics.median(times["tiled"])
    print(
        f"| {args.seq:,} tokens | {p:.3f} s | {t:.3f} s | {t / p:.2f} | "
        f"{kept['plain'] / 2**20:.0f} MiB | {kept['tiled'] / 2**20:.0f} MiB |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
