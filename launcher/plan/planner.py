"""The planner: walk the ladder, keep what fits, pick the fastest. A pure function of its inputs.

For every rung (trainer/core/strategies.py) the planner tries activation checkpointing
none -> selective -> full and every micro-batch that divides this rank's share of the global batch,
keeps the combinations the estimate says fit with `plan.headroom`, and predicts a step time for
each with a small cost model (docs/planner.md). The fastest fitting combination of each rung is
that rung's candidate; the fastest candidate wins. What is learned never changes: the global
batch, optimizer, schedule and precision stay as configured; only micro-batch x accumulation,
recomputation, sharding and offload move.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from launcher.estimate.activations import with_activations
from launcher.estimate.compiled_layers import compiled_reason
from launcher.estimate.expert_split import dispatch_reason
from launcher.estimate.peak import Estimate
from launcher.estimate.shape import ModelShape, model_shape
from launcher.estimate.stream_states import resident_reason
from launcher.plan.alternatives import MethodAlternative, method_alternatives
from launcher.plan.calibration import RuntimeFigures, calibration_path
from launcher.plan.cost import Links, StreamTimes, step_time_s
from launcher.plan.hardware import Hardware
from launcher.plan.headroom import Headroom, as_headroom, plan_headroom
from launcher.plan.ladder import (
    SIMPLER_RUNG_MARGIN,
    Alternative,
    Candidate,
    job_step,
    planned_attention,
    reduce_variants,
    scaled_estimate,
    shortfall,
)
from launcher.plan.long_context import (
    attention_reason,
    climb_long,
    long_context_reasons,
    max_seq_len,
    max_seq_len_memory,
)
from launcher.plan.no_fit import what_would_fit
from launcher.plan.splits import expert_parallel_sizes, expert_reason, tensor_reason
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig
from trainer.core.parallel_dims import ParallelDims, check_expert_parallel
from trainer.core.step_spec import (
    NO_LEVERS,
    SHORT,
    Levers,
    LongContext,
    StepSpec,
    smallest_levers,
)
from trainer.core.units import GIB


@dataclass(frozen=True)
class Plan:
    strategy: str
    world_size: int
    nodes: int
    devices_per_node: int
    micro_batch_size: int
    grad_accum: int
    activation_checkpointing: str
    estimate: Estimate
    step_time_s: float
    reasons: list[str] = field(default_factory=list)
    alternatives: list[Alternative] = field(default_factory=list)
    fsdp_reduce_every_micro_batch: bool | None = None  # fsdp rungs only
    levers: Levers = NO_LEVERS
    long: LongContext = SHORT  # sequence parallel and tiled MLP
    max_seq_len: int | None = None  # the longest data.seq_len this plan still fits
    max_seq_len_memory: int | None = None  # ... memory alone allows here, beyond the positions
    attention: str = "sdpa"  # model.attn_implementation (the planner's under `auto`)
    reference: str | None = None  # preference objectives: where DPO's reference comes from
    checkpointed_layers: int | None = None  # selective: how many layers (None: every other)
    checkpoint_ops: bool = False  # selective at op level: every layer, matmul outputs saved
    expert_parallel: int = 1  # `parallel.expert`: forced, or the planner's degree

    @classmethod
    def of(
        cls, spec: StepSpec, hw: Hardware, estimate: Estimate, step_time_s: float,
        reasons: list[str], alternatives: list = (), reduce_every_micro: bool | None = None,
        max_seq_len: int | None = None, max_seq_len_memory: int | None = None,
        attention: str = "sdpa",
    ) -> Plan:  # fmt: skip
        """The plan that runs `spec` on `hw`."""
        return cls(
            strategy=spec.strategy, world_size=hw.world_size, nodes=hw.nodes,
            devices_per_node=hw.devices_per_node, micro_batch_size=spec.micro_batch_size,
            grad_accum=spec.grad_accum, activation_checkpointing=spec.activation_checkpointing,
            estimate=estimate, step_time_s=step_time_s, reasons=list(reasons),
            alternatives=list(alternatives), fsdp_reduce_every_micro_batch=reduce_every_micro,
            levers=spec.levers, long=spec.long_context, max_seq_len=max_seq_len,
            max_seq_len_memory=max_seq_len_memory, attention=attention,
            checkpointed_layers=spec.checkpointed_layers, checkpoint_ops=spec.checkpoint_ops,
        )  # fmt: skip

    @property
    def selective(self) -> str | None:
        """Under selective checkpointing, `layers` (whole layers) or `ops` (op level)."""
        if self.activation_checkpointing != "selective":
            return None
        return "ops" if self.checkpoint_ops else "layers"

    def to_json(
        self, hw: Hardware, headroom: Headroom | float, command: list[str]
    ) -> dict[str, Any]:
        """docs/interface.md's `plan --json`."""
        sp, tp = self.long.sequence_parallel, self.long.tensor_parallel
        h = as_headroom(headroom)
        device_share = h.device(self.estimate.calibrated)
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.grad_accum,
            "activation_checkpointing": self.activation_checkpointing,
            "checkpointed_layers": self.checkpointed_layers,
            "selective": self.selective,
            "chunked_loss": self.levers.chunked_loss,
            "offload_activations": self.levers.offload_activations,
            "parallel": {
                "data": self.world_size // (sp * tp),
                "sequence": sp,
                "tensor": tp,
                "expert": self.expert_parallel,
            },  # fmt: skip
            "sequence_parallel": sp,  # parallel.sequence's old name
            "tiled_mlp": self.long.tiled_mlp,
            "max_seq_len": self.max_seq_len,
            "max_seq_len_memory": self.max_seq_len_memory,
            "attn_implementation": self.attention,
            **({"reference": self.reference} if self.reference is not None else {}),
            "predicted_step_time_s": self.step_time_s,
            **(
                {"fsdp_reduce_every_micro_batch": self.fsdp_reduce_every_micro_batch}
                if self.fsdp_reduce_every_micro_batch is not None
                else {}
            ),
            "estimate": self.estimate.to_json(shortfall(self.estimate, hw, headroom) is None),
            "headroom": {"device": device_share, "host": h.host, "auto": h.auto},
            "budget": {
                "device_bytes": int(hw.device_memory_bytes * (1 - device_share)),
                "host_bytes": int(hw.host_memory_bytes * (1 - h.host)),
            },
            "hardware": {
                "device": hw.device,
                "device_name": hw.device_name,
                "device_memory_bytes": hw.device_memory_bytes,
                "host_memory_bytes": hw.host_memory_bytes,
            },
            "reasons": list(self.reasons),
            "alternatives": [a.to_json() for a in self.alternatives],
            "command": list(command),
        }


