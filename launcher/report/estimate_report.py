"""`oomless estimate`: memory per device and per host for every strategy, as a table or JSON.

`--trace` (calibration) also runs one real step of the engine under FakeTensorMode for the rows it
can trace (`launcher/estimate/trace.py`: single, fsdp) and prints traced and analytic peaks side by
side.

A forced `parallel.expert` above 1 is estimated as one rank of that split holds it
(launcher/estimate/expert_split.py), on the rungs that take one, as the planner would run it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from launcher.estimate.activations import with_activations
from launcher.estimate.expert_split import dispatch_reason
from launcher.estimate.methods import why_not_on
from launcher.estimate.peak import Estimate, estimate
from launcher.estimate.shape import ModelShape, model_shape
from launcher.plan.hardware import Hardware, detect_hardware
from launcher.plan.headroom import plan_headroom
from launcher.plan.job import check_device_features
from launcher.plan.ladder import best_for_rung, job_step, rung_world, shortfall
from launcher.plan.planner import model_reasons
from launcher.plan.splits import sequence_parallel_sizes
from trainer.core import strategies
from trainer.core.config import JobConfig
from trainer.core.hf_config import hf_config_dict
from trainer.core.parallel_dims import ParallelDims, check_expert_parallel
from trainer.core.step_spec import Finetune, Levers, smallest_levers
from trainer.core.units import GIB, MIB


def estimate_command(cfg: JobConfig, as_json: bool, trace: bool) -> int:
    hw = detect_hardware(cfg.hardware)
    check_device_features(cfg, hw)
    shape = with_activations(forced_expert_split(cfg, hw, model_shape(cfg.model)), cfg)
    sequence_parallel_sizes(cfg, hw, shape)  # a forced split that cannot run: exit 2 here
    rows = estimates_for(cfg, hw, shape)
    traced = traces_for(cfg, hw, rows, shape) if trace else {}
    if as_json:
        out = to_json(shape, hw, rows, plan_headroom(cfg))
        for entry, row in zip(out["strategies"], rows, strict=True):
            if row.strategy in traced:
                entry["trace"] = traced[row.strategy]
        print(json.dumps(out, indent=2))
    else:
        print(render(shape, hw, rows, cfg))
        if trace:
            print(render_traces(rows, traced))
    return 0


def forced_expert_split(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> ModelShape:
    """`shape` split over the config's forced expert degree (checked on the ranks found: exit 2
    naming the degrees that run); unchanged under `auto` or 1, which the estimate keeps whole."""
    ep = cfg.parallel.expert
    if not isinstance(ep, int) or ep == 1:
        return shape
    check_expert_parallel(ParallelDims(hw.world_size, 1, 1, ep), shape.num_experts)
    return replace(shape, expert_parallel=ep)


def traces_for(
    cfg: JobConfig, hw: Hardware, rows: list[Estimate], shape: ModelShape
) -> dict[str, dict[str, Any]]:
    """Trace one step of every traceable row at its micro-batch and checkpointing, under the
    shape's expert split; the analytic peak next to it is recomputed for the same accumulation
    (1, or 2 standing for any more)."""
    from launcher.estimate.trace import trace_step, traceable

    hf_config = hf_config_dict(cfg.model.config, cfg.model.name_or_path)
    per_rank = max(1, cfg.train.global_batch_size // hw.world_size)
    finetune = Finetune.of(cfg)
    out = {}
    for row in rows:
        if not traceable(row.strategy, finetune):
            continue
        grad_accum = 2 if per_rank > row.micro_batch_size else 1
        rung = strategies.row(row.strategy)
        levers = Levers(row.chunked_loss, row.offload_activations)
        step = job_step(cfg, hw, rung, row.micro_batch_size, row.activation_checkpointing,
                        levers=levers)  # fmt: skip
        # torch.compile does not run under the tracker: the layers are traced, and compared,
        # eager (what compile saves less is checked against torch's partitioner in the tests)
        spec = replace(step, grad_accum=grad_accum, compiled_layers=False)
        traced = trace_step(hf_config, spec, attn_implementation=cfg.model.attn_implementation,
                            expert=shape.expert_parallel)  # fmt: skip
        analytic = estimate(shape, spec)
        out[row.strategy] = {
            "grad_accum": grad_accum,
            "analytic_peak_tensor_bytes": analytic.peak_tensor_bytes,
            "traced_peak_tensor_bytes": traced.peak_bytes,
            "traced_breakdown": traced.breakdown,
        }
    return out


def render_traces(rows: list[Estimate], traced: dict[str, dict[str, Any]]) -> str:
    lines = [
        "traced (one step under FakeTensorMode; QLoRA and adamw_8bit: run for real on CPU) vs "
        "analytic peak tensor bytes, MiB per device:",
        f"{'strategy':<22}{'micro':>6} {'ckpt':<10}{'accum':>6}{'traced':>9}{'analytic':>10}"
        f"{'error':>8}",
    ]
    for r in rows:
        t = traced.get(r.strategy)
        if t is None:
            covers = "single, fsdp and stream"
            lines.append(f"{r.strategy:<22}  not traceable (--trace covers {covers})")
            continue
        tb, ab = t["traced_peak_tensor_bytes"], t["analytic_peak_tensor_bytes"]
        lines.append(
            f"{r.strategy:<22}{r.micro_batch_size:>6} {r.activation_checkpointing:<10}"
            f"{t['grad_accum']:>6}{tb / MIB:9.1f}{ab / MIB:10.1f}{(ab - tb) / tb:+8.1%}"
        )
    return "\n".join(lines)


def estimates_for(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[Estimate]:
    """One estimate per strategy runnable on this world size: the config's micro-batch and
    checkpointing where concrete, else what the planner would choose (or its smallest footprint
    when nothing fits). Under an expert split, only the rungs that run one."""
    per_rank = max(1, cfg.train.global_batch_size // hw.world_size)
    out = []
    for rung in strategies.rows():
        forced_other = cfg.strategy not in ("auto", rung.name)
        if forced_other or rung_world(rung, hw) is None:
            continue
        if shape.expert_parallel > 1 and not rung.expert_parallel:
            continue
        if why_not_on(rung, Finetune.of(cfg), cfg.precision) is not None:  # cannot run the method
            continue
        best, _ = best_for_rung(shape, rung, hw, cfg, per_rank, 1.0)
        if best is not None:
            out.append(best.estimate)
            continue
        micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1
        ac = cfg.memory.activation_checkpointing
        levers = smallest_levers(cfg.memory.chunked_loss, cfg.memory.offload_activations)
        ac = "full" if ac == "auto" else ac
        every = rung.engine == "fsdp" and cfg.fsdp.reduce_every_micro_batch is not False
        spec = job_step(cfg, hw, rung, micro, ac, reduce_every_micro=every, levers=levers)
        out.append(estimate(shape, spec))
    return out


def to_json(shape: ModelShape, hw: Hardware, rows: list[Estimate], headroom: float) -> dict:
    """docs/interface.md's `oomless estimate --json`."""
    return {
        "model": {
            "params": shape.num_params,
            "layers": shape.num_layers,
            "hidden_size": shape.hidden_size,
            "vocab_size": shape.vocab_size,
            **model_notes(shape),
        },
        "hardware": {
            "device": hw.device,
            "nodes": hw.nodes,
            "devices_per_node": hw.devices_per_node,
            "device_memory_bytes": hw.device_memory_bytes,
            "host_memory_bytes": hw.host_memory_bytes,
        },
        "strategies": [r.to_json(shortfall(r, hw, headroom) is None) for r in rows],
    }


