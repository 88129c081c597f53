"""The exact-math memory levers besides recomputation, on a built model: chunked loss
(`trainer.memory.chunked_loss`) and activation offload (`trainer.memory.offload`). Both keep the
numbers to floating-point reordering, so the OOM back-off may switch them on mid-run."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.core.config import ConfigError
from trainer.memory.chunked_loss import apply_chunked_loss, chunkable
from trainer.memory.offload import ActivationOffload
from trainer.model.build import set_offload_activations

LEVERS = ("chunked_loss", "offload_activations")  # the order the OOM back-off tries them in
LEVER_NAMES = {"chunked_loss": "chunked loss", "offload_activations": "activation offload"}


def concrete_lever(value: Any) -> bool:
    """A resolved config says true or false; `auto` left unresolved (no planner) is off."""
    return value is True


class MemoryLevers:
    """Which levers are on for `model`, and the switch for each."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        chunked_loss: bool,
        offload_activations: bool,
        loss_chunk_tokens: int | None = None,
        offload_host: torch.device | None = None,
    ):
        """`offload_host`: where offloaded copies go from a CPU device (the estimator's trace:
        `meta`, so that its CPU stand-in for the device does not count them)."""
        self.model = model
        self.loss_chunk_tokens = loss_chunk_tokens
        self.offload = ActivationOffload(device, host=offload_host)
        self.chunked_loss = self.offload_activations = False
        self.unavailable: dict[str, str] = {}  # lever -> why this model cannot use it
        if (why := chunkable(model)) is not None:
            self.unavailable["chunked_loss"] = why
            if chunked_loss:
                raise ConfigError("memory.chunked_loss", why, "set memory.chunked_loss=false")
        self.set("chunked_loss", chunked_loss)
        self.set("offload_activations", offload_activations)

    def set(self, lever: str, on: bool) -> None:
        if lever == "chunked_loss":
            if lever not in self.unavailable:
                apply_chunked_loss(self.model, on, self.loss_chunk_tokens)
        elif lever == "offload_activations":
            set_offload_activations(self.model, self.offload if on else None)
        else:
            raise ValueError(f"unknown memory lever {lever!r}")
        setattr(self, lever, on)

    def next_off(self) -> str | None:
        """The first lever still off that this model can use, in the back-off's order."""
        usable = (lever for lever in LEVERS if lever not in self.unavailable)
        return next((lever for lever in usable if not getattr(self, lever)), None)

    def drop_partial_step(self) -> None:
        """After an aborted step: forget what its forward offloaded (never brought back)."""
        self.offload.drop()

    def state(self) -> dict[str, bool]:
        return {lever: getattr(self, lever) for lever in LEVERS}

    def record(self) -> dict[str, Any]:
        """For the metrics line: what is in force, and the bytes offloaded since the last call."""
        out: dict[str, Any] = self.state()
        if self.offload_activations:
            out["offloaded_bytes"] = self.offload.offloaded_bytes
            out["restored_bytes"] = self.offload.restored_bytes
        self.offload.reset_counts()
        return out
