"""The phases of one training step, marked as they happen: the forward of each decoder layer, the
head and loss between the last forward and the first backward, the backward of each layer, and
the optimizer step.

The same markers label a real step in the profiler's trace (`trainer/observe/profile.py`) and the
FakeTensor trace of the estimate (`launcher/estimate/trace.py`), so `oomless report` can lay the
estimate's live bytes per phase over the measured ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from trainer.model.build import decoder_layers

MARKER = "oomless.phase: "  # the prefix of the marker events in a profiler trace
STEP = "step start"  # from the start of the step to the first layer: data, embeddings
OPTIMIZER = "optimizer"  # gradient clipping, the optimizer step, zeroing the gradients


def label_forward(layer: int) -> str:
    return f"forward layer {layer}"


def label_backward(layer: int) -> str:
    return f"backward layer {layer}"


HEAD = "head and loss"
EMBEDDINGS_BACKWARD = "embeddings backward"


@contextlib.contextmanager
def phase_markers(model: nn.Module, mark: Callable[[str], None]) -> Iterator[None]:
    """Call `mark(label)` whenever a phase begins, while the context is open. Forwards that
    activation checkpointing recomputes during backward are not phases of their own."""
    from torch.distributed._tools.mod_tracker import ModTracker

    layers = {id(m): i for i, m in enumerate(decoder_layers(model))}
    last = len(layers) - 1
    tracker = ModTracker()

    def pre_fw(module: nn.Module, args: object) -> None:
        i = layers.get(id(module))
        if i is not None and not tracker.is_bw:
            mark(label_forward(i))

    def post_fw(module: nn.Module, args: object, out: object) -> None:
        if layers.get(id(module)) == last and not tracker.is_bw:
            mark(HEAD)

    def pre_bw(module: nn.Module | None, grads: object) -> None:
        i = layers.get(id(module))
        if i is not None:
            mark(label_backward(i))

    def post_bw(module: nn.Module | None, grads: object) -> None:
        if layers.get(id(module)) == 0:
            mark(EMBEDDINGS_BACKWARD)

    tracker.register_user_hooks(pre_fw, post_fw, pre_bw, post_bw)
    with tracker:
        yield
    tracker.clear_user_hooks()


def mark_in_profile(label: str) -> None:
    """A zero-length event named MARKER + label in the profiler's trace (nothing when no
    profiler runs)."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(MARKER + label):
            pass
