"""`oomless train` end to end on one CPU process: the files, exit codes and messages users see."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import PYTHON, REPO, kill_tree, oomless, oomless_two_at_a_time, python_env

DEMO = REPO / "configs" / "demo.yaml"
FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "peak_device_bytes",
    "strategy",
    "world_size",
    "micro_batch_size",
    "grad_accum",
}


@contextlib.contextmanager
def _training(*overrides: str) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """`oomless train` of the demo running, its stderr collected line by line as it comes; on
    the way out it is waited for, then killed with its children if still there."""
    proc = subprocess.Popen(
        [PYTHON, "-m", "launcher.cli", "train", str(DEMO), *overrides],
        env=python_env(), cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        yield proc, lines
        proc.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        kill_tree(proc.pid)


def _wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, deadline: float) -> None:
    """Until metrics.jsonl holds `steps` lines, the run has ended, or the deadline passed."""
    path = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= steps:
            return
        time.sleep(0.05)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_config_metrics_and_a_loadable_model(tmp_path):
    run_dir = tmp_path / "run"
    r = oomless("train", str(DEMO), "train.steps=20", f"run.dir={run_dir}", "hardware.device=cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["strategy"] == "single"
    assert isinstance(resolved["train"]["micro_batch_size"], int)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["strategy"] == "single" and plan["command"]
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(1, 21))
    for m in lines:
        assert FIELDS <= set(m), FIELDS - set(m)
        assert m["world_size"] == 1 and m["strategy"] == "single"
    assert any("eval_loss" in m for m in lines)
    first, last = sum(m["loss"] for m in lines[:3]) / 3, sum(m["loss"] for m in lines[-3:]) / 3
    assert last < first * 0.9, (first, last)
    assert "eta" in r.stderr  # the human progress line
    # only oomless's own lines: no DeepSpeed accelerator line, no transformers progress bars
    assert "Setting accelerator" not in r.stdout + r.stderr
    assert "Writing model shards" not in r.stderr

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    ids = tokenizer("12+34=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    r = oomless("train", str(DEMO), f"run.dir={run_dir}", "hardware.device=cpu", "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"strategy": "single"' in r.stdout
    assert "-m trainer" in r.stdout
    assert not run_dir.exists()


# The out-of-memory runs: `oomless train` processes of one CPU rank each (the process, its exit
# code and its files are under test), independent of each other, run two at a time once for the
# module. Each test below names its runs. The engine runs in `oomless train`'s own process
# (IN_THIS_PROCESS), the back-off and the climb are the same; a child engine's exit 75 is
# test_escalation.py's.
_BACKOFF = ["train.steps=5", "train.global_batch_size=8", "train.eval_every=0",
            "run.save_final=false", "precision=fp32", "hardware.device=cpu"]  # fmt: skip
_LEVERS = ["train.steps=5", "train.global_batch_size=4", "train.eval_every=0",
           "run.save_final=false", "precision=fp32", "hardware.device=cpu",
           "memory.activation_checkpointing=none"]  # fmt: skip
_OOM_RUNS = {
    "backoff": [*_BACKOFF, "train.micro_batch_size=8",
                "debug.inject_oom={step: 3, times: 1, where: backward}"],
    "backoff_reference": [*_BACKOFF, "train.micro_batch_size=4"],
    "levers": [*_LEVERS, "train.micro_batch_size=2",
               "debug.inject_oom={step: 3, times: 5, where: backward}"],
    "levers_reference": [*_LEVERS, "train.micro_batch_size=1"],
    "setup": ["train.steps=3", "train.eval_every=0", "run.save_final=false", "hardware.device=cpu",
              "debug.inject_oom={step: 0, where: setup, strategies: [single]}"],
    "forced": ["strategy=single", "train.steps=3", "train.eval_every=0", "run.checkpoint_every=1",
               "run.save_final=false", "hardware.device=cpu",
               "debug.inject_oom={step: 2, times: 0, where: forward, strategies: [single]}"],
    "persistent": ["strategy=single", "train.steps=4", "train.global_batch_size=4",
                   "train.micro_batch_size=2", "hardware.device=cpu", "escalation.enabled=false",
                   "debug.inject_oom={step: 2, times: 0, where: forward}"],
    "eval": ["strategy=single", "train.steps=2", "train.global_batch_size=4",
             "train.micro_batch_size=2", "train.eval_every=1", "run.save_final=false",
             "hardware.device=cpu", "escalation.enabled=false",
             "debug.inject_oom={step: 1, times: 0, where: eval}"],
}  # fmt: skip


@pytest.fixture(scope="module")
def oom_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """name -> (the finished `oomless train`, its run.dir) for each of `_OOM_RUNS`."""
    root = tmp_path_factory.mktemp("oom")
    jobs = {name: ["train", str(DEMO), *args, f"run.dir={root / name}", IN_THIS_PROCESS]
            for name, args in _OOM_RUNS.items()}  # fmt: skip
    return {name: (r, root / name) for name, r in oomless_two_at_a_time(jobs).items()}


@pytest.mark.slow  # `oomless train` processes, out of memory and after: `make test` only
def test_injected_oom_backs_off_and_learns_the_same(oom_runs):
    """Half the micro-batch after an OOM at step 3: same losses as micro 4 from the start."""
    (r, a), (reference, b) = oom_runs["backoff"], oom_runs["backoff_reference"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "out of memory in backward; retrying with micro-batch 4" in r.stderr
    assert reference.returncode == 0, reference.stderr[-3000:]
    ma, mb = metrics(a), metrics(b)
    assert [m["micro_batch_size"] for m in ma] == [8, 8, 4, 4, 4]
    for x, y in zip(ma, mb, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * y["loss"], (x, y)


@pytest.mark.slow  # `oomless train` processes, out of memory and after: `make test` only
def test_at_micro_batch_1_the_back_off_pulls_the_exact_levers_and_learns_the_same(oom_runs):
    """OOMs at step 3 five times: micro-batch 2 -> 1, then chunked loss, activation offload,
    and checkpointing none -> selective -> full, on the running model; the losses equal a run at
    micro-batch 1 without any of them."""
    (r, a), (reference, b) = oom_runs["levers"], oom_runs["levers_reference"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "retrying with micro-batch 1 x accumulation 4" in r.stderr
    assert "at micro-batch 1; retrying with chunked loss on" in r.stderr
    assert "at micro-batch 1; retrying with activation offload on" in r.stderr
    assert "retrying with activation checkpointing selective (was none)" in r.stderr
    assert "retrying with activation checkpointing full (was selective)" in r.stderr
    assert reference.returncode == 0, reference.stderr[-3000:]
    ma, mb = metrics(a), metrics(b)
    assert [m["micro_batch_size"] for m in ma] == [2, 2, 1, 1, 1]
    assert [m["activation_checkpointing"] for m in ma] == ["none"] * 2 + ["full"] * 3
    assert [m["chunked_loss"] for m in ma] == [False] * 2 + [True] * 3
    assert [m["offload_activations"] for m in ma] == [False] * 2 + [True] * 3
    assert all(m["offloaded_bytes"] == m["restored_bytes"] > 0 for m in ma[2:])
    for x, y in zip(ma, mb, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * y["loss"], (x, y)


@pytest.mark.slow  # `oomless train` processes, out of memory and after: `make test` only
def test_an_oom_while_setting_up_climbs_a_rung(oom_runs):
    """Out of memory before the first step (sharding, optimizer state, loading a checkpoint):
    reported and escalated like one in a step; the next rung trains."""
    r, run_dir = oom_runs["setup"]
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (run_dir / "escalations.jsonl").read_text().splitlines()
    (escalation,) = [json.loads(line) for line in lines]
    assert escalation["from"] == "single" and escalation["to"] != "single"
    assert escalation["reason"].startswith("out of memory in setup"), escalation
    assert [m["strategy"] for m in metrics(run_dir)] == [escalation["to"]] * 3


@pytest.mark.slow  # `oomless train` processes, out of memory and after: `make test` only
def test_a_forced_strategy_is_where_escalation_starts(oom_runs):
    """`strategy: single` that runs out of memory for good climbs to a higher rung (same math)
    and says that it left the forced rung; the run ends where it would have ended."""
    r, run_dir = oom_runs["forced"]
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (run_dir / "escalations.jsonl").read_text().splitlines()
    (escalation,) = [json.loads(x) for x in lines]
    assert escalation["from"] == "single" and escalation["to"] != "single"
    assert escalation["reason"].endswith("; left the forced strategy single"), escalation
    said = f"escalating single -> {escalation['to']} after out of memory at step 2, leaving the "
    assert said + "forced strategy single" in r.stderr, r.stderr[-3000:]
    assert [m["strategy"] for m in metrics(run_dir)] == ["single"] + [escalation["to"]] * 2


@pytest.mark.slow  # `oomless train` processes, out of memory and after: `make test` only
def test_persistent_oom_without_escalation_exits_75_with_a_report(oom_runs):
    """escalation.enabled=false: a forced rung that runs out of memory stops there."""
    r, run_dir = oom_runs["persistent"]
    assert r.returncode == 75, r.stderr[-3000:]
    report = json.loads((run_dir / "oom-report.json").read_text())
    assert report["step"] == 2 and report["phase"] == "forward"
    assert report["micro_batch_size"] == 1 and report["strategy"] == "single"
    # micro-batch 2 -> 1, chunked loss, activation offload, selective, full
    assert report["activation_checkpointing"] == "full" and report["num_backoffs"] == 5
    assert report["chunked_loss"] and report["offload_activations"]
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # `oomless train` processes, out of memory and after: `make test` only
def test_an_oom_in_evaluation_at_eval_batch_1_exits_75_with_a_report(oom_runs):
    """Evaluation backs off like a step (eval batch 2 -> 1) and then gives up like one."""
    r, run_dir = oom_runs["eval"]
    assert r.returncode == 75, r.stderr[-3000:]
    assert "eval: out of memory; eval batch halved to 1" in r.stderr
    report = json.loads((run_dir / "oom-report.json").read_text())
    assert report["phase"] == "eval" and report["step"] == 1 and report["strategy"] == "single"
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_second_signal_during_the_stop_still_writes_the_checkpoint(tmp_path):
    """Exit 143 promises a checkpoint: a second SIGTERM, sent once the first was received (the
    step and the checkpoint still to finish), is logged, and the checkpoint is finished."""
    run_dir = tmp_path / "run"
    with _training(
        "train.steps=200", "train.eval_every=0", "run.checkpoint_every=0",
        "run.save_final=false", f"run.dir={run_dir}", "hardware.device=cpu",
        "train.global_batch_size=256",
    ) as (proc, lines):  # fmt: skip
        deadline = time.time() + 240
        _wait_for_steps(proc, run_dir, 1, deadline)
        proc.send_signal(signal.SIGTERM)
        while time.time() < deadline and not any("received SIGTERM" in x for x in lines):
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)  # the step (and the checkpoint) is still to come
    stderr = "".join(lines)
    assert proc.returncode == 143, stderr[-3000:]
    assert "received SIGTERM again: still finishing this step and its checkpoint" in stderr
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{metrics(run_dir)[-1]['step']}"


@pytest.mark.slow
def test_sigterm_checkpoints_exits_143_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "train",
        str(DEMO),
        "train.steps=60",
        "train.eval_every=0",
        "run.checkpoint_every=1000",
        "run.save_final=false",
        f"run.dir={run_dir}",
        "hardware.device=cpu",
    ]
    proc = subprocess.Popen(
        [PYTHON, "-m", "launcher.cli", *args],
        env=python_env(),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_steps(proc, run_dir, 3, time.time() + 240)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 143, stderr[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.removeprefix("step_"))
    assert 3 <= stopped_at < 60
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, stopped_at + 1))

    r = oomless(*args, IN_THIS_PROCESS)  # the resume: the engine in this CLI's process
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / latest}" in r.stderr
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, 61))


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("fsdp", marks=pytest.mark.slow),
        pytest.param("zero3_offload", marks=pytest.mark.slow),
        "auto",  # `make test-fast`'s 2-rank smoke
    ],
)
def test_train_spawns_torchrun_for_two_cpu_processes(tmp_path, strategy):
    """A forced rung runs as forced; `auto` runs the rung the planner picked (ddp: the demo model
    fits twice over, and a replica per process needs the least communication)."""
    run_dir = tmp_path / "run"
    r = oomless(
        "train",
        str(DEMO),
        f"strategy={strategy}",
        "hardware.device=cpu",
        "hardware.devices_per_node=2",
        "train.steps=20",
        f"run.dir={run_dir}",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch.distributed.run" in r.stderr and "--nproc_per_node 2" in r.stderr
    # DeepSpeed's op-build prints and torch's deprecation warnings for its collectives stay out
    assert "built successfully" not in r.stdout and "FutureWarning" not in r.stderr
    plan = json.loads((run_dir / "plan.json").read_text())
    ran = strategy if strategy != "auto" else "ddp"
    assert plan["strategy"] == ran and plan["world_size"] == 2
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["strategy"] == ran
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(1, 21))
    assert all(m["world_size"] == 2 and m["strategy"] == ran for m in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert all(FIELDS <= set(m) for m in lines)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "final").config.model_type == "llama"


@pytest.mark.slow
def test_bad_input_found_by_the_workers_exits_2_with_its_line_last(tmp_path):
    """torchrun reports a failed worker as exit 1; a config error found after the launch (here a
    data row) still ends `oomless train` with exit 2 and the one line, last."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    run_dir = tmp_path / "run"
    r = oomless(
        "train", str(DEMO), f"data.path={data}", "strategy=ddp", "hardware.device=cpu",
        "hardware.devices_per_node=2", f"run.dir={run_dir}",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        f"config error: data.path: {data} row 2 has no 'completion' field; fix the row, "
        "or set data.on_bad_row=skip to skip such rows"
    )


