"""Shared fixtures: tiny HF configs and job trees, built inline (no network); bounded
subprocesses; and the session's last check: no process a test started is still alive."""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.cli_worker import DONE

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A launch probe's calibration (launcher/plan/calibration.py) would carry one test's measurement
# into every later plan of the session: off, except where a test names a file of its own.
os.environ["OOMLESS_CALIBRATION"] = "off"

# What the suite compiles outlives the checkout, in a per-user cache that later runs reuse.
# DeepSpeed JIT-builds its CPU ops (CPU Adam, shared-memory collectives) with the venv's include
# path in their flags: one dir per environment, so that two checkouts on one machine do not
# rebuild each other's ops over and over (a lock left by a killed build is removed by the
# backend); a new venv rebuilds them once (pip writes the sources with the install time, and
# ninja rebuilds what is older than its sources). Inductor's compiled kernels (`train.compile`,
# torchao's low-bit optimizers) are keyed by content and flags and share one dir: a fresh clone
# at the same path reuses them. Set here, so the subprocesses the tests start inherit them.
TEST_CACHE = Path(os.environ.get("OOMLESS_TEST_CACHE") or Path.home() / ".cache" / "oomless-tests")
VENV_KEY = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(TEST_CACHE / "torch_extensions" / VENV_KEY))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(TEST_CACHE / "inductor"))

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.fixture
def tiny_llama_config() -> dict:
    return copy.deepcopy(TINY_LLAMA)


def write_demo_job(path: Path, **sections: dict) -> Path:
    """A one-process fp32 job on the shipped demo data (prompt/completion, a 45-token vocabulary)
    with the tiny Llama, written to `path`; `sections` update its sections key by key."""
    demo = REPO / "configs" / "demo"
    job: dict = {
        "model": {"config": {**TINY_LLAMA, "vocab_size": 45}, "tokenizer": str(demo / "tokenizer")},
        "data": {
            "path": str(demo / "train.jsonl"),
            "format": "prompt_completion",
            "seq_len": 32,
            "cache_dir": str(path.parent / "cache"),
        },
        "train": {"lr": 3e-3},
        "precision": "fp32",
        "memory": {"activation_checkpointing": "none"},
        "hardware": {"device": "cpu", "devices_per_node": 1},
        "run": {"save_final": False},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values} if isinstance(values, dict) else values
    path.write_text(yaml.safe_dump(job))
    return path


