"""Long context in the plan: the attention implementation weighed with the splits
(launcher/plan/splits.py searches how many ranks split each sequence and whether the MLP runs
tiled), the longest sequence the chosen plan still fits, and the reasons in words.
docs/long-context.md.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from launcher.estimate.analytic_activations import MODELLED_TYPES
from launcher.estimate.attention_kernels import block_mask_bytes
from launcher.estimate.shape import ModelShape
from launcher.plan.hardware import Hardware
from launcher.plan.headroom import Headroom, plan_headroom
from launcher.plan.ladder import (
    DENSE_MASK,
    Candidate,
    Climb,
    job_step,
    scaled_estimate,
    shortfall,
)
from launcher.plan.splits import climb_splits, faster, frugal_sequence_parallel
from trainer.core.config import JobConfig
from trainer.core.step_spec import LongContext, StepSpec, lever_variants
from trainer.core.strategies import Strategy
from trainer.core.units import GIB

LONGEST_SEARCHED = 1 << 24  # tokens: the longest sequence the search for max_seq_len tries
# `auto` attention on GPUs weighs an implementation without the dense mask of packed windows
# once that mask (its booleans and SDPA's bias) takes this share of a device's memory
MASK_SHARE = 0.01


def attention_choices(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[str]:
    """The attention implementations to climb with: the config's own, or for `auto` sdpa and,
    on GPUs where the dense mask of packed windows takes MASK_SHARE of a device or more, an
    implementation that keeps the documents apart without it (`maskless_attention`), for the
    blocks the analytic model knows (whose transformers classes run flash and flex attention)."""
    chosen = cfg.model.attn_implementation
    if chosen != "auto":
        return [chosen]
    if hw.device != "cuda" or not cfg.data.pack or shape.model_type not in MODELLED_TYPES:
        return ["sdpa"]
    if dense_mask_bytes(cfg.data.seq_len, cfg.precision) < MASK_SHARE * hw.device_memory_bytes:
        return ["sdpa"]
    return ["sdpa", maskless_attention()]


def dense_mask_bytes(seq_len: int, precision: str) -> int:
    """The dense mask of one packed window under sdpa: its booleans, and the bias SDPA makes of
    them while a layer computes."""
    return (1 + (4 if precision == "fp32" else 2)) * seq_len**2


def maskless_attention() -> str:
    """flash_attention_2 where flash-attn is installed (its varlen kernel takes the documents
    from the position ids), else flex_attention (a sparse block mask; torch has its backward
    on CUDA)."""
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"


def with_attention(cfg: JobConfig, name: str) -> JobConfig:
    """The job with `model.attn_implementation` set to `name`."""
    return cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"attn_implementation": name})}
    )


def climb_long(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, rungs: list[Strategy],
    exclude: tuple[str, ...] | list[str] = (), memory_scale: float = 1.0,
) -> tuple[Climb, LongContext, str, dict[str, Climb]]:  # fmt: skip
    """`climb_splits` with each of `attention_choices`: the first (sdpa) unless another fits
    where it does not, or is predicted faster by more than SIMPLER_RUNG_MARGIN. (climb, split,
    attention implementation, the climbs of each implementation tried)."""
    best: tuple[Climb, LongContext, str] | None = None
    climbs = {}
    for attention in attention_choices(cfg, hw, shape):
        found, long = climb_splits(
            with_attention(cfg, attention), hw, shape, rungs, exclude, memory_scale
        )
        climbs[attention] = found
        if best is None or faster(found, best[0]):
            best = (found, long, attention)
    assert best is not None
    return (*best, climbs)


def max_seq_len(
    shape: ModelShape, spec: StepSpec, hw: Hardware, headroom: Headroom | float, memory_scale: float
) -> int:
    """The longest `seq_len`, a multiple of the sequence group, at which `spec` (its rung,
    levers, split and micro-batch) still fits `hw`, and at most the model's positions: a
    binary search on the estimate."""
    unit = max(1, spec.sequence_parallel)
    limit = min(shape.max_positions or LONGEST_SEARCHED, LONGEST_SEARCHED)
    return longest_fitting(shape, spec, hw, headroom, memory_scale, limit // unit * unit)


def longest_fitting(
    shape: ModelShape, spec: StepSpec, hw: Hardware, headroom: Headroom | float,
    memory_scale: float, limit: int = LONGEST_SEARCHED,
) -> int:  # fmt: skip
    """The longest `seq_len` up to `limit`, a multiple of the sequence group, at which `spec`
    fits `hw` (0: not even its own): doubling from its own, then a binary search."""
    unit = max(1, spec.sequence_parallel)

    def fits_at(tokens: int) -> bool:
        return fits(shape, replace(spec, seq_len=tokens * unit), hw, headroom, memory_scale)

    lo, top = max(1, min(spec.seq_len, limit) // unit), limit // unit
    if not fits_at(lo):
        return 0
    hi = lo
    while hi < top and fits_at(hi):
        lo, hi = hi, min(hi * 2, top)
    if fits_at(hi):
        return hi * unit
    while hi - lo > 1:  # fits_at(lo), not fits_at(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo * unit


def fits(
    shape: ModelShape, spec: StepSpec, hw: Hardware, headroom: Headroom | float, memory_scale: float
) -> bool:
    """Whether `spec`'s estimate fits `hw` less the headroom."""
    return shortfall(scaled_estimate(shape, spec, memory_scale), hw, headroom) is None


