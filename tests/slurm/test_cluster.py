"""End to end on a real Slurm cluster: `oomless submit` runs a two-node job; USR1 requeues it;
a lost node (elastic.min_nodes) leaves the job on the node left.

Needs the local two-node cluster (`slurm/dev-cluster/start.sh`, as root; `.ci/run` starts it);
skipped with the reason when `sinfo` does not show nodes n1 and n2 up. Both nodes share this
machine, so each job is two CPU ranks on one host, one per Slurm node.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import PYTHON, REPO, python_env

pytestmark = pytest.mark.slow

DEMO = REPO / "configs" / "demo.yaml"
NUM_STEPS = 40
JOB_TIMEOUT_S = 240
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _cluster_up() -> str | None:
    """None when the local cluster is up, else why the tests skip."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        return f"no Slurm here ({err}); start one with slurm/dev-cluster/start.sh (root)"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}; start slurm/dev-cluster/start.sh (root)"
    states = dict(line.split()[:2] for line in out.stdout.splitlines() if line.strip())
    up = {"idle", "mixed", "allocated"}
    if not all(states.get(node) in up for node in ("n1", "n2")):
        return f"local cluster nodes n1/n2 not up ({states}); run slurm/dev-cluster/start.sh"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster():
    reason = _cluster_up()
    if reason:
        pytest.skip(reason)


def _submit(run_dir: Path, *overrides: str) -> str:
    out = subprocess.run(
        [PYTHON, "-m", "launcher.cli", "submit", str(DEMO), f"run.dir={run_dir}",
         "hardware.device=cpu", "hardware.nodes=2", "hardware.devices_per_node=1",
         "hardware.host_memory=16GiB", "strategy=fsdp", f"train.steps={NUM_STEPS}",
         "train.eval_every=0", "train.log_every=10", "run.save_final=false",
         "slurm.time=00:10:00", "slurm.grace_s=60", "slurm.setup=[export OMP_NUM_THREADS=1]",
         *overrides],
        capture_output=True, text=True, env=python_env(), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    job_id = out.stdout.strip().splitlines()[-1]
    assert job_id.isdigit(), out.stdout
    return job_id


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    fields = (item.split("=", 1) for item in out.stdout.split() if "=" in item)
    return {key: value for key, value in fields}


def _wait(job_id: str, run_dir: Path) -> dict[str, str]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        job = _job(job_id)
        if job.get("JobState") in TERMINAL:
            return job
        time.sleep(1)
    subprocess.run(["scancel", job_id], timeout=30)
    pytest.fail(f"job {job_id} not done in {JOB_TIMEOUT_S}s: {_failure(run_dir)}")


def _log(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("slurm-*.out")))


def _failure(run_dir: Path) -> str:
    """What a failed job's log says first and last: with --kill-on-bad-exit the tail is the
    other node's SIGTERM, and the cause is the first error above it."""
    log = _log(run_dir)
    first = min(
        (i for i in (log.find(m) for m in ("Traceback", "terminate called", "error")) if i >= 0),
        default=0,
    )
    return f"{log[max(first - 500, 0) : first + 2500]}\n...\n{log[-2000:]}"


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("slurm") / "whole"
    job_id = _submit(run_dir)
    job = _wait(job_id, run_dir)
    assert job["JobState"] == "COMPLETED", f"{job}\n{_failure(run_dir)}"
    assert job["ExitCode"] == "0:0"
    return _metrics(run_dir)


def test_two_node_job_completes_with_world_size_two(uninterrupted):
    """Sized to the nodes as sinfo has them (2 CPUs here; main asked 8 and pended forever)."""
    assert [r["step"] for r in uninterrupted] == list(range(1, NUM_STEPS + 1))
    assert {r["world_size"] for r in uninterrupted} == {2}
    assert {r["strategy"] for r in uninterrupted} == {"fsdp"}
    assert uninterrupted[-1]["loss"] < uninterrupted[0]["loss"]


def test_usr1_checkpoints_requeues_and_resumes_bit_exact(uninterrupted, tmp_path):
    run_dir = tmp_path / "preempted"
    job_id = _submit(run_dir)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(_metrics(run_dir)) < 5:  # mid-run: a few steps done
        assert _job(job_id).get("JobState") not in TERMINAL, _failure(run_dir)
        assert time.monotonic() < deadline, "no training steps before the deadline"
        time.sleep(0.2)
    # Slurm's preemption/time-limit warning: USR1 to every task of the job's steps (torchrun).
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)
    job = _wait_requeued_and_done(job_id, run_dir, deadline)
    log = _log(run_dir)
    assert job["JobState"] == "COMPLETED", f"{job}\n{_failure(run_dir)}"
    assert int(job["Restarts"]) == 1, job
    assert "restart 1" in log, log[-3000:]
    # the ranks exit 0 and the batch script requeues: no torchrun killed mid-run, no tracebacks
    assert "oomless: preempted; checkpoint written; requeueing job" in log, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, _failure(run_dir)
    assert list(run_dir.glob("checkpoints/step_*")), "no preemption checkpoint"
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))  # contiguous, no repeats
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted]  # bit-exact, fp32


def _wait_requeued_and_done(job_id: str, run_dir: Path, deadline: float) -> dict[str, str]:
    """The job goes back to the queue (Restarts 1) and then finishes."""
    while time.monotonic() < deadline:
        job = _job(job_id)
        if job.get("JobState") in TERMINAL:
            return job
        time.sleep(1)
    subprocess.run(["scancel", job_id], timeout=30)
    pytest.fail(f"job {job_id} not done after USR1: {_failure(run_dir)}")


