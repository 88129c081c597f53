"""What a rung's model states are, as the estimator's peak walk reads them: the bytes on the
device and on the host, and how gradients come and go during a step (the values:
launcher/estimate/model_states.py, launcher/estimate/stream_states.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GradFlow:
    """How gradients come and go on one device during one micro-batch's backward."""

    held: int = 0  # gradients alive when the micro-batch starts (accumulation)
    per_layer: int = 0  # gradient bytes each layer's backward adds
    head: int = 0  # ... lm_head's and the final norm's
    root_at_embedding: int = 0  # the root's gradients alive during the embedding's backward
    in_layer: int = 0  # gradients of the layer being back-propagated, at its peak
    released_per_layer: int = 0  # held gradients a layer's reduce-scatter frees
    reduce_root: int = 0  # ... of the root's, after the embedding's backward
    pending_reduce: int = 0  # the previous reduce-scatter's input, freed at the next one
    head_released: int = 0  # part of `head` reduce-scattered right after the head's backward


@dataclass(frozen=True)
class ModelStates:
    """One rank's model states for a rung, and how its gradients come and go in the first and in
    a later micro-batch of a step (accumulation)."""

    on_device: dict[str, int]  # params, grads, optimizer
    on_host: dict[str, int]  # per rank
    base: int  # device bytes alive through the whole step
    grads_at_step: int  # gradient bytes alive at the optimizer step
    first: GradFlow
    later: GradFlow
    gather_layer: int = 0  # unsharded parameters while a layer computes
    gather_root: int = 0  # ... while the root (embeddings, norm, head) computes
    root_kept: int = 0  # part of gather_root held from forward's end into backward
    # FSDP2 with an untied embedding (trainer/backends/fsdp.py): the embedding and the head are
    # groups of their own, so while the layers compute only `root_in_layers` of the root is
    # unsharded (None: all of gather_root); the head's `head_group` is resharded after its
    # backward, and the embedding (`embed_regather`) is gathered again for its backward
    root_in_layers: int | None = None
    head_group: int = 0
    embed_regather: int = 0
