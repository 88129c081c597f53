"""fp32 master weights, gradients and AdamW state of the `stream` rung in host memory: one flat
buffer of each per unit (a decoder layer; or the resident parts: embeddings, final norm, head),
so a unit moves in one copy and steps in one call of torch's fused AdamW. Pinned where CUDA is
present (its copies then run asynchronously), plain memory on CPU processes.

The step runs on a worker thread, unit by unit in the order the next forward needs them; a
fetch of a unit for the device waits for that unit's update only (`wait_updated`), so the next
step's first layers compute while the last ones are still being stepped. No update starts before
the global grad norm (and fp16's overflow check) is known: the backend computes both first.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from trainer.core.step_spec import OptimizerSpec

HOST = torch.device("cpu")  # where the state lives (the estimate's trace gives `meta`)


@dataclass(frozen=True)
class Place:
    """Where one parameter lives in the flat buffers: its unit, offset and shape."""

    unit: int
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


class HostState:
    """The flat per-unit buffers, their optimizers and the step worker.

    Built from the model's fp32 parameters, grouped in units; `order` is the model's parameter
    order. Each parameter's own storage is released once copied (set to an empty tensor: the
    caller points it at device memory next), so the host never holds the model twice over.
    """

    def __init__(
        self,
        units: list[list[tuple[str, nn.Parameter]]],
        order: list[str],
        optim: OptimizerSpec,
        pin: bool,
        device: torch.device = HOST,
    ):
        self.places: dict[str, Place] = {}
        self.device = device  # the host (meta in the estimate's trace: no bytes)
        self.masters: list[nn.Parameter] = [self._flat(u, named, pin) for u, named in
                                            enumerate(units)]  # fmt: skip
        self.order = order
        self.optimizers = [
            torch.optim.AdamW([m], lr=optim.lr, betas=optim.betas, eps=optim.eps,
                              weight_decay=optim.weight_decay, fused=True)
            for m in self.masters
        ]  # fmt: skip
        for optimizer, master in zip(self.optimizers, self.masters, strict=True):
            # AdamW's state from the start (what its first step would create): a checkpoint
            # loads into these buffers, with no second copy of the moments beside them
            zeros = {key: torch.zeros_like(master.detach()) for key in ("exp_avg", "exp_avg_sq")}
            optimizer.state[master] = {"step": torch.zeros((), dtype=torch.float32), **zeros}
        self.lr = optim.lr
        self._updated = [threading.Event() for _ in self.masters]
        for event in self._updated:
            event.set()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="oomless-host-adam")
        self._pending: Future | None = None

    def _flat(self, unit: int, named: list[tuple[str, nn.Parameter]], pin: bool) -> nn.Parameter:
        numel = sum(p.numel() for _, p in named)
        flat = torch.empty(numel, dtype=torch.float32, device=self.device, pin_memory=pin)
        offset = 0
        for name, p in named:
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            self.places[name] = Place(unit, offset, p.shape)
            offset += p.numel()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        master = nn.Parameter(flat)
        master.grad = torch.zeros(numel, dtype=torch.float32, device=self.device, pin_memory=pin)
        return master

    @property
    def num_params(self) -> int:
        return sum(m.numel() for m in self.masters)

    def view(self, name: str, flat_of_unit: Mapping[int, torch.Tensor] | list) -> torch.Tensor:
        """The parameter `name`'s view into one of the per-unit flat buffers."""
        place = self.places[name]
        flat = flat_of_unit[place.unit]
        return flat[place.offset : place.offset + place.numel].view(place.shape)

    def master(self, name: str) -> torch.Tensor:
        return self.view(name, [m.detach() for m in self.masters])

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters]

    def grad_views(self) -> list[torch.Tensor]:
        """Every parameter's gradient, in the model's parameter order (the norm `single`
        takes, over the same values in the same order)."""
        grads = self.grads()
        return [self.view(name, grads) for name in self.order]

    def moments(self, name: str) -> dict[str, torch.Tensor]:
        """AdamW's state of parameter `name`: views of the moments, and the step."""
        unit = self.places[name].unit
        state = self.optimizers[unit].state[self.masters[unit]]
        out = {key: self.view(name, {unit: state[key]}) for key in ("exp_avg", "exp_avg_sq")}
        return {**out, "step": torch.as_tensor(float(state["step"]), dtype=torch.float32)}

    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]]) -> None:
        """AdamW's state from the canonical per-name form (a no-op copy where a checkpoint was
        loaded into the views `moments` gave out)."""
        for name, place in self.places.items():
            if name not in moments:
                continue
            state = self.optimizers[place.unit].state[self.masters[place.unit]]
            for key in ("exp_avg", "exp_avg_sq"):
                view = self.view(name, {place.unit: state[key]})
                view.copy_(moments[name][key].reshape(place.shape))
            state["step"].fill_(float(moments[name]["step"]))

    def wait_updated(self, unit: int) -> None:
        self._updated[unit].wait()

    def start_step(self) -> None:
        """Step every unit on the worker thread, in unit order; gradients zeroed after."""
        self.finish_step()
        for event in self._updated:
            event.clear()
        self._pending = self._worker.submit(self._step_all, self.lr)

    def _step_all(self, lr: float) -> None:
        try:
            for unit, optimizer in enumerate(self.optimizers):
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                self.masters[unit].grad.zero_()
                self._updated[unit].set()
        finally:  # a failed step must not leave a fetch waiting: finish_step raises its error
            for event in self._updated:
                event.set()

    def finish_step(self) -> None:
        """The step under way, if any, is done (its error, if any, raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def zero_grads(self) -> None:
        self.finish_step()
        for grad in self.grads():
            grad.zero_()

    def close(self) -> None:
        self.finish_step()
        self._worker.shutdown(wait=True)