class NoFitError(Exception):
    """Nothing fits on the hardware given (exit 3); the message says what would, and
    `alternatives` holds the opt-in method/optimizer changes that would (plan/alternatives.py)."""

    def __init__(self, message: str, alternatives: list[MethodAlternative] | None = None):
        super().__init__(message)
        self.alternatives = alternatives or []


def make_plan(
    cfg: JobConfig,
    hw: Hardware,
    shape: ModelShape | None = None,
    *,
    exclude: tuple[str, ...] | list[str] = (),
    memory_scale: float = 1.0,
) -> Plan:
    """The plan for this job on this hardware (raises NoFitError or ConfigError)."""
    shape = shape or model_shape(cfg.model)
    if not shape.num_experts and cfg.parallel.expert in ("auto", 1):  # nothing to split
        return _make_plan(cfg, hw, shape, exclude, memory_scale, 1)
    degrees = expert_parallel_sizes(cfg, hw, shape)
    if degrees == [1]:
        return _make_plan(cfg, hw, shape, exclude, memory_scale, 1)
    untensored = cfg  # no tensor split beside an expert split
    if cfg.parallel.tensor == "auto":
        untensored = cfg.model_copy(
            update={"parallel": cfg.parallel.model_copy(update={"tensor": 1})}
        )
    if len(degrees) == 1:  # a forced split: the degree checked on the ranks found
        (ep,) = degrees
        check_expert_parallel(ParallelDims(hw.world_size, 1, 1, ep), shape.num_experts)
        plan = _make_plan(untensored, hw, shape, exclude, memory_scale, ep)
        why = (
            f"expert parallel {ep}: each MoE layer's experts split over {ep} of the data x "
            "sequence ranks (parallel.expert as the config forces it)"
        )
        return replace(plan, reasons=[*plan.reasons, why])
    plans: dict[int, Plan | None] = {1: _plan_or_none(cfg, hw, shape, exclude, memory_scale, 1)}
    for ep in degrees[1:]:
        plans[ep] = _plan_or_none(untensored, hw, shape, exclude, memory_scale, ep)
    times = [(ep, None if p is None else p.step_time_s) for ep, p in plans.items()]
    base = plans[1]
    split = min((p for p in plans.values() if p is not None and p.expert_parallel > 1),
                key=lambda p: p.step_time_s, default=None)  # fmt: skip
    chosen = base
    if split is not None and (
        base is None or split.step_time_s < base.step_time_s * (1 - SIMPLER_RUNG_MARGIN)
    ):
        chosen = split
    if chosen is None:  # nothing fits at any degree: the unsplit job's message
        return _make_plan(cfg, hw, shape, exclude, memory_scale, 1)
    why = expert_reason(cfg, hw, times, chosen.expert_parallel)
    return replace(chosen, reasons=[*chosen.reasons, why])


