"""The job config's `debug` section: faults injected and measurements forced, for tests and
benchmarks; every key is inert unless set (docs/config.md "debug")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainer.core import strategies
from trainer.core.config.base import Section as _Section


class InjectOomConfig(_Section):
    step: int = Field(ge=0)
    rank: int | None = Field(None, ge=0)
    times: int = Field(1, ge=0)
    where: Literal["setup", "forward", "backward", "optimizer", "eval"] = "backward"
    strategies: list[str] | None = None

    @field_validator("strategies")
    @classmethod
    def _known(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if name not in strategies.names():
                raise ValueError(
                    f"unknown strategy '{name}'; use one of {', '.join(strategies.names())}"
                )
        return v


class InjectHangConfig(_Section):
    """`debug.inject_hang`: that rank stops answering collectives at that step (tests only;
    once per run.dir: a restart does not hang again)."""

    step: int = Field(ge=1)  # the optimizer step, counted from 1
    rank: int = Field(0, ge=0)


class SlowRank0Config(_Section):
    """Seconds added to rank 0's serial work (tests of the waiting ranks)."""

    tokenize_s: float = Field(0.0, ge=0)
    checkpoint_s: float = Field(0.0, ge=0)
    final_save_s: float = Field(0.0, ge=0)


class ProfileConfig(_Section):
    start: int = Field(ge=1)  # the first profiled optimizer step, counted from 1
    steps: int = Field(2, ge=1)


class DebugConfig(_Section):
    inject_oom: InjectOomConfig | None = None
    inject_hang: InjectHangConfig | None = None
    slow_rank0: SlowRank0Config | None = None
    # torch.profiler over optimizer steps start .. start + steps - 1 -> run.dir/profile/
    profile: ProfileConfig | None = None
    crash_in_save: int | None = Field(None, ge=1)  # SIGKILL at the N-th point inside saves
    # cap the CUDA allocator at this fraction of each device (emulates a smaller card, so an
    # out-of-memory and the escalation after it are real; bench/gpu_validate.sh); inert on CPU
    device_memory_fraction: float | None = Field(None, gt=0, le=1)
    # multiply what the launch probe measures after the first step (trainer/observe/probe.py), so
    # a test can force the re-plan of an over-budget step on any machine
    probe_scale: float | None = Field(None, gt=0, le=100)
    # seconds the `stream` rung's copy threads sleep before each copy (trainer/streaming/
    # copies.py): a missing wait then shows as a wrong loss on any machine
    stream_copy_delay_s: float | None = Field(None, ge=0, le=10)
