"""`oomless estimate`: memory per device and per host for every strategy, as a table or JSON."""

from __future__ import annotations

import json
from typing import Any

from launcher.config import ConfigError, JobConfig
from launcher.estimate import GIB, STRATEGIES, Estimate, estimate
from launcher.hardware import Hardware, detect_hardware
from launcher.model_shape import ModelShape, model_shape
from launcher.plan import LADDER, _best_for_rung, rung_world


def estimate_command(cfg: JobConfig, as_json: bool, trace: bool) -> int:
    if trace:
        raise ConfigError(
            "--trace", "traced estimates are not available in this version", "drop --trace"
        )
    hw = detect_hardware(cfg.hardware)
    shape = model_shape(cfg.model)
    rows = estimates_for(cfg, hw, shape)
    if as_json:
        print(json.dumps(to_json(shape, hw, rows, cfg.memory.headroom), indent=2))
    else:
        print(render(shape, hw, rows, cfg))
    return 0


def estimates_for(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[Estimate]:
    """One estimate per strategy runnable on this world size: the config's micro-batch and
    checkpointing where concrete, else what the planner would choose (or its smallest footprint
    when nothing fits)."""
    names = STRATEGIES if cfg.strategy == "auto" else (cfg.strategy,)
    per_rank = max(1, cfg.train.global_batch_size // hw.world_size)
    out = []
    for rung in LADDER:
        if rung.name not in names or rung_world(rung, hw) is None:
            continue
        best, _ = _best_for_rung(shape, rung, hw, cfg, per_rank, 1.0)
        if best is not None:
            out.append(best.estimate)
            continue
        micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1
        ac = cfg.memory.activation_checkpointing
        out.append(
            estimate(
                shape,
                strategy=rung.name,
                world_size=hw.world_size,
                devices_per_node=hw.devices_per_node,
                micro_batch_size=micro,
                seq_len=cfg.data.seq_len,
                activation_checkpointing="full" if ac == "auto" else ac,
                precision=cfg.precision,
                device=hw.device,
            )
        )
    return out


def to_json(shape: ModelShape, hw: Hardware, rows: list[Estimate], headroom: float) -> dict:
    """INTERFACE.md's `oomless estimate --json`."""
    return {
        "model": {
            "params": shape.num_params,
            "layers": shape.num_layers,
            "hidden_size": shape.hidden_size,
            "vocab_size": shape.vocab_size,
        },
        "hardware": {
            "device": hw.device,
            "nodes": hw.nodes,
            "devices_per_node": hw.devices_per_node,
            "device_memory_bytes": hw.device_memory_bytes,
            "host_memory_bytes": hw.host_memory_bytes,
        },
        "strategies": [r.to_json(hw, headroom) for r in rows],
    }


def render(shape: ModelShape, hw: Hardware, rows: list[Estimate], cfg: JobConfig) -> str:
    def gib(n: int) -> str:
        return f"{n / GIB:7.1f}"

    head = (
        f"{shape.model_type}, {shape.num_params / 1e9:.2f}B params, {shape.num_layers} layers; "
        f"seq {cfg.data.seq_len}, {cfg.precision}; {hw.nodes} node(s) x {hw.devices_per_node} "
        f"{hw.device} of {hw.device_memory_bytes / GIB:.0f} GiB, host "
        f"{hw.host_memory_bytes / GIB:.0f} GiB per node (GiB below, per device unless host)"
    )
    cols = f"{'strategy':<22}{'micro':>6} {'ckpt':<10}{'params':>8}{'grads':>8}{'optim':>8}"
    cols += f"{'activ':>8}{'temp':>8}{'overhd':>8}{'DEVICE':>8}{'HOST':>8}  fits"
    lines = [head, cols]
    for r in rows:
        b: dict[str, Any] = r.device_breakdown
        fits = "yes" if r.fits(hw, cfg.memory.headroom) else "no"
        lines.append(
            f"{r.strategy:<22}{r.micro_batch_size:>6} {r.activation_checkpointing:<10}"
            f"{gib(b['params'])} {gib(b['grads'])} {gib(b['optimizer'])} "
            f"{gib(b['activations'])} {gib(b['temporary'])} {gib(b['runtime_overhead'])} "
            f"{gib(r.device_total_bytes)} {gib(r.host_total_bytes)}  {fits}"
        )
    return "\n".join(lines)
