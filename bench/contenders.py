"""Each contender of a one-machine comparison in a process of its own, stepped on request.

In one process, the contenders share one heap and one set of thread pools, and what one leaves
behind changes the speed of the next: with a second oomless LoRA instance alternating in the same
process, oomless / peft + Trainer moved from 1.010 to 0.975 while the two oomless instances stayed
at 0.996 of each other (docs/benchmarks.md). A spawned process per contender removes that: the
parent only tells one child at a time to take N optimizer steps, the child times them, and the
others wait on their pipe without using a core.

Inside its process a contender builds and runs in a thread of its own, never the main thread: the
Trainer has to run in a thread (it is parked between steps), so every side does, and all of them
allocate from a thread's malloc arena alike.
"""

from __future__ import annotations

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


class ContenderProcess:
    """`build(*build_args)` -> Contender, run in a spawned child; `time(n)` -> seconds of n steps.

    `build` must be importable by name (a module-level function), and so must its arguments be
    picklable. The child takes one untimed warm-up step before it reports ready, so compiling and
    the Trainer's preparation are not timed.
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
        self.info: dict[str, Any] = self._reply()

    def time(self, num_steps: int) -> float:
        time.sleep(SETTLE_S)
        self._conn.send(num_steps)
        return self._reply()

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
                self._reply()
            finally:
                self._process.join(timeout=60)

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._process.join(timeout=10)
            raise RuntimeError(
                f"bench contender {self.name!r} died (exit code {self._process.exitcode})"
            ) from None
        if status == "error":
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


def time_in_processes(
    builds: dict[str, tuple[Callable[..., Contender], tuple]],
    num_rounds: int,
    num_steps: int,
    device: torch.device,
) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """Build every contender in its own process (one after the other), then alternate them
    (`bench.common.alternate`: shuffled every round). Returns the seconds of each round per
    contender and what each build reported."""
    processes: dict[str, ContenderProcess] = {}
    try:
        for name, (build, build_args) in builds.items():
            processes[name] = ContenderProcess(name, build, *build_args, device=device)
        times = alternate(
            {name: (lambda p=p: p.time(num_steps)) for name, p in processes.items()}, num_rounds
        )
    finally:
        for process in processes.values():
            process.close()
    return times, {name: p.info for name, p in processes.items()}
