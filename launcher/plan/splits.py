"""The search over the degree of every dimension of parallelism (today: the sequence group of
Ulysses, trainer/parallel/sequence.py; tensor and expert parallel join here), made with the rung:
the ladder is climbed at each split in turn, the first with which some rung fits is the plan's.

The splits come smallest first: each sequence not split and the MLP whole first; then with the
MLP tiled (trainer/memory/tiled_mlp.py); then split over the smallest number of ranks that
divides the world, the model's heads and the sequence, and so on upwards (a sequence group
within a node first, as the divisors come). `parallel.sequence: N` (`sequence_parallel: N`) or
`memory.tiled_mlp: true|false` in the config fixes that part. docs/long-context.md.
"""

from __future__ import annotations

from launcher.estimate.shape import ModelShape
from launcher.plan.hardware import Hardware
from launcher.plan.ladder import Climb, climb, uneven_batch
from trainer.core import strategies
from trainer.core.config import JobConfig
from trainer.core.parallel_dims import (
    AttentionShape,
    Batch,
    ParallelDims,
    check_sequence_parallel,
    sequence_sizes,
)
from trainer.core.step_spec import LongContext
from trainer.core.strategies import Strategy


def sequence_parallel_sizes(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[int]:
    """The sequence group sizes the planner may use, smallest first: the config's own (checked:
    exit 2 naming the sizes that would run), or every size that runs the job
    (trainer/core/parallel_dims.py: the world, the heads, the sequence and the batch)."""
    attention = AttentionShape(shape.num_heads, shape.num_kv_heads)
    batch = Batch(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    if cfg.train.micro_batch_size == "auto":
        batch = Batch(cfg.train.global_batch_size)
    if cfg.objective.preference:  # a pair's log-probs are sums over whole sequences
        return [1]
    if isinstance(cfg.sequence_parallel, int):
        dims = ParallelDims(hw.world_size, cfg.sequence_parallel)
        check_sequence_parallel(dims, attention, cfg.data.seq_len, batch)
        return [cfg.sequence_parallel]
    sizes = sequence_sizes(hw.world_size, attention, cfg.data.seq_len, batch)
    # Only a sequence split shares the batch: that is the user's choice where one sequence a
    # rank would fit unsplit; where it would not, the sequence needs splitting anyway.
    if sizes and sizes[0] > 1 and fits_unsplit(cfg, hw, shape):
        raise uneven_batch(cfg.train.global_batch_size, hw.world_size, splits=sizes)
    # not split first, always: where nothing shares the batch over the ranks the ladder says so
    return sizes or [1]


def fits_unsplit(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> bool:
    """Whether one whole sequence on each rank, as many as the ranks, fits some rung at its
    smallest footprint (one sequence a micro-batch, the MLP tiled where the config allows)."""
    one_each = cfg.train.model_copy(
        update={"global_batch_size": hw.world_size, "micro_batch_size": 1}
    )
    unsplit = cfg.model_copy(update={"train": one_each})
    long = LongContext(1, cfg.memory.tiled_mlp is not False)
    return bool(climb(unsplit, hw, shape, strategies.rows(), long=long).ranked)


def frugal_sequence_parallel(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> int:
    """The sequence group the config leaves the planner at its largest (the smallest share of
    each sequence a rank holds): the config's own size, 1 for preference pairs."""
    if isinstance(cfg.sequence_parallel, int):
        return cfg.sequence_parallel
    if cfg.objective.preference:  # a pair's log-probs are sums over whole sequences
        return 1
    attention = AttentionShape(shape.num_heads, shape.num_kv_heads)
    sizes = sequence_sizes(hw.world_size, attention, hw.world_size * 1024,
                           Batch(cfg.train.global_batch_size))  # fmt: skip
    return max(sizes or [1])


def long_context_choices(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[LongContext]:
    """The splits to try, in order: each sequence group size without, then with, tiled MLP."""
    tiled = cfg.memory.tiled_mlp
    tiles = (False, True) if tiled == "auto" else (bool(tiled),)
    return [LongContext(sp, t) for sp in sequence_parallel_sizes(cfg, hw, shape) for t in tiles]


def climb_splits(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, rungs: list[Strategy],
    exclude: tuple[str, ...] | list[str] = (), memory_scale: float = 1.0,
) -> tuple[Climb, LongContext]:  # fmt: skip
    """The ladder climbed at the first split with which some rung fits, and that split; when
    none fits, the climb of the most split one (the smallest footprints, for the message)."""
    choices = long_context_choices(cfg, hw, shape)
    for long in choices:
        found = climb(cfg, hw, shape, rungs, exclude, memory_scale, long)
        if found.ranked:
            return found, long
    return found, long
