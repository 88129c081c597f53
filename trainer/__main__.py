"""`python -m trainer RESOLVED_CONFIG`: what torchrun or srun runs on every rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trainer.config import ConfigError, load_config
from trainer.contract import CONFIG_ERROR_FILE


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainer RESOLVED_CONFIG", file=sys.stderr)
        return 2
    cfg = None
    try:
        cfg = load_config(argv[0])
        from trainer.dist import exit_without_teardown
        from trainer.engine import run_training

        exit_without_teardown(run_training(cfg))
    except ConfigError as err:  # bad data rows, an unreachable model: one line, exit 2
        print(err, file=sys.stderr)
        if cfg is not None:
            _leave_for_launcher(Path(cfg.run.dir), str(err))
        return 2


def _leave_for_launcher(run_dir: Path, line: str) -> None:
    """torchrun reports any failed worker as exit 1: the line tells `oomless train` it was a
    config error (exit 2). Every rank that fails writes it; the lines are the same."""
    tmp = run_dir / f".{CONFIG_ERROR_FILE}.{os.getpid()}"
    try:
        tmp.write_text(line + "\n")
        os.replace(tmp, run_dir / CONFIG_ERROR_FILE)
    except OSError:
        pass  # the run dir is gone or read-only: the line on stderr is all there is


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
