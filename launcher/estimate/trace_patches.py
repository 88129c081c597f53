"""What the traces replace in torch and transformers while they run (`launcher/estimate/trace.py`
and `launcher/estimate/saved_tensors.py` use these): DTensor's sharding propagation kept out of
the memory count, and MoE experts that multiply under fake tensors, eagerly and compiled."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


@contextlib.contextmanager
def patched(module, **replacements):
    """`module`'s attributes replaced while the context runs, those it has (transformers'
    names differ between versions)."""
    originals = {n: getattr(module, n) for n in replacements if hasattr(module, n)}
    for name in originals:
        setattr(module, name, replacements[name])
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


@contextlib.contextmanager
def untracked_sharding_propagation():
    """DTensor's sharding propagation out of the tracker's sight: to find an op's output shape
    it runs the op on fake arguments of the global shapes, outside any real computation (a run
    of the engine allocates nothing for it). Under the tracker those would count as live bytes
    wherever its cache misses: every fused AdamW step under torch 2.11, four fp32 copies of the
    whole model. Here it runs with the dispatch modes set aside, on a fake mode of its own."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    with patched(ShardingPropagator, _propagate_tensor_meta_non_cached=untracked):
        yield


@contextlib.contextmanager
def moe_fake_kernels():
    """MoE experts under fake tensors. transformers' grouped experts multiply through its
    `_grouped_mm`: torch's grouped_mm, whose meta kernel accepts bf16 only (its CUDA kernel's
    restriction), or its own fallback op, a loop over experts whose backward reads the offsets'
    values before transformers 5.23 (a fake tensor has none; compiled, every MoE layer broke
    the graph). On fake tensors and under torch.compile the multiply is `experts_multiply`;
    real tensors (QLoRA and 8-bit traces) take the fallback, which takes every dtype. A no-op
    for dense models or without transformers' MoE integration."""
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        from transformers.integrations import moe
    except ImportError:
        moe = None
    if not hasattr(moe, "_grouped_mm"):
        yield
        return
    original = moe._grouped_mm

    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor):
        if isinstance(input, FakeTensor) or torch.compiler.is_compiling():
            return experts_multiply(input.to(weight.dtype), weight, offs)
        return original(input, weight, offs)

    with patched(moe, _grouped_mm=grouped_mm, _can_use_grouped_mm=lambda *a, **k: False):
        yield


def experts_multiply(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor):
    """(S, in) rows sorted by expert times (E, in, out) expert weights -> (S, out), as one opaque
    operator whose fake kernels allocate what transformers' fallback allocates: the output; the
    input and weights saved for backward; their gradients (no per-expert temporaries: its
    products write into slices of those). Opaque as that fallback and torch's grouped_mm are, a
    compiled trace's partitioner saves its input rather than recompute through it."""
    return torch.ops.oomless.experts_multiply(input, weight, offs)


@torch.library.custom_op("oomless::experts_multiply", mutates_args=())
def _experts_multiply(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    output = input.new_zeros(input.size(0), weight.size(2))
    for i, (start, end) in enumerate(_spans(offs)):
        torch.mm(input[start:end], weight[i], out=output[start:end])
    return output


@_experts_multiply.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return input.new_empty(input.size(0), weight.size(2))


@torch.library.custom_op("oomless::experts_multiply_backward", mutates_args=())
def _experts_multiply_backward(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    for i, (start, end) in enumerate(_spans(offs)):
        torch.mm(grad_output[start:end], weight[i].T, out=grad_input[start:end])
        torch.mm(input[start:end].T, grad_output[start:end], out=grad_weight[i])
    return grad_input, grad_weight


@_experts_multiply_backward.register_fake
def _(input, weight, offs, grad_output) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight)


def _save_for_backward(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]  # kept beside, as the fallback keeps it


def _backward(ctx: Any, grad_output: torch.Tensor):
    input, weight = ctx.saved_tensors
    return (*torch.ops.oomless.experts_multiply_backward(input, weight, ctx.offs, grad_output),
            None)  # fmt: skip


_experts_multiply.register_autograd(_backward, setup_context=_save_for_backward)


def _spans(offs: torch.Tensor) -> list[tuple[int, int]]:
    """Each expert's rows, from the cumulative counts (real tensors only)."""
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))
