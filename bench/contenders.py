"""The contenders of a one-machine comparison, each in a process of its own, in fresh sessions.

In one process, the contenders share one heap and one set of thread pools, and what one leaves
behind changes the speed of the next: with a second oomless LoRA instance alternating in the same
process, oomless / peft + Trainer moved from 1.010 to 0.975 while the two oomless instances stayed
at 0.996 of each other. In a spawned process each, nothing is shared, but a process has a speed
of its own: four processes running the very same oomless LoRA step, alternated for 30 rounds,
had medians of 562-579 ms, and 4 of the 6 pairs had a 90% interval without 1.00
(docs/benchmarks.md). Where a process's heap and libraries land decides that, and it is drawn
again with each process.

So the rounds are split over sessions: each session starts a fresh process per contender, steps
them in turn for its share of the rounds, and ends them. A contender's median then spans several
processes, and the bootstrap interval resamples sessions first (bench.common.ratio_interval), so
it shows what one process's luck can move.

Inside its process a contender builds and runs in a thread of its own, never the main thread: the
Trainer has to run in a thread (it is parked between steps), so every side does, and all of them
allocate from a thread's malloc arena alike. The parent tells one child at a time to take N
optimizer steps; the child times them; the others wait on their pipe without using a core.
"""

from __future__ import annotations

import math
import multiprocessing
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import alternate, timed

# Before each timed call: the previous contender's OpenMP workers spin for a moment after their
# last parallel region, and on a 2-core machine that would be taken from the next one's start.
SETTLE_S = 0.05


@dataclass
class Contender:
    """What a build function returns, in the child: `run(num_steps)` takes optimizer steps."""

    run: Callable[[int], None]
    info: dict[str, Any] = field(default_factory=dict)  # sent to the parent once built
    close: Callable[[], None] = lambda: None


@dataclass
class Timings:
    """Seconds of every round per contender, the session each round ran in, and what each
    contender's build reported (from the last session)."""

    round_s: dict[str, list[float]]
    session_of_round: list[int]
    info: dict[str, dict[str, Any]]


class ContenderProcess:
    """`build(*build_args)` -> Contender, run in a spawned child; `time(n)` -> seconds of n steps.

    `build` must be importable by name (a module-level function), and its arguments picklable.
    The child takes one untimed warm-up step before it reports ready (`wait_ready`), so compiling
    and the Trainer's preparation are not timed.
    """

    def __init__(self, name: str, build: Callable[..., Contender], *build_args: Any, device):
        self.name = name
        spawn = multiprocessing.get_context("spawn")
        self._conn, child_end = spawn.Pipe()
        self._process = spawn.Process(
            target=_serve,
            args=(child_end, build, build_args, device),
            name=f"bench-{name}",
            daemon=True,  # never outlives the comparison, whatever happens to the parent
        )
        self._process.start()
        child_end.close()
        self.info: dict[str, Any] | None = None
        self._failed = False

    def wait_ready(self) -> dict[str, Any]:
        if self.info is None:
            self.info = self._reply()
        return self.info

    def time(self, num_steps: int) -> float:
        time.sleep(SETTLE_S)
        self._conn.send(num_steps)
        return self._reply()

    def close(self) -> None:
        if self._failed or not self._process.is_alive():  # its error is raised already
            self._process.join(timeout=10)
            return
        try:
            self._conn.send(None)
            self._reply()
        finally:
            self._process.join(timeout=60)

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self._failed = True
            self._process.join(timeout=10)
            raise RuntimeError(
                f"bench contender {self.name!r} died (exit code {self._process.exitcode})"
            ) from None
        if status == "error":
            self._failed = True
            raise RuntimeError(f"bench contender {self.name!r} failed:\n{value}")
        return value


def _serve(conn: Any, build: Callable[..., Contender], build_args: tuple, device: Any) -> None:
    device = torch.device(device)
    thread = ThreadPoolExecutor(1)
    try:
        contender = thread.submit(build, *build_args).result()
        thread.submit(contender.run, 1).result()  # warm-up
        conn.send(("ok", contender.info))
        while (num_steps := conn.recv()) is not None:
            seconds = thread.submit(timed, lambda n=num_steps: contender.run(n), device).result()
            conn.send(("ok", seconds))
        thread.submit(contender.close).result()
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        thread.shutdown()


def add_sessions_arg(parser: Any) -> None:
    parser.add_argument(
        "--sessions",
        type=int,
        default=1,
        help="spread the rounds over this many sessions, each with a fresh process per "
        "contender (a process's speed varies by a few %% from one to the next)",
    )


def time_in_processes(
    builds: dict[str, tuple[Callable[..., Contender], tuple]],
    num_rounds: int,
    num_steps: int,
    device: torch.device,
    num_sessions: int = 1,
) -> Timings:
    """`num_rounds` rounds of `num_steps` steps per contender, spread evenly over `num_sessions`
    sessions of fresh processes. In a session every contender's process starts at once (builds
    and warm-ups overlap, untimed), then they alternate (`bench.common.alternate`: the order
    shuffled every round)."""
    num_sessions = max(1, min(num_sessions, num_rounds))
    per_session = [
        math.ceil(num_rounds * (s + 1) / num_sessions) - math.ceil(num_rounds * s / num_sessions)
        for s in range(num_sessions)
    ]
    round_s: dict[str, list[float]] = {name: [] for name in builds}
    session_of_round: list[int] = []
    info: dict[str, dict[str, Any]] = {}
    for session, num_session_rounds in enumerate(per_session):
        processes: dict[str, ContenderProcess] = {}
        try:
            for name, (build, build_args) in builds.items():
                processes[name] = ContenderProcess(name, build, *build_args, device=device)
            info = {name: p.wait_ready() for name, p in processes.items()}
            times = alternate(
                {name: (lambda p=p: p.time(num_steps)) for name, p in processes.items()},
                num_session_rounds,
                first_round=len(session_of_round),
            )
        finally:
            for process in processes.values():
                process.close()
        for name, values in times.items():
            round_s[name] += values
        session_of_round += [session] * num_session_rounds
        print(f"session {session + 1}/{num_sessions}: {num_session_rounds} rounds", flush=True)
    return Timings(round_s, session_of_round, info)
