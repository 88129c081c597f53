"""What a Slurm partition's nodes have (`sinfo`), and the job's requests sized to fit them.

`oomless submit` reads the partition at submit time: a job that asks a node for more CPUs or
memory than it has pends forever (`Reason=PartitionConfig`) while the submit looks fine. So the
CPU request is capped at what a node has, the memory request at a node's memory, and a plan whose
host memory, GPUs per node or node count cannot be had there stops with exit 3 in one line.
Parsing and sizing are pure (tested on recorded `sinfo` lines); `read_partition` runs sinfo.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from launcher.plan.planner import NoFitError
from trainer.core.units import GIB, MIB

SINFO_FORMAT = "%N|%c|%m|%G|%P"
SINFO_TIMEOUT_S = 30
_GPU_GRES = re.compile(r"gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class PartitionNodes:
    """The smallest node of a partition (what every node of the job can be given)."""

    partition: str
    num_nodes: int
    cpus: int
    memory_bytes: int
    gpus: int

    def describe(self) -> str:
        return (
            f"partition {self.partition}: {self.num_nodes} nodes, smallest has {self.cpus} CPUs, "
            f"{self.memory_bytes / GIB:.1f} GiB memory, {self.gpus} GPUs"
        )


@dataclass(frozen=True)
class SlurmRequest:
    cpus_per_task: int
    mem_bytes: int


def parse_sinfo(text: str, partition: str | None) -> PartitionNodes | None:
    """`sinfo -h -N -o '%N|%c|%m|%G|%P'` lines -> the partition's smallest node (None: no nodes).

    Without a partition, the default one (marked `*`) is read."""
    nodes: dict[str, tuple[int, int, int]] = {}
    name = partition
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        node, cpus, memory_mb, gres, part = parts
        is_default = part.endswith("*")
        part = part.rstrip("*")
        if (partition is not None and part != partition) or (partition is None and not is_default):
            continue
        name = part
        gpus = sum(int(n) for n in _GPU_GRES.findall(gres))
        nodes[node] = (int(cpus), int(memory_mb.rstrip("+")) * MIB, gpus)
    if not nodes:
        return None
    return PartitionNodes(
        partition=name or "default",
        num_nodes=len(nodes),
        cpus=min(c for c, _, _ in nodes.values()),
        memory_bytes=min(m for _, m, _ in nodes.values()),
        gpus=min(g for _, _, g in nodes.values()),
    )


def read_partition(partition: str | None) -> PartitionNodes | None:
    """The partition's nodes as `sinfo` reports them now; None when sinfo is not here."""
    argv = ["sinfo", "-h", "-N", "-o", SINFO_FORMAT] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        raise NoFitError(f"'{' '.join(argv)}' did not answer in {SINFO_TIMEOUT_S} s") from None
    nodes = parse_sinfo(out.stdout, partition) if out.returncode == 0 else None
    if nodes is None:
        where = f"partition {partition}" if partition else "the default partition"
        raise NoFitError(f"sinfo shows no nodes in {where} ({out.stderr.strip()[:200]})")
    return nodes


def size_request(
    nodes: PartitionNodes,
    num_nodes: int,
    gpus_per_node: int,
    ranks_per_node: int,
    host_bytes_needed: int,
    cpus_wanted: int,
    min_mem_bytes: int,
) -> SlurmRequest:
    """The requests that fit `nodes`, or NoFitError (exit 3) naming what cannot be had."""
    where = f"partition {nodes.partition}"
    if num_nodes > nodes.num_nodes:
        raise NoFitError(
            f"the plan needs {num_nodes} nodes and {where} has {nodes.num_nodes}; "
            f"set hardware.nodes <= {nodes.num_nodes} or pick another slurm.partition"
        )
    if gpus_per_node > nodes.gpus:
        raise NoFitError(
            f"the plan needs {gpus_per_node} GPUs per node and {where}'s nodes have "
            f"{nodes.gpus}; set hardware.devices_per_node <= {nodes.gpus} or pick another "
            "slurm.partition"
        )
    if host_bytes_needed > nodes.memory_bytes:
        raise NoFitError(
            f"the plan needs {host_bytes_needed / GIB:.1f} GiB host memory per node and "
            f"{where}'s nodes have {nodes.memory_bytes / GIB:.1f} GiB; use more nodes, a rung "
            "that offloads less, or another slurm.partition"
        )
    wanted = -(-max(min_mem_bytes, host_bytes_needed) // GIB) * GIB  # whole GiB
    mem = min(wanted, nodes.memory_bytes)  # at most a node's memory (whole MiB)
    cpus = max(1, min(cpus_wanted, nodes.cpus))
    del ranks_per_node  # ranks share the CPUs they are given (OMP_NUM_THREADS = CPUs / ranks)
    return SlurmRequest(cpus_per_task=cpus, mem_bytes=mem)
