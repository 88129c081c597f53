"""`ddp`: a full replica per rank, gradients all-reduced by torch DistributedDataParallel.

Every rank builds the same seeded weights, so no broadcast is needed at start. Gradients are
bucket views (`gradient_as_bucket_view`), so DDP adds no second copy of them. Accumulation
micro-steps run under `no_sync`; DDP averages over ranks, and the engine's loss is a share of the
global token mean, so backward scales it by the world size.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.backends import BackendContext, ModelFactory, OptimizerSpec, common


class DdpBackend:
    def __init__(self, strategy: str, ctx: BackendContext):
        self.name = strategy
        self.ctx = ctx
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.precision == "fp16")

    def setup(self, factory: ModelFactory, optim: OptimizerSpec) -> nn.Module:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None

        def wrap(inner: nn.Module) -> nn.Module:
            return DistributedDataParallel(
                inner, device_ids=device_ids, gradient_as_bucket_view=True
            )

        self.model = common.build_replica(factory, self.ctx, wrap)
        self.inner = self.model.module
        self.optimizer = common.build_adamw(self.model.parameters(), optim)
        self.grad_clip = optim.grad_clip
        return self.model

    def compute_context(self) -> AbstractContextManager:
        return common.autocast_context(self.ctx.device, self.ctx.precision)

    def no_sync(self) -> AbstractContextManager:
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss * self.ctx.world_size).backward()

    def step(self) -> float:
        return common.replica_step(self)

    def set_lr(self, lr: float) -> None:
        common.set_lr(self.optimizer, lr)

    def set_micro_batch(self, micro_batch_size: int, grad_accum: int) -> None:
        pass  # DDP's reduction does not depend on how the rank's batch is cut

    def drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _named_params(self) -> dict[str, nn.Parameter]:
        return common.trained_params(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return common.replica_state_dict(self._named_params(), self.optimizer, self.scaler)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        common.load_replica_state_dict(state, self._named_params(), self.optimizer, self.scaler)

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.ctx.rank != 0:
            return None
        return common.full_replica_state_dict(self.inner)

    def memory_stats(self) -> dict[str, int]:
        return common.device_memory_stats(self.ctx.device)

    def reset_peak(self) -> None:
        common.reset_device_peak(self.ctx.device)
