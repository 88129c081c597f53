"""Process-group setup and the few collectives the engine needs; rank-aware logging.

Every rank runs the same engine. Under torchrun the environment names the rank; run directly, the
process is rank 0 of a world of 1 and no process group is created.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from trainer.core import strategies
from trainer.core.config import JobConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


def env_rank() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment, else from srun's (one task
    per rank, launched without torchrun); (0, 0, 1) outside both."""
    env = os.environ
    if "RANK" not in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return (int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)))


def _rendezvous_env() -> dict[str, str]:
    """MASTER_ADDR/PORT, RANK, WORLD_SIZE for env:// when torchrun did not set them."""
    rank, local_rank, world_size = env_rank()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank)}
    if world_size == 1:
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    else:  # srun tasks: the job's first node, a port derived from the job id
        port = 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000
        env |= {
            "MASTER_ADDR": slurm_head_node(os.environ["SLURM_JOB_NODELIST"]),
            "MASTER_PORT": str(port),
        }
    return env


SCONTROL_TIMEOUT_S = 60


def slurm_head_node(nodelist: str, timeout_s: float = SCONTROL_TIMEOUT_S) -> str:
    """The first host of a Slurm node list (`scontrol show hostnames`), within `timeout_s`: an
    unresponsive slurmctld fails the start in one line instead of hanging it."""
    import subprocess

    argv = ["scontrol", "show", "hostnames", nodelist]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"'{' '.join(argv)}' did not answer in {timeout_s:.0f} s (is slurmctld reachable?)"
        ) from None
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise RuntimeError(f"'{' '.join(argv)}' failed: {out.stderr.strip()[:200]}")
    return hosts[0]


def wait_for_future(future: Any, what: str, timeout_s: float, progress_s: float = 60.0) -> Any:
    """`future.result()` with a progress line every `progress_s` and a bound: background work
    (an async checkpoint's writes) that does not finish in `timeout_s` raises TimeoutError
    naming it, instead of blocking the run forever on a stuck file system."""
    import concurrent.futures

    start = time.monotonic()
    while True:
        waited_s = time.monotonic() - start
        left_s = timeout_s - waited_s
        if left_s <= 0:
            raise TimeoutError(
                f"{what} did not finish in {timeout_s:.0f} s (dist.timeout_s): the file system "
                "is stuck or too slow; the unfinished checkpoint is never loaded"
            )
        try:
            return future.result(timeout=min(progress_s, left_s))
        except concurrent.futures.TimeoutError:
            log.warning("still waiting for %s: %.0f s so far", what, time.monotonic() - start)


