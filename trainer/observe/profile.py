"""`debug.profile: {start, steps}`: torch.profiler over a window of optimizer steps, on every rank.

Writes `run.dir/profile/rank{N}.trace.json` (Chrome trace format: Perfetto, chrome://tracing)
with CPU and CUDA activities, shapes and memory events, plus the phase markers of
`trainer/observe/phases.py`; on CUDA also `rank{N}.memory_snapshot.pickle` (pytorch.org/memory_viz).
The steps it profiles carry `"profiled": true` in metrics.jsonl: their time includes the
profiler's overhead and is left out of throughput (ETA, trackers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.core.contract import trace_path
from trainer.core.files import umask_mode, write_by_name
from trainer.observe.phases import STEP, mark_in_profile, phase_markers

log = logging.getLogger(__name__)


class ProfileWindow:
    """Profiles optimizer steps `start .. start + steps - 1` (counted from 1); inert unless set."""

    def __init__(
        self,
        spec: Any,
        run_dir: Path,
        rank: int,
        device: torch.device,
        model: nn.Module,
        optimizer: Any = None,
    ) -> None:
        self.first = spec.start - 1 if spec is not None else -1  # 0-based loop index
        self.last = self.first + spec.steps - 1 if spec is not None else -1
        self.run_dir, self.rank, self.device, self.model = run_dir, rank, device, model
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.profiler: torch.profiler.profile | None = None
        self._markers: Any = None
        self._step_range: Any = None

    def begin(self, step: int) -> None:
        """Before the step with 0-based index `step` runs."""
        if not self.first <= step <= self.last:
            return
        if self.profiler is None:
            self._start()
        self._step_range = torch.profiler.record_function(f"oomless: optimizer step {step + 1}")
        self._step_range.__enter__()
        mark_in_profile(STEP)

    def end(self, step: int) -> bool:
        """After the step ran; True when it was profiled (its time is not throughput)."""
        if self.profiler is None:
            return False
        self._step_range.__exit__(None, None, None)
        self.profiler.step()
        if step >= self.last:
            self._finish()
        return True

    def close(self) -> None:
        """Stop a window the run leaves early (out of memory, a signal) without writing it."""
        if self.profiler is not None:
            self._markers.__exit__(None, None, None)
            self.profiler.stop()
            self.profiler = None
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.profiler = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True
        )
        with _quiet_stderr():  # kineto's "profiler_start" line
            self.profiler.start()
        self.profiler.add_metadata_json("oomless", json.dumps(self._metadata()))
        self._markers = phase_markers(self.model, mark_in_profile)
        self._markers.__enter__()

    def _finish(self) -> None:
        assert self.profiler is not None
        self._markers.__exit__(None, None, None)
        with _quiet_stderr():
            self.profiler.stop()
        out = trace_path(self.run_dir, self.rank)
        profiler, mode = self.profiler, umask_mode(0o666)
        write_by_name(out, lambda tmp: profiler.export_chrome_trace(str(tmp)), mode)
        written = [out]
        if self.device.type == "cuda":
            snapshot = out.with_name(f"rank{self.rank}.memory_snapshot.pickle")
            dump = torch.cuda.memory._dump_snapshot
            write_by_name(snapshot, lambda tmp: dump(str(tmp)), mode)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        self.profiler = None
        if self.rank == 0:
            log.info(
                "profiled steps %d-%d: %s (open in ui.perfetto.dev)",
                self.first + 1,
                self.last + 1,
                ", ".join(str(p) for p in written),
            )

    def _metadata(self) -> dict[str, Any]:
        """What the memory timeline needs besides the events: on CPU the profiler sees only the
        allocations made after it starts, so the bytes of the state alive then (parameters,
        buffers, optimizer state on this rank) are recorded here."""
        return {
            "device": self.device.type,
            "rank": self.rank,
            "steps": [self.first + 1, self.last + 1],
            "state_bytes_at_start": _state_bytes(self.model, self.optimizer, self.device),
        }


def _state_bytes(model: nn.Module, optimizer: Any, device: torch.device) -> int:
    """Bytes of the distinct storages of this rank's parameters, buffers and optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard
        if local.device.type == device.type and local.untyped_storage().size():
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a moment (lines printed by C++ code)."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
