"""`python -m trainer RESOLVED_CONFIG`: what torchrun or srun runs on every rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trainer.core.config import ConfigError, load_config
from trainer.core.contract import CONFIG_ERROR_FILE
from trainer.core.files import write_atomic
from trainer.core.logs import redact
from trainer.core.run_lock import acquire_run_lock, die_with_parent, exit_if_orphaned
from trainer.runtime.host_heap import bound_heap_retention


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainer RESOLVED_CONFIG", file=sys.stderr)
        return 2
    bound_heap_retention()  # before any tensor: freed host tensors leave the resident set
    # A rank dies with its parent (torchrun, or srun's task): never trains on as an orphan.
    parent = os.getppid()
    die_with_parent()
    exit_if_orphaned(parent)
    cfg = None
    try:
        cfg = load_config(argv[0])
        # Global rank 0 holds run.dir for the run (a Slurm job, a torchrun started by hand);
        # under `oomless train` the supervisor's lock is recognised and kept by the supervisor.
        lock = acquire_run_lock(cfg.run.dir) if os.environ.get("RANK", "0") == "0" else None
        from trainer.engine import run_training

        try:
            return run_training(cfg)
        finally:
            if lock is not None:
                lock.release()
    except ConfigError as err:  # bad data rows, an unreachable model: one line, exit 2
        line = redact(str(err))  # a data or model URL can carry a password
        # one write, atomic on a pipe: every rank says the same line into torchrun's one stderr,
        # and print()'s two writes (the text, then the newline) could interleave into a blank line
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        if cfg is not None:
            _leave_for_launcher(Path(cfg.run.dir), line)
        return 2


def _leave_for_launcher(run_dir: Path, line: str) -> None:
    """torchrun reports any failed worker as exit 1: the line tells `oomless train` it was a
    config error (exit 2). Every rank that fails writes it; the lines are the same."""
    try:
        write_atomic(run_dir / CONFIG_ERROR_FILE, line + "\n")
    except OSError:
        pass  # the run dir is gone or read-only: the line on stderr is all there is


def _exit(code: int | str | None) -> None:
    """Every way out of a rank skips the interpreter's teardown once torch is loaded (a config
    error or a peer's failure after the process group exists too): trainer/runtime/dist.py."""
    if "torch" not in sys.modules:
        sys.exit(code)
    from trainer.runtime.dist import exit_without_teardown

    if not isinstance(code, int):  # SystemExit("message") or SystemExit(None)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    exit_without_teardown(code)


if __name__ == "__main__":
    try:
        _exit(main(sys.argv[1:]))
    except SystemExit as stop:  # a rank told to stop by its peers (trainer/runtime/dist.py)
        _exit(stop.code)
