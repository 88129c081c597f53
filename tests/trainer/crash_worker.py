"""Kill a run at many points inside its checkpoint saves, restart it, and check what it learned.

Run by tests/trainer/test_checkpoint_crash.py as one process. This process imports the engine but
never computes (so forking stays safe); every training run is a forked child. For each crash point
K: a child trains with `debug.crash_in_save=K` and SIGKILLs itself at the K-th point inside its
saves; a second child starts the same run again with `run.resume: auto`. The second must resume
from the newest complete checkpoint (never a half-written one) and end with exactly the losses of
an uninterrupted run. Prints one JSON line per experiment, then a summary line.

    python tests/trainer/crash_worker.py CONFIG_YAML WORK_DIR NUM_POINTS
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def child(cfg_path: str, overrides: list[str]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from trainer.core.config import load_config
            from trainer.engine import run_training

            code = run_training(load_config(cfg_path, overrides))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def main() -> int:
    cfg_path, work, num_points = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    import trainer.engine  # noqa: F401  (import once, before forking)

    ref_dir = work / "reference"
    assert child(cfg_path, [f"run.dir={ref_dir}"]) == 0
    reference = losses(ref_dir)
    num_ok = 0
    for point in range(1, num_points + 1):
        run_dir = work / f"crash_{point}"
        first = child(cfg_path, [f"run.dir={run_dir}", f"debug.crash_in_save={point}"])
        ckpts = run_dir / "checkpoints"
        present = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
        second = child(cfg_path, [f"run.dir={run_dir}"])
        got = losses(run_dir)
        same = got == reference
        num_ok += first == -signal.SIGKILL and second == 0 and same
        print(
            json.dumps(
                {
                    "point": point,
                    "first_exit": first,
                    "second_exit": second,
                    "after_crash": present,
                    "losses_equal": same,
                }
            ),
            flush=True,
        )
    print(json.dumps({"num_points": num_points, "num_ok": num_ok}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
