"""The planner: walk the ladder, keep what fits, pick the fastest. A pure function of its inputs.

For every rung (trainer/core/strategies.py) the planner tries activation checkpointing
none -> selective -> full and every micro-batch that divides this rank's share of the global batch,
keeps the combinations the estimate says fit with `memory.headroom`, and predicts a step time for
each with a small cost model (docs/planner.md). The fastest fitting combination of each rung is
that rung's candidate; the fastest candidate wins. What is learned never changes: the global
batch, optimizer, schedule and precision stay as configured; only micro-batch x accumulation,
recomputation, sharding and offload move.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from launcher.activations import with_activations
from launcher.estimate import Estimate, estimate
from launcher.estimate_finetune import Finetune, method_cost, why_not_on
from launcher.estimate_levers import (
    NO_LEVERS,
    Levers,
    lever_variants,
    offload_pcie_seconds,
    recomputed_head_flops_per_token,
    smallest_levers,
)
from launcher.hardware import Hardware
from launcher.model_shape import ModelShape, model_shape
from launcher.plan_finetune import MethodAlternative, method_alternatives
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig
from trainer.core.strategies import AC_LEVELS, Strategy
from trainer.core.units import GIB

# Cost-model constants (docs/planner.md): effective bandwidths and rates, not peaks. The
# bandwidths are defaults for the `hardware.*_bandwidth` keys.
INTRA_NODE_BYTES_S = {"cuda": 150e9, "cpu": 2e9}  # NVLink-class / shared memory via gloo
INTER_NODE_BYTES_S = {"cuda": 20e9, "cpu": 1e9}  # per device over the network
PCIE_BYTES_S = 12e9
NVME_BYTES_S = 3e9
BASE_UTILIZATION = 0.45  # fraction of peak FLOP/s a well-fed step reaches
SATURATION_TOKENS = 512  # tokens per micro-batch at which utilisation is half its base
# A rung later on the ladder must be predicted this much faster to be chosen over an earlier one:
# the cost model ranks rungs coarsely, and earlier rungs have fewer moving parts.
SIMPLER_RUNG_MARGIN = 0.10
CPU_PEAK_FLOPS = 0.2e12  # when planning CPU processes (tests, the demo)
DEVICE_MEMORY_BYTES_S = {"cuda": 1.5e12, "cpu": 20e9}  # QLoRA's dequantisation is memory-bound
UNKNOWN_GPU_PEAK_FLOPS = 100e12


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

    def to_json(self, hw: Hardware, headroom: float, command: list[str]) -> dict[str, Any]:
        """docs/interface.md's `plan --json`."""
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.grad_accum,
            "activation_checkpointing": self.activation_checkpointing,
            "chunked_loss": self.levers.chunked_loss,
            "offload_activations": self.levers.offload_activations,
            "predicted_step_time_s": self.step_time_s,
            **(
                {"fsdp_reduce_every_micro_batch": self.fsdp_reduce_every_micro_batch}
                if self.fsdp_reduce_every_micro_batch is not None
                else {}
            ),
            "estimate": self.estimate.to_json(hw, headroom),
            "reasons": list(self.reasons),
            "alternatives": [a.to_json() for a in self.alternatives],
            "command": list(command),
        }


class NoFitError(Exception):
    """Nothing fits on the hardware given (exit 3); the message says what would, and
    `alternatives` holds the opt-in method/optimizer changes that would (plan_finetune.py)."""

    def __init__(self, message: str, alternatives: list[MethodAlternative] | None = None):
        super().__init__(message)
        self.alternatives = alternatives or []


def rung_world(rung: Strategy, hw: Hardware) -> int | None:
    world = hw.world_size
    if world < rung.min_world or (rung.max_world is not None and world > rung.max_world):
        return None
    return world


