"""The degrees of parallelism of a run and the checks on them, torch-free (torchtitan's
`ParallelDims`): the planner, the config's checks before launch and the engine's device mesh
read the same arithmetic, so a split the planner offers is one the engine can run.

Two dimensions now: data and sequence (Ulysses, trainer/parallel/sequence.py). Rank r is
sequence rank r % sequence of data rank r // sequence: the ranks of a sequence group are
neighbours, within a node as long as the group fits in one.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.core.errors import ConfigError


@dataclass(frozen=True)
class AttentionShape:
    """What splitting a sequence around attention needs to know of a model (None: no heads,
    e.g. Mamba)."""

    heads: int | None
    kv_heads: int | None = None

    @classmethod
    def of_hf_config(cls, text_config: dict) -> AttentionShape:
        heads = text_config.get("num_attention_heads")
        kv = text_config.get("num_key_value_heads")
        return cls(int(heads) if heads else None, int(kv) if kv else None)


@dataclass(frozen=True)
class Batch:
    """How the global batch is cut: sequences per step, and per micro-batch (None: auto)."""

    global_size: int
    micro: int | None = None


@dataclass(frozen=True)
class ParallelDims:
    """The world as data x sequence ranks."""

    world_size: int
    sequence: int = 1

    @property
    def data(self) -> int:
        """Data-parallel groups: ranks that read different sequences."""
        return self.world_size // self.sequence

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(data rank, sequence rank) of a global rank."""
        return divmod(rank, self.sequence)

    def sequence_groups(self) -> list[list[int]]:
        """The global ranks of each sequence group, data rank by data rank."""
        sp = self.sequence
        return [list(range(first, first + sp)) for first in range(0, self.world_size, sp)]

    def problem(self, attention: AttentionShape, seq_len: int, batch: Batch) -> str | None:
        """Why this split cannot run the job, in words; None when it can."""
        sp = self.sequence
        if sp < 1 or self.world_size % sp:
            ranks = "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"
            return f"{sp} does not divide the world of {ranks}"
        if sp == 1:
            return None  # nothing is split (a model without attention heads trains as ever)
        heads = attention.heads
        if heads is None:
            return f"{sp}: this model has no attention heads to split the sequence around"
        kv = attention.kv_heads or heads
        if heads % sp:
            return f"{sp} does not divide the model's {heads} attention heads"
        if kv % sp and sp % kv:
            return (
                f"{sp} and the model's {kv} key/value heads do not divide one another (each "
                "rank needs whole key/value heads, repeated where there are fewer than sp)"
            )
        if seq_len % sp:
            return f"{sp} does not divide data.seq_len={seq_len} (every rank holds seq_len / sp)"
        return self.batch_problem(batch)

    def batch_problem(self, batch: Batch) -> str | None:
        """Why the data groups cannot share the global batch evenly; None when they can."""
        sp = self.sequence
        if batch.global_size % self.data:
            return (
                f"the {self.data} data groups ({self.world_size} ranks / {sp}) do not divide "
                f"train.global_batch_size={batch.global_size}"
            )
        if batch.micro and (batch.global_size // self.data) % batch.micro:
            return (
                f"train.micro_batch_size={batch.micro} does not divide each of the {self.data} "
                f"data groups' {batch.global_size // self.data} sequences"
            )
        return None


def sequence_sizes(
    world_size: int, attention: AttentionShape, seq_len: int, batch: Batch
) -> list[int]:
    """Every sequence group size that runs the job on `world_size` ranks, smallest first (1
    wherever the world divides the batch)."""
    sizes = []
    for sp in range(1, world_size + 1):
        dims = ParallelDims(world_size, sp)
        if dims.problem(attention, seq_len, batch) is None and dims.batch_problem(batch) is None:
            sizes.append(sp)
    return sizes


def check_sequence_parallel(
    dims: ParallelDims, attention: AttentionShape, seq_len: int, batch: Batch
) -> None:
    """ConfigError (one line, exit 2) when `dims` cannot run the job; the fix names only sizes
    that pass this same check."""
    problem = dims.problem(attention, seq_len, batch)
    if problem is None:
        return
    sizes = [str(sp) for sp in sequence_sizes(dims.world_size, attention, seq_len, batch)]
    fix = (
        f"use sequence_parallel={' or '.join(sizes)}"
        if sizes
        else "change the device count or train.global_batch_size"
    )
    raise ConfigError("sequence_parallel", problem, fix)