@pytest.mark.slow
def test_a_stop_at_launch_exits_143_saying_no_checkpoint_was_written(tmp_path):
    """SIGTERM right after torchrun starts, before any rank can checkpoint: exit 143 with a line
    saying so (it said nothing), and none of torchrun's traceback (it goes to torchrun.log)."""
    run_dir = tmp_path / "run"
    with _training(
        "train.steps=200", "train.eval_every=0", f"run.dir={run_dir}", "hardware.device=cpu",
        "hardware.devices_per_node=2",
    ) as (proc, lines):  # fmt: skip
        deadline = time.time() + 120
        while time.time() < deadline and not any(x.startswith("launching:") for x in lines):
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
    stderr = "".join(lines)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "stopped by a signal before this launch wrote a checkpoint; run it again to start from "
        "the beginning"
    )
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_stop_during_a_checkpoint_write_exits_after_that_write(tmp_path, asynchronous):
    """The checkpoint being written is the stop's: exit 143 right after it (it took one more
    step and a second checkpoint, doubling what a grace period must cover)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            PYTHON, "-m", "launcher.cli", "train", str(DEMO), "train.steps=50",
            "train.eval_every=0", "run.checkpoint_every=2", "run.save_final=false",
            f"run.dir={run_dir}", "hardware.device=cpu", "debug.slow_rank0={checkpoint_s: 3}",
            f"run.async_checkpoint={str(asynchronous).lower()}",
        ],
        env=python_env(), cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for_steps(proc, run_dir, 2, time.time() + 240)
        time.sleep(0.5)  # inside step_2's write (3 s)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 143, stderr[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    if asynchronous:
        # the background write under way is the stop's: a periodic (even) step, and none after
        stopped = int(latest.removeprefix("step_"))
        assert stopped % 2 == 0, stderr[-3000:]
        assert f"stopped by SIGTERM after step {stopped}; checkpoint written" in stderr
        assert f"step_{stopped + 1}" not in stderr, stderr[-3000:]
    else:
        assert latest == "step_2", stderr[-3000:]
        assert "stopped by SIGTERM after step 2; checkpoint written" in stderr
        assert [m["step"] for m in metrics(run_dir)] == [1, 2]
