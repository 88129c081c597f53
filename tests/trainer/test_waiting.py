"""Ranks wait on rank 0's serial work, not on a clock (issue 20, item 1).

Two ranks with `dist.timeout_s=2`, and rank 0's tokenisation, checkpoint completion and final save
each made to take 5 s: a barrier would time out ("Timed out waiting 2000ms for recv", exit 1);
the waiting ranks instead say what they wait for and the run ends with exit 0."""

from __future__ import annotations

import pytest

from tests.test_cli_train import DEMO, metrics, oomless

pytestmark = pytest.mark.slow


def test_ranks_wait_for_slow_rank0_work_past_dist_timeout(tmp_path):
    run_dir = tmp_path / "run"
    r = oomless(
        "train", str(DEMO), "strategy=ddp", "hardware.device=cpu", "hardware.devices_per_node=2",
        "train.steps=2", "train.eval_every=0", "run.checkpoint_every=1", "dist.timeout_s=2",
        "debug.slow_rank0={tokenize_s: 5, checkpoint_s: 5, final_save_s: 5}", f"run.dir={run_dir}",
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for what in ("tokenising the data", "writing checkpoint step_1", "saving the final model"):
        assert f"[rank1] waiting for rank 0 to finish {what}: " in r.stderr, r.stderr[-4000:]
    assert "Timed out" not in r.stderr and "Traceback" not in r.stderr
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert (run_dir / "final" / "config.json").is_file()