def resolve_device(cfg: JobConfig, local_rank: int) -> torch.device:
    kind = cfg.hardware.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        fraction = cfg.debug.device_memory_fraction
        if fraction is not None:  # a smaller card, emulated: real OOMs, real escalation
            torch.cuda.set_per_process_memory_fraction(fraction, local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg: JobConfig, device: torch.device) -> None:
    """Create the default process group once per process (idempotent; never torn down here).

    Sharded rungs need a group even on one process (FSDP2 meshes, DeepSpeed), so outside torchrun
    they get a group of one on a free local port; `single` on one process needs none.

    NCCL for CUDA tensors, gloo for CPU ones; on CUDA both are registered so that collectives on
    host tensors (offloaded states, flags) also work.
    """
    _, _, world_size = env_rank()
    if dist.is_initialized() or (
        world_size == 1 and strategies.row(cfg.strategy).engine == "single"
    ):
        return
    if "MASTER_ADDR" not in os.environ:  # a group of one, or srun tasks without torchrun
        os.environ.update(_rendezvous_env())
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        rank, _, world_size = env_rank()
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's shared store: a namespace of its own for this attempt; else None.

    torchrun keeps one TCPStore for the whole job (c10d and static rendezvous) and hands it to
    the workers of every attempt, and the keys a process group writes there (each rank's gloo
    address, NCCL's unique id) do not name the attempt. After `--max-restarts` restarts the
    workers, a new rank can read the address a killed rank left behind and connect to a dead
    port: gloo's connectFullMesh fails with "connection refused" until the timeout (pytorch
    issue 135712). torchrun restarts the whole worker group at once, so the restart count is the
    same on every rank of a node; on several nodes with c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    gives every round a fresh store instead (the workers then see USE_AGENT_STORE=False).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    _, _, world_size = env_rank()
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"oomless/attempt_{attempt}/default_pg", store)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(values: list[float], device: torch.device, group: Any = None) -> list[float]:
    """Sum a few scalars over the ranks of `group` (None: all) in one collective (fp64 so token
    counts stay exact)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def all_reduce_max(value: float, device: torch.device) -> float:
    return all_reduce_max_many([value], device)[0]


def all_reduce_max_many(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max of a few scalars over all ranks, in one collective."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


_rank0_turns = itertools.count()
POLL_S = 0.1


def after_rank0(
    what: str, work: Callable[[], T], then: Callable[[], T] | None = None, *, clock_s: float
) -> T | None:
    """Rank 0 runs `work` alone (tokenising, a checkpoint's fsync, the final save); the other
    ranks wait for it to finish, then run `then`.

    They wait on the work itself, not on a clock: a key in the process group's store that rank 0
    sets when it is done (or failed), polled without a deadline but the job's. A barrier would time
    out after `dist.timeout_s` (`clock_s`) whatever the work's size; here, past that time the
    waiting ranks say what they wait for, and again every minute or `clock_s`, whichever is longer.
    Every rank calls this in the same order (the keys count the calls).
    """
    if not is_distributed():
        return work()
    key = f"oomless/after_rank0/{next(_rank0_turns)}"
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        try:
            result = work()
        except BaseException:
            store.set(key, "failed")
            raise
        store.set(key, "done")
        return result
    _wait_for_key(store, key, what, clock_s)
    return then() if then is not None else None


def slow_down(cfg: JobConfig, what: str) -> None:
    """`debug.slow_rank0.<what>`: make rank 0's serial work take that much longer (tests)."""
    slow = cfg.debug.slow_rank0
    if slow is not None and getattr(slow, what):
        time.sleep(getattr(slow, what))


def _wait_for_key(store: dist.Store, key: str, what: str, clock_s: float) -> None:
    start = time.monotonic()
    next_note_s = clock_s
    while not store.check([key]):
        time.sleep(POLL_S)
        waited_s = time.monotonic() - start
        if waited_s >= next_note_s:
            log.warning(
                "waiting for rank 0 to finish %s: %.0f s so far (past dist.timeout_s=%g, "
                "which does not apply here); no deadline but the job's",
                what,
                waited_s,
                clock_s,
            )
            next_note_s = waited_s + max(60.0, clock_s)
    if store.get(key) == b"failed":
        log.info("rank 0 failed while %s; stopping (its error says why)", what)  # its line only
        raise SystemExit(1)


def exit_without_teardown(code: int) -> NoReturn:
    """End a torchrun worker once its files are written, skipping the interpreter's teardown.

    Left to the interpreter, gloo's threads can be destroyed unjoined while C++ statics unwind,
    even after destroy_process_group ("terminate called without an active exception"): SIGABRT
    after the last step, which torchrun reports as a failed run and srun --kill-on-bad-exit as a
    failed job. Only the streams need a flush: the run's
    files are closed by now, and the peers need no goodbye (they exit the same way).

    On several nodes, the ranks of node 0 leave last (`LAST_NODE_DELAY_S`): node 0's torchrun
    hosts the store of the agents' exit barrier and shuts it as soon as its own wait returns; an
    agent that reached the barrier last then waits on a closed store and logs torch's
    "Error waiting on exit barrier" traceback into the job's log (seen on the local Slurm
    cluster). With node 0 last, its agent completes the barrier and nobody waits after it.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("GROUP_RANK") == "0" and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        time.sleep(LAST_NODE_DELAY_S)
    os._exit(code)


LAST_NODE_DELAY_S = 2.0  # the other nodes' ranks end their collectives with node 0's: ms apart
