"""Independent traces run over two cores: half the time's worth of them in a forked child process
where there is a second core. Tracing under fake tensors is pure Python, so threads would not
help; the same numbers come out as one after the other (launcher/estimate/traced_activations.py
measures the activations of unknown blocks this way). A forked child whose backward cannot run
(`_backward_runs`) runs its half in a fresh interpreter instead (`serve_afresh`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# How long the second process may take over its half of the traces before its half is traced
# again here (a child that hangs must not hang the plan).
CHILD_TIMEOUT_S = 900


def on_two_cores(
    jobs: list[tuple], run: Callable[[tuple], Any], cost: Callable[[tuple], int]
) -> list[Any]:
    """`run(job)` for every job, about half the time's worth of them (by `cost`) in a forked
    child process where there is a second core; a failed or silent child's half is run here
    instead."""
    import multiprocessing

    usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if len(jobs) < 2 or usable_cores < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [run(job) for job in jobs]
    ctx = multiprocessing.get_context("fork")
    mine: list[int] = []
    others: list[int] = []
    load = [0, 0]
    for i in sorted(range(len(jobs)), key=lambda i: -cost(jobs[i])):  # longest first
        side = 0 if load[0] <= load[1] else 1
        (mine, others)[side].append(i)
        load[side] += cost(jobs[i])
    theirs = [jobs[i] for i in others]
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_run_into, args=(theirs, run, send), daemon=True)
    child.start()
    send.close()
    ours = [run(jobs[i]) for i in mine]
    answer: Any = f"silent for {CHILD_TIMEOUT_S} s"
    with contextlib.suppress(EOFError, OSError):
        if receive.poll(CHILD_TIMEOUT_S):
            answer = "ended without an answer"  # kept where recv finds the pipe closed
            answer = receive.recv()
    child.join(timeout=5)
    if child.is_alive():
        child.kill()
    if not isinstance(answer, list):  # the child failed: its traces again, here
        log.warning("the second trace process %s: its %d traces run here", answer, len(theirs))
        answer = [run(job) for job in theirs]
    merged: dict[int, Any] = dict(zip(mine, ours, strict=True))
    merged |= dict(zip(others, answer, strict=True))
    return [merged[i] for i in range(len(jobs))]


def _run_into(jobs: list[tuple], run: Callable[[tuple], Any], send: Any) -> None:
    """The forked child's half: its results, or what it raised (then the parent runs them)."""
    try:
        _one_thread()
        if not _backward_runs():
            _afresh(jobs, run, send)  # does not return
        send.send([run(job) for job in jobs])
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which retries
        send.send(f"raised {err!r}")
    finally:
        send.close()


def _one_thread() -> None:
    """torch on one thread in the forked child: libgomp is not fork-safe, so where the parent
    ran an OpenMP parallel region before the fork (a real op on a large tensor: a traced step's
    batch, a QLoRA base), the child's first parallel region waits for ever on the parent's team,
    which the fork did not copy. On one thread torch runs no parallel region; the traces are
    Python on one core anyway."""
    torch = sys.modules.get("torch")
    if torch is not None:  # else the parent started no team
        torch.set_num_threads(1)


def _backward_runs() -> bool:
    """Whether this process's autograd engine runs a backward. Once the parent's engine started
    its device threads (any backward where a GPU is present; under torch 2.11, one on fake
    tensors), a child forked after raises on its first."""
    torch = sys.modules.get("torch")
    if torch is None:  # the parent never imported it, so never ran a backward
        return True
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError as err:
        if "fork" not in str(err):
            raise
        return False
    return True


def _afresh(jobs: list[tuple], run: Callable[[tuple], Any], send: Any) -> None:
    """This child becomes a fresh interpreter (same pid, same pipe to the parent) that runs the
    half: it imports what it runs by name (seconds), while the parent runs its own half. What
    it runs goes through a file only this user can read, which it deletes on reading."""
    fd, payload = tempfile.mkstemp(prefix="oomless-traces-", suffix=".pickle")
    with os.fdopen(fd, "wb") as file:
        pickle.dump((jobs, run), file)
    os.set_inheritable(send.fileno(), True)
    code = "from launcher.estimate.trace_pool import serve_afresh; serve_afresh()"
    argv = [sys.executable, "-c", code, json.dumps(sys.path), payload, str(send.fileno())]
    try:
        os.execv(sys.executable, argv)
    finally:  # reached only where the exec failed
        os.unlink(payload)


def serve_afresh() -> None:
    """`_afresh`'s interpreter: the parent's import path, then the half, as a forked child."""
    from multiprocessing.connection import Connection

    path, payload, fd = sys.argv[1:]
    sys.path[:0] = [p for p in json.loads(path) if p not in sys.path]
    with open(payload, "rb") as file:
        jobs, run = pickle.load(file)  # written by this process before its exec
    os.unlink(payload)
    _run_into(jobs, run, Connection(int(fd), readable=False))
