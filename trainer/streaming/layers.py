"""Decoder layers streamed through two device buffers.

Every decoder layer's parameters are views into one of two flat device buffers (layer i into
buffer i % 2), in the compute dtype; a layer's weights are copied in from the host's fp32 masters
(`HostState`) on the copy queue while the layer before it computes. Forward runs each layer
without saving its activations and keeps only its input; backward copies the weights in again in
reverse order, recomputes the layer from its input, and sends the layer's gradients to the host
on a second queue, where they are accumulated in fp32 across micro-batches, while the previous
layer's backward runs. A buffer is refilled only after the computation that read it is done
(an event on CUDA; on CPU processes the computation has returned).

`DeviceLedger` is the backend's own count of what it holds on the device: both buffers, the
resident parts, the kept layer inputs and the gradients on their way out.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.streaming.copies import Copies, Ticket
from trainer.streaming.host_state import HostState


class DeviceLedger:
    """Bytes the `stream` backend holds on the device, and their peak since the last reset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self.kept = 0  # layer inputs kept for backward (dropped with an abandoned step)
        self.peak = 0

    def hold(self, nbytes: int, kept: bool = False) -> None:
        with self._lock:
            self.held += nbytes
            self.kept += nbytes if kept else 0
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int, kept: bool = False) -> None:
        with self._lock:
            self.held -= nbytes
            self.kept -= nbytes if kept else 0

    def drop_kept(self) -> None:
        with self._lock:
            self.held -= self.kept
            self.kept = 0

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.held


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class LayerStreamer:
    """Streams `layers` (host units `first_unit`...) through two device buffers."""

    def __init__(
        self,
        layers: list[list[tuple[str, nn.Parameter]]],
        host: HostState,
        first_unit: int,
        dtype: torch.dtype,
        copies: tuple[Copies, Copies],
        ledger: DeviceLedger,
    ):
        self.host, self.ledger = host, ledger
        self.copies_in, self.copies_out = copies
        device = self.copies_in.device
        self.units = [first_unit + i for i in range(len(layers))]
        self.numel = max(host.masters[u].numel() for u in self.units)
        self.slots = [torch.empty(self.numel, dtype=dtype, device=device) for _ in range(2)]
        ledger.hold(2 * nbytes(self.slots[0]))
        pinned = device.type == "cuda"
        # staging in the compute dtype (a 16-bit copy of one layer, never of the model)
        self.staging_in = self._staging(dtype) if pinned and dtype != torch.float32 else None
        self.staging_out = self._staging(dtype) if pinned else None
        self.params: list[list[nn.Parameter]] = [[p for _, p in named] for named in layers]
        for i, named in enumerate(layers):
            for name, p in named:
                place = host.places[name]
                p.data = self.slots[i % 2][place.offset : place.offset + place.numel].view(
                    place.shape
                )
        self._holds: list[int | None] = [None, None]
        self._tickets: list[Ticket | None] = [None, None]
        self._free: list[Any] = [None, None]  # compute events after a buffer's last reader
        self._out: deque[Ticket] = deque()  # gradients on their way to the host

    def _staging(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.numel, dtype=dtype, pin_memory=True)

    def invalidate(self) -> None:
        """The masters changed (a step, a load): every buffer is refilled before its next use."""
        self._holds = [None, None]

    def _fetch(self, index: int) -> None:
        slot = index % 2
        if self._holds[slot] == index:
            return
        unit = self.units[index]
        self._holds[slot] = index
        self._tickets[slot] = self.copies_in.submit(
            lambda: self._copy_in(unit, slot), after=self._free[slot]
        )

    def _copy_in(self, unit: int, slot: int) -> None:
        self.host.wait_updated(unit)
        master = self.host.masters[unit].detach()
        copy_in(self.slots[slot][: master.numel()], master, self.staging_in)

    def _ready(self, index: int) -> None:
        self._fetch(index)
        ticket = self._tickets[index % 2]
        assert ticket is not None
        ticket.wait()

    def forward(self, index: int, hidden: torch.Tensor, call: Callable) -> torch.Tensor:
        self._ready(index)
        if index + 1 < len(self.units):
            self._fetch(index + 1)
        out = call(hidden)
        self._free[index % 2] = self.copies_in.compute_mark()
        return out

    def backward(
        self, index: int, hidden: torch.Tensor, grad_out: torch.Tensor, call: Callable,
        autocast: dict[str, Any],
    ) -> torch.Tensor | None:  # fmt: skip
        self.make_room()
        self._ready(index)
        if index > 0:
            self._fetch(index - 1)
        x = hidden.detach().requires_grad_(hidden.requires_grad)
        with torch.enable_grad(), torch.autocast(**autocast):
            out = call(x)
        params = self.params[index]
        inputs = ([x] if x.requires_grad else []) + params
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        grad_in = grads[0] if x.requires_grad else None
        param_grads = grads[1:] if x.requires_grad else grads
        pieces = [grad_or_zeros(g, p) for g, p in zip(param_grads, params, strict=True)]
        del grads, param_grads, out
        self._free[index % 2] = self.copies_in.compute_mark()
        self.send(self.units[index], pieces)
        return grad_in

    def make_room(self) -> None:
        """At most one unit's gradients still on their way out while more are made (what the
        estimate counts): where the copies out are slower, the caller waits."""
        while len(self._out) > 1:
            self._out.popleft().done()

    def send(self, unit: int, pieces: list[torch.Tensor]) -> None:
        """Accumulate `pieces` (a unit's gradients on the device, flat, in the order of its host
        buffer) into the unit's fp32 host gradients, on the outgoing queue. Piece by piece: a
        flat copy of them all would hold the layer's gradients twice on the device."""
        size = sum(nbytes(g) for g in pieces)
        self.ledger.hold(size)
        grad = self.host.masters[unit].grad

        def copy() -> None:
            self.host.wait_updated(unit)
            copy_out(pieces, grad, self.staging_out)

        def then() -> None:
            pieces.clear()  # the device's copies freed with the copy done
            self.ledger.release(size)

        self._out.append(self.copies_out.submit(copy, after=self.copies_out.compute_mark(),
                                                then=then))  # fmt: skip


