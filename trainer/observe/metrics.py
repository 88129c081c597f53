"""metrics.jsonl (one object per optimizer step, docs/interface.md) and the human progress line."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from trainer.core.contract import METRICS_FILE
from trainer.core.errors import disk_full
from trainer.core.files import append_line, link_refused, write_atomic

log = logging.getLogger(__name__)


def finite(value: Any) -> Any:
    """`value` with every NaN and infinity (in dicts and lists too) made None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def strict_json(obj: Any, **kwargs: Any) -> str:
    """JSON every parser reads: NaN and infinities written as null (json.dumps alone writes a bare
    NaN, which is not JSON)."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def step_of(line: str) -> int | None:
    """The step of a metrics.jsonl line oomless wrote; None for anything else (not JSON, not an
    object, no whole-number `step`)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class MetricsLog:
    """Appends JSON lines on rank 0 and prints a progress line with an ETA."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, log_every: int = 1):
        self.path = run_dir / METRICS_FILE
        self.total_steps = total_steps
        self.enabled = enabled
        self.log_every = log_every
        self._start = time.perf_counter()
        self._first_step: int | None = None
        self._profiled_s = 0.0  # profiled steps' time (profiler overhead): not in the ETA
        self._num_profiled = 0
        self._said_not_finite = False  # a NaN or infinite metric, said once
        self._said_full = False  # a full disk, said once

    def truncate_after(self, step: int) -> None:
        """Keep the lines of steps <= `step` (a resumed run rewrites what came after).

        A crash or a full disk can leave the last line cut off, and a user may add a line of
        their own (a note): a line that is not a step's record is dropped, with one warning. The
        file is replaced in one rename, so a crash here loses nothing either. A symbolic link at
        its name is refused (one line, exit 2), never read or written through.
        """
        if self.path.is_symlink():
            raise link_refused(self.path)
        if not self.path.exists():
            return
        lines = self.path.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
        kept, dropped = [], []
        for num, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record_step = step_of(line)
            if record_step is None:
                dropped.append(num)
            elif record_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        if dropped == [len(lines)] and not lines[-1].endswith("\n"):
            log.warning("%s: dropped an incomplete last line (%d bytes)", self.path, len(lines[-1]))
        elif dropped:
            shown = ", ".join(map(str, dropped[:5])) + (" ..." if len(dropped) > 5 else "")
            log.warning(
                "%s: dropped %d line%s that %s not a step's record (line %s: a note, or cut off "
                "by a kill); the run goes on",
                self.path,
                len(dropped),
                "" if len(dropped) == 1 else "s",
                "is" if len(dropped) == 1 else "are",
                shown,
            )
        write_atomic(self.path, "".join(kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            append_line(self.path, strict_json(record), durable=False)
        except OSError as err:  # rank 0 alone: raising here would leave the others waiting
            if disk_full(err) is None:
                raise
            if not self._said_full:
                self._said_full = True
                log.warning("%s: %s; step %d's line was not written (said once); training goes "
                            "on (its next checkpoint says what to do)", self.path, err.strerror,
                            record["step"])  # fmt: skip
        step = record["step"]
        bad = sorted(k for k, v in record.items() if finite(v) is None and v is not None)
        if bad and not self._said_not_finite:
            self._said_not_finite = True
            log.warning("step %d: %s not finite (null in %s)", step, ", ".join(bad), METRICS_FILE)
        if self._first_step is None:
            self._first_step = step
            self._start = time.perf_counter() - record.get("step_time_s", 0.0)
        if record.get("profiled"):
            self._profiled_s += record.get("step_time_s", 0.0)
            self._num_profiled += 1
        if step % self.log_every == 0 or step == self.total_steps or "eval_loss" in record:
            log.info(self._progress_line(record))

    def _progress_line(self, r: dict[str, Any]) -> str:
        step = r["step"]
        done = step - (self._first_step or step) + 1 - self._num_profiled
        elapsed = time.perf_counter() - self._start - self._profiled_s
        eta_s = elapsed / max(done, 1) * (self.total_steps - step)
        parts = [
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}",
            f"loss {r['loss']:.4f}",
            f"lr {r['lr']:.2e}",
            f"gnorm {r['grad_norm']:.3f}",
            "profiled" if r.get("profiled") else f"{r['tokens_per_s']:,.0f} tok/s",
        ]
        if "mfu" in r:
            parts.append(f"mfu {r['mfu']:.1%}")
        if "reward_accuracy" in r:  # a preference objective (docs/preference.md)
            parts.append(f"reward acc {r['reward_accuracy']:.0%} margin {r['reward_margin']:.3f}")
        if "eval_loss" in r:
            parts.append(f"eval_loss {r['eval_loss']:.4f}")
        if "eval_exact_match" in r:
            parts.append(f"eval_exact_match {r['eval_exact_match']:.1%}")
        parts.append(f"eta {_hms(eta_s)}")
        return " | ".join(parts)


def _hms(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
