"""The hang watchdog (`run.hang_timeout_s`): a step that does not finish is diagnosed, not
waited out.

A daemon thread per rank watches the running step. When it outlasts the limit (a fixed
`run.hang_timeout_s`, or with `auto` 10 x the slowest step so far and at least 5 minutes, or
half of `dist.timeout_s` when that is shorter, so the watchdog fires before torch's collective
timeout ends the waiting ranks; `auto` arms after the first step, whose warm-up has no measure),
the rank writes every thread's Python stack (faulthandler) to run.dir/hang/rank{N}.txt and tells
the other ranks through the job's rendezvous store (the TCPStore torchrun's agent or rank 0
serves, which answers while the collectives do not). Every rank then adds its own stack, even
one between steps. The first rank that fired waits a moment for the others, names in one line the
ranks that did not arrive and the collective the others wait in, writes hang/report.json, and
every rank exits 124 (EXIT_HANG): `oomless train` restarts from the last checkpoint up to
`run.max_restarts` times (launcher/run/supervisor.py). docs/resilience.md.

Which ranks did not arrive: the ranks whose main thread is not inside torch.distributed while
others are (they wait for it); when every rank is in a collective, those in a different one or
at an earlier step; a rank whose watchdog could not answer (a process wedged without the GIL) is
named as not answering. Collectives that wait in C++ alone (DDP's gradient buckets) leave no
Python frame: the report then says the stacks are the evidence.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from trainer.core.config import JobConfig
from trainer.core.contract import EXIT_HANG, HANG_DIR, HANG_REPORT_FILE
from trainer.core.files import (
    PRIVATE_FILE_MODE,
    run_subdir,
    write_atomic,
    write_by_name,
    write_json,
)
from trainer.core.run_lock import LOCK_OWNER_ENV

log = logging.getLogger(__name__)

AUTO_FACTOR = 10  # auto: this many times the slowest step so far
AUTO_FLOOR_S = 300.0  # and never less than 5 minutes (or half of dist.timeout_s when shorter)
GATHER_S = 20.0  # how long the first rank waits for the others' stacks
_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep
_TRAINER = os.sep + "trainer" + os.sep


@dataclass
class RankState:
    """What one rank says when a hang was detected."""

    rank: int
    step: int | None  # the step it is in (counted from 1), None between steps
    collective: str | None  # the torch.distributed function its main thread waits in
    where: str | None  # the innermost oomless frame of its main thread

    def describe(self) -> str:
        at = f"step {self.step}" if self.step is not None else "between steps"
        return f"rank {self.rank} ({at}, " + (
            f"waiting in {self.collective})" if self.collective else f"at {self.where or '?'})"
        )


class HangWatchdog:
    """One per rank: `started(step)` / `finished()` around each step; `close()` at the end."""

    def __init__(self, cfg: JobConfig, run_dir: Path, rank: int, world_size: int):
        fixed = cfg.run.hang_timeout_s
        self.fixed_s = float(fixed) if isinstance(fixed, int) else None
        # auto fires before torch's collective timeout ends the waiting ranks (no stacks then)
        self.floor_s = min(AUTO_FLOOR_S, cfg.dist.timeout_s / 2)
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.slowest_s = 0.0
        self._step: int | None = None
        self._since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store = _rendezvous_store() if world_size > 1 else None
        self._prefix = f"oomless/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._thread = threading.Thread(target=self._watch, name="oomless-hang-watchdog")
        self._thread.daemon = True
        self._thread.start()

    def limit_s(self) -> float | None:
        """The longest a step may run now; None while `auto` has no step measured yet."""
        if self.fixed_s is not None:
            return self.fixed_s
        if not self.slowest_s:
            return None
        return max(self.floor_s, AUTO_FACTOR * self.slowest_s)

    def started(self, step: int) -> None:
        with self._lock:
            self._step, self._since = step, time.monotonic()

    def finished(self) -> None:
        with self._lock:
            if self._since is not None:
                self.slowest_s = max(self.slowest_s, time.monotonic() - self._since)
            self._step, self._since = None, None

    def close(self) -> None:
        self._stop.set()

    def _poll_s(self) -> float:
        limit = self.limit_s() or self.floor_s
        return max(1.0, min(30.0, limit / 10))

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s()):
            with self._lock:
                since, limit = self._since, self.limit_s()
            outlasted = since is not None and limit is not None
            if outlasted and time.monotonic() - since > limit:
                self._fire(first=True)
            elif self._store is not None and self._store.check([f"{self._prefix}/fired"]):
                self._fire(first=False)  # another rank found the hang: add this rank's stack

    def _fire(self, first: bool) -> None:
        """Stacks to run.dir/hang/, the diagnosis (by the first rank to fire), exit 124."""
        state = self._state()
        try:
            self.dump_stacks(state)
            if self._store is None:
                self._report({0: state})
            else:
                self._store.set(f"{self._prefix}/rank/{self.rank}", json.dumps(state.__dict__))
                first = first and self._store.add(f"{self._prefix}/fired", 1) == 1
                if first:
                    self._report(self._gather())
                    self._store.set(f"{self._prefix}/done", "1")
                else:
                    self._store.wait([f"{self._prefix}/done"], timedelta(seconds=2 * GATHER_S))
        except Exception as err:  # the diagnosis is best effort; the exit is not
            log.error("hang watchdog: %s", err)
        finally:
            logging.shutdown()
            os._exit(EXIT_HANG)

    def _state(self) -> RankState:
        with self._lock:
            step = None if self._step is None else self._step + 1
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        collective, where = _innermost(frame, _TORCH_DIST), _innermost(frame, _TRAINER)
        return RankState(self.rank, step, collective, where)

    def dump_stacks(self, state: RankState) -> Path:
        """This rank's Python stacks to run.dir/hang/rank{N}.txt, through a fresh temporary
        file renamed over it (a link planted there is replaced, never written through)."""
        head = f"# oomless hang watchdog: {state.describe()}; limit {self.limit_s() or 0:.0f} s\n"

        def fill(tmp: Path) -> None:
            with open(tmp, "w") as out:
                out.write(head)
                out.flush()
                faulthandler.dump_traceback(file=out, all_threads=True)

        hang_dir = run_subdir(self.run_dir, HANG_DIR)
        return write_by_name(hang_dir / f"rank{self.rank}.txt", fill, PRIVATE_FILE_MODE)

    def _gather(self) -> dict[int, RankState]:
        """Every rank's state that arrives within GATHER_S (a rank wedged without its watchdog
        thread never does)."""
        keys = {r: f"{self._prefix}/rank/{r}" for r in range(self.world_size)}
        deadline = time.monotonic() + GATHER_S
        while time.monotonic() < deadline and not self._store.check(list(keys.values())):
            time.sleep(0.5)
        states = {}
        for r, key in keys.items():
            if self._store.check([key]):
                states[r] = RankState(**json.loads(self._store.get(key)))
        return states

    def _report(self, states: dict[int, RankState]) -> None:
        report = diagnose(states, self.world_size, self.limit_s() or 0.0)
        report["stacks"] = str(self.run_dir / HANG_DIR)
        write_json(self.run_dir / HANG_DIR / HANG_REPORT_FILE, report)
        # under `oomless train` the supervisor says it, with what it does next
        supervised = LOCK_OWNER_ENV in os.environ
        log.log(logging.DEBUG if supervised else logging.ERROR, "%s", report["line"])


def diagnose(states: dict[int, RankState], world_size: int, limit_s: float) -> dict[str, Any]:
    """The ranks that did not arrive and the collective the others wait in, and the one line."""
    silent = [r for r in range(world_size) if r not in states]
    waiting = {r: s for r, s in states.items() if s.collective}
    elsewhere = {r: s for r, s in states.items() if not s.collective}
    if waiting and elsewhere:
        late = sorted(elsewhere)
    elif waiting:  # all in collectives: those at an earlier step, or in another collective
        first_step = min(s.step or 0 for s in waiting.values())
        late = sorted(r for r, s in waiting.items() if (s.step or 0) == first_step)
        if len(late) == len(waiting):
            names = {s.collective for s in waiting.values()}
            late = [] if len(names) == 1 else late
    else:
        late = []
    late = sorted(set(late) | set(silent))
    waiters = [r for r in sorted(waiting) if r not in late]
    collective = waiting[waiters[0]].collective if waiters else None
    step = max((s.step for s in states.values() if s.step is not None), default=None)
    at = f"step {step}" if step is not None else "a step"
    who = _ranks(late) if late else ""
    if late and collective:
        called = waiting[waiters[0]].where
        line = (
            f"hang at {at}: {who} did not arrive at {collective}"
            + (f" called from {called}" if called else "")
            + f", where {_ranks(waiters)} wait{'s' if len(waiters) == 1 else ''}"
        )
    elif late:
        line = f"hang at {at}: {who} did not arrive"
    elif collective:
        line = f"hang at {at}: every rank waits in {collective} (a lost peer or the network?)"
    else:
        line = f"hang at {at}: no rank waits in a Python collective (see the stacks)"
    for r in late:
        line += (
            f"; rank {r} did not answer"
            if r in silent
            else f"; rank {r} is at {states[r].where or '?'}"
        )
    line += f"; limit run.hang_timeout_s={limit_s:.0f} s"
    return {
        "step": step,
        "ranks": late,
        "collective": collective,
        "line": line,
        "states": {str(r): s.__dict__ for r, s in sorted(states.items())},
    }


def _ranks(ranks: list[int]) -> str:
    """ "rank 1", "ranks 0, 2 and 3", "63 ranks (1..63)"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 4:
        return f"{len(ranks)} ranks ({ranks[0]}..{ranks[-1]})"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def inject_hang(cfg: JobConfig, step: int, rank: int, run_dir: Path) -> None:
    """`debug.inject_hang`: at that step that rank stops (sleeps), once per run.dir."""
    spec = cfg.debug.inject_hang
    if spec is None or spec.step != step + 1 or spec.rank != rank:
        return
    marker = run_subdir(run_dir, HANG_DIR) / f"injected-step{spec.step}-rank{rank}"
    if marker.exists():
        return
    write_atomic(marker, "")
    log.warning("debug.inject_hang: rank %d stops answering at step %d", rank, spec.step)
    while True:
        time.sleep(1.0)


def _innermost(frame: FrameType | None, marker: str) -> str | None:
    """`function (path:line)` of the innermost frame whose file is under `marker`."""
    while frame is not None:
        path = frame.f_code.co_filename
        if marker in path:
            short = path[path.rindex(marker) + 1 :]
            return f"{frame.f_code.co_name} ({short}:{frame.f_lineno})"
        frame = frame.f_back
    return None


def _rendezvous_store() -> Any:
    """A client of the job's rendezvous TCPStore (MASTER_ADDR:MASTER_PORT, set for env://)."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=GATHER_S * 3),
        wait_for_workers=False,
    )
