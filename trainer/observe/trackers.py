"""Experiment trackers: rank 0 sends every metrics.jsonl record, the resolved config, the plan and
the run's events (escalations, out-of-memory back-offs) to TensorBoard, W&B, MLflow or Trackio.

One small class per tracker, each talking to its own library (an optional extra:
`pip install 'oomless[tensorboard]'`). Everything stays on this machine unless the user's
environment says otherwise: W&B runs offline unless WANDB_MODE is set, MLflow writes to
run.dir/mlruns unless MLFLOW_TRACKING_URI is set, Trackio writes to its local store (TRACKIO_DIR).
Credentials come from those libraries' own environment variables and are never written here.

A resumed or escalated run continues the same tracker run: the ids live in run.dir/trackers.json.
A library that is missing, or a tracker that fails or hangs mid-run, costs one warning line, never
the run: each tracker makes its calls on a thread of its own, with a deadline (`Trackers`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainer.core.contract import CONFIG_FILE, ESCALATIONS_FILE, PLAN_FILE, TRACKERS_FILE
from trainer.core.files import read_json_object, read_jsonl, write_atomic
from trainer.observe.metrics import strict_json

log = logging.getLogger(__name__)

CALL_DEADLINE_S = 10.0  # a tracker call still running after this is taken as hung
START_DEADLINE_S = 60.0  # all trackers together: a server to reach, a run to create
CLOSE_DEADLINE_S = 60.0  # the pending records flushed and the tracker run closed
STOP_CLOSE_DEADLINE_S = 5.0  # the same after a stop by signal: the grace period is short
MAX_PENDING_CALLS = 10_000  # queued calls of one tracker that has fallen this far behind
_SIGNALS_LOGGER = "trainer.runtime.signals"  # its warning says a stop signal was received

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

    Each tracker makes its calls on a thread of its own (`_Worker`), so the run never waits on a
    tracker's network or disk: a call that raises drops that tracker with one warning line; one
    still running after CALL_DEADLINE_S is taken as hung and dropped the same way, and `close`
    waits for what is left at most CLOSE_DEADLINE_S (STOP_CLOSE_DEADLINE_S after a stop by
    signal, which must checkpoint and exit within the scheduler's grace, or any other failed
    exit). Warnings logged by the
    engine while the trackers are open (out-of-memory back-offs, a stop by signal) go to them as
    events, and so do escalations the supervisor recorded since the last start.
    """

    def __init__(self, run_dir: Path, workers: list[_Worker], state: dict[str, Any]):
        self.run_dir = run_dir
        self.workers = workers
        self.state = state
        self.step = 0
        self.stopping = False  # a stop signal was received (even one that exits 0 to requeue)
        self._handler: logging.Handler | None = None
        self._saved = ""

    @classmethod
    def start(
        cls, names: list[str], run_dir: Path, run_name: str | None, start_step: int, enabled: bool
    ) -> Trackers:
        if not enabled or not names:
            return cls(run_dir, [], {})
        state = read_json_object(run_dir / TRACKERS_FILE)
        run = TrackedRun(
            dir=run_dir,
            name=run_name or run_dir.name,
            start_step=start_step,
            config=_read_config(run_dir),
            plan=read_json_object(run_dir / PLAN_FILE),
        )
        workers = []
        for name in names:
            own = state.get(name)
            worker = _Worker(name)
            worker.call("__init__", replace(run, state=dict(own) if isinstance(own, dict) else {}))
            workers.append(worker)
        trackers = cls(run_dir, _started(workers, START_DEADLINE_S), state)
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
        self._save_state()

    def event(self, text: str) -> None:
        """Queued, never waited for: a signal handler's warning comes here."""
        self._each("event", self.step, text)

    def close(self, exit_code: int) -> None:
        if self._handler is not None:
            logging.getLogger("trainer").removeHandler(self._handler)
            self._handler = None
        self._each("close", "FINISHED" if exit_code == 0 else "KILLED")
        stop = exit_code != 0 or self.stopping
        deadline_s = STOP_CLOSE_DEADLINE_S if stop else CLOSE_DEADLINE_S
        end = time.monotonic() + deadline_s
        for worker in list(self.workers):
            if not worker.wait(end - time.monotonic()):
                self.workers.remove(worker)
                log.warning("run.trackers: %s did not close within %g s; its last records may "
                            "be missing", worker.name, deadline_s)  # fmt: skip
        self._drop_failed()
        self._save_state()
        self.workers = []

    def _each(self, method: str, *args: Any) -> None:
        self._drop_failed()
        for worker in self.workers:
            worker.call(method, *args)

    def _drop_failed(self) -> None:
        """Drop, with one warning each, the trackers whose last call raised or hangs."""
        for worker in list(self.workers):
            why = worker.trouble()
            if why:
                self.workers.remove(worker)
                log.warning("run.trackers: %s %s; training goes on without it", worker.name, why)

    def _save_state(self) -> None:
        for worker in self.workers:
            self.state[worker.name] = dict(getattr(worker.tracker, "state", {}))
        text = strict_json(self.state, indent=2) + "\n"
        if self.workers and text != self._saved:
            write_atomic(self.run_dir / TRACKERS_FILE, text)
            self._saved = text

    def _send_new_escalations(self) -> None:
        if not self.workers:
            return
        lines = read_jsonl(self.run_dir / ESCALATIONS_FILE)
        sent = self.state.get("num_escalations_sent", 0)
        for e in lines[sent if isinstance(sent, int) else 0 :]:
            self.event(
                f"escalated {e.get('from')} -> {e.get('to')} after {e.get('reason')} "
                f"at step {e.get('step')}"
            )
        self.state["num_escalations_sent"] = len(lines)
        self._save_state()