def step_time_s(
    shape: ModelShape,
    rung: Strategy,
    hw: Hardware,
    cfg: JobConfig,
    micro: int,
    ac: str,
    reduce_every_micro: bool | None = False,
    levers: Levers = NO_LEVERS,
    offloaded_bytes: int = 0,
) -> float:
    """Predicted seconds per optimizer step (compute + recompute + communication + offload);
    `reduce_every_micro`: FSDP reduce-scatters after every micro-batch; `levers`: chunked loss
    recomputes the head's forward, activation offload moves `offloaded_bytes` per micro-batch
    (launcher/estimate_levers.py)."""
    seq = cfg.data.seq_len
    world = hw.world_size
    tokens = cfg.train.global_batch_size * seq
    c = 4 if cfg.precision == "fp32" else 2
    cost = method_cost(shape, Finetune.of(cfg), c)  # full fine-tuning, LoRA or QLoRA; MoE
    attention = 12 * shape.num_layers * shape.hidden_size * seq  # per token, fwd + bwd
    recomputed = {"none": 0.0, "selective": 0.5, "full": 1.0}[ac]
    recompute = recomputed * (cost.recompute_flops_per_token + attention / 3)
    if levers.chunked_loss:
        recompute += recomputed_head_flops_per_token(shape.hidden_size, shape.vocab_size)
    flops = tokens * (cost.flops_per_token + attention + recompute)
    peak = hw.peak_flops or (CPU_PEAK_FLOPS if hw.device == "cpu" else UNKNOWN_GPU_PEAK_FLOPS)
    micro_tokens = micro * seq
    utilization = BASE_UTILIZATION * micro_tokens / (micro_tokens + SATURATION_TOKENS)
    compute = flops / (world * peak * utilization)
    grad_accum = cfg.train.global_batch_size // (world * micro)
    passes = grad_accum * (2 + recomputed)  # forward, backward, recompute per micro-batch
    compute += cost.dequant_bytes * passes / DEVICE_MEMORY_BYTES_S[hw.device]

    ring = (world - 1) / world
    given = cfg.hardware
    if hw.nodes == 1:
        bandwidth = given.intra_node_bandwidth or INTRA_NODE_BYTES_S[hw.device]
    else:
        bandwidth = given.inter_node_bandwidth or INTER_NODE_BYTES_S[hw.device]
    pcie, nvme = given.pcie_bandwidth or PCIE_BYTES_S, given.nvme_bandwidth or NVME_BYTES_S
    gather_scale = c / 2 if rung.engine == "fsdp" else 1.0
    grad_reductions = grad_accum if rung.grads_every_micro or reduce_every_micro else 1
    comm_bytes = cost.trained * rung.grad_comm * grad_reductions
    comm_bytes += cost.gathered * rung.param_comm_per_micro * gather_scale * grad_accum
    comm = ring * comm_bytes / bandwidth
    per_rank = cost.trained / world  # what is stepped and moved once per step or reduction
    pcie_bytes = (rung.pcie_per_step + rung.offloaded_grads * grad_reductions) * per_rank
    pcie_bytes += rung.pcie_per_micro * grad_accum * cost.gathered / world  # params in, per use
    offload = pcie_bytes / pcie
    if rung.host_adam_params_s:
        offload += per_rank * min(hw.devices_per_node, world) / rung.host_adam_params_s
    offload += rung.nvme_per_step * per_rank / nvme
    if levers.offload_activations:
        offload += offload_pcie_seconds(offloaded_bytes * grad_accum, pcie, compute)
    return compute + comm + offload


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def estimate_for(
    shape: ModelShape,
    rung: Strategy,
    hw: Hardware,
    cfg: JobConfig,
    micro: int,
    ac: str,
    memory_scale: float,
    reduce_every_micro: bool | None = False,
    levers: Levers = NO_LEVERS,
) -> Estimate:
    """The estimate of one candidate: this rung at this micro-batch, checkpointing and levers,
    with the global batch's accumulation; device bytes scaled by a measured `memory_scale`."""
    est = estimate(
        shape,
        strategy=rung.name,
        world_size=hw.world_size,
        devices_per_node=hw.devices_per_node,
        micro_batch_size=micro,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=ac,
        precision=cfg.precision,
        device=hw.device,
        grad_accum=max(1, cfg.train.global_batch_size // (hw.world_size * micro)),
        fsdp_reduce_every_micro_batch=bool(reduce_every_micro),
        chunked_loss=levers.chunked_loss,
        offload_activations=levers.offload_activations,
        loss_chunk_tokens=cfg.memory.loss_chunk_tokens,
        finetune=Finetune.of(cfg),
    )
    if memory_scale == 1.0:
        return est
    scaled = {k: int(v * memory_scale) for k, v in est.device_breakdown.items()}
    return Estimate(
        est.strategy,
        est.world_size,
        est.micro_batch_size,
        est.activation_checkpointing,
        scaled,
        int(est.peak_tensor_bytes * memory_scale),
        int(est.device_total_bytes * memory_scale),
        est.host_breakdown,
        est.host_total_bytes,
        offloaded_bytes=est.offloaded_bytes,
        chunked_loss=est.chunked_loss,
        offload_activations=est.offload_activations,
    )


@dataclass(frozen=True)
class _Candidate:
    rung: Strategy
    micro: int
    ac: str
    estimate: Estimate
    time_s: float
    reduce_every_micro: bool | None = None  # fsdp rungs only
    levers: Levers = NO_LEVERS


def _reduce_variants(rung: Strategy, cfg: JobConfig) -> tuple[bool | None, ...]:
    """FSDP's gradient accumulation: unsharded under no-sync (False) or sharded, reducing after
    every micro-batch (True); both are tried under `fsdp.reduce_every_micro_batch: auto`. Other
    rungs have no such choice (None)."""
    if rung.engine != "fsdp":
        return (None,)
    chosen = cfg.fsdp.reduce_every_micro_batch
    return (False, True) if chosen == "auto" else (chosen,)


def best_for_rung(shape, rung, hw, cfg, per_rank, memory_scale) -> tuple[_Candidate | None, str]:
    micros = _divisors_desc(per_rank)
    if isinstance(cfg.train.micro_batch_size, int):
        micros = [cfg.train.micro_batch_size]
    acs = AC_LEVELS
    if cfg.memory.activation_checkpointing != "auto":
        acs = (cfg.memory.activation_checkpointing,)
    best: _Candidate | None = None
    smallest: Estimate | None = None
    levers = lever_variants(cfg.memory.chunked_loss, cfg.memory.offload_activations, hw.device)
    for every, ac, lev in itertools.product(_reduce_variants(rung, cfg), acs, levers):
        for micro in micros:
            est = estimate_for(shape, rung, hw, cfg, micro, ac, memory_scale, every, lev)
            if smallest is None or est.device_total_bytes < smallest.device_total_bytes:
                smallest = est
            if not est.fits(hw, cfg.memory.headroom):
                continue
            t = step_time_s(shape, rung, hw, cfg, micro, ac, every, lev, est.offloaded_bytes)
            if best is None or t < best.time_s:
                best = _Candidate(rung, micro, ac, est, t, every, lev)
            break  # smaller micro-batches at this checkpointing level are only slower
    why = "" if best else (smallest.why_not(hw, cfg.memory.headroom) or "does not fit")
    return best, why


def make_plan(
    cfg: JobConfig,
    hw: Hardware,
    shape: ModelShape | None = None,
    *,
    exclude: tuple[str, ...] | list[str] = (),
    memory_scale: float = 1.0,
) -> Plan:
    """The plan for this job on this hardware (raises NoFitError or ConfigError)."""
    shape = with_activations(shape or model_shape(cfg.model), cfg)
    per_rank = _per_rank_batch(cfg, hw)
    forced = cfg.strategy if cfg.strategy != "auto" else None
    rungs = [r for r in strategies.rows() if not forced or r.name == forced]
    candidates, rejected = _walk_ladder(rungs, shape, hw, cfg, per_rank, exclude, memory_scale)
    if forced and not candidates:
        if rejected and " rank" in (rejected[0].why_not or ""):
            raise ConfigError("strategy", f"{forced} {rejected[0].why_not}", "pick another rung")
        if forced in exclude:
            raise NoFitError(f"strategy {forced} ran out of memory and is forced by the config")
        return _forced_plan(cfg, hw, shape, forced, per_rank, rejected, memory_scale)
    if not candidates:
        changes = method_alternatives(cfg, hw, shape, exclude, memory_scale)
        raise NoFitError(_what_would_fit(cfg, hw, shape, rejected, changes), changes)
    ranked = _rank(candidates)
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
    return Plan(
        strategy=chosen.rung.name,
        world_size=hw.world_size,
        nodes=hw.nodes,
        devices_per_node=hw.devices_per_node,
        micro_batch_size=chosen.micro,
        grad_accum=per_rank // chosen.micro,
        activation_checkpointing=chosen.ac,
        estimate=chosen.estimate,
        step_time_s=chosen.time_s,
        reasons=_reasons(cfg, hw, ranked, memory_scale) + _model_reasons(shape),
        alternatives=alternatives,
        fsdp_reduce_every_micro_batch=chosen.reduce_every_micro,
        levers=chosen.levers,
    )


def _per_rank_batch(cfg: JobConfig, hw: Hardware) -> int:
    """Sequences per rank per optimizer step; the global batch must split evenly."""
    world = hw.world_size
    gbs = cfg.train.global_batch_size
    if gbs % world:
        fits = [m * world for m in range(max(1, gbs // world), gbs // world + 3)]
        raise ConfigError(
            "train.global_batch_size",
            f"{gbs} sequences cannot be split evenly over {world} ranks",
            f"use a multiple of {world} (e.g. {', '.join(map(str, fits))})",
        )
    per_rank = gbs // world
    if isinstance(cfg.train.micro_batch_size, int) and per_rank % cfg.train.micro_batch_size:
        raise ConfigError(
            "train.micro_batch_size",
            f"{cfg.train.micro_batch_size} does not divide the {per_rank} sequences per rank "
            f"({gbs} over {world} ranks)",
            f"use one of {', '.join(map(str, sorted(_divisors_desc(per_rank))))} or auto",
        )
    return per_rank


def _walk_ladder(rungs, shape, hw, cfg, per_rank, exclude, memory_scale):
    """Each rung's best fitting candidate, and why the others were turned down."""
    candidates: list[_Candidate] = []
    rejected: list[Alternative] = []
    for rung in rungs:
        why = _why_not_tried(rung, hw, cfg, exclude)
        if why is None:
            best, why = best_for_rung(shape, rung, hw, cfg, per_rank, memory_scale)
            if best is not None:
                candidates.append(best)
                continue
        rejected.append(Alternative(rung.name, False, why, None))
    return candidates, rejected


def _why_not_tried(rung: Strategy, hw: Hardware, cfg: JobConfig, exclude) -> str | None:
    if rung.name in exclude:
        return "ran out of memory in this run"
    if rung_world(rung, hw) is None:
        need = f"{rung.min_world}+ ranks" if rung.max_world is None else "exactly 1 rank"
        return f"needs {need}, has {hw.world_size}"
    if rung.needs_nvme and not cfg.deepspeed.nvme_path:
        return "needs deepspeed.nvme_path"
    return why_not_on(rung, Finetune.of(cfg))


def _rank(candidates: list[_Candidate]) -> list[_Candidate]:
    """Fastest first, except that a rung earlier on the ladder within SIMPLER_RUNG_MARGIN of
    the fastest goes first (the cost model ranks coarsely; earlier rungs are simpler)."""
    ranked = sorted(candidates, key=lambda cand: cand.time_s)  # stable: ladder order on ties
    fastest = ranked[0]
    ladder = strategies.names()
    chosen = min(
        (c for c in ranked if c.time_s <= fastest.time_s * (1 + SIMPLER_RUNG_MARGIN)),
        key=lambda cand: ladder.index(cand.rung.name),
    )
    ranked.remove(chosen)
    return [chosen, *ranked]


def _reasons(cfg: JobConfig, hw: Hardware, ranked: list[_Candidate], memory_scale: float):
    """The plan's reasons, in words: what fits, the batch geometry, why this rung."""
    chosen, world = ranked[0], hw.world_size
    per_rank = cfg.train.global_batch_size // world
    est = chosen.estimate
    reasons = [
        f"{chosen.rung.name} fits: {est.device_total_bytes / GIB:.1f} GiB of "
        f"{hw.device_memory_bytes / GIB:.1f} GiB per device (headroom {cfg.memory.headroom:.0%})"
        f", {est.host_total_bytes / GIB:.1f} GiB of {hw.host_memory_bytes / GIB:.0f}"
        " GiB host per node",
        f"micro-batch {chosen.micro} x accumulation {per_rank // chosen.micro} x {world} ranks = "
        f"global batch {cfg.train.global_batch_size}; activation checkpointing {chosen.ac}",
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
    if memory_scale != 1.0:
        reasons.append(f"estimates scaled by {memory_scale:.2f} from a measured out-of-memory")
    return reasons


def _model_reasons(shape: ModelShape) -> list[str]:
    """How the model's activations and compute were counted, where not by the analytic block."""
    reasons = []
    if shape.activations is not None:
        reasons.append(shape.activations.reason(shape.model_type))
    if shape.num_experts:
        reasons.append(
            f"mixture of experts: {shape.num_experts} experts per MoE layer, top-"
            f"{shape.experts_per_token} routing; memory counts every expert's parameters and "
            f"states, activations the {shape.experts_per_token} expert rows of every token "
            "(transformers' grouped experts keep tokens x top-k rows whatever the router picks, "
            "so no routing is worse), compute the "
            f"{shape.num_compute_params / 1e6:,.1f}M parameters a token uses of "
            f"{shape.num_params / 1e6:,.1f}M"
        )
    return reasons


def _lever_reason(chosen: _Candidate, ranked: list[_Candidate]) -> str:
    """Why the exact levers in force: what they hold off the device, and their price."""
    parts = []
    if chosen.levers.chunked_loss:
        parts.append(
            "chunked loss (the logits of one chunk of tokens at a time; the head's "
            "forward runs again in backward)"
        )
    if chosen.levers.offload_activations:
        parts.append(
            f"activation offload ({chosen.estimate.offloaded_bytes / GIB:.2f} GiB of saved "
            "activations per micro-batch wait in host memory; the copies overlap compute)"
        )
    return (
        " and ".join(parts) + f": the fastest fitting combination on {chosen.rung.name} "
        f"(micro-batch {chosen.micro}, activation checkpointing {chosen.ac})"
    )


def _forced_plan(cfg, hw, shape, name, per_rank, rejected, memory_scale) -> Plan:
    """`strategy: NAME` that the estimate says will not fit: run it anyway, smallest footprint."""
    rung = strategies.row(name)
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1
    ac = cfg.memory.activation_checkpointing
    ac = "full" if ac == "auto" else ac
    every = _reduce_variants(rung, cfg)[-1]  # the smaller footprint
    levers = smallest_levers(cfg.memory.chunked_loss, cfg.memory.offload_activations)
    est = estimate_for(shape, rung, hw, cfg, micro, ac, memory_scale, every, levers)
    changes = (
        []
        if est.fits(hw, cfg.memory.headroom)
        else method_alternatives(cfg, hw, shape, (), memory_scale)
    )
    return Plan(
        strategy=name,
        world_size=hw.world_size,
        nodes=hw.nodes,
        devices_per_node=hw.devices_per_node,
        micro_batch_size=micro,
        grad_accum=per_rank // micro,
        activation_checkpointing=ac,
        estimate=est,
        step_time_s=step_time_s(
            shape, rung, hw, cfg, micro, ac, every, levers, est.offloaded_bytes
        ),
        reasons=[
            f"strategy {name} is forced by the config, but the estimate says it will not fit: "
            f"{est.why_not(hw, cfg.memory.headroom)}",
            *_model_reasons(shape),
            *(alt.words() for alt in changes),
        ],
        alternatives=[*rejected, *changes],
        fsdp_reduce_every_micro_batch=every,
        levers=levers,
    )


def _what_would_fit(cfg: JobConfig, hw: Hardware, shape: ModelShape, rejected, changes) -> str:
    """One line: the host RAM, or the number of devices, with which the job would fit; then
    the opt-in method/optimizer `changes` that would fit here."""
    per_rank = cfg.train.global_batch_size // hw.world_size
    base = (
        f"does not fit on {hw.world_size} x {hw.device_memory_bytes / GIB:.0f} GiB "
        f"{hw.device} with {hw.host_memory_bytes / GIB:.0f} GiB host memory per node on any "
        "strategy"
    )
    offers = []
    host_offload = [r for r in strategies.rows() if r.engine == "deepspeed" and r.offloads]
    for rung in [r for r in host_offload if not r.needs_nvme]:
        name = rung.name
        est = estimate_for(shape, rung, hw, cfg, 1, "full", 1.0)
        device_ok = est.device_total_bytes <= hw.device_memory_bytes * (1 - cfg.memory.headroom)
        if device_ok and per_rank >= 1:
            need = est.host_total_bytes / (1 - cfg.memory.headroom)
            offers.append(f"{name} would fit with {need / GIB:.0f} GiB host memory per node")
            break
    fsdp = next(r for r in strategies.rows() if r.engine == "fsdp" and not r.offloads)
    for world_mult in (2, 4, 8, 16, 32, 64, 128):
        bigger = Hardware(
            hw.device,
            hw.nodes * world_mult,
            hw.devices_per_node,
            hw.device_memory_bytes,
            hw.host_memory_bytes,
            hw.device_name,
            hw.peak_flops,
        )
        if cfg.train.global_batch_size % bigger.world_size:
            continue
        est = estimate_for(shape, fsdp, bigger, cfg, 1, "full", 1.0, True)
        if est.fits(bigger, cfg.memory.headroom):
            offers.append(
                f"{fsdp.name} would fit on {bigger.world_size} such devices "
                f"({bigger.nodes} nodes x {bigger.devices_per_node})"
            )
            break
    offers += [alt.words() for alt in changes]
    return base + ("; " + "; or ".join(offers) if offers else "")


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
                    "chunked_loss": plan.levers.chunked_loss,
                    "offload_activations": plan.levers.offload_activations,
                }
            ),
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
