"""Tiled MLP (the ALST lever): each decoder layer's MLP runs over chunks of the sequence, each
chunk recomputed in backward, so its intermediate activations ([tokens, intermediate_size] x 3
for a gated MLP, the largest of a layer at long context) exist for one chunk at a time.

Exact: the MLP acts on each token alone, so chunks along the sequence compute the same numbers
(up to the matmul's blocking); what backward keeps is each chunk's input. The chunk is
`memory.mlp_chunk_tokens`, by default the model's hidden size (ALST's tile: the intermediate of
one chunk is then about the size of the layer's input). The MLP's own module, parameters and
names stay as they are (its `forward` is replaced on the instance), so sharding, checkpoints and
LoRA adapters see the same model.

Why not DeepSpeed's TiledMLP (deepspeed.runtime.sequence_parallel.ulysses_sp): it is an
autograd function that re-runs the MLP under `torch.enable_grad` in backward and accumulates the
parameter gradients itself, which assumes plain parameters (not FSDP2's DTensors, not ZeRO-3's
partitioned ones); `torch.utils.checkpoint` per chunk does the same recomputation and leaves the
gradients to autograd and to the backend's own hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.core.config import ConfigError
from trainer.model.build import decoder_layers


def apply_tiled_mlp(model: nn.Module, chunk_tokens: int | None) -> int:
    """Run the MLP of every decoder layer of `model` (built, maybe wrapped or sharded) over
    chunks of `chunk_tokens` tokens (None: the hidden size), and its norms recomputed in
    backward (`apply_recomputed_norms`), in place. Returns the chunk size."""
    layers = decoder_layers(model)
    mlps = [_mlp_of(layer) for layer in layers]
    if chunk_tokens is None:
        chunk_tokens = int(_hidden_size(model))
    for mlp in mlps:
        if not isinstance(mlp.forward, TiledForward):
            mlp.forward = TiledForward(mlp.forward, chunk_tokens)
    apply_recomputed_norms(model, layers)
    return chunk_tokens


def apply_recomputed_norms(model: nn.Module, layers: list[nn.Module]) -> None:
    """Each norm of the decoder layers (their direct children) and the final one keep only
    their input for backward and run again there. HF's RMSNorm saves an fp32 copy of its
    input and its normalised 16-bit output besides the output its consumers save: at long
    context 6 bytes per token and hidden unit, twice a layer, where the input is 2. Exact: the
    recomputation runs the same operations on the same input."""
    norms = [m for layer in layers for m in _unwrapped(layer).children() if _is_norm(m)]
    inner = getattr(model, "model", None)
    if isinstance(final := getattr(inner, "norm", None), nn.Module) and _is_norm(final):
        norms.append(final)
    for norm in norms:
        if not isinstance(norm.forward, RecomputedForward):
            norm.forward = RecomputedForward(norm.forward)


def _unwrapped(layer: nn.Module) -> nn.Module:
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm")) and not any(
        True for _ in module.children()
    )


def tiled_mlp_chunk_tokens(model: nn.Module) -> int | None:
    """The chunk of the tiled MLPs of `model` (what `apply_tiled_mlp` did), or None."""
    for module in model.modules():
        if isinstance(forward := module.__dict__.get("forward"), TiledForward):
            return forward.chunk_tokens
    return None


def _mlp_of(layer: nn.Module) -> nn.Module:
    inner = _unwrapped(layer)
    mlp = getattr(inner, "mlp", None)
    if isinstance(mlp, nn.Module):
        return mlp
    kind = type(inner).__name__
    raise ConfigError("memory.tiled_mlp", f"the decoder layers of this model ({kind}) have no "
                      "`mlp` module", "set memory.tiled_mlp=false")  # fmt: skip


def _hidden_size(model: nn.Module) -> int:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            return config.get_text_config().hidden_size
    raise ValueError(f"{type(model).__name__}: no Hugging Face config to read the hidden size")


class TiledForward:
    """An MLP's forward over chunks of dim 1 (the sequence), each checkpointed."""

    def __init__(self, forward: Callable[..., torch.Tensor], chunk_tokens: int):
        self.forward = forward
        self.chunk_tokens = chunk_tokens

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if hidden.dim() < 3 or hidden.size(1) <= self.chunk_tokens:
            return self.forward(hidden, *args, **kwargs)
        chunks = hidden.split(self.chunk_tokens, dim=1)
        if not torch.is_grad_enabled():
            return torch.cat([self.forward(c, *args, **kwargs) for c in chunks], dim=1)
        return torch.cat(
            [
                torch.utils.checkpoint.checkpoint(
                    self.forward, c, *args, use_reentrant=False, **kwargs
                )
                for c in chunks
            ],
            dim=1,
        )


class RecomputedForward:
    """A module's forward under `torch.utils.checkpoint`: backward keeps only its input."""

    def __init__(self, forward: Callable[..., torch.Tensor]):
        self.forward = forward

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.forward(hidden, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(
            self.forward, hidden, *args, use_reentrant=False, **kwargs
        )