def _plan_or_none(
    cfg: JobConfig, hw: Hardware, shape: ModelShape,
    exclude: tuple[str, ...] | list[str], memory_scale: float, ep: int,
) -> Plan | None:  # fmt: skip
    """The plan at expert degree `ep`, or None where nothing fits (a forced rung's plan that
    the estimate says will not fit included)."""
    try:
        plan = _make_plan(cfg, hw, shape, exclude, memory_scale, ep)
    except NoFitError:
        return None
    return plan if shortfall(plan.estimate, hw, plan_headroom(cfg)) is None else None


def _make_plan(
    cfg: JobConfig, hw: Hardware, shape: ModelShape,
    exclude: tuple[str, ...] | list[str], memory_scale: float, ep: int,
) -> Plan:  # fmt: skip
    shape = with_activations(replace(shape, expert_parallel=ep), cfg)
    forced = cfg.strategy if cfg.strategy != "auto" else None
    rungs = [  # an expert split runs on the rungs that take one (trainer/core/strategies.py)
        r
        for r in strategies.rows()
        if (not forced or r.name == forced) and (ep == 1 or r.expert_parallel)
    ]
    found, _, attention, climbs = climb_long(cfg, hw, shape, rungs, exclude, memory_scale)
    per_rank, ranked, rejected = found.per_rank, found.ranked, found.rejected
    if forced and not ranked:
        why = (rejected[0].why_not or "") if rejected else ""
        if " rank" in why:
            raise ConfigError("strategy", f"{forced} {why}", "pick another rung")
        if why.startswith("recomputes every layer"):  # stream, under a forced other level
            raise ConfigError("memory.activation_checkpointing", f"{forced} {why}",
                              "set it to full or auto, or pick another rung")  # fmt: skip
        if forced in exclude:
            raise NoFitError(f"strategy {forced} ran out of memory and is forced by the config")
        return _forced_plan(cfg, hw, shape, forced, per_rank, rejected, memory_scale)
    if not ranked:
        changes = method_alternatives(cfg, hw, shape, exclude, memory_scale)
        raise NoFitError(what_would_fit(cfg, hw, shape, changes), changes)
    chosen = ranked[0]
    alternatives = [
        Alternative(
            cand.rung.name,
            True,
            None,
            round(cand.time_s / chosen.time_s, 3),
            cand.micro,
            cand.ac,
            cand.levers.words(),
        )
        for cand in ranked
    ] + rejected
    longest = max_seq_len(shape, chosen.spec, hw, plan_headroom(cfg), memory_scale)
    memory_longest = max_seq_len_memory(cfg, hw, shape, chosen.spec, memory_scale, found.usable,
                                        longest)  # fmt: skip
    reasons = _reasons(cfg, hw, ranked, memory_scale) + model_reasons(shape)
    if chosen.rung.streams_layers:
        reasons.append(resident_reason(shape, chosen.spec.compute_bytes))
        parts: list[StreamTimes] = []
        step_time_s(shape, chosen.spec, hw, Links.of(cfg.hardware, hw.device),
                    chosen.estimate.offloaded_bytes, stream=parts)  # fmt: skip
        reasons.append(parts[0].words())
    reasons += long_context_reasons(shape, chosen.spec, memory_scale, longest, memory_longest)
    if (why := tensor_reason(cfg, hw, found, chosen.spec.tensor_parallel)) is not None:
        reasons.append(why)
    if attention != "sdpa" and "sdpa" in climbs:  # `auto` chose another
        reasons.append(attention_reason(cfg, chosen, attention, climbs["sdpa"]))
    if chosen.spec.compiled_layers:
        reasons.append(compiled_reason(chosen.spec, shape))
    if ep > 1:
        reasons.append(dispatch_reason(shape))
    plan = Plan.of(chosen.spec, hw, chosen.estimate, chosen.time_s, reasons, alternatives,
                   chosen.reduce_every_micro, longest, memory_longest, attention)  # fmt: skip
    return replace(plan, expert_parallel=ep)


