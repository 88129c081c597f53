"""One run per run.dir: a lock file for the life of a run, and workers that die with their parent.

`run.dir/run.lock` holds `{"pid", "host", "start_ticks", "slurm_job_id"}` of the process that
runs the run (the `oomless train` supervisor, or global rank 0 of a job that Slurm or the user
started). It is created complete in one step (a temporary file hard-linked to the lock name,
which fails if the lock exists), so a reader never sees half of one. A second start exits 2
("run.dir is in use by pid N on HOST"). A lock whose process is gone is taken over with a
warning: on this host when the pid is dead (or now names another process), under Slurm when its
job is the same job (a requeue) or no longer in the queue.

Torch-free: the launcher takes the lock before it writes anything into run.dir.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer.core.config import ConfigError
from trainer.core.contract import RUN_LOCK_FILE
from trainer.core.errors import disk_full, no_space
from trainer.core.files import make_private_dir

log = logging.getLogger(__name__)

LOCK_FILE = RUN_LOCK_FILE
# Set by the supervisor for the processes it starts: the lock it holds is theirs too.
LOCK_OWNER_ENV = "OOMLESS_RUN_LOCK_PID"
_PR_SET_PDEATHSIG = 1


class RunLock:
    """The held lock; `release` removes it if it is still ours."""

    def __init__(self, path: Path, record: dict[str, Any] | None):
        self.path = path
        self.record = record  # None: held by the supervisor that started this process

    def release(self) -> None:
        if self.record is not None and _read(self.path) == self.record:
            self.path.unlink(missing_ok=True)
            self.record = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_run_lock(run_dir: str | Path) -> RunLock:
    """Take run_dir's lock, or raise ConfigError (exit 2) when a live run holds it."""
    run_dir = make_private_dir(run_dir)
    path = run_dir / LOCK_FILE
    record = _my_record()
    for _ in range(3):
        held = _read(path)
        if held is not None and str(held.get("pid")) == os.environ.get(LOCK_OWNER_ENV):
            return RunLock(path, None)  # our supervisor's lock
        if held is None and not path.exists() or held is not None and _is_stale(held):
            if held is not None:
                log.warning(
                    "run.dir %s: taking over the lock of pid %s on %s, which is no longer running",
                    run_dir,
                    held.get("pid"),
                    held.get("host"),
                )
                _remove_if_same(path, held)
            if _create(path, record):
                return RunLock(path, record)
            continue  # someone else created it in between: look again
        raise in_use_error(run_dir, held)
    raise in_use_error(run_dir, _read(path))


def check_run_lock(run_dir: str | Path) -> None:
    """Raise ConfigError when a live run holds run_dir's lock (take nothing)."""
    path = Path(run_dir) / LOCK_FILE
    held = _read(path)
    if held is not None and not _is_stale(held):
        raise in_use_error(Path(run_dir), held)


def in_use_error(run_dir: Path, held: dict[str, Any] | None) -> ConfigError:
    held = held or {}
    job = f" (Slurm job {held['slurm_job_id']})" if held.get("slurm_job_id") else ""
    return ConfigError(
        "run.dir",
        f"{run_dir} is in use by pid {held.get('pid', '?')} on {held.get('host', '?')}{job}",
        f"wait for that run or stop it, or use another run.dir (if it is dead, remove "
        f"{run_dir / LOCK_FILE})",
    )


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (prctl PR_SET_PDEATHSIG).

    For `preexec_fn` (the child of the supervisor) and for each worker (the child of torchrun):
    a supervisor killed with SIGKILL then takes torchrun with it, and torchrun its workers,
    instead of leaving them training and writing into run.dir.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return


def exit_if_orphaned(parent_pid: int) -> None:
    """After `die_with_parent`: the parent may have died before it was asked; then stop now."""
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def _my_record() -> dict[str, Any]:
    record: dict[str, Any] = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start_ticks": _start_ticks(os.getpid()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if os.environ.get("SLURM_JOB_ID"):
        record["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return record


def _create(path: Path, record: dict[str, Any]) -> bool:
    """Create the lock holding `record`; False when it exists. A full disk is one line."""
    data = json.dumps(record)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{LOCK_FILE}.", dir=path.parent)
    except OSError as err:
        raise _no_room(path, len(data), err) from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if the lock exists: creation and content in one step
        return True
    except FileExistsError:
        return False
    except OSError as err:
        failed = err
    finally:
        os.unlink(tmp)  # before the line is said: the free bytes it names count this file's
    raise _no_room(path, len(data), failed) from None


def _no_room(path: Path, needed_bytes: int, err: OSError) -> OSError | ConfigError:
    """A full disk where the lock goes: one line (exit 2); another OSError as it was."""
    full = disk_full(err)
    if full is None:
        return err
    return no_space(
        "run.dir",
        path,
        "the run lock",
        needed_bytes,
        full,
        "free space there or set run.dir elsewhere",
    )


def _read(path: Path) -> dict[str, Any] | None:
    try:
        held = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as held by an unknown process
    return held if isinstance(held, dict) else {}


def _remove_if_same(path: Path, held: dict[str, Any]) -> None:
    if _read(path) == held:
        path.unlink(missing_ok=True)


def _is_stale(held: dict[str, Any]) -> bool:
    job = held.get("slurm_job_id")
    if job and job == os.environ.get("SLURM_JOB_ID"):
        return True  # this job's own lock, left by a run before a requeue or restart
    if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
        return not _alive(held["pid"], held.get("start_ticks"))
    if job and shutil.which("squeue"):
        out = subprocess.run(
            ["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True
        )
        return out.returncode == 0 and not out.stdout.strip() or "Invalid job id" in out.stderr
    return False  # another host, no way to tell: the user decides


def _alive(pid: int, start_ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] == "Z":
        return False  # exited, not yet reaped by its parent
    return start_ticks is None or int(fields[19]) == start_ticks  # else: the pid was reused


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, to tell a reused pid."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[19])


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; field 22 (start time) is index 19."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()
