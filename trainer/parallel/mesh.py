"""The process groups of a run's dimensions, built from its `ParallelDims`: one named device
mesh (data x sequence x tensor, torchtitan's layout) whose dimensions give the sequence groups of
Ulysses, the tensor groups of transformers' tensor-parallel plans, and the ranks FSDP shards over
(data and sequence flattened); beside it the experts' mesh (expert_data x expert over the same
token ranks: the expert groups of transformers' expert-parallel plans and the copies FSDP shards
each expert over; one root, as FSDP2 needs for a split parameter), and FSDP's hybrid shard x
replicate mesh.

A new dimension adds its name here, after its `ParallelDims` degree; the backends and the
model's changes (`trainer.parallel.parallelize`) read them from `ParallelMesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from trainer.core.parallel_dims import ParallelDims

DIMENSIONS = ("data", "sequence", "tensor")
EXPERT_DIMENSIONS = ("expert_data", "expert")


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place in the world and the groups of its dimensions (no device mesh where
    no dimension splits the model: data parallel only)."""

    dims: ParallelDims
    rank: int
    device_mesh: Any = None  # torch DeviceMesh named DIMENSIONS; None at sequence, tensor, expert 1
    expert_device_mesh: Any = None  # named EXPERT_DIMENSIONS; None at expert 1

    @property
    def sequence(self) -> int:
        return self.dims.sequence

    @property
    def tensor(self) -> int:
        return self.dims.tensor

    @property
    def expert(self) -> int:
        return self.dims.expert

    @property
    def sequence_group(self) -> Any:
        """The ranks holding the other slices of this rank's sequences; None at 1."""
        return self.device_mesh["sequence"].get_group() if self.dims.sequence > 1 else None

    @property
    def tensor_mesh(self) -> Any:
        """The 1-D mesh of this rank's tensor group; None at 1."""
        return self.device_mesh["tensor"] if self.dims.tensor > 1 else None

    @property
    def expert_mesh(self) -> Any:
        """The 1-D mesh of this rank's expert group; None at 1."""
        return self.expert_device_mesh["expert"] if self.dims.expert > 1 else None

    @property
    def expert_data_mesh(self) -> Any:
        """The ranks holding copies of this rank's experts (what FSDP shards them over)."""
        return self.expert_device_mesh["expert_data"] if self.dims.expert > 1 else None

    @property
    def same_tokens_mesh(self) -> Any:
        """The 1-D mesh of the ranks holding this rank's tokens (its tensor group, one rank
        without a tensor split)."""
        return self.device_mesh["tensor"]

    @cached_property
    def token_mesh(self) -> Any:
        """The ranks holding other tokens than this one (data x sequence, one tensor rank of
        each group): what FSDP shards over beside a tensor split; None without one."""
        if self.dims.tensor == 1:
            return None
        if self.dims.token_ranks == 1:
            return self.device_mesh["data"]
        return self.device_mesh["data", "sequence"]._flatten("tokens")

    @property
    def token_group(self) -> Any:
        """The process group a token count sums over (None: the world)."""
        mesh = self.token_mesh
        return mesh.get_group() if mesh is not None else None


def build_mesh(dims: ParallelDims, rank: int, device_type: str = "cpu") -> ParallelMesh:
    """This rank's mesh: a collective, every rank calls it (nothing where the model is not
    split: sequence, tensor and expert 1)."""
    if dims.sequence == 1 and dims.tensor == 1 and dims.expert == 1:
        return ParallelMesh(dims, rank)
    from torch.distributed.device_mesh import init_device_mesh

    shape = (dims.data, dims.sequence, dims.tensor)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMENSIONS)
    experts = None
    if dims.expert > 1:  # token rank t: expert rank t % expert (tensor 1: t is the rank)
        experts = init_device_mesh(
            device_type, (dims.expert_data, dims.expert), mesh_dim_names=EXPERT_DIMENSIONS
        )
        experts._flatten("expert_tokens")  # a norm over both dimensions: one all-reduce
    return ParallelMesh(dims, rank, mesh, experts)


def hybrid_shard_mesh(dims: ParallelDims, devices_per_node: int, device_type: str) -> Any:
    """HSDP's 2-D device mesh over the whole world: shard within a node, replicate across nodes
    (`fsdp.hybrid: true`)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dims.world_size
    if world % devices_per_node:
        raise ValueError(f"world size {world} is not a multiple of {devices_per_node} per node")
    return init_device_mesh(
        device_type, (world // devices_per_node, devices_per_node),
        mesh_dim_names=("replicate", "shard"),
    )  # fmt: skip