def copy_in(dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor | None) -> None:
    """fp32 host `src` into the device's `dst` (flat, the compute dtype). With `staging` (a
    pinned 16-bit buffer) the cast runs on the host, piece by piece, and half the bytes cross
    PCIe; the copy thread waits for each piece before it reuses the staging buffer."""
    if staging is None:
        dst.copy_(src, non_blocking=dst.device.type == "cuda")
        return
    step = staging.numel()
    for start in range(0, src.numel(), step):
        piece = src[start : start + step]
        staging[: piece.numel()].copy_(piece)
        dst[start : start + piece.numel()].copy_(staging[: piece.numel()], non_blocking=True)
        torch.cuda.current_stream(dst.device).synchronize()


def copy_out(pieces: list[torch.Tensor], grad: torch.Tensor, staging: torch.Tensor | None) -> None:
    """Device `pieces` (flat, in order) added into the fp32 host `grad` from its start. With
    `staging` (a pinned buffer of one layer; the resident parts may be larger) a fill of it at a
    time: the copy thread waits for each fill to land before it adds it and refills."""
    if staging is None:  # CPU processes: the "device" is this host
        offset = 0
        for g in pieces:
            grad[offset : offset + g.numel()].add_(g)
            offset += g.numel()
        return
    step, filled, added = staging.numel(), 0, 0
    for g in pieces:
        done = 0
        while done < g.numel():
            n = min(step - filled, g.numel() - done)
            staging[filled : filled + n].copy_(g[done : done + n], non_blocking=True)
            filled, done = filled + n, done + n
            if filled == step:
                added += _land(staging, filled, grad, added, g.device)
                filled = 0
    if filled:
        _land(staging, filled, grad, added, pieces[-1].device)


def _land(staging: torch.Tensor, n: int, grad: torch.Tensor, at: int, device) -> int:
    """The first `n` of `staging` added into `grad` at `at`, once their copy has landed."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    grad[at : at + n].add_(staging[:n])
    return n


def grad_or_zeros(grad: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    return (torch.zeros_like(p) if grad is None else grad).reshape(-1)


def _autocast_state(device_type: str) -> dict[str, Any]:
    return {
        "device_type": device_type,
        "dtype": torch.get_autocast_dtype(device_type),
        "enabled": torch.is_autocast_enabled(device_type),
    }


class _StreamedLayer(torch.autograd.Function):
    """A layer run from its streamed weights, its input kept and the layer recomputed in
    backward; the weights are not autograd inputs: their gradients go to the host."""

    @staticmethod
    def forward(ctx, hidden, streamer, index, call, on_device):  # noqa: ANN001 (autograd's)
        ctx.streamer, ctx.index, ctx.call = streamer, index, call
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.save_for_backward(hidden)
        ctx.kept = nbytes(hidden) if on_device else 0
        streamer.ledger.hold(ctx.kept, kept=True)
        return streamer.forward(index, hidden, call)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        (hidden,) = ctx.saved_tensors
        streamer = ctx.streamer
        grad_in = streamer.backward(ctx.index, hidden, grad_out, ctx.call, ctx.autocast)
        streamer.ledger.release(ctx.kept, kept=True)
        # the layer's other arguments (mask, rotary tables) let go of: a hook that outlives the
        # graph keeps this node (a module tracker's, the profiler's phases), not them
        ctx.call = None
        return grad_in, None, None, None, None


def apply_streaming(layers: nn.ModuleList, streamer: LayerStreamer) -> None:
    """Each layer's `forward` goes through the streamer; modules, names and signatures stay.
    Inside the checkpointing wrapper `parallelize` put around each layer (switched off: the
    streamer recomputes), so that activation offload's hooks, which that wrapper enters, take
    the kept input to host memory (`trainer/memory/offload.py`) when the lever is on."""
    for index, wrapper in enumerate(layers):
        switch = getattr(getattr(wrapper, "checkpoint_fn", None), "func", None)
        inner = getattr(wrapper, "_checkpoint_wrapped_module", wrapper)
        _stream_forward(inner, streamer, index, switch)


def _stream_forward(layer: nn.Module, streamer: LayerStreamer, index: int, switch: Any) -> None:
    original = layer.forward

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        def call(h: torch.Tensor) -> torch.Tensor:
            return original(h, *args, **kwargs)

        if not torch.is_grad_enabled():  # evaluation, a reference pass: nothing kept
            return streamer.forward(index, hidden_states, call)
        on_device = getattr(switch, "offload", None) is None  # else kept in host memory
        return _StreamedLayer.apply(hidden_states, streamer, index, call, on_device)

    layer.forward = forward
