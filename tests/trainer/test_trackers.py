"""Experiment trackers, end to end through `oomless train` on one CPU process: TensorBoard, W&B
(offline), MLflow (file store in run.dir) and Trackio (local store) receive every metrics.jsonl
record, read back here with each library's own reader; an escalated run (out of memory on
`single` at step 6, the next rung resumes from the step-4 checkpoint) continues the same
tracker run and records the back-offs and the escalation as events; a tracker whose library is
missing costs one warning line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import PYTHON, REPO, python_env, run_bounded, write_demo_job

pytestmark = pytest.mark.slow
DEMO = REPO / "configs" / "demo"
STEPS = 10
ALL = "run.trackers=[tensorboard, wandb, mlflow, trackio]"


def _job(tmp: Path) -> Path:
    return write_demo_job(
        tmp / "job.yaml",
        train={"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4},
        run={"checkpoint_every": 4},
    )


def _train(job: Path, run_dir: Path, *overrides: str, env: dict | None = None):
    return run_bounded(
        [PYTHON, "-m", "launcher.cli", "train", str(job), f"run.dir={run_dir}", *overrides],
        env=env or _env(job.parent),
        cwd=REPO,
        timeout=400,
    )


def _env(tmp: Path) -> dict[str, str]:
    env = python_env()
    env["TRACKIO_DIR"] = str(tmp / "trackio")
    for key in list(env):  # offline by default: nothing here may reach a tracking server
        if key.startswith(("WANDB_", "MLFLOW_")):
            del env[key]
    return env


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def escalated(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("trackers")
    job = _job(tmp)
    run_dir = tmp / "run"
    r = _train(
        job,
        run_dir,
        ALL,
        "run.name=tracked",
        "debug.inject_oom={step: 6, times: 0, where: forward, strategies: [single]}",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return run_dir, r.stderr


def test_the_run_escalated_and_resumed_from_step_4(escalated):
    run_dir, stderr = escalated
    assert "escalating single -> " in stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'step_4'}" in stderr
    assert sorted(_losses(run_dir)) == list(range(1, STEPS + 1))
    for name in ("tensorboard", "wandb", "mlflow", "trackio"):
        assert f"tracking in {name}" in stderr
    # oomless's own lines only: no library warnings (the checkpoint's single-process notice)
    assert "UserWarning" not in stderr and "FutureWarning" not in stderr, stderr[-3000:]


def test_tensorboard_loss_equals_metrics(escalated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = escalated
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    # the second attempt purged the first one's steps after its checkpoint (step 5)
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == pytest.approx(_losses(run_dir), rel=1e-6)  # TensorBoard keeps float32
    events = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/text_summary")]
    assert any("out of memory in forward" in e for e in events), events
    assert any(e.startswith("escalated single -> ") for e in events), events


def test_mlflow_loss_equals_metrics_in_one_run(escalated):
    from mlflow.tracking import MlflowClient

    run_dir, _ = escalated
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("oomless")
    (run,) = client.search_runs([experiment.experiment_id])  # both attempts: one run
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    expected = _losses(run_dir)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step for m in history} == set(expected)
    for m in history:  # step 5 twice: once before the OOM, again after the resume
        assert m.value == pytest.approx(expected[m.step], rel=1e-12)
    assert len(history) == STEPS + 1
    events = [v for k, v in run.data.tags.items() if k.startswith("event.")]
    assert any("escalated single -> " in e for e in events), events
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["mlflow"]["run_id"] == run.info.run_id


def test_wandb_offline_runs_share_one_id_and_log_every_step(escalated):
    run_dir, _ = escalated
    state = json.loads((run_dir / "trackers.json").read_text())
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per attempt: W&B's offline mode writes a file per process run
    assert {f.stem for f in files} == {f"run-{state['wandb']['id']}"}
    expected = _losses(run_dir)
    logged: dict[int, list[float]] = {}
    for f in files:
        for step, values in _wandb_history(f):
            if "loss" in values:
                logged.setdefault(step, []).append(values["loss"])
    assert set(logged) == set(expected)
    for step, values in logged.items():
        assert values == pytest.approx([expected[step]] * len(values), rel=1e-12)


def test_trackio_loss_equals_metrics_in_one_run(escalated):
    run_dir, _ = escalated
    os.environ["TRACKIO_DIR"] = str(run_dir.parent / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_runs("oomless") == ["tracked"]
    logs = SQLiteStorage.get_logs("oomless", "tracked")
    expected = _losses(run_dir)
    logged = {}
    for row in logs:
        if "loss" in row:
            logged[row["step"]] = row["loss"]
    assert logged == pytest.approx(expected, rel=1e-12)
    alerts = SQLiteStorage.get_alerts("oomless", run_name="tracked")
    assert any("escalated single -> " in (a.get("text") or "") for a in alerts), alerts


def test_a_missing_tracker_library_is_one_warning_line(tmp_path):
    """wandb shadowed by a module that fails to import, as an uninstalled one does."""
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n"
    )
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), env["PYTHONPATH"]])
    job = _job(tmp_path)
    run_dir = tmp_path / "run"
    r = _train(job, run_dir, "run.trackers=[wandb, tensorboard]", "train.steps=3", IN_THIS_PROCESS,
               env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [line for line in r.stderr.splitlines() if "wandb" in line]
    assert warned == [
        "run.trackers: wandb is not installed (No module named 'wandb'): "
        "pip install 'oomless[wandb]'; training goes on without it"
    ]
    assert sorted(_losses(run_dir)) == [1, 2, 3]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def _wandb_history(path: Path):
    """(step, {key: value}) of the history records in a W&B transaction log (.wandb): W&B's
    own protobuf records, in the LevelDB log framing wandb-core writes them with (7-byte file
    header, 32 KiB blocks, 7-byte chunk headers: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        chunks = chunk if kind in (1, 2) else chunks + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: i.value_json for i in record.history.item}
                yield record.history.step.num, {k: json.loads(v) for k, v in items.items()}
