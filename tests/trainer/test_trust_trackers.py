"""Trackers under faults: a tracker whose calls block never delays the run or its stop,
and a tracking URI's password never reaches the log or a run file.

The blocking tracker is a fault injection, registered in `TRACKERS` under a name the config
accepts, as the real ones are: its `log` waits forever, as a client stuck on a dead
connection does. The password test runs the real MLflow client against a port nobody listens on.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, kill_tree, oomless, python_env, write_demo_job
from trainer.core.contract import CHECKPOINTS_DIR
from trainer.observe import trackers


class HangingTracker:
    """Starts at once; every `log` blocks forever (events and close return)."""

    name = "tensorboard"
    extra = "tensorboard"

    def __init__(self, run: trackers.TrackedRun):
        self.where = "a tracker whose log call never returns"
        self.state = {"started": True}

    def log(self, step: int, values: dict[str, float]) -> None:
        threading.Event().wait()

    def event(self, step: int, text: str) -> None:
        pass

    def close(self, status: str) -> None:
        pass


class SlowStartTracker(HangingTracker):
    def __init__(self, run: trackers.TrackedRun):
        threading.Event().wait()


def _record(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "tokens_per_s": 10.0}


def test_a_hung_log_call_never_blocks_the_loop_and_drops_the_tracker(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", HangingTracker)
    monkeypatch.setattr(trackers, "CALL_DEADLINE_S", 0.5)
    with caplog.at_level(logging.INFO):
        t = trackers.Trackers.start(["tensorboard"], tmp_path, "r", 0, enabled=True)
        assert "tracking in tensorboard: a tracker whose log call never returns" in caplog.text
        t0 = time.monotonic()
        for step in range(1, 4):
            t.log(_record(step))  # queued: the first one hangs on the tracker's thread
        logging.getLogger("trainer.runtime.signals").warning(
            "received SIGTERM: stopping after this step"
        )
        assert time.monotonic() - t0 < 0.2
        time.sleep(0.7)
        t.log(_record(4))
        assert "run.trackers: tensorboard has not returned from a call in " in caplog.text
        assert t.workers == []
        t0 = time.monotonic()
        t.close(143)
        assert time.monotonic() - t0 < 0.2  # nothing left to wait for


def test_close_after_a_stop_waits_at_most_the_stop_deadline(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", HangingTracker)
    monkeypatch.setattr(trackers, "STOP_CLOSE_DEADLINE_S", 0.5)
    t = trackers.Trackers.start(["tensorboard"], tmp_path, "r", 0, enabled=True)
    t.log(_record(1))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        t.close(143)
    assert 0.4 < time.monotonic() - t0 < 1.0
    assert "run.trackers: tensorboard did not close within 0.5 s" in caplog.text


def test_a_stop_signal_that_exits_0_still_closes_within_the_stop_deadline(tmp_path, monkeypatch):
    """SIGUSR1 under a batch script that requeues: exit 0, but still inside Slurm's grace."""
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", HangingTracker)
    monkeypatch.setattr(trackers, "STOP_CLOSE_DEADLINE_S", 0.5)
    t = trackers.Trackers.start(["tensorboard"], tmp_path, "r", 0, enabled=True)
    t.log(_record(1))
    logging.getLogger("trainer.runtime.signals").warning(
        "received SIGUSR1: stopping after this step"
    )
    t0 = time.monotonic()
    t.close(0)
    assert time.monotonic() - t0 < 1.0  # not CLOSE_DEADLINE_S


def test_a_tracker_that_does_not_start_in_time_is_left_out(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", SlowStartTracker)
    monkeypatch.setattr(trackers, "START_DEADLINE_S", 0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        t = trackers.Trackers.start(["tensorboard"], tmp_path, "r", 0, enabled=True)
    assert time.monotonic() - t0 < 1.0
    assert "run.trackers: tensorboard did not start within 0.5 s" in caplog.text
    t.log(_record(1))
    t.close(0)


_RUN_WITH_A_HANGING_TRACKER = """
import sys
from trainer.observe import trackers
from tests.trainer.test_trust_trackers import HangingTracker
trackers.TRACKERS["tensorboard"] = HangingTracker
from launcher.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_with_a_hung_tracker_checkpoints_and_exits_143_quickly(tmp_path):
    job = write_demo_job(
        tmp_path / "job.yaml",
        train={"steps": 2000, "global_batch_size": 8, "micro_batch_size": 4},
        run={"checkpoint_every": 0, "trackers": ["tensorboard"]},
    )
    run = tmp_path / "run"
    # run.max_restarts=0: the engine runs in this process, whose tracker is patched
    argv = [PYTHON, "-c", _RUN_WITH_A_HANGING_TRACKER, "train", str(job), f"run.dir={run}",
            "run.max_restarts=0"]  # fmt: skip
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=python_env(),
        cwd=REPO,
    )  # fmt: skip
    lines: list[str] = []
    watchdog = threading.Timer(300, kill_tree, [proc.pid])  # a loop stuck in a tracker call
    watchdog.start()
    try:
        for line in proc.stderr:  # "step    3/2000 | loss ...": step 3 done
            lines.append(line)
            if line.startswith("step") and line.split()[1].startswith("3/"):
                break
        proc.send_signal(signal.SIGTERM)
        stopped_at = closed_at = None  # the checkpoint written; the trackers closed
        for line in proc.stderr:  # without the deadlines: never ends (the watchdog kills it)
            lines.append(line)
            if line.startswith("stopped by SIGTERM"):
                stopped_at = time.monotonic()
            if line.startswith("run.trackers: tensorboard did not close within"):
                closed_at = time.monotonic()
        rc = proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        kill_tree(proc.pid)
    log = "".join(lines)
    assert rc == 143, log[-4000:]
    assert stopped_at is not None, log[-3000:]
    if closed_at is not None:  # still hung at the stop: closing it costs at most the deadline
        assert closed_at - stopped_at < trackers.STOP_CLOSE_DEADLINE_S + 1.5
    assert "received SIGTERM: stopping after this step" in log
    assert "tensorboard has not returned from a call" in log or closed_at is not None, log
    checkpoints = [p.name for p in (run / CHECKPOINTS_DIR).glob("step_*")]
    assert len(checkpoints) == 1 and int(checkpoints[0].removeprefix("step_")) >= 3, checkpoints


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_tracking_uri_password_is_in_no_log_line_and_no_run_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret-pw@127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    job = write_demo_job(
        tmp_path / "job.yaml",
        train={"steps": 2, "global_batch_size": 8, "micro_batch_size": 4},
        run={"trackers": ["mlflow"]},
    )
    run = tmp_path / "run"
    r = oomless("train", str(job), f"run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "http://alice:***@127.0.0.1" in r.stderr  # the URI was printed: redacted
    assert "s3cret" not in r.stderr + r.stdout
    for path in Path(run).rglob("*"):
        if path.is_file():
            assert b"s3cret" not in path.read_bytes(), path
