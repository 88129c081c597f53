"""Runs trainings of tests/trainer/test_sequence_parallel.py one after another in one process,
under torchrun (every rank runs this); the one-process references go through tests/cli_worker.py.

`python sp_worker.py BASE_CONFIG WORK_DIR RUNS_JSON`: RUNS_JSON is a list of [name, overrides];
each run is the real engine (`run_training`) with its own run dir WORK_DIR/name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    base, work, runs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    from trainer.core.config import load_config
    from trainer.engine import run_training

    for name, overrides in runs:
        overrides = [o.replace("{work}", str(work)) for o in overrides]
        cfg = load_config(base, [*overrides, f"run.dir={work / name}"])
        code = run_training(cfg)
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    from trainer.runtime.dist import exit_without_teardown

    exit_without_teardown(main())