def test_the_local_cluster_declares_this_machines_cpus_and_memory():
    """Real sizes, not generous ones: a job that asks a node for more than the machine has
    pends here as it would on a real cluster."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %c %m"], capture_output=True, text=True, timeout=30
    )
    mem_total_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    for line in out.stdout.splitlines():
        _, cpus, memory_mb = line.split()
        assert int(cpus) == os.cpu_count() and int(memory_mb) == mem_total_mb, line


def test_a_submit_the_partition_cannot_hold_exits_3_naming_it(tmp_path):
    """A plan whose host memory per node is more than the partition's nodes have: exit 3 in one
    line, nothing written, no job (main printed a job id that then pended forever)."""
    run_dir = tmp_path / "big"
    argv = [
        PYTHON, "-m", "launcher.cli", "submit", str(REPO / "configs/models/llama-3.1-8b.yaml"),
        f"run.dir={run_dir}", "hardware.device=cpu", "hardware.nodes=2",
        "hardware.devices_per_node=1", "hardware.host_memory=512GiB",
        "hardware.device_memory=512GiB",
    ]  # fmt: skip
    dry = subprocess.run(
        [*argv, "--dry-run"], capture_output=True, text=True, env=python_env(), cwd=REPO,
        timeout=120,
    )  # fmt: skip
    assert "oomless submit: would exit 3 here: the plan needs" in dry.stderr, dry.stderr
    out = subprocess.run(argv, capture_output=True, text=True, env=python_env(), cwd=REPO,
                         timeout=120)  # fmt: skip
    if out.returncode == 0:  # submitted: take it out of the queue again
        subprocess.run(["scancel", out.stdout.strip().splitlines()[-1]], timeout=30)
    assert out.returncode == 3, (out.stdout, out.stderr[-2000:])
    (line,) = out.stderr.strip().splitlines()
    assert "GiB host memory per node and partition debug's nodes have" in line, line
    assert not run_dir.exists()


def test_two_node_losses_equal_a_two_process_local_run(uninterrupted, tmp_path):
    """The Slurm job (two nodes x one rank) trains exactly like `oomless train` with 2 ranks."""
    run_dir = tmp_path / "local"
    out = subprocess.run(
        [PYTHON, "-m", "launcher.cli", "train", str(DEMO), f"run.dir={run_dir}",
         "hardware.device=cpu", "hardware.nodes=1", "hardware.devices_per_node=2",
         "hardware.host_memory=16GiB", "strategy=fsdp", f"train.steps={NUM_STEPS}",
         "train.eval_every=0", "train.log_every=10", "run.save_final=false"],
        capture_output=True, text=True, env={**python_env(), "OMP_NUM_THREADS": "1"}, cwd=REPO,
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    records = _metrics(run_dir)
    assert {r["world_size"] for r in records} == {2}
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted]


def test_a_lost_node_continues_on_the_one_left_with_the_same_batch(uninterrupted, tmp_path):
    """elastic.min_nodes=1: n2 goes DOWN mid-run; the job keeps its allocation, re-plans for n1
    (the same global batch of 16: micro-batch 8 x 2 ranks becomes 16 x 1), resumes from the
    newest checkpoint and ends COMPLETED with every step, as one node resumed from there would."""
    run_dir = tmp_path / "elastic"
    job_id = _submit(
        run_dir, "elastic.min_nodes=1", "run.checkpoint_every=5", "run.keep_checkpoints=10"
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(_metrics(run_dir)) < 12:
        assert _job(job_id).get("JobState") not in TERMINAL, _failure(run_dir)
        assert time.monotonic() < deadline, "no training steps before the deadline"
        time.sleep(0.2)
    down = ["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=oomless-elastic-test"]
    try:
        subprocess.run(down, check=True, timeout=30)
        job = _wait(job_id, run_dir)
    finally:  # the cluster as the other tests need it (slurmd on n2 re-registers by itself)
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], timeout=30)
        while _cluster_up() and time.monotonic() < deadline + 60:
            time.sleep(1)
    assert job["JobState"] == "COMPLETED", f"{job}\n{_failure(run_dir)}"
    log = _log(run_dir)
    assert "oomless: continuing on 1 node(s): n1" in log, log[-3000:]
    (lost,) = [json.loads(x) for x in (run_dir / "escalations.jsonl").read_text().splitlines()]
    assert lost["reason"].startswith("node lost: 2 -> 1 nodes"), lost
    resumed = lost["step"]
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    assert [r["world_size"] for r in records] == [2] * resumed + [1] * (NUM_STEPS - resumed)
    assert {r["micro_batch_size"] * r["grad_accum"] * r["world_size"] for r in records} == {16}
    assert [r["loss"] for r in records[:resumed]] == [r["loss"] for r in uninterrupted[:resumed]]

    reference = tmp_path / "one-node"
    out = subprocess.run(
        [PYTHON, "-m", "launcher.cli", "train", str(DEMO), f"run.dir={reference}",
         "hardware.device=cpu", "hardware.nodes=1", "hardware.devices_per_node=1",
         "hardware.host_memory=16GiB", "strategy=fsdp", f"train.steps={NUM_STEPS}",
         "train.eval_every=0", "train.log_every=10", "run.save_final=false",
         f"run.resume={run_dir / 'checkpoints' / f'step_{resumed}'}", IN_THIS_PROCESS],
        capture_output=True, text=True, env={**python_env(), "OMP_NUM_THREADS": "1"}, cwd=REPO,
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    after = _metrics(reference)
    assert [r["step"] for r in after] == list(range(resumed + 1, NUM_STEPS + 1))
    for got, want in zip(records[resumed:], after, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-4 * want["loss"], (got, want)
