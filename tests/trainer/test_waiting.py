"""Ranks wait on rank 0's serial work, not on a clock; what waits on
something outside the run (an async checkpoint's writes, scontrol) has a bound (item 3).

Two ranks with `dist.timeout_s=2`, and rank 0's tokenisation made to take 5 s (the ranks start
apart), its checkpoint completions (steps 1 and 2) and final save 3 s each (the ranks leave the
step together): a barrier would time out ("Timed out waiting 2000ms for recv", exit 1); the
waiting ranks instead say what they wait for and the run ends with exit 0."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import pytest

from tests.conftest import oomless
from tests.test_cli_train import DEMO, metrics
from trainer.runtime.dist import slurm_head_node, wait_for_future


@pytest.mark.slow
def test_ranks_wait_for_slow_rank0_work_past_dist_timeout(tmp_path):
    run_dir = tmp_path / "run"
    r = oomless(
        "train", str(DEMO), "strategy=ddp", "hardware.device=cpu", "hardware.devices_per_node=2",
        "train.steps=2", "train.eval_every=0", "run.checkpoint_every=1", "dist.timeout_s=2",
        "debug.slow_rank0={tokenize_s: 5, checkpoint_s: 3, final_save_s: 3}", f"run.dir={run_dir}",
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for what in ("tokenising the data", "writing checkpoint step_1", "saving the final model"):
        assert f"[rank1] waiting for rank 0 to finish {what}: " in r.stderr, r.stderr[-4000:]
    assert "Timed out" not in r.stderr and "Traceback" not in r.stderr
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"  # the last step
    assert (run_dir / "final" / "config.json").is_file()


def test_an_async_checkpoint_write_that_never_ends_is_bounded(caplog):
    """Checkpointer.finish waited on the background write with future.result(): forever."""
    never = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(never.wait, 60)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError) as err:
            wait_for_future(stuck, "the background write of checkpoint step_4", 1.0, 0.3)
        assert time.monotonic() - start < 5
        assert str(err.value).startswith(
            "the background write of checkpoint step_4 did not finish in 1 s (dist.timeout_s)"
        )
        assert "still waiting for the background write of checkpoint step_4" in caplog.text
        assert wait_for_future(pool.submit(lambda: 7), "quick", 5.0) == 7
        never.set()


def test_an_unresponsive_scontrol_is_bounded(tmp_path, monkeypatch):
    """srun tasks read the head node with `scontrol show hostnames`, which had no timeout."""
    fake = tmp_path / "scontrol"  # stands for a slurmctld that does not answer
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not answer in 1 s \(is slurmctld reachable\?\)"):
        slurm_head_node("node[1-2]", timeout_s=1)
    assert time.monotonic() - start < 10
