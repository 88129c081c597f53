"""A rank lost mid-run restarts from the newest checkpoint and ends with the loss of an
uninterrupted run (one reference run, shared): a rank SIGKILLed under torchrun with
--max-restarts 1, and a rank that hangs (debug.inject_hang) found by the hang watchdog
(run.hang_timeout_s), its stacks in run.dir/hang/, restarted by `oomless train`.

(The restarted ranks meet in a store namespace of their own: tests/trainer/test_restart_store.py
makes the race that used to fail here deterministic.)"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil
import pytest

from tests.conftest import PYTHON, REPO, kill_tree, oomless, python_env
from tests.test_cli_train import DEMO, metrics

pytestmark = pytest.mark.slow
STEPS = 16
COMMON = [
    "strategy=fsdp",
    "hardware.device=cpu",
    "hardware.devices_per_node=2",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "precision=fp32",
    "run.save_final=false",
    "run.checkpoint_every=4",
]


def _rank_process(root: psutil.Process, rank: int) -> psutil.Process | None:
    for proc in root.children(recursive=True):
        try:
            if proc.environ().get("RANK") == str(rank) and "trainer" in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    return None


def _kill_rank_1_after(
    proc: subprocess.Popen, metrics_path, num_steps: int
) -> psutil.Process | None:
    """SIGKILL rank 1 once `num_steps` steps are logged (a checkpoint was written at step 4)."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= num_steps:
            victim = _rank_process(psutil.Process(proc.pid), rank=1)
            if victim is not None:
                victim.send_signal(signal.SIGKILL)
                return victim
        time.sleep(0.2)
    return None


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The same run, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    r = oomless("train", str(DEMO), *COMMON, f"run.dir={run_dir}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return metrics(run_dir)


def test_killed_rank_restarts_and_finishes_like_an_uninterrupted_run(tmp_path, reference):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [PYTHON, "-m", "launcher.cli", "train", str(DEMO), *COMMON, "dist.max_restarts=1",
         f"run.dir={run_dir}"],
        env=python_env(), cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        victim = _kill_rank_1_after(proc, run_dir / "metrics.jsonl", num_steps=7)
        assert victim is not None, "never saw rank 1 running"
        _, stderr = proc.communicate(timeout=400)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, stderr[-4000:]
    assert "resumed from" in stderr
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))

    assert abs(lines[-1]["loss"] - reference[-1]["loss"]) <= 1e-5 * reference[-1]["loss"]


def test_a_hung_rank_is_named_its_stacks_kept_and_the_run_restarts_once(tmp_path, reference):
    run_dir = tmp_path / "hung"
    hang = ["run.hang_timeout_s=30", "run.max_restarts=1", "debug.inject_hang={step: 6, rank: 1}"]
    r = oomless("train", str(DEMO), *COMMON, *hang, f"run.dir={run_dir}", timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    said = [line for line in r.stderr.splitlines() if "hang at step" in line]
    assert len(said) == 1, r.stderr[-4000:]
    assert said[0].startswith("oomless: hang at step 6: rank 1 did not arrive at ")
    assert "where rank 0 waits" in said[0] and "rank 1 is at inject_hang" in said[0]
    assert "restarting after the hang (1 of run.max_restarts=1) from step_4" in r.stderr
    stacks = {n: (run_dir / "hang" / f"rank{n}.txt").read_text() for n in (0, 1)}
    assert "in inject_hang" in stacks[1] and "in all_reduce" in stacks[0], stacks
    report = json.loads((run_dir / "hang" / "report.json").read_text())
    assert report["ranks"] == [1] and report["step"] == 6
    (escalation,) = [
        json.loads(x) for x in (run_dir / "escalations.jsonl").read_text().splitlines()
    ]
    assert escalation["step"] == 6 and escalation["reason"].startswith("hang: hang at step 6")
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for got, want in zip(lines, reference, strict=True):  # resumed exactly: the same losses
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (got, want)