def _reasons(cfg: JobConfig, hw: Hardware, ranked: list[Candidate], memory_scale: float):
    """The plan's reasons, in words: what fits, the batch geometry, why this rung."""
    chosen = ranked[0]
    world = chosen.spec.data_ranks  # data-parallel groups
    per_rank = cfg.train.global_batch_size // world
    est = chosen.estimate
    reasons = [
        f"{chosen.rung.name} fits: {est.device_total_bytes / GIB:.1f} GiB of "
        f"{hw.device_memory_bytes / GIB:.1f} GiB per device (headroom "
        f"{plan_headroom(cfg).device(est.calibrated):.0%})"
        f", {est.host_total_bytes / GIB:.1f} GiB of {hw.host_memory_bytes / GIB:.1f} GiB host"
        " per node",
        f"micro-batch {chosen.micro} x accumulation {per_rank // chosen.micro} x {world} "
        + ("ranks" if world == hw.world_size else "data-parallel groups")
        + f" = global batch {cfg.train.global_batch_size}; activation checkpointing "
        + chosen.spec.checkpointing_words,
    ]
    if chosen.levers != NO_LEVERS:
        reasons.append(_lever_reason(chosen, ranked))
    if chosen.reduce_every_micro and per_rank // chosen.micro > 1:
        reasons.append(
            f"{chosen.rung.name} reduce-scatters gradients after every micro-batch and "
            "accumulates them sharded (unsharded accumulation holds 4 bytes per parameter more "
            "on every device)"
        )
    fastest = min(ranked, key=lambda cand: cand.time_s)
    if fastest is not chosen and fastest.time_s < chosen.time_s:
        reasons.append(
            f"{len(ranked)} rungs fit; {chosen.rung.name} ({chosen.time_s:.3g} s predicted) "
            f"is within {SIMPLER_RUNG_MARGIN:.0%} of the fastest, {fastest.rung.name} "
            f"({fastest.time_s:.3g} s), and comes earlier on the ladder (simpler, fewer moving "
            "parts); the cost model does not resolve finer differences"
        )
    elif len(ranked) > 1:
        runner_up = ranked[1]
        if runner_up.time_s > chosen.time_s * 1.001:
            reasons.append(
                f"fastest predicted step of {len(ranked)} rungs that fit: "
                f"{chosen.time_s:.3g} s vs {runner_up.time_s:.3g} s on {runner_up.rung.name}"
            )
        else:
            reasons.append(
                f"{len(ranked)} rungs fit; {chosen.rung.name} ties {runner_up.rung.name} on "
                "predicted step time and comes first on the ladder (simpler, fewer moving parts)"
            )
    figures = dict(hw.calibration).get(chosen.rung.name) if est.calibrated else None
    if figures is not None:
        reasons.append(calibration_reason(figures, est.device_breakdown["runtime_overhead"]))
    if memory_scale != 1.0:
        reasons.append(
            f"estimates scaled by {memory_scale:.2f} from a measured step (an out-of-memory, "
            "or the launch probe's first step over the budget)"
        )
    return reasons


def calibration_reason(figures: RuntimeFigures, overhead_bytes: int) -> str:
    """What a calibrated plan says of the probe it read."""
    reserve = (
        f" and the allocator's reserve ({figures.reserve_ratio:.2f} of the bytes that come and go)"
        if figures.reserve_ratio is not None
        else ""
    )
    return (
        f"calibrated by a launch probe of {figures.measured_on} on this hardware: runtime "
        f"overhead {overhead_bytes / GIB:.2f} GiB, the fixed bytes it measured "
        f"({figures.fixed_bytes / GIB:.2f} GiB){reserve}, not the estimate's assumption; "
        f"delete {calibration_path()} to plan without it"
    )


def model_reasons(shape: ModelShape) -> list[str]:
    """How the model's activations and compute were counted, where not by the analytic block."""
    reasons = []
    if shape.activations is not None:
        reasons.append(shape.activations.reason(shape.model_type))
    if shape.num_experts:
        reasons.append(
            f"mixture of experts: {shape.num_experts} experts per MoE layer, top-"
            f"{shape.experts_per_token} routing; memory counts every expert's parameters and "
            f"states, activations the {shape.experts_per_token} expert rows of every token "
            + (
                "(transformers' grouped experts keep tokens x top-k rows whatever the router "
                "picks, so no routing is worse)"
                if shape.expert_parallel == 1
                else "(unsplit; the split's worst case below)"
            )
            + ", compute the "
            f"{shape.num_compute_params / 1e6:,.1f}M parameters a token uses of "
            f"{shape.num_params / 1e6:,.1f}M"
        )
    return reasons


