"""What the long-context levers cost on CPU: the Ulysses all-to-all against the attention it
wraps, and the tiled MLP's step time and saved bytes against the plain MLP.

    torchrun --standalone --nproc_per_node 2 -m bench.long_context all_to_all [--seq 8192]
    python -m bench.long_context tiled_mlp [--seq 8192]

`all_to_all` (every rank): one attention layer's exchange at sequence parallel = world size
(q, k, v in, the output back: 4 all-to-alls of [1, heads, seq / sp, head_dim] fp32) against
sdpa over [1, heads / sp, seq, head_dim] on each rank, median of `--rounds`.
`tiled_mlp`: forward + backward of one Llama MLP (hidden 1024, intermediate 4096) over
[1, seq, 1024], plain and tiled in chunks of the hidden size; median step time and the bytes
saved for backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 16, 64, 1024, 4096


def _median_s(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def all_to_all(seq: int, rounds: int) -> dict:
    import torch.distributed as dist

    from trainer.parallel.sequence import all_to_all as exchange

    dist.init_process_group("gloo")
    sp = dist.get_world_size()
    local = torch.randn(sp, 1, HEADS // sp, seq // sp, HEAD_DIM)  # one tensor, chunked by rank
    q = torch.randn(1, HEADS // sp, seq, HEAD_DIM)

    def exchange_layer() -> None:
        for _ in range(4):  # q, k, v and the output
            exchange(local, None)
        dist.barrier()

    def attention() -> None:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)

    result = {
        "seq": seq,
        "sequence_parallel": sp,
        "bytes_per_all_to_all": local.numel() * local.element_size(),
        "all_to_all_layer_s": _median_s(exchange_layer, rounds),
        "attention_s": _median_s(attention, rounds),
    }
    result["all_to_all_over_attention"] = result["all_to_all_layer_s"] / result["attention_s"]
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.destroy_process_group()
    return result


def tiled_mlp(seq: int, rounds: int) -> dict:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from trainer.memory.tiled_mlp import TiledForward

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE))
    x = torch.randn(1, seq, HIDDEN, requires_grad=True)
    tiled = TiledForward(mlp.forward, HIDDEN)
    out: dict = {"seq": seq, "chunk_tokens": HIDDEN}
    for name, forward in (("plain", mlp.forward), ("tiled", tiled)):
        saved: list[int] = []

        def step(forward=forward, saved=saved) -> None:
            saved.clear()

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = forward(x)
            y.sum().backward()

        out[f"{name}_step_s"] = _median_s(step, rounds)
        out[f"{name}_saved_bytes"] = sum(saved)
    out["tiled_over_plain_time"] = out["tiled_step_s"] / out["plain_step_s"]
    print(json.dumps(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["all_to_all", "tiled_mlp"])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    (all_to_all if args.what == "all_to_all" else tiled_mlp)(args.seq, args.rounds)


if __name__ == "__main__":
    main()
