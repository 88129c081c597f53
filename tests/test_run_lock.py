"""One run per run.dir, and no worker outlives its supervisor."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time

import psutil
import pytest

from tests.conftest import PYTHON, REPO, kill_tree, python_env, run_bounded
from tests.test_cli_train import DEMO
from trainer.core.config import ConfigError
from trainer.core.run_lock import LOCK_FILE, acquire_run_lock


@pytest.mark.slow
def test_a_second_start_exits_2_and_a_killed_supervisor_takes_its_workers(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "train",
        str(DEMO),
        "strategy=ddp",
        "hardware.device=cpu",
        "hardware.devices_per_node=2",
        "train.steps=100000",
        "train.eval_every=0",
        "run.checkpoint_every=0",
        "run.save_final=false",
        f"run.dir={run_dir}",
    ]
    log = (tmp_path / "supervisor.log").open("w")
    proc = subprocess.Popen(
        [PYTHON, "-m", "launcher.cli", *args],
        env=python_env(),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    workers: list[psutil.Process] = []
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, (tmp_path / "supervisor.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never trained"
            time.sleep(0.5)
        before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "plan.json")}

        # a second start on the same run.dir: one line, exit 2, nothing written
        r = run_bounded([PYTHON, "-m", "launcher.cli", *args], 120, env=python_env(), cwd=REPO)
        err = r.stderr
        assert r.returncode == 2 and err.count("\n") == 1, err
        assert f"is in use by pid {proc.pid} on {socket.gethostname()}" in err
        assert {n: (run_dir / n).read_bytes() for n in before} == before

        # SIGKILL the supervisor: torchrun and both ranks go with it
        workers = psutil.Process(proc.pid).children(recursive=True)
        ranks = [p for p in workers if "torch.distributed.run" not in p.cmdline()]
        assert len(ranks) == 2, [p.cmdline() for p in workers]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(workers, timeout=120)
        assert not alive, [p.cmdline() for p in alive]
        lines = metrics.read_text().count("\n")
        time.sleep(1)
        assert metrics.read_text().count("\n") == lines  # nothing trains on
        # the ranks were stopped by SIGTERM, not killed: they wrote a checkpoint to resume from
        assert (run_dir / "checkpoints" / "latest").is_file()
    finally:
        kill_tree(proc.pid)
        for p in workers:
            kill_tree(p.pid)
        log.close()

    # the dead supervisor's lock is taken over by the next start, with a warning
    held = json.loads((run_dir / LOCK_FILE).read_text())
    assert held["pid"] == proc.pid
    with acquire_run_lock(run_dir) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not (run_dir / LOCK_FILE).exists()


def test_the_lock_of_a_live_process_refuses_a_dead_ones_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    host = socket.gethostname()
    with subprocess.Popen(["sleep", "60"]) as live:
        (run_dir / LOCK_FILE).write_text(json.dumps({"pid": live.pid, "host": host}))
        with pytest.raises(ConfigError, match=f"is in use by pid {live.pid} on {host}"):
            acquire_run_lock(run_dir)
        live.kill()
    # killed and reaped: a stale lock
    with caplog.at_level(logging.WARNING), acquire_run_lock(run_dir) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert f"taking over the lock of pid {live.pid}" in caplog.text
    # a lock on another host cannot be checked from here: it stays the user's call
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(ConfigError, match="in use by pid 1 on elsewhere"):
        acquire_run_lock(run_dir)