def render(shape: ModelShape, hw: Hardware, rows: list[Estimate], cfg: JobConfig) -> str:
    def gib(n: int) -> str:
        return f"{n / GIB:7.1f}"

    head = (
        f"{shape.model_type}, {shape.num_params / 1e9:.2f}B params, {shape.num_layers} layers; "
        f"seq {cfg.data.seq_len}, {cfg.precision}; "
        + (f"expert parallel {shape.expert_parallel}; " if shape.expert_parallel > 1 else "")
        + (
            f"{cfg.objective.type}: micro counts pairs (2 sequences); "
            if cfg.objective.preference
            else ""
        )
        + f"{hw.nodes} node(s) x {hw.devices_per_node} "
        f"{hw.device} of {hw.device_memory_bytes / GIB:.0f} GiB, host "
        f"{hw.host_memory_bytes / GIB:.0f} GiB per node (GiB below, per device unless host)"
    )
    cols = f"{'strategy':<22}{'micro':>6} {'ckpt':<10}{'params':>8}{'grads':>8}{'optim':>8}"
    cols += f"{'activ':>8}{'temp':>8}{'overhd':>8}{'DEVICE':>8}{'HOST':>8}  fits  levers"
    lines = [head, *(f"  {note}" for note in model_notes(shape).get("notes", [])), cols]
    for r in rows:
        b: dict[str, Any] = r.device_breakdown
        fits = "yes" if shortfall(r, hw, plan_headroom(cfg)) is None else "no"
        lines.append(
            f"{r.strategy:<22}{r.micro_batch_size:>6} {r.activation_checkpointing:<10}"
            f"{gib(b['params'])} {gib(b['grads'])} {gib(b['optimizer'])} "
            f"{gib(b['activations'])} {gib(b['temporary'])} {gib(b['runtime_overhead'])} "
            f"{gib(r.device_total_bytes)} {gib(r.host_total_bytes)}  {fits:<4}  {_levers(r)}"
        )
    return "\n".join(lines)


def model_notes(shape: ModelShape) -> dict[str, Any]:
    """How this model's activations and compute are counted, where not by the analytic block:
    the activations' source (traced / bound) and, for MoE models, experts, active params and
    the expert degree estimated (a forced split's bound in the notes)."""
    out: dict[str, Any] = {}
    if shape.activations is not None:
        out["activations"] = shape.activations.source
    if shape.num_experts:
        out |= {
            "experts": shape.num_experts,
            "experts_per_token": shape.experts_per_token,
            "active_params": shape.num_compute_params,
            "expert_parallel": shape.expert_parallel,
        }
    notes = model_reasons(shape)
    if shape.expert_parallel > 1:
        notes.append(dispatch_reason(shape))
    if notes:
        out["notes"] = notes
    return out


def _levers(r: Estimate) -> str:
    """The exact levers of a row, short: chunked loss, activation offload."""
    on = [n for n, v in (("chunked", r.chunked_loss), ("offload", r.offload_activations)) if v]
    return "+".join(on) or "-"
