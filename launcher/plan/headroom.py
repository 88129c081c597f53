"""What the planner leaves free beyond the estimate: `plan.headroom` (docs/planner.md).

The estimate already holds the allocator's reserve (launcher/estimate/peak.py, measured by a
launch probe once one ran on this hardware), so the headroom is not a second reserve: it covers
what no estimate sees. `auto`: 10% of device and host memory; 5% of the device once a probe of
this hardware, rung and model family calibrated the estimate's runtime overhead. A number: that
share of both, as the user asks. Slurm's `--mem` and the TrainJob's memory take the host's share.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.core.config import JobConfig

AUTO_HEADROOM = 0.10
CALIBRATED_DEVICE_HEADROOM = 0.05


@dataclass(frozen=True)
class Headroom:
    fraction: float  # of device and host memory; under auto, of an uncalibrated device
    auto: bool = True

    def device(self, calibrated: bool) -> float:
        """The device's share, for an estimate calibrated by a probe or not."""
        return CALIBRATED_DEVICE_HEADROOM if self.auto and calibrated else self.fraction

    @property
    def host(self) -> float:
        return self.fraction

    def words(self, calibrated: bool) -> str:
        device, how = self.device(calibrated), "auto" if self.auto else "plan.headroom"
        if device == self.host:
            return f"{device:.0%} of device and host memory left free ({how})"
        return f"{device:.0%} of device and {self.host:.0%} of host memory left free ({how})"


def plan_headroom(cfg: JobConfig) -> Headroom:
    """`plan.headroom` (or its old name `memory.headroom`) as the planner uses it."""
    value = cfg.plan.headroom
    if value == "auto":
        return Headroom(AUTO_HEADROOM)
    return Headroom(float(value), auto=False)


def as_headroom(headroom: Headroom | float) -> Headroom:
    """A bare fraction (tests, benches) is that share of both."""
    return headroom if isinstance(headroom, Headroom) else Headroom(float(headroom), auto=False)
