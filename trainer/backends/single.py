"""`single`: the whole model, its gradients and AdamW state on one device.

Mixed precision is the docs/interface.md contract: fp32 master weights, grads and optimizer state;
forward and loss under autocast in bf16/fp16; fp16 adds a dynamic gradient scaler. Under
`precision: bf16_pure` the weights themselves are bf16 (no autocast, no fp32 copy).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from trainer.backends import BackendContext, ModelFactory, OptimizerSpec, common


class SingleBackend:
    def __init__(self, strategy: str, ctx: BackendContext):
        self.name = strategy
        self.ctx = ctx
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.precision == "fp16")

    def setup(self, factory: ModelFactory, optim: OptimizerSpec) -> nn.Module:
        model = common.build_replica(factory, self.ctx)
        self.model = model
        self.optimizer = common.build_adamw(model.parameters(), optim, self.ctx.grad_accum)
        self.grad_clip = optim.grad_clip
        return model

    def compute_context(self) -> AbstractContextManager:
        return common.autocast_context(self.ctx.device, self.ctx.precision)

    def no_sync(self) -> AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self) -> float:
        return common.replica_step(self)

    def set_lr(self, lr: float) -> None:
        common.set_lr(self.optimizer, lr)

    def set_micro_batch(self, micro_batch_size: int, grad_accum: int) -> None:
        # the loss is already normalised by global tokens: nothing else depends on the cut
        common.refuse_accumulation(self.optimizer, grad_accum)

    def drop_grads(self) -> None:
        assert self.optimizer is not None
        common.drop_grads(self.optimizer)

    def _named_params(self) -> dict[str, nn.Parameter]:
        assert self.model is not None
        return common.trained_params(self.model)

    def state_dict(self) -> dict[str, Any]:
        return common.replica_state_dict(self._named_params(), self.optimizer, self.scaler)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        common.load_replica_state_dict(state, self._named_params(), self.optimizer, self.scaler)

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        assert self.model is not None
        return common.full_replica_state_dict(self.model)

    def memory_stats(self) -> dict[str, int]:
        return common.device_memory_stats(self.ctx.device)

    def reset_peak(self) -> None:
        common.reset_device_peak(self.ctx.device)
