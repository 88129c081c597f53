"""Out-of-memory handling inside the process: detect, agree over ranks, inject for tests.

Ranks agree on an OOM at fixed points of a step (after forward, before backward's collectives,
after each backward; the last one also covers the entry of the optimizer step) with one scalar
collective, so a rank that ran out of memory never leaves the others waiting in a collective it
will not join. An OOM inside the optimizer step itself (past the last agreement) ends the
process with exit 75 on that rank alone (`OutOfMemoryInStep`); torchrun then stops the others.
An OOM raised *inside* backward's collectives on one rank only (e.g. mid-backward under FSDP)
cannot be agreed on; the other ranks then hit `dist.timeout_s` or see the rank's exit.
"""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.core.config import InjectOomConfig
from trainer.core.contract import OOM_REPORT_FILE
from trainer.core.files import write_atomic
from trainer.runtime.dist import all_reduce_max

log = logging.getLogger(__name__)

_OOM_MESSAGES = ("out of memory", "cuda error: out of memory", "cublas_status_alloc_failed")


def is_oom(err: BaseException) -> bool:
    """torch's OOM error, and the RuntimeError forms other libraries (DeepSpeed, cuBLAS) raise."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _OOM_MESSAGES)


class StepAborted(Exception):
    """Some rank ran out of memory during `phase`; every rank raises this together."""

    def __init__(self, phase: str, local_error: BaseException | None):
        super().__init__(f"out of memory during {phase}")
        self.phase = phase
        self.local_error = local_error


class OutOfMemoryInStep(Exception):
    """This rank ran out of memory inside the optimizer step, past the last agreement point.

    The other ranks may be waiting in the step's collectives (ZeRO's all-gather, FSDP's norm
    all-reduce), so there is nothing left to agree with: the rank reports and exits 75 on its
    own, and torchrun stops the others. A retry in process could also apply part of the update
    twice; resuming from the checkpoint on the next rung is exact.
    """

    def __init__(self, local_error: BaseException):
        super().__init__(f"out of memory during the optimizer step: {local_error}")
        self.phase = "optimizer"
        self.local_error = local_error


class FaultInjector:
    """`debug.inject_oom`: raise a real torch.OutOfMemoryError at a chosen point (tests only)."""

    def __init__(self, spec: InjectOomConfig | None, strategy: str, rank: int):
        active = spec is not None and (spec.strategies is None or strategy in spec.strategies)
        self.spec = spec if active else None
        self.rank = rank
        self.num_fired = 0
        self.step = -1

    def at(self, phase: str) -> None:
        spec = self.spec
        if spec is None or phase != spec.where or self.step + 1 < spec.step:
            return
        if spec.rank is not None and spec.rank != self.rank:
            return
        if spec.times and self.num_fired >= spec.times:
            return
        self.num_fired += 1
        err = torch.OutOfMemoryError(
            f"debug.inject_oom: injected out of memory in {phase} at step {self.step + 1} "
            f"on rank {self.rank}"
        )
        err.oom_phase = phase  # type: ignore[attr-defined]
        raise err


NO_FAULTS = FaultInjector(None, "", 0)


PHASES = ("forward", "backward", "optimizer", "eval")


def agree(failed: BaseException | None, phase: str, device: torch.device) -> None:
    """Raise StepAborted on every rank if any rank failed in `phase` (the guarded span; an
    injected error names its own phase, and every rank learns that name in the same scalar)."""
    code = 0.0
    if failed is not None:
        code = 1.0 + PHASES.index(getattr(failed, "oom_phase", phase))
    agreed = int(all_reduce_max(code, device))
    if agreed:
        raise StepAborted(PHASES[agreed - 1], failed)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_summary(device: torch.device) -> dict[str, Any]:
    """What the OOM report shows: allocator counters and, when recorded, the largest blocks."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    keys = (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "num_alloc_retries",
        "num_ooms",
    )
    summary: dict[str, Any] = {k: stats.get(k, 0) for k in keys}
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    summary["free_bytes"], summary["total_bytes"] = free_bytes, total_bytes
    segments = torch.cuda.memory_snapshot()
    blocks = sorted(
        (b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"),
        reverse=True,
    )
    summary["largest_live_blocks_bytes"] = blocks[:10]
    return summary


def write_oom_report(run_dir: Path, report: dict[str, Any], rank: int = 0) -> Path:
    """Atomically (a fresh temporary file each: ranks that failed alone may write at once)."""
    return write_atomic(run_dir / OOM_REPORT_FILE, json.dumps(report, indent=2) + "\n")
