"""The ladder walk: for every rung, the fastest combination of micro-batch, activation
checkpointing and exact levers that the estimate says fits; then the rungs ranked.

Each combination is one `StepSpec` (trainer/core/step_spec.py): the estimate
(`launcher/estimate/peak.py`) says whether it fits, the cost model (`launcher/plan/cost.py`) how
long its step takes. What is learned never changes here: the global batch, optimizer, schedule and
precision stay as configured; only micro-batch x accumulation, recomputation, sharding and
offload move.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from launcher.estimate.methods import why_not_on
from launcher.estimate.peak import Estimate, estimate
from launcher.estimate.shape import ModelShape
from launcher.plan.cost import Links, step_time_s
from launcher.plan.hardware import Hardware
from launcher.plan.headroom import Headroom, as_headroom, plan_headroom
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig
from trainer.core.methods import REFERENCE_SOURCES
from trainer.core.step_spec import (
    NO_LEVERS,
    Finetune,
    Levers,
    LongContext,
    StepSpec,
    lever_variants,
)
from trainer.core.strategies import AC_LEVELS, Strategy
from trainer.core.units import GIB

# A rung later on the ladder must be predicted this much faster to be chosen over an earlier one:
# the cost model ranks rungs coarsely, and earlier rungs have fewer moving parts.
SIMPLER_RUNG_MARGIN = 0.10
# the shares of the decoder layers selective checkpointing may recompute, when the planner chooses
SELECTIVE_SHARES = (0.25, 0.5, 0.75)
# attention implementations that keep packed documents apart through a dense [seq, seq] mask
DENSE_MASK = ("auto", "sdpa", "eager")


@dataclass(frozen=True)
class Alternative:
    strategy: str
    fits: bool
    why_not: str | None
    relative_step_time: float | None
    micro_batch_size: int | None = None
    activation_checkpointing: str | None = None
    levers: str | None = None  # the exact levers in words (`Levers.words`)

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "fits": self.fits,
            "why_not": self.why_not,
            "relative_step_time": self.relative_step_time,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "levers": self.levers,
        }


@dataclass(frozen=True)
class Candidate:
    """One rung's fastest fitting step, its estimate and predicted step time."""

    rung: Strategy
    spec: StepSpec
    estimate: Estimate
    time_s: float
    reduce_every_micro: bool | None = None  # fsdp rungs only

    @property
    def micro(self) -> int:
        return self.spec.micro_batch_size

    @property
    def ac(self) -> str:
        return self.spec.activation_checkpointing

    @property
    def levers(self) -> Levers:
        return self.spec.levers


def shortfall(est: Estimate, hw: Hardware, headroom: Headroom | float) -> str | None:
    """Why the estimate does not fit the device or the host memory less the headroom
    (launcher/plan/headroom.py), in words; None when it fits."""
    h = as_headroom(headroom)
    device = h.device(est.calibrated)
    if est.device_total_bytes > hw.device_memory_bytes * (1 - device):
        return (
            f"needs {est.device_total_bytes / GIB:.1f} GiB per device, has "
            f"{hw.device_memory_bytes / GIB:.1f} GiB less {device:.0%} headroom"
        )
    if est.host_total_bytes > hw.host_memory_bytes * (1 - h.host):
        return (
            f"needs {est.host_total_bytes / GIB:.1f} GiB host memory per node, has "
            f"{hw.host_memory_bytes / GIB:.1f} GiB less {h.host:.0%} headroom"
        )
    return None


def rung_world(rung: Strategy, hw: Hardware, tensor: int = 1) -> int | None:
    """The ranks the rung counts (a tensor group once); None where it cannot run on them."""
    world = hw.world_size // tensor
    if world < rung.min_world or (rung.max_world is not None and world > rung.max_world):
        return None
    return world