def python_env() -> dict[str, str]:
    """Environment for subprocesses (torchrun, the CLI) that import this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable


def run_bounded(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output, text) that, when it times out or the test is interrupted
    (pytest-timeout), kills the whole process tree: torchrun's workers and the ranks the CLI
    starts in a session of their own, not only the direct child."""
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            kill_tree(proc.pid)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def oomless(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, from this checkout (in `env`, by default `python_env()`); on a
    timeout its whole process tree is killed."""
    return run_bounded(
        [PYTHON, "-m", "launcher.cli", *args], timeout=timeout, env=env or python_env(), cwd=REPO
    )


def oomless_two_at_a_time(
    jobs: dict[str, list[str]], timeout: float = 300
) -> dict[str, subprocess.CompletedProcess]:
    """`oomless ARGS` for each job, two processes at a time, each on one intra-op thread: for
    runs of one CPU rank whose processes are under test. Two such runs share the two cores
    without waiting on each other; runs of two ranks would, at every collective."""
    env = {**python_env(), "OMP_NUM_THREADS": "1"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda args: oomless(*args, timeout=timeout, env=env), jobs.values())
        return dict(zip(jobs, done, strict=True))


def _one_thread_while_ops_build(env: dict[str, str]) -> dict[str, str]:
    """One intra-op thread (unless the environment sets one) for a process of tiny-model runs
    while DeepSpeed's ops build in the background: two OpenMP threads that share a core with the
    build wait at every barrier (the preference fixture's SFT trained at ~500 tok/s in CI beside
    it, 150-200 s for the fixture, against 15,000-30,000 tok/s and 18 s here). Once the ops are
    built, two threads are faster for the slow tier's runs."""
    return {"OMP_NUM_THREADS": "1", **env} if _prebuild_pids() else env


def train_in_one_process(
    jobs: list[tuple[list[str], Path]], timeout_per_run_s: float = 300
) -> None:
    """`oomless train ARGS` for each (ARGS, LOG) in turn, all in ONE process (tests/cli_worker.py)
    with each run's stderr written to its LOG: for runs a test reads, where the CLI's own process
    is not what is under test. The process stays for the next call (its imports are paid once a
    session) while the environment it would get is the same. Fails at the first run that exits
    non-zero, with its log's end; on a timeout the process is killed."""
    for _, log in jobs:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
    worker = _cli_worker(_one_thread_while_ops_build(python_env()))
    deadline = time.monotonic() + timeout_per_run_s * len(jobs)
    done: list[dict] = []
    try:
        worker.stdin.write(json.dumps([{"args": a, "log": str(log)} for a, log in jobs]) + "\n")
        worker.stdin.flush()
        while len(done) < len(jobs) and not (done and done[-1]["exit"]):
            line = _WORKER["lines"].get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:  # the worker ended
                break
            if line.startswith(DONE):
                done.append(json.loads(line.removeprefix(DONE)))
    except queue.Empty:
        close_cli_worker()
        raise subprocess.TimeoutExpired(worker.args, timeout_per_run_s * len(jobs)) from None
    except BaseException:
        close_cli_worker()
        raise
    if len(done) == len(jobs) and not done[-1]["exit"]:
        return
    stderr = close_cli_worker()
    at = len(done) - 1 if done and done[-1]["exit"] else min(len(done), len(jobs) - 1)
    failed = Path(jobs[at][1])
    log = failed.read_text()[-3000:] if failed.is_file() else ""
    raise AssertionError(f"exit {worker.returncode} at {failed}:\n{log}\n{stderr[-3000:]}")


# tests/cli_worker.py while it lives: proc, the environment it started with, its stdout's lines
_WORKER: dict[str, object] = {}


# what pytest sets per test, what the code under test sets in this process when a test runs
# it here (a process group of one, the allocator's launch environment, mlflow's file store), and
# what the first import of transformers' models here sets (its mlflow integration's session id,
# torch's CUDA check): not a different environment for the worker's runs
_NOT_STEERING = {"PYTEST_CURRENT_TEST", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                 "LOCAL_RANK", "PYTORCH_CUDA_ALLOC_CONF", "MLFLOW_ALLOW_FILE_STORE",
                 "_MLFLOW_TELEMETRY_SESSION_ID", "PYTORCH_NVML_BASED_CUDA_CHECK"}  # fmt: skip


def _same_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _NOT_STEERING}


def _cli_worker(env: dict[str, str]) -> subprocess.Popen:
    """The session's tests/cli_worker.py, started in `env` unless one started in it lives."""
    proc = _WORKER.get("proc")
    if proc is not None and (proc.poll() is not None or _WORKER["env"] != _same_env(env)):
        close_cli_worker()
    if "proc" not in _WORKER:
        stderr = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            [PYTHON, str(REPO / "tests" / "cli_worker.py")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO, env=env,
        )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        _WORKER.update(proc=proc, env=_same_env(env), lines=lines, stderr=stderr)
    return _WORKER["proc"]


def close_cli_worker() -> str:
    """End the session's tests/cli_worker.py (end of input, else killed after 10 s); its stderr."""
    proc = _WORKER.pop("proc", None)
    if proc is None:
        return ""
    try:
        proc.stdin.close()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        kill_tree(proc.pid)
        proc.wait()
    stderr = _WORKER.pop("stderr")
    stderr.seek(0)
    text = stderr.read()
    stderr.close()
    return text


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (collected first, so none is orphaned unseen)."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def live_children() -> list[psutil.Process]:
    """Descendants of this pytest process that are still running (zombies do not count), less
    the DeepSpeed op build started in the background (which finishes on its own) and the
    session's tests/cli_worker.py (ended at the session's end)."""
    live = []
    worker = _WORKER.get("proc")
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in _prebuild_pids() or (worker is not None and proc.pid == worker.pid):
            continue
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
        except psutil.NoSuchProcess:
            continue
    return live


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return str(proc.pid)


