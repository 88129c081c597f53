"""What a job that fits nowhere could change to fit: 8-bit optimizer states, bf16 weights
without an fp32 master (and the step in backward), LoRA or QLoRA. These change what is learned,
so the planner never turns them on: it names them, in the exit-3 line, in a forced plan's
reasons and as `plan --json`'s `alternatives` (entries with a `change` and its `overrides`),
each with the rung it would run on and its memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.estimate.shape import ModelShape
from launcher.plan.hardware import Hardware
from launcher.plan.ladder import climb
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig, apply_overrides, build_config
from trainer.core.units import GIB, size_words

# The opt-in changes, least change to what is learned first: 8-bit moments and bf16 weights
# (with the step in backward where gradients must not all exist at once) still train every
# weight; LoRA trains adapters on the 16-bit base; QLoRA on a 4-bit base. Each is a set of
# KEY=VALUE overrides that `oomless plan` accepts as they are.
IN_BACKWARD = "train.optimizer_in_backward"
OPT_INS: tuple[dict[str, Any], ...] = (
    {"train.optimizer": "adamw_8bit"},
    {"precision": "bf16_pure"},
    {"precision": "bf16_pure", "train.optimizer": "adamw_8bit"},
    {"precision": "bf16_pure", IN_BACKWARD: True},
    {"precision": "bf16_pure", "train.optimizer": "adamw_8bit", IN_BACKWARD: True},
    {"precision": "bf16_pure", "train.optimizer": "paged_adamw_8bit", IN_BACKWARD: True},
    {"finetune.method": "lora"},
    {"finetune.method": "lora", "train.optimizer": "adamw_8bit"},
    {"finetune.method": "qlora"},
    {"finetune.method": "qlora", "train.optimizer": "adamw_8bit"},
)
METHOD_ORDER = ("full", "lora", "qlora")
OPTIMIZER_ORDER = ("adamw", "adamw_8bit", "paged_adamw_8bit")


@dataclass(frozen=True)
class MethodAlternative:
    """A change of `finetune.method` / `train.optimizer` with which the job fits, and where."""

    change: str  # "finetune.method=lora" (several joined by " and ")
    overrides: tuple[str, ...]
    strategy: str
    world_size: int
    micro_batch_size: int
    activation_checkpointing: str
    device_peak_bytes: int  # peak tensor bytes
    device_total_bytes: int
    host_total_bytes: int
    device_memory_bytes: int
    fits: bool = True

    def words(self) -> str:
        where = self.strategy + (f" x{self.world_size}" if self.world_size > 1 else "")
        return (
            f"{self.change} would fit on {where} ({self.device_total_bytes / GIB:.1f} GiB of "
            f"{size_words(self.device_memory_bytes)})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "change": self.change,
            "overrides": list(self.overrides),
            "strategy": self.strategy,
            "world_size": self.world_size,
            "fits": self.fits,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "device_peak_bytes": self.device_peak_bytes,
            "device_total_bytes": self.device_total_bytes,
            "host_total_bytes": self.host_total_bytes,
        }


def _levels(cfg: JobConfig) -> tuple[int, int, int, int]:
    """How far a config is from full fine-tuning in mixed precision with AdamW, per opt-in."""
    return (
        METHOD_ORDER.index(cfg.finetune.method),
        OPTIMIZER_ORDER.index(cfg.train.optimizer),
        int(cfg.precision == "bf16_pure"),
        int(cfg.train.optimizer_in_backward),
    )


def _at_least(levels: tuple[int, ...], than: tuple[int, ...]) -> bool:
    """`levels` changes at least as much as `than`, in every opt-in."""
    return all(a >= b for a, b in zip(levels, than, strict=True))


def _overrides(cfg: JobConfig, opt_in: dict[str, Any]) -> tuple[str, ...]:
    """The KEY=VALUE overrides that turn `cfg` into `opt_in` (the step in backward cannot clip
    by the global gradient norm: it turns clipping off too)."""
    now = cfg.to_dict()
    out = []
    for key, value in opt_in.items():
        section, _, leaf = key.rpartition(".")
        current = now[section][leaf] if section else now[key]
        if current != value:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    if opt_in.get(IN_BACKWARD) and cfg.train.grad_clip > 0 and out:
        out.append("train.grad_clip=0")
    return tuple(out)


def method_alternatives(
    cfg: JobConfig,
    hw: Hardware,
    shape: ModelShape,
    exclude: tuple[str, ...] | list[str] = (),
    memory_scale: float = 1.0,
) -> list[MethodAlternative]:
    """The opt-in changes with which this job fits on this hardware, each on the rung the
    planner would pick for it; a change is left out when a smaller one fits."""
    forced = cfg.strategy if cfg.strategy != "auto" else None
    rungs = [r for r in strategies.rows() if not forced or r.name == forced]
    now = _levels(cfg)
    found: list[MethodAlternative] = []
    fitting: list[tuple[int, ...]] = []
    for opt_in in OPT_INS:
        overrides = _overrides(cfg, opt_in)
        if not overrides:
            continue
        try:  # validated as `oomless plan` would: what it refuses is no alternative
            changed = build_config(apply_overrides(cfg.to_dict(), list(overrides)))
        except ConfigError:
            continue
        levels = _levels(changed)
        if not _at_least(levels, now) or any(_at_least(levels, f) for f in fitting):
            continue
        try:
            ranked = climb(changed, hw, shape, rungs, exclude, memory_scale).ranked
        except ConfigError:  # e.g. target modules this model does not have
            continue
        if not ranked:
            continue
        best = ranked[0]
        fitting.append(levels)
        found.append(
            MethodAlternative(
                change=" and ".join(overrides),
                overrides=overrides,
                strategy=best.rung.name,
                world_size=hw.world_size,
                micro_batch_size=best.micro,
                activation_checkpointing=best.ac,
                device_peak_bytes=best.estimate.peak_tensor_bytes,
                device_total_bytes=best.estimate.device_total_bytes,
                host_total_bytes=best.estimate.host_total_bytes,
                device_memory_bytes=hw.device_memory_bytes,
            )
        )
    return found
