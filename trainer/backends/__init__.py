"""Backends: everything that differs between strategies, behind one small protocol.

One file per backend, no inheritance between them; shared logic lives in free functions
(`trainer.backends.common`, `trainer.runtime.dist`); every backend changes its model through
`trainer.parallel.parallelize`, in the one order. The engine talks only to `Backend` and never names
a strategy.

Gradient convention (what `backward` receives): `loss` is this micro-batch's contribution to the
token-weighted mean loss of the whole global batch, i.e. sum of token losses on this rank's
micro-batch divided by the number of target tokens in the global batch (all ranks, all
micro-batches). The true gradient is the SUM of these contributions over ranks and micro-steps.
A backend whose reduction averages over ranks multiplies by world_size; DeepSpeed, which also
divides by its accumulation steps, multiplies by grad_accum too; fp16 loss scaling lives here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trainer.core import strategies
from trainer.core.config import JobConfig
from trainer.core.step_spec import OptimizerSpec
from trainer.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class BackendContext:
    """Where and how the backend runs: fixed for the life of one process."""

    cfg: JobConfig  # for the backend's own section (fsdp:, deepspeed:)
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    precision: str  # bf16 | fp16 | fp32 | bf16_pure
    activation_checkpointing: str  # none | selective | full
    micro_batch_size: int
    grad_accum: int
    mesh: ParallelMesh | None = None  # the dimensions' groups (trainer/parallel/mesh.py)


class ModelFactory(Protocol):
    """Builds the model; the same seed gives the same initial weights for every backend."""

    hf_config: Any

    def build(self, device: str | torch.device) -> nn.Module:
        """'meta' gives the structure only; any other device gives initialised fp32 weights."""

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 CPU state dict of the initial weights (seeded random init or pretrained)."""


class Backend(Protocol):
    name: str

    def setup(self, factory: ModelFactory, optim: OptimizerSpec) -> nn.Module:
        """Build, wrap, shard or offload the model; build the optimizer. Returns what to call."""

    def compute_context(self) -> AbstractContextManager:
        """Context for forward (autocast where the backend computes in 16 bit that way)."""

    def no_sync(self) -> AbstractContextManager:
        """Context for accumulation micro-steps that must not reduce gradients yet."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> float:
        """Unscale, clip, optimizer step, zero grads (set_to_none). Returns pre-clip grad norm."""

    def set_lr(self, lr: float) -> None: ...

    def set_micro_batch(self, micro_batch_size: int, grad_accum: int) -> None:
        """The OOM back-off re-cut this rank's batch (global batch unchanged) before a retry."""

    def drop_grads(self) -> None:
        """Discard partial gradients of an abandoned step (OOM back-off)."""

    def state_dict(self) -> dict[str, Any]:
        """Canonical: {'model': {name: fp32}, 'optim': {name: {exp_avg, exp_avg_sq, step}}}."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full fp32 weights on CPU on rank 0 (None on other ranks); a collective."""

    def memory_stats(self) -> dict[str, int]:
        """At least {'peak_device_bytes'}; peaks since the last reset_peak()."""

    def reset_peak(self) -> None: ...


def build_backend(strategy: str, ctx: BackendContext) -> Backend:
    """The backend of the strategy's row, imported lazily: DeepSpeed is imported only when a
    DeepSpeed rung runs."""
    module_name, class_name = strategies.row(strategy).backend.split(":")
    cls: Callable[..., Backend] = getattr(importlib.import_module(module_name), class_name)
    return cls(strategy, ctx)
