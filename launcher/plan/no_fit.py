"""What a job that fits on no rung would fit with: the exit-3 line (docs/interface.md).

Each offer is one the planner would accept as it stands: a host memory size is rounded up at
the precision it is printed with, and where CPU processes share the host's memory (no
`hardware.device_memory` in the config) the size covers the device's share too. Something is
always offered while anything would fit: more host memory, more devices, flash attention, the
opt-in method/optimizer changes, and only then a shorter sequence.
"""

from __future__ import annotations

from launcher.estimate.methods import why_not_on
from launcher.estimate.peak import Estimate
from launcher.estimate.shape import ModelShape
from launcher.plan.alternatives import MethodAlternative
from launcher.plan.hardware import Hardware
from launcher.plan.headroom import plan_headroom
from launcher.plan.ladder import climb, job_step, scaled_estimate, shortfall
from launcher.plan.long_context import (
    attention_choices,
    climb_long,
    longest_sequences,
    mask_words,
    with_attention,
    with_flash_attention,
)
from trainer.core import strategies
from trainer.core.config import JobConfig
from trainer.core.step_spec import Finetune
from trainer.core.strategies import Strategy
from trainer.core.units import size_words

DEVICE_MULTIPLES = (2, 4, 8, 16, 32, 64, 128)


def what_would_fit(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, changes: list[MethodAlternative]
) -> str:
    """One line: the hardware it was planned for, then the host memory or the number of devices
    with which the job would fit, then the opt-in method/optimizer `changes` that would fit
    here."""
    cfg = with_attention(cfg, attention_choices(cfg, hw, shape)[-1])  # `auto`: the one it would use
    per_rank = cfg.train.global_batch_size // hw.world_size
    base = (
        f"does not fit on {hw.world_size} x {size_words(hw.device_memory_bytes)} {hw.device} "
        f"with {size_words(hw.host_memory_bytes)} host memory per node on any strategy"
    )
    finetune = Finetune.of(cfg)
    runs = [r for r in strategies.rows() if why_not_on(r, finetune, cfg.precision) is None]
    more_memory = _more_memory(cfg, hw, shape, runs)
    offers = [o for o in more_memory if "per device" not in o]  # host memory: cheap to add
    offers += _more_devices(cfg, hw, shape, runs)
    if finetune.in_backward:
        offers.append(_without_step_in_backward(cfg, hw, shape, per_rank))
    offers += _with_varlen_attention(cfg, hw, shape)
    offers += [alt.words() for alt in changes]
    if not offers:  # a shorter sequence is a change of what is learned: only when nothing else
        rungs = [r for r in runs if not r.needs_nvme]
        offers += longest_sequences(cfg, hw, shape, rungs, _smallest_micro(cfg, hw.world_size))
    if not offers:  # larger devices: the last resort, and always something said
        offers += more_memory
    return base + ("; " + "; or ".join(offers) if offers else "")


def _smallest_micro(cfg: JobConfig, world: int) -> int:
    """The step in backward runs one micro-batch per step; otherwise one sequence."""
    in_backward = cfg.train.optimizer_in_backward
    return max(1, cfg.train.global_batch_size // world) if in_backward else 1


def _more_memory(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, runs: list[Strategy]
) -> list[str]:
    """The least memory with which a rung would fit at its smallest footprint (one sequence a
    micro-batch, every layer recomputed), rounded up as printed: host memory per node where
    that is all it takes, else device memory too. CPU processes that share the host (no
    hardware.device_memory given) take their share of the host memory as device memory."""
    keep = 1 - plan_headroom(cfg).fraction
    shared = hw.device == "cpu" and cfg.hardware.device_memory is None
    if cfg.train.global_batch_size < hw.world_size:
        return []
    needs = []  # (device too small, device bytes, host bytes, rung)
    for rung in runs:
        if rung.needs_nvme or rung.min_world > hw.world_size:
            continue
        if rung.max_world is not None and hw.world_size > rung.max_world:
            continue
        spec = job_step(cfg, hw, rung, _smallest_micro(cfg, hw.world_size), "full")
        est = scaled_estimate(shape, spec, 1.0)
        device, host = est.device_total_bytes / keep, est.host_total_bytes / keep
        if shared:
            host = max(host, device * hw.devices_per_node)
        small = not shared and device > hw.device_memory_bytes
        needs.append((small, device if small else 0.0, host, rung.name))
    if not needs:
        return []
    small, device, host, name = min(needs)
    host_words = f"{size_words(host, up=True)} host memory per node"
    if shared:
        return [f"{name} would fit with {host_words} (the {hw.device} processes' share included)"]
    if small:
        more_host = f" and {host_words}" if host > hw.host_memory_bytes else ""
        return [f"{name} would fit with {size_words(device, up=True)} per device{more_host}"]
    return [f"{name} would fit with {host_words}"]


def _more_devices(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, runs: list[Strategy]
) -> list[str]:
    """The fewest devices of this kind (in whole nodes) on which FSDP would fit."""
    fsdp = next(r for r in strategies.rows() if r.engine == "fsdp" and not r.offloads)
    if fsdp not in runs:
        return []
    for multiple in DEVICE_MULTIPLES:
        bigger = Hardware(
            hw.device,
            hw.nodes * multiple,
            hw.devices_per_node,
            hw.device_memory_bytes,
            hw.host_memory_bytes,
            hw.device_name,
            hw.peak_flops,
        )
        if cfg.train.global_batch_size % bigger.world_size:
            continue
        micro = _smallest_micro(cfg, bigger.world_size)
        spec = job_step(cfg, bigger, fsdp, micro, "full", reduce_every_micro=True)
        if shortfall(scaled_estimate(shape, spec, 1.0), bigger, plan_headroom(cfg)) is None:
            return [
                f"{fsdp.name} would fit on {bigger.world_size} such devices "
                f"({bigger.nodes} nodes x {bigger.devices_per_node})"
            ]
    return []


def _fits_words(name: str, est: Estimate, hw: Hardware) -> str:
    return f"{name} ({size_words(est.device_total_bytes)} of {size_words(hw.device_memory_bytes)})"


def _with_varlen_attention(cfg: JobConfig, hw: Hardware, shape: ModelShape) -> list[str]:
    """Flash attention, where it makes the job fit (see `with_flash_attention`)."""
    flash = with_flash_attention(cfg, hw)
    if flash is None:
        return []
    rungs = [r for r in strategies.rows() if cfg.strategy in ("auto", r.name)]
    climbed, _, _, _ = climb_long(flash, hw, shape, rungs)
    if not climbed.ranked:
        return []
    best = climbed.ranked[0]
    return [
        "model.attn_implementation=flash_attention_2 would fit on "
        f"{_fits_words(best.rung.name, best.estimate, hw)}: "
        + mask_words(cfg.model.attn_implementation)
    ]


def _without_step_in_backward(
    cfg: JobConfig, hw: Hardware, shape: ModelShape, per_rank: int
) -> str:
    """What `train.optimizer_in_backward` costs this job, and where it fits without it."""
    why = (
        "train.optimizer_in_backward allows no accumulation, so each rank's "
        f"{per_rank} sequences are one micro-batch"
    )
    train = cfg.train.model_copy(update={"optimizer_in_backward": False})
    without = cfg.model_copy(update={"train": train})
    rungs = [r for r in strategies.rows() if cfg.strategy in ("auto", r.name)]
    ranked = climb(without, hw, shape, rungs).ranked
    if not ranked:
        return why
    best = ranked[0]
    where = _fits_words(best.rung.name, best.estimate, hw)
    return f"train.optimizer_in_backward=false would fit on {where}: {why}"