class _Worker:
    """One tracker and the daemon thread that makes its calls, in order.

    `call` only queues (SimpleQueue.put is safe in a signal handler); the thread runs the
    calls and records the first error; a tracker that failed or hangs is never called again.
    """

    def __init__(self, name: str):
        self.name = name
        self.tracker: Any = None
        self.error: BaseException | None = None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._num_sent = 0
        self._num_done = 0
        self._busy_since: float | None = None
        threading.Thread(target=self._serve, name=f"tracker-{name}", daemon=True).start()

    def call(self, method: str, *args: Any) -> None:
        self._num_sent += 1
        self._calls.put((method, args))

    def wait(self, timeout_s: float) -> bool:
        """True once every queued call has returned; False after `timeout_s` without."""
        end = time.monotonic() + timeout_s
        while self._num_done < self._num_sent:
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True

    def trouble(self) -> str | None:
        """Why this tracker must be dropped (its call failed, or hangs), else None."""
        if self.error is not None:
            return f"failed ({_one_line(self.error)})"
        since = self._busy_since
        if since is not None and time.monotonic() - since > CALL_DEADLINE_S:
            return f"has not returned from a call in {time.monotonic() - since:.0f} s"
        if self._num_sent - self._num_done > MAX_PENDING_CALLS:
            return f"falls behind ({self._num_sent - self._num_done} calls waiting)"
        return None

    def _serve(self) -> None:
        while True:
            method, args = self._calls.get()
            self._busy_since = time.monotonic()
            try:
                if method == "__init__":
                    self.tracker = TRACKERS[self.name](*args)
                elif self.error is None:
                    getattr(self.tracker, method)(*args)
            except BaseException as err:  # a tracker never stops the run: it is dropped
                self.error = err
            finally:
                self._busy_since = None
                self._num_done += 1


def _started(workers: list[_Worker], deadline_s: float) -> list[_Worker]:
    """The workers whose tracker started within `deadline_s` (together), each said in a line."""
    end = time.monotonic() + deadline_s
    started = []
    for worker in workers:
        done = worker.wait(end - time.monotonic())
        err, extra = worker.error, TRACKERS[worker.name].extra
        if not done:
            log.warning("run.trackers: %s did not start within %g s; training goes on without "
                        "it", worker.name, deadline_s)  # fmt: skip
        elif isinstance(err, ImportError):
            log.warning("run.trackers: %s is not installed (%s): pip install 'oomless[%s]'; "
                        "training goes on without it", worker.name, err, extra)  # fmt: skip
        elif err is not None:
            log.warning("run.trackers: %s failed to start (%s); training goes on without it",
                        worker.name, _one_line(err))  # fmt: skip
        else:
            started.append(worker)
            log.info("tracking in %s: %s", worker.name, worker.tracker.where)
    return started


class _EventHandler(logging.Handler):
    """Engine warnings (back-offs, a stop by signal) as tracker events."""

    def __init__(self, trackers: Trackers):
        super().__init__(level=logging.WARNING)
        self.trackers = trackers

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == _SIGNALS_LOGGER:  # a stop was asked: close in the grace period
            self.trackers.stopping = True
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
