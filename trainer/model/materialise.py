"""A meta-device model made real on this rank, holding its part only: FSDP2's shards, a tensor
split's blocks, or both. Pretrained safetensors are read by each rank, its own block of every
tensor (`trainer.model.pretrained.load_fsdp_shards`); random init (and weights in other formats)
with `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`: rank 0 alone
builds the full weights and sends every rank its part, so no other rank holds the full model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from trainer.model.pretrained import load_fsdp_shards, load_per_rank
from trainer.runtime.dist import after_rank0


def materialise(model: nn.Module, factory: Any, ctx: Any, home: torch.device, what: str) -> None:
    """This rank's parts of a meta-device model on `home`, filled with the initial weights
    (`what` names the parts in the load report)."""
    model.to_empty(device=home)
    rebuild_buffers(model, home)
    if not load_per_rank(model, factory, load_fsdp_shards, ctx, what):
        full = after_rank0(
            "building the initial weights",
            factory.initial_state_dict,
            clock_s=ctx.cfg.dist.timeout_s,
        )
        set_model_state_dict(
            model,
            full or {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )


def rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inverse frequencies, Gemma's embedding scale) are not in
    any state dict: after `to_empty` they hold garbage, so rebuild each owning module's
    buffers: rotary embeddings from their config, the others by the model's own
    `_init_weights` (its parameters are overwritten by the initial state right after)."""
    persistent = set(model.state_dict())
    for prefix, module in model.named_modules():
        own = [
            name
            for name, _ in module.named_buffers(recurse=False)
            if (f"{prefix}.{name}" if prefix else name) not in persistent
        ]
        if not own:
            continue
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(module)(config=module.config)
            for name, buf in fresh.named_buffers():
                getattr(module, name).copy_(buf)
        elif hasattr(model, "_init_weights"):
            with torch.no_grad():
                model._init_weights(module)
