"""Who requeues what after a stop signal (pure; the real requeue runs in test_cluster.py)."""

from __future__ import annotations

import signal

from trainer.runtime.slurm_requeue import requeue_command, requeue_if_preempted, slurm_job_id

JOB = {"SLURM_JOB_ID": "41"}
ARRAY = {"SLURM_JOB_ID": "57", "SLURM_ARRAY_JOB_ID": "50", "SLURM_ARRAY_TASK_ID": "7"}


def test_rank0_requeues_its_job_after_usr1():
    assert requeue_command(signal.SIGUSR1, 0, JOB) == ["scontrol", "requeue", "41"]


def test_array_task_is_requeued_by_its_task_id():
    assert slurm_job_id(ARRAY) == "50_7"
    assert requeue_command(signal.SIGUSR1, 0, ARRAY) == ["scontrol", "requeue", "50_7"]


def test_nothing_for_other_signals_other_ranks_or_outside_slurm():
    assert requeue_command(signal.SIGTERM, 0, JOB) is None  # scancel / Ctrl-C: a plain stop
    assert requeue_command(signal.SIGINT, 0, JOB) is None
    assert requeue_command(signal.SIGUSR1, 1, JOB) is None  # only rank 0 asks
    assert requeue_command(signal.SIGUSR1, 0, {}) is None  # not a Slurm job


def test_outside_slurm_requeue_is_a_no_op(monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    assert requeue_if_preempted(signal.SIGUSR1, rank=0) is False


def test_under_the_submit_script_the_ranks_exit_0_and_leave_the_requeue_to_it(
    tmp_path, monkeypatch
):
    """torchrun and srun end cleanly (exit 0); rank 0 leaves requeue.json for the script."""
    import json

    from trainer.runtime.slurm_requeue import REQUEUE_MARKER, after_stop

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("OOMLESS_REQUEUE_BY_SCRIPT", "1")
    assert after_stop(signal.SIGUSR1, 1, 7, tmp_path, 143) == 0
    assert not (tmp_path / REQUEUE_MARKER).exists()  # only rank 0 writes it
    assert after_stop(signal.SIGUSR1, 0, 7, tmp_path, 143) == 0
    assert json.loads((tmp_path / REQUEUE_MARKER).read_text()) == {"step": 7, "job": "41"}
    assert after_stop(signal.SIGTERM, 1, 7, tmp_path, 143) == 143  # scancel: a plain stop
    monkeypatch.delenv("OOMLESS_REQUEUE_BY_SCRIPT")  # ranks of a script of the user's own
    assert after_stop(signal.SIGUSR1, 1, 7, tmp_path, 143) == 143
