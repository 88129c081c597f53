"""The one order in which a model is changed (torchtitan's `parallelize.py`): the engine's
backends and the estimate's trace (launcher/estimate/trace.py) all reach their model here, so
they cannot drift apart.

    sequence split: the model's attention goes through Ulysses' all-to-alls (on its config,
       before it is built: trainer/parallel/sequence.py)
    -> build (the backend's: a replica on the device, a meta-device model, ZeRO-3 partitions)
    -> tensor split: each layer's projections over the tensor group, by the architecture's
       plan in transformers (trainer/parallel/tensor.py)
    -> expert split: each MoE layer's experts over the expert group, tokens dispatched to them
       by all-to-all, by the architecture's plan in transformers (trainer/parallel/expert.py;
       the backend's wrap shards the experts over their copies first)
    -> activation checkpointing: every decoder layer wrapped, switched on per `ModelChanges`
    -> compile: each decoder layer, after checkpointing and before sharding
    -> train mode, then the backend's wrap (FSDP2 `fully_shard`, DDP, a DeepSpeed engine)

`ModelChanges` is all it reads: no job config, so the trace builds one from its step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from trainer.model.build import apply_activation_checkpointing, apply_compile
from trainer.parallel.expert import apply_expert_parallel
from trainer.parallel.mesh import ParallelMesh
from trainer.parallel.sequence import apply_sequence_parallel
from trainer.parallel.tensor import apply_tensor_parallel


@dataclass(frozen=True)
class ModelChanges:
    """What `parallelize` does to a model: its dimensions' groups and its recomputation."""

    mesh: ParallelMesh | None = None  # None: no dimension splits the model (data parallel only)
    activation_checkpointing: str = "none"  # none | selective | full
    checkpointed_layers: int | None = None  # selective: how many (None: every other one)
    checkpoint_ops: bool = False  # selective at op level (`memory.selective: ops`)
    compile: bool = False


def parallelize(
    build: Callable[[], nn.Module],
    hf_config: Any,
    changes: ModelChanges,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """The model `build` makes from `hf_config`, changed in the one order (the module
    docstring); what `wrap` returns (the model itself without one)."""
    mesh = changes.mesh
    if mesh is not None:  # its models attend over the sequence group
        apply_sequence_parallel(hf_config, mesh.sequence, mesh.sequence_group)
    model = build()
    if mesh is not None and mesh.tensor > 1:
        apply_tensor_parallel(model, mesh.tensor_mesh)
    if mesh is not None and mesh.expert > 1:
        apply_expert_parallel(model, mesh.expert_mesh, mesh.same_tokens_mesh)
    apply_activation_checkpointing(
        model, changes.activation_checkpointing, changes.checkpointed_layers, changes.checkpoint_ops
    )
    if changes.compile:
        apply_compile(model)
    model.train()
    return wrap(model) if wrap is not None else model