def per_rank_batch(
    cfg: JobConfig, hw: Hardware, sequence_parallel: int = 1, tensor_parallel: int = 1
) -> int:
    """Sequences per rank per optimizer step; the global batch must split evenly over the
    data-parallel groups (the ranks of a sequence or tensor group read the same sequences)."""
    world = hw.world_size // (sequence_parallel * tensor_parallel)
    gbs = cfg.train.global_batch_size
    if gbs % world:
        raise uneven_batch(gbs, world)
    per_rank = gbs // world
    if isinstance(cfg.train.micro_batch_size, int) and per_rank % cfg.train.micro_batch_size:
        raise ConfigError(
            "train.micro_batch_size",
            f"{cfg.train.micro_batch_size} does not divide the {per_rank} sequences per rank "
            f"({gbs} over {world} data-parallel ranks)",
            f"use one of {', '.join(map(str, sorted(_divisors_desc(per_rank))))} or auto",
        )
    return per_rank


def uneven_batch(gbs: int, world: int, splits: list[int] | None = None) -> ConfigError:
    """The global batch does not split over `world` data-parallel ranks: its multiples that do,
    and `splits`, the sequence group sizes whose data groups share it (long context: the fix is
    the user's to choose, since splitting a short sequence costs all-to-alls)."""
    fits = [m * world for m in range(max(1, gbs // world), gbs // world + 3)]
    fix = f"use a multiple of {world} (e.g. {', '.join(map(str, fits))})"
    if splits:
        sizes = " or ".join(map(str, splits))
        fix += f", or split each sequence over ranks: sequence_parallel={sizes}"
    return ConfigError(
        "train.global_batch_size", f"{gbs} sequences cannot be split evenly over {world} ranks", fix
    )


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def job_step(
    cfg: JobConfig, hw: Hardware, rung: Strategy, micro: int, ac: str, *,
    reduce_every_micro: bool | None = False, levers: Levers = NO_LEVERS,
    finetune: Finetune | None = None, long: LongContext | None = None,
    checkpointed: int | None = None, ops: bool | None = None,
) -> StepSpec:  # fmt: skip
    """The step this job runs on `rung` at this micro-batch, checkpointing (`checkpointed`
    layers under selective; None: the config's count, or every other layer) and levers, with
    the global batch's accumulation; split over a sequence group as `long` says (None: as the
    config says, `auto` being 1 and off)."""
    if checkpointed is None and isinstance(cfg.memory.checkpointed_layers, int):
        checkpointed = cfg.memory.checkpointed_layers
    if ops is None:  # the config's: op level where it says so
        ops = cfg.memory.selective == "ops"
    long = long or LongContext.of(cfg)
    data_ranks = hw.world_size // (long.sequence_parallel * long.tensor_parallel)
    return StepSpec(
        strategy=rung.name,
        world_size=hw.world_size,
        micro_batch_size=micro,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=ac,
        checkpointed_layers=checkpointed if ac == "selective" and not ops else None,
        checkpoint_ops=ops and ac == "selective",
        precision=cfg.precision,
        grad_accum=max(1, cfg.train.global_batch_size // (data_ranks * micro)),
        devices_per_node=hw.devices_per_node,
        device=hw.device,
        # packed windows get a dense block-causal mask, except under flash/flex attention
        # (position ids, or a sparse block mask, keep the documents apart)
        packed=cfg.data.pack and cfg.model.attn_implementation in DENSE_MASK,
        block_mask=cfg.data.pack and cfg.model.attn_implementation == "flex_attention",
        fsdp_reduce_every_micro_batch=bool(reduce_every_micro),
        chunked_loss=levers.chunked_loss,
        offload_activations=levers.offload_activations,
        loss_chunk_tokens=cfg.memory.loss_chunk_tokens,
        finetune=finetune or Finetune.of(cfg),
        sequence_parallel=long.sequence_parallel,
        tiled_mlp=long.tiled_mlp,
        tensor_parallel=long.tensor_parallel,
        mlp_chunk_tokens=cfg.memory.mlp_chunk_tokens,
        sequences_per_example=2 if cfg.objective.preference else 1,
        reference=REFERENCE_SOURCES.get((cfg.objective.type, cfg.finetune.method)),
        flash_attention=runs_flash(cfg, hw.device),
        compiled_layers=cfg.train.compile,
        **_calibrated(hw, rung.name),
    )


def _calibrated(hw: Hardware, rung: str) -> dict[str, Any]:
    """The StepSpec fields a probe of this hardware and rung measured (plan/calibration.py)."""
    figures = dict(hw.calibration).get(rung)
    if figures is None:
        return {}
    return {"runtime_fixed_bytes": figures.fixed_bytes, "reserve_ratio": figures.reserve_ratio}


def planned_attention(configured: str) -> str:
    """The attention implementation a plan runs where the planner does not choose: the
    config's, `auto` being sdpa."""
    return "sdpa" if configured == "auto" else configured


def runs_flash(cfg: JobConfig, device: str) -> bool:
    """Whether FlashAttention-2 attends: flash-attn's `flash_attention_2`, or SDPA's flash
    kernel, which torch picks on CUDA for 16-bit attention without a mask (unpacked windows)."""
    if device != "cuda" or cfg.precision == "fp32":
        return False
    attention = planned_attention(cfg.model.attn_implementation)
    return attention == "flash_attention_2" or (attention == "sdpa" and not cfg.data.pack)


def scaled_estimate(shape: ModelShape, spec: StepSpec, memory_scale: float) -> Estimate:
    """The estimate of one step, device bytes scaled by a measured `memory_scale`."""
    est = estimate(shape, spec)
    if memory_scale == 1.0:
        return est
    return replace(
        est,
        device_breakdown={k: int(v * memory_scale) for k, v in est.device_breakdown.items()},
        peak_tensor_bytes=int(est.peak_tensor_bytes * memory_scale),
        device_total_bytes=int(est.device_total_bytes * memory_scale),
        phases={},
    )


def reduce_variants(rung: Strategy, cfg: JobConfig) -> tuple[bool | None, ...]:
    """FSDP's gradient accumulation: unsharded under no-sync (False) or sharded, reducing after
    every micro-batch (True); both are tried under `fsdp.reduce_every_micro_batch: auto`. Other
    rungs have no such choice (None)."""
    if rung.engine != "fsdp":
        return (None,)
    chosen = cfg.fsdp.reduce_every_micro_batch
    return (False, True) if chosen == "auto" else (chosen,)


@dataclass(frozen=True)
class Climb:
    """What a walk up the ladder found: each fitting rung's best step, fastest first (the
    simplest within SIMPLER_RUNG_MARGIN of the fastest leading), and why the others did not."""

    per_rank: int  # sequences per rank per optimizer step
    ranked: list[Candidate]
    rejected: list[Alternative]
    usable: tuple[Strategy, ...] = ()  # the rungs the job may run on here, whatever their memory
    # (tensor degree, predicted step time of its best fitting step or None), each degree tried
    tensor_times: tuple[tuple[int, float | None], ...] = ()


@dataclass(frozen=True)
class _Walk:
    """What every rung's search shares, worked out once per climb."""

    cfg: JobConfig
    hw: Hardware
    shape: ModelShape
    per_rank: int
    memory_scale: float
    finetune: Finetune
    levers: list[Levers]
    links: Links
    long: LongContext | None = None


def climb(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, rungs: list[Strategy],
    exclude: tuple[str, ...] | list[str] = (), memory_scale: float = 1.0,
    long: LongContext | None = None,
) -> Climb:  # fmt: skip
    """Walk `rungs` for this job: each one's fastest fitting step, then the ranking; each
    sequence split as `long` says (None: as the config says)."""
    long = long or LongContext.of(cfg)
    per_rank = per_rank_batch(cfg, hw, long.sequence_parallel, long.tensor_parallel)
    finetune = Finetune.of(cfg)
    unsupported = {rung.name: why_not_on(rung, finetune, cfg.precision) for rung in rungs}
    levers = lever_variants(cfg.memory.chunked_loss, cfg.memory.offload_activations, hw.device)
    walk = _Walk(cfg, hw, shape, per_rank, memory_scale, finetune, levers,
                 Links.of(cfg.hardware, hw.device), long)  # fmt: skip
    candidates: list[Candidate] = []
    rejected: list[Alternative] = []
    usable: list[Strategy] = []
    for rung in rungs:
        why = _why_not_tried(rung, hw, cfg, exclude, long.tensor_parallel)
        why = why or unsupported[rung.name]
        if why is None:
            usable.append(rung)
            best, why = _best_on(walk, rung)
            if best is not None:
                candidates.append(best)
                continue
        rejected.append(Alternative(rung.name, False, why, None))
    if not candidates:
        return Climb(per_rank, [], rejected, tuple(usable))
    # fastest first, except that a rung earlier on the ladder within SIMPLER_RUNG_MARGIN of
    # the fastest goes first (the cost model ranks coarsely; earlier rungs are simpler)
    ranked = sorted(candidates, key=lambda cand: cand.time_s)  # stable: ladder order on ties
    ladder = strategies.names()
    limit = ranked[0].time_s * (1 + SIMPLER_RUNG_MARGIN)
    chosen = min((c for c in ranked if c.time_s <= limit), key=lambda c: ladder.index(c.rung.name))
    ranked.remove(chosen)
    return Climb(per_rank, [chosen, *ranked], rejected, tuple(usable))


def best_for_rung(
    shape: ModelShape, rung: Strategy, hw: Hardware, cfg: JobConfig, per_rank: int,
    memory_scale: float,
) -> tuple[Candidate | None, str]:  # fmt: skip
    """The rung's fastest fitting step, or None and why the smallest one does not fit."""
    finetune = Finetune.of(cfg)
    levers = lever_variants(cfg.memory.chunked_loss, cfg.memory.offload_activations, hw.device)
    links = Links.of(cfg.hardware, hw.device)
    return _best_on(_Walk(cfg, hw, shape, per_rank, memory_scale, finetune, levers, links), rung)


def _best_on(walk: _Walk, rung: Strategy) -> tuple[Candidate | None, str]:
    cfg, hw = walk.cfg, walk.hw
    micros = _divisors_desc(walk.per_rank)
    if isinstance(cfg.train.micro_batch_size, int):
        micros = [cfg.train.micro_batch_size]
    if walk.finetune.in_backward:  # one micro-batch per step: no accumulation
        micros = [m for m in micros if m == walk.per_rank]
        if not micros:
            return None, f"train.optimizer_in_backward needs micro-batch {walk.per_rank}"
    best: Candidate | None = None
    smallest: Estimate | None = None
    levels = _checkpointing(walk)
    if rung.streams_layers:  # it recomputes every layer itself: its kept inputs, the checkpoints
        levels = [level for level in levels if level == ("full", False)]
        if not levels:
            level = cfg.memory.activation_checkpointing
            return None, f"recomputes every layer (memory.activation_checkpointing={level})"
    for every, (ac, ops), lev in itertools.product(reduce_variants(rung, cfg), levels, walk.levers):
        # a smaller micro-batch at the same checkpointing is only slower, except where it lets
        # selective checkpointing recompute fewer layers: then every micro-batch is weighed
        weigh_all = ac == "selective" and not ops and cfg.memory.checkpointed_layers == "auto"
        if ops and (lev.offload_activations or rung.engine == "deepspeed"):
            continue  # op-level outputs are not offloaded; DeepSpeed's rungs untried with it
        for micro in micros:
            spec, est = _step_at(walk, rung, micro, ac, every, lev, ops)
            if smallest is None or est.device_total_bytes < smallest.device_total_bytes:
                smallest = est
            t = step_time_s(walk.shape, spec, hw, walk.links, est.offloaded_bytes)
            if not _fits_faster(est, t, spec, best, hw, plan_headroom(cfg)):
                if shortfall(est, hw, plan_headroom(cfg)) is None and not weigh_all:
                    break  # fits, but slower: smaller micro-batches here are only slower still
                continue
            best = Candidate(rung, spec, est, t, every)
            if not weigh_all:
                break
    if smallest is None:  # every step was ruled out above: op-level checkpointing cannot run
        why = "memory.selective=ops " + (
            "is not run on DeepSpeed's rungs" if rung.engine == "deepspeed"
            else "keeps its outputs on the device: not with memory.offload_activations=true"
        )  # fmt: skip
        return None, why
    why = "" if best else (shortfall(smallest, hw, plan_headroom(cfg)) or "does not fit")
    return best, why


def _checkpointing(walk: _Walk) -> list[tuple[str, bool]]:
    """The checkpointing the walk tries: (level, op level) for each level the config allows;
    selective at op level beside selective of whole layers where `memory.selective` allows it
    and the estimate models it (a full fine-tune of a Llama-style block, no tiled MLP or
    sequence split)."""
    cfg = walk.cfg
    levels = AC_LEVELS if cfg.memory.activation_checkpointing == "auto" else (
        cfg.memory.activation_checkpointing,
    )  # fmt: skip
    long = walk.long or LongContext.of(cfg)
    modelled = (walk.shape.activations is None and not walk.finetune.adapters
                and long.sequence_parallel == 1 and not long.tiled_mlp
                and cfg.memory.checkpointed_layers == "auto")  # fmt: skip
    out = []
    for level in levels:
        if level != "selective" or cfg.memory.selective == "layers":
            out.append((level, False))
        elif cfg.memory.selective == "ops":
            out.append((level, True))
        else:
            out += [(level, False)] + ([(level, True)] if modelled else [])
    return out


def _step_at(
    walk: _Walk, rung: Strategy, micro: int, ac: str, every: bool | None, lev: Levers,
    ops: bool = False,
) -> tuple[StepSpec, Estimate]:  # fmt: skip
    """The step at this micro-batch and checkpointing level, and its estimate. Selective
    checkpointing with `memory.checkpointed_layers: auto` checkpoints the fewest of a quarter,
    a half or three quarters of the layers that fit (each layer fewer is one layer's forward
    less to recompute; steps of a quarter keep the choice above the cost model's noise and the
    plan readable); where none of them fits, three quarters (the smallest footprint short of
    full)."""

    def at(count: int | None) -> tuple[StepSpec, Estimate]:
        spec = job_step(walk.cfg, walk.hw, rung, micro, ac, reduce_every_micro=every,
                        levers=lev, finetune=walk.finetune, long=walk.long,
                        checkpointed=count, ops=ops)  # fmt: skip
        return spec, scaled_estimate(walk.shape, spec, walk.memory_scale)

    if ac != "selective" or ops or walk.cfg.memory.checkpointed_layers != "auto":
        return at(None)
    layers = walk.shape.num_layers
    counts = sorted({max(1, round(layers * q)) for q in SELECTIVE_SHARES} - {layers})
    for count in counts[:-1]:
        step = at(count)
        if shortfall(step[1], walk.hw, plan_headroom(walk.cfg)) is None:
            return step
    return at(counts[-1]) if counts else at(None)


def _fits_faster(
    est: Estimate, time_s: float, spec: StepSpec, than: Candidate | None, hw: Hardware,
    headroom: Headroom,
) -> bool:  # fmt: skip
    """Whether a step fits and beats the best so far on its rung. Activation offload must earn
    its place: it fills the node's host memory (and the job's `--mem`), so a step that offloads
    is chosen over one that does not only when predicted faster by more than
    SIMPLER_RUNG_MARGIN, and a step that does not offload wins back within it."""
    if shortfall(est, hw, headroom) is not None:
        return False
    if than is None:
        return True
    offloads, best_offloads = spec.offload_activations, than.spec.offload_activations
    if offloads and not best_offloads:
        return time_s < than.time_s * (1 - SIMPLER_RUNG_MARGIN)
    if best_offloads and not offloads:
        return time_s < than.time_s * (1 + SIMPLER_RUNG_MARGIN)
    return time_s < than.time_s


def _why_not_tried(
    rung: Strategy, hw: Hardware, cfg: JobConfig, exclude, tensor: int = 1
) -> str | None:
    if rung.name in exclude:
        return "ran out of memory in this run"
    if tensor > 1 and not rung.tensor_parallel:
        return f"runs no tensor split (tensor parallel {tensor})"
    if rung_world(rung, hw, tensor) is None:
        need = f"{rung.min_world}+ ranks" if rung.max_world is None else "exactly 1 rank"
        return f"needs {need}, has {hw.world_size}"
    if rung.needs_nvme and not cfg.deepspeed.nvme_path:
        return "needs deepspeed.nvme_path"
    return None
