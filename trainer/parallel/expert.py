"""Expert parallel: each MoE layer's experts split over the ranks of an expert group by the
architecture's own plan, which transformers declares in the model's config (`base_model_ep_plan`:
the experts' 3-D weights `grouped_gemm`, sharded by expert; the experts module
`ep_dispatch_experts`) and applies itself (`apply_expert_parallelism` with its `all_to_all`
dispatch): each (token, expert) pair goes to the rank holding the expert in an uneven
all-to-all, the experts run on what they received, and a second all-to-all brings the outputs
back to be weighted by the router on the sender. No architecture is written here; the router and
its top-k are the model's own.

The expert ranks come from the ranks holding different tokens (data x sequence): an expert group
of `expert` neighbouring ranks holds each layer's experts once between them, and the
`expert_data` groups hold copies of the same experts, which FSDP shards (`shard_experts`); the
dense weights stay under FSDP over all the token ranks. Gradients: an expert's gradient arrives
summed over its expert group's tokens (the all-to-all's backward), so FSDP divides the sum over
its copies by the token ranks, the factor the backend's loss was multiplied by
(trainer/backends/fsdp.py), not by its own group size; FSDP2 applies such a factor through
PREMUL_SUM, which gloo refuses, so the reduction is forced to a plain sum divided locally.
"""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any

from torch import nn

from trainer.core.errors import ConfigError

log = logging.getLogger(__name__)

DISPATCH = "ep_dispatch_experts"  # transformers' style of an experts module that receives tokens
IMPLEMENTATION = "all_to_all"  # in training the tokens move; `auto` picks it too, but says so


def check_installed(expert: int) -> None:
    """ConfigError (exit 2) when `parallel.expert` > 1 and the installed transformers cannot
    apply an expert plan by all-to-all dispatch (its distributed API arrived within 5.x)."""
    if expert > 1 and _apply_function() is None:
        raise ConfigError(
            "parallel.expert",
            f"{expert} needs transformers.distributed.expert_parallel.apply_expert_parallelism "
            f"with its '{IMPLEMENTATION}' dispatch, which transformers {version('transformers')} "
            "lacks",
            "install transformers>=5.24, or use parallel.expert=1",
        )


def _apply_function() -> Any:
    """transformers' `apply_expert_parallelism`, where the installed version has it, its
    all-to-all dispatch and the plan expansion it takes (None otherwise)."""
    from transformers import PreTrainedModel

    try:
        from transformers.distributed.expert_parallel import (
            EPImplementationInterface,
            apply_expert_parallelism,
        )
    except ImportError:
        return None
    if IMPLEMENTATION not in EPImplementationInterface() or not hasattr(
        PreTrainedModel, "_expand_parallel_plan"
    ):
        return None
    return apply_expert_parallelism


def installed() -> bool:
    """Whether the installed transformers can split a model's experts."""
    return _apply_function() is not None


def apply_expert_parallel(model: nn.Module, expert_mesh: Any, tensor_mesh: Any) -> None:
    """Split `model`'s experts over `expert_mesh` by its architecture's plan, in place (on the
    meta device too: each rank then materialises its experts only); `tensor_mesh` is the
    group holding the same tokens (one rank: expert and tensor parallel do not combine). A LoRA
    model's base is split; its experts are frozen."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    plan = hf._expand_parallel_plan(dict(hf.ep_plan))
    named = dict(hf.named_parameters()) | dict(hf.named_modules())
    plan = {name: style for name, style in plan.items() if name in named}
    _apply_function()(hf, expert_mesh, tensor_mesh, plan, ep_implementation=IMPLEMENTATION)
    split = [named[name] for name, style in plan.items() if style == DISPATCH]
    for module in split:
        module._oomless_expert_split = True
    if split and expert_mesh.get_rank() == 0:
        log.info(
            "expert parallel %d: %d MoE layers' experts split, %d per rank, tokens dispatched "
            "by all-to-all",
            expert_mesh.size(), len(split), split[0].num_experts,
        )  # fmt: skip


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules `apply_expert_parallel` split, in model order."""
    return [m for m in model.modules() if getattr(m, "_oomless_expert_split", False)]


def shard_experts(
    model: nn.Module, expert_data_mesh: Any, token_ranks: int, options: dict[str, Any]
) -> None:
    """FSDP2 over each split experts module's copies (`expert_data_mesh`), before the decoder
    layers are sharded (a module sharded first keeps its own group): its gradient summed over
    the copies and divided by `token_ranks` (the module docstring)."""
    from torch.distributed.fsdp import fully_shard

    for module in expert_modules(model):
        fully_shard(module, **{**options, "mesh": expert_data_mesh})
        module.set_gradient_divide_factor(float(token_ranks))
        if expert_data_mesh.size() > 1:  # at 1, no reduce-scatter: FSDP divides once itself
            module.set_force_sum_reduction_for_comms(True)
