"""Kill a run at many points inside its checkpoint saves, restart it, and check what it learned.

Run by tests/trainer/test_checkpoint_crash.py as one process. This process imports the engine but
never computes (so forking stays safe); every training run is a forked child. For each crash point
K: a child trains with `debug.crash_in_save=K` and SIGKILLs itself at the K-th point inside its
saves; a second child starts the same run again with `run.resume: auto`. The second must resume
from the newest complete checkpoint (never a half-written one) and end with exactly the losses of
an uninterrupted run. Two experiments run at a time, each a forked process on one thread (the
reference too, so the losses compare at the same thread count). Prints one JSON line per
experiment, in order, then a summary line.

    python tests/trainer/crash_worker.py CONFIG_YAML WORK_DIR NUM_POINTS
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

PARALLEL = 2  # experiments at a time: the CI machine's cores


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


def experiment(cfg_path: str, run_dir: Path, point: int, reference: dict[int, float]) -> dict:
    """Kill a run at save point `point`, start it again, and compare what it learned."""
    first = child(cfg_path, [f"run.dir={run_dir}", f"debug.crash_in_save={point}"])
    ckpts = run_dir / "checkpoints"
    present = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    second = child(cfg_path, [f"run.dir={run_dir}"])
    return {
        "point": point,
        "first_exit": first,
        "second_exit": second,
        "after_crash": present,
        "losses_equal": losses(run_dir) == reference,
    }


def main() -> int:
    cfg_path, work, num_points = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    import torch

    import trainer.engine  # noqa: F401  (import once, before forking)

    torch.set_num_threads(1)
    ref_dir = work / "reference"
    assert child(cfg_path, [f"run.dir={ref_dir}"]) == 0
    reference = losses(ref_dir)
    running: dict[int, int] = {}  # pid -> point
    for point in [*range(1, num_points + 1), None]:
        while running and (point is None or len(running) == PARALLEL):
            pid, _ = os.wait()
            running.pop(pid, None)
        if point is None:
            break
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                result = experiment(cfg_path, work / f"crash_{point}", point, reference)
                (work / f"crash_{point}.json").write_text(json.dumps(result))
                code = 0
            finally:
                os._exit(code)
        running[pid] = point
    results = [json.loads((work / f"crash_{p}.json").read_text()) for p in range(1, num_points + 1)]
    for result in results:
        print(json.dumps(result), flush=True)
    num_ok = sum(
        r["first_exit"] == -signal.SIGKILL and r["second_exit"] == 0 and r["losses_equal"]
        for r in results
    )
    print(json.dumps({"num_points": num_points, "num_ok": num_ok}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
