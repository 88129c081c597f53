"""Tensor parallel: each decoder layer's projections split over the ranks of a tensor group by
the architecture's own plan, which transformers declares in the model's config
(`base_model_tp_plan`: column-wise q/k/v and gate/up, row-wise o and down; its head gathers the
logits on every rank) and applies itself (`apply_tensor_parallelism`): no architecture is
written here, and the plan styles stay transformers' (`embedding_rowwise`,
`replicated_with_grad_allreduce`, `packed_colwise`, `colwise_gather_output`).

The split parameters become DTensors over the tensor mesh; the others (norms) stay whole on every
rank, their gradients equal there. FSDP shards on top over the ranks that hold other tokens
(`ParallelMesh.token_mesh`), so a parameter is a 2-D DTensor under `fsdp x tensor`.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.core.errors import ConfigError


def check_installed(tensor: int) -> None:
    """ConfigError (exit 2) when `parallel.tensor` > 1 and the installed transformers cannot
    apply a plan (its distributed API moved between 5.17 and 5.24)."""
    if tensor > 1 and _apply_function() is None:
        raise ConfigError(
            "parallel.tensor",
            f"{tensor} needs transformers.distributed.tensor_parallel.apply_tensor_parallelism, "
            f"which transformers {version('transformers')} lacks",
            "install transformers>=5.24, or use parallel.tensor=1",
        )


def _apply_function() -> Any:
    """transformers' `apply_tensor_parallelism`, where the installed version has it and the
    plan expansion it takes (None otherwise)."""
    from transformers import PreTrainedModel

    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        return None
    return apply_tensor_parallelism if hasattr(PreTrainedModel, "_expand_parallel_plan") else None


def installed() -> bool:
    """Whether the installed transformers can split a model (`make test-floor` may lack it)."""
    return _apply_function() is not None


def apply_tensor_parallel(model: nn.Module, tensor_mesh: Any) -> None:
    """Split `model`'s projections over `tensor_mesh` by its architecture's plan, in place (on
    the meta device too: each rank then materialises its part only). A tied head keeps the
    embedding's split weight (both are split by rows of the vocabulary)."""
    plan = model._expand_parallel_plan(dict(model.tp_plan))
    named = dict(model.named_parameters()) | dict(model.named_modules())
    plan = {name: style for name, style in plan.items() if name in named}  # tied: named once
    _apply_function()(model, tensor_mesh, plan)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    for name, style in plan.items():
        if style == PARTIAL_GRADIENTS and isinstance(named[name], nn.Module):
            _sum_gradients_per_backward(named[name], tensor_mesh.get_group())


# transformers' style for a replicated norm that sees only its rank's heads (Qwen3's q/k norms)
PARTIAL_GRADIENTS = "replicated_with_grad_allreduce"


def _sum_gradients_per_backward(module: nn.Module, group: Any) -> None:
    """Sum each backward's gradient of `module`'s parameters over the tensor group before it is
    accumulated. transformers' style sums the accumulated `.grad` (a post-accumulate hook): under
    gradient accumulation every micro-batch would sum the earlier ones again (measured: losses
    1e-5 off one process's by step 2 at accumulation 4). Hooked at the first forward, as there:
    building or sharding the model may replace the parameter objects."""
    del module.forward  # transformers' wrapper that installs its hook
    hooked: dict[str, nn.Parameter] = {}

    def hook_once(module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and hooked.get(name) is not param:
                param.register_hook(lambda grad: _summed(grad, group))
                hooked[name] = param

    module.register_forward_pre_hook(hook_once)


def _summed(grad: torch.Tensor, group: Any) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def is_split(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh")


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` over parameters on different meshes (a tensor split leaves the norms
    whole, or on FSDP's 1-D mesh, and the split ones on a 2-D one): each mesh's gradients as one
    norm, the global norm of those, every gradient scaled by min(1, max_norm / norm) as torch
    does. Returns the norm before clipping."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        norms.append(norm.full_tensor() if is_split(norm) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # no sync: a device tensor
    for grads in groups.values():  # a DTensor's local block, scaled in place
        torch._foreach_mul_([g.to_local() if is_split(g) else g for g in grads], coef)
    return total


def on_several_meshes(parameters: list[torch.Tensor]) -> bool:
    """Whether `parameters` lie on more than one mesh (plain tensors count as one)."""
    return len({getattr(p, "device_mesh", None) for p in parameters}) > 1
