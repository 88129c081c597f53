"""The search over the degree of every dimension of parallelism (the sequence group of Ulysses,
trainer/parallel/sequence.py; the tensor group, trainer/parallel/tensor.py; the expert group,
trainer/parallel/expert.py, whose degrees `expert_parallel_sizes` lists and the planner weighs
plan by plan), made with the rung: at each tensor degree the ladder is climbed at each sequence
split in turn, the first with which some rung fits is that degree's; the fastest degree is the
plan's (tensor 1 unless a split is predicted faster by more than SIMPLER_RUNG_MARGIN).

The splits come smallest first: each sequence not split and the MLP whole first; then with the
MLP tiled (trainer/memory/tiled_mlp.py); then split over the smallest number of ranks that
divides the world, the model's heads and the sequence, and so on upwards (a sequence group
within a node first, as the divisors come). `parallel.sequence: N` (`sequence_parallel: N`) or
`memory.tiled_mlp: true|false` in the config fixes that part. docs/long-context.md.
"""

from __future__ import annotations

from dataclasses import replace

from launcher.estimate.shape import ModelShape
from launcher.plan.cost import SIMPLER_RUNG_MARGIN, Links
from launcher.plan.hardware import Hardware
from launcher.plan.ladder import Climb, climb, uneven_batch
from trainer.core import strategies
from trainer.core.config import JobConfig
from trainer.core.expert_plan import expert_param_names, expert_plan
from trainer.core.parallel_dims import (
    AttentionShape,
    Batch,
    ParallelDims,
    check_sequence_parallel,
    check_tensor_parallel,
    expert_sizes,
    sequence_sizes,
    tensor_sizes,
)
from trainer.core.step_spec import LongContext
from trainer.core.strategies import Strategy
from trainer.core.tensor_plan import check_tensor_plan, has_tensor_plan