def _lever_reason(chosen: Candidate, ranked: list[Candidate]) -> str:
    """Why the exact levers in force: what they hold off the device, and their price."""
    parts = []
    if chosen.levers.chunked_loss:
        parts.append(
            "chunked loss (the logits of one chunk of tokens at a time; the head's "
            "forward runs again in backward)"
        )
    if chosen.levers.offload_activations:
        what = "each layer's checkpointed input" if chosen.ac == "full" else "saved activations"
        pinned = chosen.estimate.host_breakdown.get("offloaded_activations", 0)
        parts.append(
            f"activation offload ({chosen.estimate.offloaded_bytes / GIB:.2f} GiB of {what} per "
            f"micro-batch wait in host memory, {pinned / GIB:.1f} GiB held there per node; "
            "the copies overlap compute)"
        )
    return (
        " and ".join(parts) + f": the fastest fitting combination on {chosen.rung.name} "
        f"(micro-batch {chosen.micro}, activation checkpointing {chosen.spec.checkpointing_words})"
    )


def _forced_plan(cfg, hw, shape, name, per_rank, rejected, memory_scale) -> Plan:
    """`strategy: NAME` that the estimate says will not fit: run it anyway, smallest footprint."""
    rung = strategies.row(name)
    micro = cfg.train.micro_batch_size
    if not isinstance(micro, int):  # the step in backward runs one micro-batch per step
        micro = per_rank if cfg.train.optimizer_in_backward else 1
    ac = cfg.memory.activation_checkpointing
    ac = "full" if ac == "auto" else ac
    every = reduce_variants(rung, cfg)[-1]  # the smaller footprint
    levers = smallest_levers(cfg.memory.chunked_loss, cfg.memory.offload_activations)
    spec = job_step(cfg, hw, rung, micro, ac, reduce_every_micro=every, levers=levers)
    est = scaled_estimate(shape, spec, memory_scale)
    changes = (
        []
        if shortfall(est, hw, plan_headroom(cfg)) is None
        else method_alternatives(cfg, hw, shape, (), memory_scale)
    )
    links = Links.of(cfg.hardware, hw.device)
    reasons = [
        f"strategy {name} is forced by the config, but the estimate says it will not fit: "
        f"{shortfall(est, hw, plan_headroom(cfg))}",
        *model_reasons(shape),
        *(alt.words() for alt in changes),
    ]
    time_s = step_time_s(shape, spec, hw, links, est.offloaded_bytes)
    return Plan.of(spec, hw, est, time_s, reasons, [*rejected, *changes], every,
                   attention=planned_attention(cfg.model.attn_implementation))  # fmt: skip


def apply_plan(cfg: JobConfig, plan: Plan, hw: Hardware) -> JobConfig:
    """The resolved config the ranks run: every `auto` made concrete, nothing learned changed."""
    return cfg.model_copy(
        update={
            "strategy": plan.strategy,
            **(
                {
                    "fsdp": cfg.fsdp.model_copy(
                        update={"reduce_every_micro_batch": plan.fsdp_reduce_every_micro_batch}
                    )
                }
                if plan.fsdp_reduce_every_micro_batch is not None
                else {}
            ),
            "train": cfg.train.model_copy(update={"micro_batch_size": plan.micro_batch_size}),
            "memory": cfg.memory.model_copy(
                update={
                    "activation_checkpointing": plan.activation_checkpointing,
                    "checkpointed_layers": plan.checkpointed_layers or "auto",
                    "selective": plan.selective or "auto",
                    "chunked_loss": plan.levers.chunked_loss,
                    "offload_activations": plan.levers.offload_activations,
                    "tiled_mlp": plan.long.tiled_mlp,
                }
            ),
            "parallel": cfg.parallel.model_copy(
                update={
                    "sequence": plan.long.sequence_parallel,
                    "tensor": plan.long.tensor_parallel,
                    "expert": plan.expert_parallel,
                }
            ),
            "sequence_parallel": plan.long.sequence_parallel,
            "model": cfg.model.model_copy(update={"attn_implementation": plan.attention}),
            "hardware": cfg.hardware.model_copy(
                update={
                    "device": hw.device,
                    "nodes": plan.nodes,
                    "devices_per_node": plan.devices_per_node,
                    "device_memory": hw.device_memory_bytes,
                    "host_memory": hw.host_memory_bytes,
                }
            ),
        }
    )
