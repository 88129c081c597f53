"""The process groups of a run's dimensions, built from its `ParallelDims` (one place for every
group a dimension needs: the sequence groups of Ulysses, FSDP's hybrid shard x replicate mesh).

A new dimension adds its group here, named after its `ParallelDims` degree; the backends and the
model's changes (`trainer.parallel.parallelize`) read them from `ParallelMesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainer.core.parallel_dims import ParallelDims


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place in the world and the process groups of its dimensions."""

    dims: ParallelDims
    rank: int
    sequence_group: Any = None  # the ranks holding the other slices of its sequences; None at 1

    @property
    def sequence(self) -> int:
        return self.dims.sequence


def build_mesh(dims: ParallelDims, rank: int) -> ParallelMesh:
    """This rank's mesh. Creates the group of every sequence group: a collective, every rank
    calls it, in the same order (nothing at sequence 1)."""
    group = None
    if dims.sequence > 1:
        for ranks in dims.sequence_groups():
            created = dist.new_group(ranks)
            if rank in ranks:
                group = created
    return ParallelMesh(dims, rank, group)


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
