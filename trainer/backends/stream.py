"""`stream`: fp32 master weights, gradients and AdamW state in host memory, the decoder layers
streamed through one device (MegaTrain's design, arXiv 2604.05091; our own code).

The resident parts (embeddings, final norm, output layer) stay on the device in the compute
dtype; every decoder layer's weights come in from the host for its forward and again for its
backward, double-buffered (`trainer/streaming/layers.py`), its input kept (in host memory under
activation offload) and the layer recomputed. Gradients go back per layer and are accumulated
on the host in fp32. The step is `single`'s math: fp16's unscale and overflow check (the same
`GradScaler`), the global grad norm over every parameter in the model's order, clipping, then
torch's fused AdamW per layer buffer on a host thread, overlapped with the next step's first
layers (`host_state.py`).
docs/stream.md says what it does not take (LoRA, QLoRA, 8-bit states, the step in backward:
trainer/core/methods.py refuses them).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from trainer.backends import BackendContext, ModelFactory, OptimizerSpec, common
from trainer.model.build import decoder_layers
from trainer.model.pretrained import canonical_name
from trainer.parallel.parallelize import ModelChanges, parallelize
from trainer.streaming.copies import Copies, Ticket
from trainer.streaming.host_state import HOST, HostState
from trainer.streaming.layers import (
    DeviceLedger,
    LayerStreamer,
    apply_streaming,
    copy_in,
    grad_or_zeros,
    nbytes,
)

_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _HostSteps:
    """What `GradScaler` unscales and steps: every host master; `step` starts the host step."""

    def __init__(self, host: HostState):
        self.host = host
        self.param_groups = [{"params": host.masters}]
        self.stepped = False

    def step(self) -> None:
        self.host.start_step()
        self.stepped = True


class StreamBackend:
    """`host`: where the fp32 state lives; `copies`: the two queues (in, out). The estimate's
    trace (launcher/estimate/trace_stream.py) gives the meta device, whose tensors have no bytes,
    and queues that run each copy on its own thread; the engine gives neither."""

    def __init__(
        self,
        strategy: str,
        ctx: BackendContext,
        host: torch.device = HOST,
        copies: tuple[Any, Any] | None = None,
    ):
        self.name = strategy
        self.ctx = ctx
        self.host_device = host
        self.dtype = _PRECISION_DTYPES[ctx.precision]
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.precision == "fp16")
        self.ledger = DeviceLedger()
        delay_s = ctx.cfg.debug.stream_copy_delay_s or 0.0
        self.copies = copies or (Copies(ctx.device, "copy-in", delay_s),
                                 Copies(ctx.device, "copy-out", delay_s))  # fmt: skip
        self._resident_ticket: Ticket | None = None

    def setup(self, factory: ModelFactory, optim: OptimizerSpec) -> nn.Module:
        self.grad_clip = optim.grad_clip
        # no checkpointing wrappers: the streamer recomputes every layer from its input
        changes = ModelChanges(mesh=self.ctx.mesh)
        build = lambda: factory.build("cpu")  # noqa: E731 (the fp32 host copy, streamed from)
        self.model = parallelize(build, factory.hf_config, changes,
                                 lambda model: self._stream(model, optim))  # fmt: skip
        return self.model

    def _stream(self, model: nn.Module, optim: OptimizerSpec) -> nn.Module:
        """The built CPU model turned into a streamed one: its parameters into the host's
        flat buffers, the layers' onto the two device buffers, the rest resident."""
        layers = decoder_layers(model)
        named = [(canonical_name(n), p) for n, p in model.named_parameters()]
        layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
        units: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(layers) + 1)]
        for name, p in named:
            units[layer_of.get(id(p), -1) + 1].append((name, p))
        device = self.ctx.device
        self.host = HostState(units, [n for n, _ in named], optim, pin=device.type == "cuda",
                              device=self.host_device)  # fmt: skip
        self.resident = units[0]
        for name, p in self.resident:
            p.data = self.host.master(name).to(device, self.dtype, copy=True)
            self.ledger.hold(nbytes(p.data))
        if any(b.device != device for b in model.buffers()):  # the parameters are placed
            model.to(device)  # buffers (rotary frequencies)
        self.streamer = LayerStreamer(units[1:], self.host, 1, self.dtype, self.copies,
                                      self.ledger)  # fmt: skip
        apply_streaming(layers, self.streamer)
        model.register_forward_pre_hook(lambda module, args: self._wait_resident())
        return model

    def _wait_resident(self) -> None:
        if self._resident_ticket is not None:
            self._resident_ticket.wait()
            self._resident_ticket = None

    def _refresh_resident(self) -> None:
        """The resident parts from their updated masters, on the copy queue."""
        staging = self.streamer.staging_in

        def copy() -> None:
            self.host.wait_updated(0)
            for name, p in self.resident:
                copy_in(p.data.view(-1), self.host.master(name).reshape(-1), staging)

        self._resident_ticket = self.copies[0].submit(copy, after=self.copies[0].compute_mark())

    def compute_context(self) -> AbstractContextManager:
        return common.autocast_context(self.ctx.device, self.ctx.precision)

    def no_sync(self) -> AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the streamed layers; the resident parts' gradients follow them to
        the host (accumulated there in fp32, like every layer's)."""
        self.scaler.scale(loss).backward()
        pieces = [grad_or_zeros(p.grad, p) for _, p in self.resident]
        for _, p in self.resident:
            p.grad = None
        self.streamer.make_room()  # the last layers' may still be leaving under slow copies
        self.streamer.send(0, pieces)

    def step(self) -> float:
        """`single`'s step on the host: unscale (fp16), the global norm, clip, then AdamW per
        unit on the host thread (started here, finished before the unit is next fetched)."""
        self.copies[1].drain()  # every gradient is on the host
        steps = _HostSteps(self.host)
        if self.scaler.is_enabled():
            self.scaler.unscale_(steps)
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.get_total_norm(self.host.grad_views(), foreach=True)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(self.host.grads(), coef)
        if self.scaler.is_enabled():
            self.scaler.step(steps)
            self.scaler.update()
        else:
            steps.step()
        if not steps.stepped:  # an fp16 overflow: the step is skipped, its gradients dropped
            self.host.zero_grads()
        self.streamer.invalidate()
        self._refresh_resident()
        return float(norm)

    def set_lr(self, lr: float) -> None:
        self.host.lr = lr  # taken by the next step when it starts (one may still be running)

    def set_micro_batch(self, micro_batch_size: int, grad_accum: int) -> None:
        pass  # the loss is normalised by global tokens: nothing depends on the cut

    def drop_grads(self) -> None:
        self.copies[1].drain()
        self.host.zero_grads()
        self.ledger.drop_kept()
        for _, p in self.resident:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The canonical form: fp32 masters and AdamW moments per parameter name (views of the
        host buffers; the step under way is finished first)."""
        self.host.finish_step()
        return {
            "model": {name: self.host.master(name) for name in self.host.order},
            "optim": {name: self.host.moments(name) for name in self.host.order},
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.host.finish_step()
        with torch.no_grad():
            for name in self.host.order:
                self.host.master(name).copy_(state["model"][name])
        self.host.load_moments(state["optim"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.streamer.invalidate()
        self._refresh_resident()

    def full_model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every entry of the model's state dict on the CPU: the masters for parameters (a
        tied weight under each of its names), buffers as they are."""
        self.host.finish_step()
        names: dict[int, str] = {}  # a tied weight: its first name, the one the host keeps
        for n, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), canonical_name(n))
        out = {}
        for n, t in self.model.state_dict(keep_vars=True).items():
            source = self.host.master(names[id(t)]) if id(t) in names else t.detach()
            out[canonical_name(n)] = source.to("cpu", copy=True)
        return out

    def memory_stats(self) -> dict[str, int]:
        """The device's peaks, and `stream_device_bytes`: the peak of what this backend holds
        on the device by its own count (buffers, resident parts, kept inputs, gradients out)."""
        return {**common.device_memory_stats(self.ctx.device),
                "stream_device_bytes": self.ledger.peak}  # fmt: skip

    def reset_peak(self) -> None:
        common.reset_device_peak(self.ctx.device)
        self.ledger.reset_peak()
