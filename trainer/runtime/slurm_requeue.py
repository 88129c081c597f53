"""Requeue a preempted Slurm job after the preemption checkpoint.

Slurm sends SIGUSR1 `grace_s` before a job's time limit or preemption (`--signal=USR1@GRACE` in
the script `oomless submit` writes). The engine finishes the step and checkpoints. Then:

- under the script `oomless submit` writes (it exports `OOMLESS_REQUEUE_BY_SCRIPT=1`), rank 0
  leaves `run.dir/requeue.json` and every rank exits 0, so torchrun and srun end cleanly; the
  script then requeues the job (`after_stop`). A requeue from inside the running step made Slurm
  SIGTERM both torchruns, and each printed a SignalException traceback into slurm-*.out.
- otherwise (ranks started by a script of the user's own) rank 0 asks Slurm itself
  (`requeue_if_preempted`) and the ranks exit 143.

`run.resume: auto` continues the requeued job from that checkpoint. SIGTERM and SIGINT are plain
stops.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

from trainer.core.files import write_atomic

log = logging.getLogger(__name__)

REQUEUE_TIMEOUT_S = 30
# exported by the sbatch template, launcher/slurm/templates/submit.sbatch.tmpl
REQUEUE_BY_SCRIPT_ENV = "OOMLESS_REQUEUE_BY_SCRIPT"
REQUEUE_MARKER = "requeue.json"  # left for that script by rank 0


def after_stop(signum: int, rank: int, step: int, run_dir: Path, exit_signal: int) -> int:
    """The exit code of a rank that stopped on `signum` after its checkpoint (see the module
    doc): 0 when the batch script requeues the job, else `exit_signal` (rank 0 requeued it
    itself if preempted)."""
    env = os.environ
    by_script = env.get(REQUEUE_BY_SCRIPT_ENV) == "1" and slurm_job_id(env) is not None
    if signum == signal.SIGUSR1 and by_script:
        if rank == 0:
            marker = {"step": step, "job": slurm_job_id(env)}
            write_atomic(run_dir / REQUEUE_MARKER, json.dumps(marker) + "\n")
            log.warning("checkpoint written at step %d; the batch script requeues the job", step)
        return 0
    if rank == 0:
        requeue_if_preempted(signum, rank)
    return exit_signal


def slurm_job_id(env: dict[str, str] | os._Environ) -> str | None:
    """The id `scontrol requeue` takes: `JOB_TASK` for an array task, else the job id."""
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return env.get("SLURM_JOB_ID") or None


def requeue_command(signum: int, rank: int, env: dict[str, str] | os._Environ) -> list[str] | None:
    """The requeue argv when this rank should requeue its job after `signum`, else None."""
    if signum != signal.SIGUSR1 or rank != 0:
        return None
    job_id = slurm_job_id(env)
    return None if job_id is None else ["scontrol", "requeue", job_id]


def requeue_if_preempted(signum: int, rank: int | None = None) -> bool:
    """After the checkpoint for a stop signal: requeue the Slurm job if it was SIGUSR1 (rank 0).

    `rank` defaults to $RANK (torchrun) or $SLURM_PROCID (srun), else 0. Returns True when the
    job was requeued; False when there is nothing to do (other signal, other rank, not under
    Slurm) or `scontrol` failed (logged; the run still exits 143 with its checkpoint).
    """
    env = os.environ
    if rank is None:
        rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    argv = requeue_command(signum, rank, env)
    if argv is None:
        return False
    if shutil.which(argv[0]) is None:
        log.error("SIGUSR1 under Slurm job %s but scontrol is not on PATH: not requeued", argv[2])
        return False
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.error("scontrol requeue %s timed out: not requeued", argv[2])
        return False
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", argv[2], out.stderr.strip())
        return False
    log.warning("checkpoint written; Slurm job %s requeued (run.resume: auto resumes)", argv[2])
    return True
