"""Training FLOPs per token, in one place: the engine's MFU, the planner's cost model
(launcher/plan/cost.py) and the benchmarks (bench/common.py) count the same work.

PaLM's accounting (Chowdhery et al., 2022, appendix B): a matmul parameter costs 2 FLOPs per
token forward and 4 backward (6N); attention's score and value matmuls add 12 x layers x hidden
x seq per token, forward and backward. Recomputation is not useful work and is not counted here.
Torch-free.
"""

from __future__ import annotations


def attention_flops_per_token(num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Attention's score and value matmuls (q.k^T and p.v), forward and backward, per token."""
    return 12.0 * num_layers * hidden_size * seq_len


def training_flops_per_token(
    num_params: int, num_layers: int, hidden_size: int, seq_len: int
) -> float:
    """6N for the matmuls plus attention: what an MFU figure divides by."""
    return 6.0 * num_params + attention_flops_per_token(num_layers, hidden_size, seq_len)
