"""Experiment trackers: rank 0 sends every metrics.jsonl record, the resolved config, the plan and
the run's events (escalations, out-of-memory back-offs) to TensorBoard, W&B, MLflow or Trackio.

One small class per tracker, each talking to its own library (an optional extra:
`pip install 'oomless[tensorboard]'`). Everything stays on this machine unless the user's
environment says otherwise: W&B runs offline unless WANDB_MODE is set, MLflow writes to
run.dir/mlruns unless MLFLOW_TRACKING_URI is set, Trackio writes to its local store (TRACKIO_DIR).
Credentials come from those libraries' own environment variables and are never written here.

A resumed or escalated run continues the same tracker run: the ids live in run.dir/trackers.json.
A library that is missing, or a tracker that fails mid-run, costs one warning line, never the run.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.core.contract import CONFIG_FILE, ESCALATIONS_FILE, PLAN_FILE, TRACKERS_FILE
from trainer.core.files import write_atomic

log = logging.getLogger(__name__)

PROJECT = "oomless"  # the W&B project, MLflow experiment and Trackio project unless set otherwise


@dataclass
class TrackedRun:
    """What a tracker needs to start: where the run lives, its name, and what to record first."""

    dir: Path
    name: str
    start_step: int  # optimizer steps already done (a resumed run continues after them)
    config: dict[str, Any]
    plan: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)  # this tracker's ids from trackers.json


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics.jsonl record, under the same names (no `step`)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class TensorBoardTracker:
    """Event files in run.dir/tensorboard; a resumed run drops the steps after its checkpoint."""

    name = "tensorboard"
    extra = "tensorboard"

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run.dir / "tensorboard"
        # purge_step: events at or after it, from the attempt before, are hidden on reading
        purge = run.start_step + 1 if run.start_step else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)
        if not run.start_step:
            self.writer.add_text("config", _code_block(json.dumps(run.config, indent=2)), 0)
        self.writer.add_text("plan", _code_block(json.dumps(run.plan, indent=2)), run.start_step)
        self.where = str(self.log_dir)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def event(self, step: int, text: str) -> None:
        self.writer.add_text("events", text, step)

    def close(self, status: str) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, offline unless WANDB_MODE says otherwise; the same run id after a resume."""

    name = "wandb"
    extra = "wandb"

    def __init__(self, run: TrackedRun):
        import wandb

        self.run_id = run.state.get("id") or uuid.uuid4().hex[:8]
        mode = os.environ.get("WANDB_MODE", "offline")
        settings = wandb.Settings(
            console="off", silent=True, disable_git=True, x_disable_stats=True
        )
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=run.name,
            id=self.run_id,
            resume="allow",
            dir=str(run.dir),
            mode=mode,
            config={"config": run.config, "plan": run.plan},
            allow_val_change=True,
            settings=settings,
        )
        self.state = {"id": self.run_id}
        self.where = f"{mode}, run {self.run_id} in {run.dir / 'wandb'}"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def event(self, step: int, text: str) -> None:
        self.run.log({"event": text}, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class MlflowTracker:
    """An MLflow run in run.dir/mlruns (or MLFLOW_TRACKING_URI); the config and plan as
    artifacts, events as tags; a resumed run logs into the same run id."""

    name = "mlflow"
    extra = "mlflow"

    def __init__(self, run: TrackedRun):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = (run.dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps its file store in maintenance mode behind this switch; its database
            # store needs SQLAlchemy and costs ~10 s of migrations per new run dir
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = run.state.get("run_id")
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment, run_name=run.name).info.run_id
            self.client.log_dict(self.run_id, run.config, "config.json")
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self.client.log_dict(self.run_id, run.plan, f"plan-from-step-{run.start_step}.json")
        self.num_events = int(run.state.get("num_events", 0))
        self.state = {"run_id": self.run_id, "num_events": self.num_events}
        self.where = f"run {self.run_id} at {uri}"

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def event(self, step: int, text: str) -> None:
        self.num_events += 1
        self.state["num_events"] = self.num_events
        self.client.set_tag(self.run_id, f"event.{self.num_events:03d}", f"step {step}: {text}")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class TrackioTracker:
    """A Trackio run in its local store (TRACKIO_DIR); events as Trackio alerts; a resumed run
    continues the run of the same name."""

    name = "trackio"
    extra = "trackio"

    def __init__(self, run: TrackedRun):
        import trackio

        self.trackio = trackio
        resuming = "name" in run.state
        self.run_name = run.state.get("name", run.name)
        with _quiet_stdout():  # trackio prints its own banner lines
            self.run = trackio.init(
                project=PROJECT,
                name=self.run_name,
                resume="must" if resuming else "never",
                config={"config": run.config, "plan": run.plan},
                embed=False,
                auto_log_gpu=False,
                auto_log_cpu=False,
            )
        self.state = {"name": self.run_name}
        self.where = f"project {self.run.project}, run {self.run_name}"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def event(self, step: int, text: str) -> None:
        with _quiet_stdout():
            self.run.alert(title=f"step {step}", text=text, level=self.trackio.AlertLevel.WARN)

    def close(self, status: str) -> None:
        with _quiet_stdout():
            self.trackio.finish()


TRACKERS = {
    cls.name: cls for cls in (TensorBoardTracker, WandbTracker, MlflowTracker, TrackioTracker)
}


class Trackers:
    """The configured trackers of one run, on rank 0 (elsewhere: none, every call a no-op).

    Every call goes to each tracker; one that raises is dropped with one warning line. Warnings
    logged by the engine while the trackers are open (out-of-memory back-offs, a stop by
    signal) go to them as events, and so do escalations the supervisor recorded since the
    last start.
    """

    def __init__(self, run_dir: Path, trackers: list[Any], state: dict[str, Any]):
        self.run_dir = run_dir
        self.trackers = trackers
        self.state = state
        self.step = 0
        self._handler: logging.Handler | None = None

    @classmethod
    def start(
        cls, names: list[str], run_dir: Path, run_name: str | None, start_step: int, enabled: bool
    ) -> Trackers:
        if not enabled or not names:
            return cls(run_dir, [], {})
        state = _read_json(run_dir / TRACKERS_FILE)
        run = TrackedRun(
            dir=run_dir,
            name=run_name or run_dir.name,
            start_step=start_step,
            config=_read_config(run_dir),
            plan=_read_json(run_dir / PLAN_FILE),
        )
        started = []
        for name in names:
            tracker_cls = TRACKERS[name]
            run.state = dict(state.get(name, {}))
            try:
                tracker = tracker_cls(run)
            except ImportError as err:
                log.warning(
                    "run.trackers: %s is not installed (%s): pip install 'oomless[%s]'; "
                    "training goes on without it",
                    name,
                    err,
                    tracker_cls.extra,
                )
                continue
            except Exception as err:
                log.warning("run.trackers: %s failed to start (%s); training goes on without it",
                            name, _one_line(err))  # fmt: skip
                continue
            started.append(tracker)
            log.info("tracking in %s: %s", name, tracker.where)
        trackers = cls(run_dir, started, state)
        trackers.step = start_step
        trackers._save_state()
        trackers._send_new_escalations()
        trackers._handler = _EventHandler(trackers)
        logging.getLogger("trainer").addHandler(trackers._handler)
        return trackers

    def log(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record (its numeric fields, same names)."""
        self.step = int(record["step"])
        values = scalars(record)
        if record.get("profiled"):  # the profiler's overhead is not the run's throughput
            for key in ("tokens_per_s", "step_time_s", "mfu"):
                values.pop(key, None)
        self._each("log", self.step, values)

    def event(self, text: str) -> None:
        self._each("event", self.step, text)
        self._save_state()

    def close(self, exit_code: int) -> None:
        if self._handler is not None:
            logging.getLogger("trainer").removeHandler(self._handler)
            self._handler = None
        self._each("close", "FINISHED" if exit_code == 0 else "KILLED")
        self._save_state()
        self.trackers = []

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:
                self.trackers.remove(tracker)
                log.warning("run.trackers: %s failed (%s); training goes on without it",
                            tracker.name, _one_line(err))  # fmt: skip

    def _save_state(self) -> None:
        for tracker in self.trackers:
            self.state[tracker.name] = getattr(tracker, "state", {})
        if self.trackers:
            _write_json(self.run_dir / TRACKERS_FILE, self.state)

    def _send_new_escalations(self) -> None:
        path = self.run_dir / ESCALATIONS_FILE
        if not self.trackers or not path.exists():
            return
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        sent = int(self.state.get("num_escalations_sent", 0))
        for e in lines[sent:]:
            self.event(
                f"escalated {e['from']} -> {e['to']} after {e['reason']} at step {e['step']}"
            )
        self.state["num_escalations_sent"] = len(lines)
        self._save_state()


class _EventHandler(logging.Handler):
    """Engine warnings (back-offs, a stop by signal) as tracker events."""

    def __init__(self, trackers: Trackers):
        super().__init__(level=logging.WARNING)
        self.trackers = trackers

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != __name__:  # not our own "tracker failed" lines
            self.trackers.event(record.getMessage())


@contextlib.contextmanager
def _quiet_stdout():
    """A library's banner prints go to the debug log instead of the run's output."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield
    for line in buffer.getvalue().splitlines():
        log.debug("%s", line)


def _code_block(text: str) -> str:
    return "    " + text.replace("\n", "\n    ")  # markdown code block in TensorBoard's text tab


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _read_config(run_dir: Path) -> dict[str, Any]:
    """run.dir/config.yaml as written by the launcher: secrets already redacted."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")
