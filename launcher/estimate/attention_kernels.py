"""What an attention kernel allocates on a GPU that the CPU trace cannot see.

FlashAttention-2 runs attention where transformers' `sdpa` reaches PyTorch's flash kernel (CUDA,
16-bit, no mask: unpacked windows) and under `flash_attention_2` (the flash-attn package). Its
backward allocates, inside the kernel call and beyond the gradients it returns
(`mha_bwd` of PyTorch's and flash-attn's `flash_api.cpp`): an fp32 accumulator of the query
gradient, [b, s, heads, head_dim] (`dq_accum`); the softmax's row terms, fp32 [b, heads, s]
(`softmax_d`); and under grouped-query attention the key and value gradients of every query
head in the compute dtype, summed per key/value head afterwards (`dk_expanded`,
`dv_expanded`). The CPU trace runs SDPA's CPU flash kernel, whose own buffers fake tensors do
not see either, so the estimate adds these where FlashAttention-2 runs (measured on an H200:
docs/gpu.md, long context). flex_attention on packed windows keeps a sparse block mask instead
of a dense one.
"""

from __future__ import annotations

from launcher.estimate.shape import ModelShape


def flash_backward_bytes(
    shape: ModelShape, b: int, s: int, c: int, r: int, sp: int = 1, heads: tuple | None = None
) -> int:
    """A decoder layer's live bytes beyond its saved tensors while its attention's backward runs
    under FlashAttention-2, for `b` sequences of `s` tokens on this rank (`sp`: Ulysses' ranks,
    each attending over the whole sequence with its share of the heads; `c` compute and `r`
    residual-stream bytes): the stream's gradient, the attention output's gradient, the q/k/v
    gradients and the kernel's buffers. `heads`: (query heads, key/value heads, head size) of
    the call, where not the shape's."""
    num_heads, num_kv_heads, head_dim = heads or (
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
    )
    t = b * s
    q = num_heads * head_dim
    kv = max(num_kv_heads, sp) * head_dim  # Ulysses repeats k/v to one head a rank
    grads = r * t * shape.hidden_size + c * t * q + c * t * (q + 2 * kv)
    buffers = 4 * t * q + 4 * b * num_heads * s  # dq_accum, softmax_d
    if kv < q:  # grouped-query attention: k/v gradients per query head first
        buffers += 2 * c * t * q
    return grads + buffers


def layer_flash_bytes(shape: ModelShape, b: int, s: int, c: int, r: int, sp: int = 1) -> int:
    """`flash_backward_bytes` of the model's attention: the analytic block's heads, or for a
    traced block the largest of the calls its trace saw the flash kernel take (none: 0)."""
    if shape.activations is None:
        return flash_backward_bytes(shape, b, s, c, r, sp)
    calls = shape.activations.flash_calls
    return max((flash_backward_bytes(shape, b, s, c, r, sp, tuple(h)) for h in calls), default=0)


FLEX_BLOCK = 128  # torch's flex_attention block: a BlockMask keeps indices per pair of blocks


def block_mask_bytes(micro: int, seq: int) -> int:
    """flex_attention's BlockMask of `micro` packed windows of `seq` tokens (the whole sequence
    under Ulysses), as transformers builds it (`create_block_mask`, compiled: no dense mask on
    the way): int32 block indices for every pair of 128-token blocks, partial and full, by
    rows and transposed for backward."""
    blocks = -(-seq // FLEX_BLOCK)
    return 4 * 4 * micro * blocks * blocks
