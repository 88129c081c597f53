"""Long context in the plan: how many ranks split each sequence (Ulysses sequence parallelism,
trainer/memory/sequence_parallel.py) and whether the MLP runs tiled (trainer/memory/tiled_mlp.py),
chosen with the rung; and the longest sequence the chosen plan still fits.

The ladder is climbed with each sequence not split and the MLP whole first; then with the MLP
tiled; then split over the smallest number of ranks that divides the world, the model's heads
and the sequence, and so on upwards (a sequence group within a node first, as the divisors
come). The first split with which some rung fits is the plan's. `sequence_parallel: N` or
`memory.tiled_mlp: true|false` in the config fixes that part. docs/long-context.md.
"""

from __future__ import annotations

from dataclasses import replace

from launcher.estimate.shape import ModelShape
from launcher.plan.hardware import Hardware
from launcher.plan.ladder import Climb, climb, scaled_estimate, shortfall, uneven_batch
from trainer.core.config import JobConfig
from trainer.core.parallel_dims import (
    AttentionShape,
    Batch,
    ParallelDims,
    check_sequence_parallel,
    sequence_sizes,
)
from trainer.core.step_spec import LongContext, StepSpec
from trainer.core.strategies import Strategy
from trainer.core.units import GIB

LONGEST_SEARCHED = 1 << 24  # tokens: the longest sequence the search for max_seq_len tries


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
    if sizes and sizes[0] > 1:  # only a sequence split shares the batch: the user's choice
        raise uneven_batch(cfg.train.global_batch_size, hw.world_size, splits=sizes)
    # not split first, always: where nothing shares the batch over the ranks the ladder says so
    return sizes or [1]


def long_context_choices(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[LongContext]:
    """The splits to try, in order: each sequence group size without, then with, tiled MLP."""
    tiled = cfg.memory.tiled_mlp
    tiles = (False, True) if tiled == "auto" else (bool(tiled),)
    return [LongContext(sp, t) for sp in sequence_parallel_sizes(cfg, hw, shape) for t in tiles]


def climb_long(
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


def max_seq_len(
    shape: ModelShape, spec: StepSpec, hw: Hardware, headroom: float, memory_scale: float
) -> int:
    """The longest `seq_len`, a multiple of the sequence group, at which `spec` (its rung,
    levers, split and micro-batch) still fits `hw`, and at most the model's positions: a
    binary search on the estimate."""
    unit = max(1, spec.sequence_parallel)
    limit = shape.max_positions or LONGEST_SEARCHED

    def fits(tokens: int) -> bool:
        est = scaled_estimate(shape, replace(spec, seq_len=tokens * unit), memory_scale)
        return shortfall(est, hw, headroom) is None

    lo, top = spec.seq_len // unit, min(limit, LONGEST_SEARCHED) // unit
    if not fits(lo):
        return 0
    hi = lo
    while hi < top and fits(hi):
        lo, hi = hi, min(hi * 2, top)
    if fits(hi):
        return hi * unit
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def long_context_reasons(
    shape: ModelShape, spec: StepSpec, memory_scale: float, longest: int
) -> list[str]:
    """The split and the longest sequence, in words."""
    reasons = []
    sp = spec.sequence_parallel
    if sp > 1:
        one = replace(spec, micro_batch_size=1)
        whole = scaled_estimate(shape, replace(one, sequence_parallel=1), memory_scale)
        split = scaled_estimate(shape, one, memory_scale)
        reasons.append(
            f"sequence parallel {sp}: activations of one {spec.seq_len:,}-token sequence are "
            f"{_size(whole.device_breakdown['activations'])}; "
            f"{_size(split.device_breakdown['activations'])} per rank ({sp} ranks hold "
            f"{spec.local_seq_len:,} tokens each; all-to-alls around attention)"
        )
    if spec.tiled_mlp:
        reasons.append(
            "tiled MLP: each layer's MLP runs over chunks of "
            f"{spec.mlp_chunk_tokens or shape.hidden_size:,} tokens and keeps only their inputs "
            "(its forward runs again in backward)"
        )
    if longest:
        at_most = " (the model's positions)" if longest == shape.max_positions else ""
        reasons.append(f"longest sequence that fits this plan: {longest:,} tokens{at_most}")
    return reasons


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.1f} MiB"
