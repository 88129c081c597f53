"""What a full fine-tune that fits nowhere could change to fit: 8-bit optimizer states, LoRA or
QLoRA. These change what is learned, so the planner never turns them on: it names them, in the
exit-3 line, in a forced plan's reasons and as `plan --json`'s `alternatives` (entries with a
`change`), each with the rung it would run on and its memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.hardware import Hardware
from launcher.ladder import climb
from launcher.model_shape import ModelShape
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig
from trainer.core.units import GIB

# The opt-in (method, optimizer) pairs, least change to what is learned first: 8-bit moments
# still train every weight; LoRA trains adapters on the 16-bit base; QLoRA on a 4-bit base.
METHOD_ORDER = ("full", "lora", "qlora")
OPTIMIZER_ORDER = ("adamw", "adamw_8bit")
PAIRS = (
    ("full", "adamw_8bit"),
    ("lora", "adamw"),
    ("lora", "adamw_8bit"),
    ("qlora", "adamw"),
    ("qlora", "adamw_8bit"),
)


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
            f"{self.device_memory_bytes / GIB:.0f} GiB)"
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


def _more_or_equal(pair: tuple[str, str], than: tuple[str, str]) -> bool:
    """`pair` changes at least as much as `than`, in both the method and the optimizer."""
    return METHOD_ORDER.index(pair[0]) >= METHOD_ORDER.index(than[0]) and OPTIMIZER_ORDER.index(
        pair[1]
    ) >= OPTIMIZER_ORDER.index(than[1])


def _with(cfg: JobConfig, method: str, optimizer: str) -> JobConfig:
    return cfg.model_copy(
        update={
            "finetune": cfg.finetune.model_copy(update={"method": method}),
            "train": cfg.train.model_copy(update={"optimizer": optimizer}),
        }
    )


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
    now = (cfg.finetune.method, cfg.train.optimizer)
    found: list[MethodAlternative] = []
    fitting: list[tuple[str, str]] = []
    for pair in PAIRS:
        if pair == now or not _more_or_equal(pair, now):
            continue
        if any(_more_or_equal(pair, f) for f in fitting):
            continue
        try:
            changed = _with(cfg, *pair)
            ranked = climb(changed, hw, shape, rungs, exclude, memory_scale).ranked
        except ConfigError:  # e.g. target modules this model does not have
            continue
        if not ranked:
            continue
        best = ranked[0]
        fitting.append(pair)
        overrides = tuple(
            f"{key}={new}"
            for key, new, old in zip(("finetune.method", "train.optimizer"), pair, now, strict=True)
            if new != old
        )
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