def max_seq_len_memory(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, chosen: StepSpec, memory_scale: float,
    rungs: tuple[Strategy, ...], within_positions: int,
) -> int:  # fmt: skip
    """The longest `data.seq_len` memory alone allows on `hw`, beyond the model's positions:
    the chosen step, or any of `rungs` (those the plan may use) at one sequence per micro-batch
    with the most frugal split and levers the config leaves to the planner (the largest
    sequence group, tiled MLP, full checkpointing, chunked loss, activation offload). Each rung
    doubles its sequence from `within_positions` (the chosen step's `max_seq_len`) while it
    fits; only those that got furthest are searched to the token."""
    headroom = plan_headroom(cfg)
    longest = within_positions
    if within_positions and within_positions >= shape.max_positions:  # memory allows more
        start = replace(chosen, seq_len=within_positions)
        longest = longest_fitting(shape, start, hw, headroom, memory_scale)
    reach: dict[StepSpec, int] = {}
    for spec in frugal_steps(cfg, hw, shape, chosen, rungs):
        unit = spec.sequence_parallel
        tokens = max(spec.seq_len, longest // unit * unit)
        while tokens < LONGEST_SEARCHED and fits(
            shape, replace(spec, seq_len=tokens), hw, headroom, memory_scale
        ):
            reach[spec] = tokens
            tokens *= 2
    furthest = max(reach.values(), default=0)
    for spec, tokens in reach.items():
        if tokens == furthest:
            start = replace(spec, seq_len=tokens)
            longest = max(longest, longest_fitting(shape, start, hw, headroom, memory_scale))
    return longest


def frugal_steps(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, chosen: StepSpec, rungs: tuple[Strategy, ...]
) -> list[StepSpec]:
    """`chosen` on each of `rungs` with the smallest footprint the config leaves open, its
    sequence a multiple of the group (`max_seq_len_memory`)."""
    sp = frugal_sequence_parallel(cfg, hw, shape)
    mem = cfg.memory
    ac = mem.activation_checkpointing if mem.activation_checkpointing != "auto" else "full"
    lever = lever_variants(mem.chunked_loss, mem.offload_activations, hw.device)[-1]
    data_ranks = max(1, hw.world_size // sp)
    base = replace(
        chosen, micro_batch_size=1, seq_len=max(sp, chosen.seq_len // sp * sp),
        grad_accum=max(1, cfg.train.global_batch_size // data_ranks),
        activation_checkpointing=ac, chunked_loss=lever.chunked_loss,
        offload_activations=lever.offload_activations, sequence_parallel=sp,
        tiled_mlp=mem.tiled_mlp is not False, fsdp_reduce_every_micro_batch=True,
    )  # fmt: skip
    auto = cfg.model.attn_implementation == "auto" and hw.device == "cuda" and cfg.data.pack
    if auto and shape.model_type in MODELLED_TYPES:  # at long context auto drops the dense mask
        flex = maskless_attention() == "flex_attention"
        flash = not flex and cfg.precision != "fp32"
        base = replace(base, packed=False, block_mask=flex, flash_attention=flash)
    return [replace(base, strategy=rung.name) for rung in rungs]


def long_context_reasons(
    shape: ModelShape, spec: StepSpec, memory_scale: float, longest: int, memory_longest: int = 0
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
    if memory_longest:
        beyond = ""
        if shape.max_positions and memory_longest > shape.max_positions:
            beyond = (f", beyond the model's {shape.max_positions:,} positions (model.rope_scaling "
                      "extends them: opt-in, it changes what is learned)")  # fmt: skip
        reasons.append(
            f"longest sequence memory alone allows here: {memory_longest:,} tokens (one "
            f"sequence per micro-batch, the most frugal split and levers){beyond}"
        )
    return reasons


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.1f} MiB"


def attention_reason(cfg: JobConfig, chosen: Candidate, attention: str, sdpa: Climb) -> str:
    """Why `auto` attention is `attention` and not sdpa: the masks of each, and sdpa's own
    climb (what it would fit, or that it does not)."""
    seq, micro = chosen.spec.seq_len, chosen.spec.num_sequences  # a pair is two sequences
    mask = micro * dense_mask_bytes(seq, cfg.precision)
    kept = "no mask (the documents from the position ids)"
    if attention == "flex_attention":
        kept = f"a block mask of {_size(block_mask_bytes(micro, seq))}"
    if sdpa.ranked:
        best = sdpa.ranked[0]
        verdict = (f"sdpa fits on {best.rung.name} but is predicted {best.time_s:.3g} s per "
                   f"step vs {chosen.time_s:.3g} s")  # fmt: skip
    else:
        verdict = "sdpa fits on no rung"
    return (
        f"attention {attention}: {kept} keeps the packed documents apart, where sdpa builds a "
        f"dense mask of {_size(mask)} (booleans and its bias while a layer computes); {verdict}"
    )


def longest_sequences(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, rungs: list[Strategy], micro: int
) -> list[str]:
    """The longest data.seq_len that fits here, and a longer one under flash attention where
    that applies (16M tokens on 8,000 GPUs: 146,432 under sdpa, 6,323,200 under flash)."""
    offers = []
    here = longest_sequence(cfg, hw, shape, rungs, micro)
    if here is not None:
        offers.append(
            f"data.seq_len={here[0]} would fit on {here[1].name} (the longest that fits here)"
        )
    flash = with_flash_attention(cfg, hw)
    longer = None if flash is None else longest_sequence(flash, hw, shape, rungs, micro)
    if longer is not None and (here is None or longer[0] > here[0]):
        offers.append(
            f"model.attn_implementation=flash_attention_2 and data.seq_len={longer[0]} would "
            f"fit on {longer[1].name} (no dense mask of the packed documents)"
        )
    return offers


def longest_sequence(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, rungs: list[Strategy], micro: int
) -> tuple[int, Strategy] | None:
    """The longest data.seq_len (a multiple of 1024 from 2048 on) that some rung fits here with
    full checkpointing and every lever the config allows, and that rung."""
    levers = lever_variants(cfg.memory.chunked_loss, cfg.memory.offload_activations, hw.device)[-1]
    # `auto`: the smaller footprint, the most split sequence and the tiled MLP
    long = LongContext(frugal_sequence_parallel(cfg, hw, shape), cfg.memory.tiled_mlp is not False)
    specs = [(r, job_step(cfg, hw, r, micro, "full", levers=levers, long=long)) for r in rungs]

    def fits(tokens: int) -> Strategy | None:
        for rung, spec in specs:
            est = scaled_estimate(shape, replace(spec, seq_len=tokens), 1.0)
            if shortfall(est, hw, plan_headroom(cfg)) is None:
                return rung
        return None

    lo, hi = 0, cfg.data.seq_len  # fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    longest = lo - lo % 1024 if lo >= 2048 else lo
    if not longest or (where := fits(longest)) is None:
        return None
    return longest, where


def with_flash_attention(cfg: JobConfig, hw: Hardware) -> JobConfig | None:
    """The job under flash attention where it would attend differently only in memory: packed
    documents under sdpa or eager attend through a dense [seq, seq] mask per sequence, under
    flex_attention through a block mask of the whole sequence, flash attention's
    variable-length kernel needs none (the same math, but a kernel the GPU machine must have);
    None where that does not apply."""
    if hw.device != "cuda" or not cfg.data.pack:
        return None
    if cfg.model.attn_implementation not in (*DENSE_MASK, "flex_attention"):
        return None
    return with_attention(cfg, "flash_attention_2")


def mask_words(attention: str) -> str:
    """What the packed documents' mask costs under `attention`, in words (the hints)."""
    if attention == "flex_attention":
        return "flex_attention's block mask is the whole sequence's on every rank"
    return f"{attention} attends through a dense mask of the packed documents"