# DeepSpeed's CPU ops built in the background while the fast modules run (tests/prebuild_ops.py)
_PREBUILD: dict[str, object] = {}


def pytest_collection_modifyitems(session: pytest.Session, config, items: list) -> None:
    """Order: modules without slow tests first, then the modules with slow tests, so that the
    background op build below takes the core the single-process tests leave idle. A module stays
    whole (its module fixtures are built once).

    When slow tests are in the session, DeepSpeed's ops start building in the background at the
    lowest priority; the first slow test waits for them: for every op but async_io where the
    session has fast tests too (the build has ended by then), for all of them in a session of
    slow tests only (`make test`'s slow tier, tests/tiers.py: its tests keep both cores busy
    beside the fast tier's, so an op left to build behind them would starve while a launch
    waits on its lock)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path in slow)  # stable
    if not slow or config.option.collectonly or os.environ.get("OOMLESS_TEST_PREBUILD") == "0":
        return
    stage = Path(tempfile.gettempdir()) / f"oomless-prebuild-{VENV_KEY}-{os.getpid()}.stage"
    only_slow = all(item.get_closest_marker("slow") for item in items)
    _PREBUILD.update(stage=stage, start=time.monotonic(), whole=only_slow,
                     log=TEST_CACHE / f"prebuild-{VENV_KEY}.log")  # fmt: skip
    stage.write_text("")
    _PREBUILD["log"].parent.mkdir(parents=True, exist_ok=True)
    with _PREBUILD["log"].open("w") as out:
        _PREBUILD["proc"] = subprocess.Popen(
            [PYTHON, str(REPO / "tests" / "prebuild_ops.py"), str(stage)],
            stdout=out, stderr=subprocess.STDOUT, env=python_env(), cwd=REPO,
            start_new_session=True,
        )  # fmt: skip


def _prebuild_pids() -> set[int]:
    proc = _PREBUILD.get("proc")
    if proc is None or proc.poll() is not None:
        return set()
    try:
        return {proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _ops_ready(stage: Path) -> bool:
    """The build has every op but async_io (or every op, in a session of slow tests only), or
    has ended (tests/prebuild_ops.py's lines; a failed build leaves the tests to build inline)."""
    proc = _PREBUILD.get("proc")
    if proc is not None and proc.poll() is not None:
        return True
    lines = stage.read_text().split()
    return "ended" in lines or ("common" in lines and not _PREBUILD["whole"])


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Before the first slow test (outside its timeout): wait until the background build has
    every op but async_io, or has ended; at most 30 minutes (then the test builds inline)."""
    stage = _PREBUILD.get("stage")
    if stage is not None and item.get_closest_marker("slow") and not _PREBUILD.get("waited"):
        _PREBUILD["waited"] = True
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        said, deadline = False, time.monotonic() + 1800
        while not _ops_ready(stage) and time.monotonic() < deadline:
            if not said and reporter is not None:
                reporter.write_line(
                    f"\nwaiting for DeepSpeed's ops, building in the background since "
                    f"{time.monotonic() - _PREBUILD['start']:.0f} s (log: {_PREBUILD['log']})"
                )
                said = True
            time.sleep(1)
        if said and reporter is not None:
            reporter.write_line(
                f"DeepSpeed's ops ready after {time.monotonic() - _PREBUILD['start']:.0f} s"
            )
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any process a test started outlived the tests (a hang left behind).

    Waits a few seconds for processes that are already shutting down, then kills the rest so
    that nothing lingers on the machine, and sets the exit status. (The local Slurm daemons are
    not children of pytest and are not looked at.) The session's tests/cli_worker.py ends first.
    """
    close_cli_worker()
    deadline = time.monotonic() + 10
    left = live_children()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = live_children()
    stage = _PREBUILD.get("stage")
    if stage is not None:
        stage.unlink(missing_ok=True)
    if not left:
        return
    lines = "\n".join(f"  {_describe(p)}" for p in left)
    for proc in left:
        kill_tree(proc.pid)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"processes left behind by the tests (killed now):\n{lines}"
    if reporter is not None:
        reporter.write_sep("=", "processes left behind", red=True)
        reporter.write_line(message)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
