"""SIGKILL inside a checkpoint save at 20 different points: the next start always resumes from
the newest complete checkpoint and ends with exactly the losses of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import PYTHON, REPO, TINY_LLAMA, python_env, run_bounded

pytestmark = pytest.mark.slow
DEMO = REPO / "configs" / "demo"
NUM_POINTS = 20


def test_killed_saves_are_never_loaded_and_training_goes_on(tmp_path):
    job = {
        "model": {"config": {**TINY_LLAMA, "vocab_size": 45}, "tokenizer": str(DEMO / "tokenizer")},
        "data": {
            "path": str(DEMO / "train.jsonl"),
            "format": "prompt_completion",
            "seq_len": 32,
            "cache_dir": str(tmp_path / "cache"),
        },
        "train": {"steps": 6, "global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3},
        "precision": "fp32",
        "strategy": "single",
        "memory": {"activation_checkpointing": "none"},
        "hardware": {"device": "cpu", "devices_per_node": 1},
        "run": {"save_final": False, "checkpoint_every": 2, "keep_checkpoints": 1},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
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
