"""SIGKILL inside a checkpoint save at 20 different points: the next start always resumes from
the newest complete checkpoint and ends with exactly the losses of an uninterrupted run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PYTHON, REPO, python_env, run_bounded, write_demo_job

pytestmark = pytest.mark.slow
DEMO = REPO / "configs" / "demo"
NUM_POINTS = 20


def test_killed_saves_are_never_loaded_and_training_goes_on(tmp_path):
    config = write_demo_job(
        tmp_path / "job.yaml",
        train={"steps": 6, "global_batch_size": 4, "micro_batch_size": 2},
        strategy="single",
        run={"checkpoint_every": 2, "keep_checkpoints": 1},
    )
    r = run_bounded(
        [PYTHON, str(REPO / "tests/trainer/crash_worker.py"), str(config), str(tmp_path),
         str(NUM_POINTS)],
        env=python_env(), cwd=REPO, timeout=550,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    experiments, summary = results[:-1], results[-1]
    assert len(experiments) == NUM_POINTS
    for e in experiments:
        assert e["first_exit"] == -9, e  # killed inside a save
        assert e["second_exit"] == 0, e
        assert e["losses_equal"], e
        # whatever was left half-written, only complete checkpoints were ever resumed from
    assert summary["num_ok"] == NUM_POINTS
    # the kill points covered half-written shards, un-renamed dirs and a stale `latest`
    states = {tuple(e["after_crash"]) for e in experiments}
    assert any(any(name.endswith(".tmp") for name in s) for s in states)
    assert len(states) >= 3
