"""`stream`'s step under the estimate's trace (launcher/estimate/trace.py): the engine's own
backend (trainer/backends/stream.py), its host state on the meta device and its device tensors
fake.

What the trace counts is what the backend keeps on the device: the resident parts in the compute
dtype, the two layer buffers, every layer's kept input, one layer's recompute and backward, its
gradients' flat copy and the previous layer's flat still on its way to the host, and the
embeddings' and head's activations. The fp32 masters, gradients and AdamW moments it streams
from are meta tensors: no bytes, and under their own device in the tracker's count. The copy
queues run each copy on the tracing thread, one submission late: a layer's weights are in its
buffer before it computes, and a layer's gradient flat is still alive while the next layer
back-propagates, as on a GPU where the copy out runs beside that layer's backward. The host's
AdamW step writes host buffers only and refills the buffers in place: nothing the device holds
changes, so the traced step ends once every gradient is on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.backends import BackendContext, OptimizerSpec
from trainer.backends.stream import StreamBackend
from trainer.core.config import ModelConfig
from trainer.core.step_spec import StepSpec
from trainer.memory.levers import MemoryLevers
from trainer.memory.tiled_mlp import apply_tiled_mlp
from trainer.model.build import HFModelFactory

HOST = torch.device("meta")


class _Job:
    """A copy submitted to `TracedCopies`: run at the latest when waited for."""

    def __init__(self, queue: TracedCopies, copy: Callable[[], None], then: Callable | None):
        self.queue, self.copy, self.then = queue, copy, then

    def run(self) -> None:
        copy, then, self.copy, self.then = self.copy, self.then, None, None
        if copy is not None:  # once; the closures (a gradient flat) are dropped with it
            copy()
            if then is not None:
                then()

    def wait(self) -> None:
        self.queue.run_until(self)

    done = wait


class TracedCopies:
    """`trainer/streaming/copies.py`'s `Copies` for the trace: no thread, each copy run on the
    caller's thread when the next one is submitted (or when it is waited for, or drained)."""

    cuda = False

    def __init__(self, device: torch.device):
        self.device = device
        self._pending: list[_Job] = []

    def compute_mark(self) -> None:
        return None

    def submit(self, copy: Callable[[], None], after: Any = None, then: Callable | None = None):
        job = _Job(self, copy, then)
        self.run_until(self._pending[-1] if self._pending else None)
        self._pending.append(job)
        return job

    def run_until(self, job: _Job | None) -> None:
        while job is not None and job in self._pending:
            self._pending.pop(0).run()

    def drain(self) -> None:
        self.run_until(self._pending[-1] if self._pending else None)

    def close(self) -> None:
        self.drain()


class _FakeFactory:
    """The engine's model factory, its CPU model on fake tensors: the structure built on the
    meta device before the fake mode starts, given fake CPU storage in it (as the other rungs'
    traces give theirs)."""

    def __init__(self, factory: HFModelFactory):
        self.hf_config = factory.hf_config
        self.meta = factory.build("meta")

    def build(self, device: str | torch.device) -> nn.Module:
        model = self.meta.to_empty(device=device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # to_empty made two tensors of a tied weight: one again
        return model


def traced_stream_model(
    hf_config: dict[str, Any], spec: StepSpec, ctx: BackendContext, attn_implementation: str,
    stack: contextlib.ExitStack,
) -> tuple[nn.Module, StreamBackend]:  # fmt: skip
    """The stream backend's model for `spec`, set up as the engine sets it up, under a fake
    tensor mode entered on `stack` (its host state on the meta device), with the memory levers
    after it as the engine applies them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model_cfg = ModelConfig(config=dict(hf_config), attn_implementation=attn_implementation)
    factory = _FakeFactory(HFModelFactory(model_cfg, seed=0))
    stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    copies = (TracedCopies(ctx.device), TracedCopies(ctx.device))
    backend = StreamBackend(spec.strategy, ctx, host=HOST, copies=copies)
    optim = OptimizerSpec(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=1.0)
    model = backend.setup(factory, optim)
    MemoryLevers(
        model, ctx.device, spec.chunked_loss, spec.offload_activations, spec.loss_chunk_tokens,
        offload_host=HOST,  # the kept inputs' host copies: not the device's
    )  # fmt: skip
    if spec.tiled_mlp:
        apply_tiled_mlp(model, spec.mlp_chunk_tokens)
    return model, backend


def land_gradients(backend: StreamBackend) -> None:
    """Every gradient of the micro-batch on the host: the last ones out (the resident parts')
    travel while the next micro-batch's first layers compute, long before its head (where a
    step peaks), or before the host's AdamW (which changes nothing the device holds)."""
    backend.copies[1].drain()