def tensor_parallel_sizes(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[int]:
    """The tensor degrees the planner may use, smallest first: the config's own (checked: exit 2
    naming the degrees that work), or 1 and, on GPUs, every degree within a node that splits the
    model's heads, where transformers has a plan for it and the job can take one (a full
    fine-tune without compile, fp16 or hybrid sharding: trainer/core/config/checks.py)."""
    attention = AttentionShape(shape.num_heads, shape.num_kv_heads)
    forced = cfg.parallel.tensor
    if isinstance(forced, int):
        check_tensor_parallel(ParallelDims(hw.world_size, 1, forced), attention)
        check_tensor_plan(shape.model_type, forced)
        return [forced]
    takes = (
        hw.device == "cuda"
        and cfg.finetune.method == "full"
        and not (cfg.train.compile or cfg.fsdp.hybrid or cfg.precision == "fp16")
        and (cfg.strategy == "auto" or strategies.row(cfg.strategy).tensor_parallel)
    )
    if not takes or not has_tensor_plan(shape.model_type):
        return [1]
    node = min(hw.devices_per_node or hw.world_size, hw.world_size)
    sp = cfg.sequence_parallel if isinstance(cfg.sequence_parallel, int) else 1
    batch = Batch(cfg.train.global_batch_size)
    splits = [  # those that take the config's own sequence split, where it sets one
        tp
        for tp in tensor_sizes(node, attention)[1:]
        if ParallelDims(hw.world_size, sp, tp).problem(attention, cfg.data.seq_len, batch) is None
    ]
    return [1, *splits]


def expert_parallel_sizes(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[int]:
    """The expert degrees the planner may use, smallest first: the config's own, or 1 and, on
    GPUs, every degree that divides the model's experts and the ranks, where transformers
    declares a plan for the architecture and the job can take a split (full fine-tunes and LoRA
    leaving the experts frozen, on a rung that takes one, without a tensor split, compile,
    hybrid sharding or fp16: trainer/core/config/expert_checks.py)."""
    forced = cfg.parallel.expert
    if isinstance(forced, int):
        return [forced]
    plan = expert_plan(shape.model_type) if shape.num_experts else ()
    targets = cfg.finetune.lora.target_modules
    names_experts = isinstance(targets, list) and bool(set(targets) & expert_param_names(plan))
    takes = (
        hw.device == "cuda"
        and bool(plan)
        and cfg.finetune.method in ("full", "lora")
        and not (cfg.finetune.method == "lora" and names_experts)
        and not (cfg.train.compile or cfg.fsdp.hybrid or cfg.precision == "fp16")
        and (cfg.strategy == "auto" or strategies.row(cfg.strategy).expert_parallel)
        and cfg.parallel.tensor in ("auto", 1)
    )
    return expert_sizes(hw.world_size, shape.num_experts) if takes else [1]


def sequence_parallel_sizes(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, tensor: int = 1
) -> list[int]:
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
        dims = ParallelDims(hw.world_size, cfg.sequence_parallel, tensor)
        check_sequence_parallel(dims, attention, cfg.data.seq_len, batch)
        return [cfg.sequence_parallel]
    sizes = sequence_sizes(hw.world_size, attention, cfg.data.seq_len, batch, tensor)
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


def long_context_choices(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, tensor: int = 1
) -> list[LongContext]:
    """The splits to try at a tensor degree, in order: each sequence group size without, then
    with, tiled MLP."""
    tiled = cfg.memory.tiled_mlp
    tiles = (False, True) if tiled == "auto" else (bool(tiled),)
    sizes = sequence_parallel_sizes(cfg, hw, shape, tensor)
    return [LongContext(sp, t, tensor) for sp in sizes for t in tiles]


def climb_splits(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, rungs: list[Strategy],
    exclude: tuple[str, ...] | list[str] = (), memory_scale: float = 1.0,
) -> tuple[Climb, LongContext]:  # fmt: skip
    """The ladder climbed at the fastest tensor degree's first fitting split, and that split;
    when none fits, the climb of the most split one (the smallest footprints, for the message).
    The climb's `tensor_times` hold each degree's predicted step time (None: nothing fit)."""
    climbs = [
        _first_fitting(cfg, hw, shape, rungs, exclude, memory_scale, tensor)
        for tensor in tensor_parallel_sizes(cfg, hw, shape)
    ]
    times = [(long.tensor_parallel, found.ranked[0].time_s if found.ranked else None)
             for found, long in climbs]  # fmt: skip
    fitting = [(found, long) for found, long in climbs[1:] if found.ranked]
    found, long = climbs[0]
    split = min(fitting, key=lambda pair: pair[0].ranked[0].time_s, default=None)
    if split is not None and faster(split[0], found):  # a split over the simplest degree
        found, long = split
    return (replace(found, tensor_times=tuple(times)) if len(times) > 1 else found), long


def _first_fitting(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, rungs: list[Strategy],
    exclude: tuple[str, ...] | list[str], memory_scale: float, tensor: int,
) -> tuple[Climb, LongContext]:  # fmt: skip
    for long in long_context_choices(cfg, hw, shape, tensor):
        found = climb(cfg, hw, shape, rungs, exclude, memory_scale, long)
        if found.ranked:
            return found, long
    return found, long


def faster(found: Climb, than: Climb) -> bool:
    """Whether `found` fits and `than` does not, or is predicted faster by the margin."""
    if not found.ranked:
        return False
    if not than.ranked:
        return True
    return found.ranked[0].time_s < than.ranked[0].time_s * (1 - SIMPLER_RUNG_MARGIN)


def expert_reason(
    cfg: JobConfig, hw: Hardware, times: list[tuple[int, float | None]], expert: int
) -> str:
    """Why this expert degree, in words: each degree's predicted step time and the bandwidths
    the cost model used."""
    links = Links.of(cfg.hardware, hw.device)
    between = "inter-node" if hw.nodes > 1 else "intra-node"
    fsdp_bw = links.inter_node if hw.nodes > 1 else links.intra_node
    node = hw.devices_per_node or hw.world_size
    a2a = ", ".join(
        f"{ep}: {(links.intra_node if ep <= node else links.inter_node) / 1e9:g} GB/s"
        for ep, _ in times[1:]
    )
    listed = ", ".join(f"{ep}: {'does not fit' if t is None else f'{t:.3g} s'}" for ep, t in times)
    what = f"expert parallel {expert}" if expert > 1 else "no expert split (expert parallel 1)"
    return (
        f"{what}: predicted step time by expert degree {listed} (a split of N cuts FSDP's "
        f"gathers and reductions of the experts to each rank's 1/N, over its copies, at "
        f"{fsdp_bw / 1e9:g} GB/s {between}, overlapped with compute; and adds a dispatch and a "
        f"combine all-to-all of the tokens x top-k rows per MoE layer and pass, on the critical "
        f"path, at {a2a}; a split must be {SIMPLER_RUNG_MARGIN:.0%} faster to be chosen)"
    )


def tensor_reason(cfg: JobConfig, hw: Hardware, found: Climb, tensor: int) -> str | None:
    """Why this tensor degree, in words, with the bandwidths the cost model used; None where
    only one degree was open (forced, or no plan, or a job a tensor split does not take)."""
    if len(found.tensor_times) < 2:
        return None
    links = Links.of(cfg.hardware, hw.device)
    between = "inter-node" if hw.nodes > 1 else "intra-node"
    fsdp_bw = links.inter_node if hw.nodes > 1 else links.intra_node
    times = ", ".join(
        f"{tp}: {'does not fit' if t is None else f'{t:.3g} s'}" for tp, t in found.tensor_times
    )
    what = (
        f"tensor parallel {tensor} inside each node"
        if tensor > 1
        else "no tensor split (tensor parallel 1)"
    )
    return (
        f"{what}: predicted step time by tensor degree {times} (a split of t cuts FSDP's "
        f"gathers and reductions to 1/t of the model at {fsdp_bw / 1e9:g} GB/s {between}, "
        "and adds 2 all-reduces of the hidden states per layer and pass at "
        f"{links.intra_node / 1e9:g} GB/s intra-node; a split must be "
        f"{SIMPLER_RUNG_MARGIN:.0%} faster to be chosen)"
    )
