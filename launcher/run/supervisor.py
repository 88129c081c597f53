"""`oomless train`: plan, write the run dir, launch, and climb the ladder on out-of-memory.

The supervisor is the only place that decides how processes start; the engine runs the same way
on every rank whatever started it. When a launch exits 75 (out of memory after the in-process
back-off), the supervisor reads `oom-report.json`, scales the estimate by what was measured so it
does not pick a rung that will OOM again, re-plans without the failed rung, and relaunches with
`run.resume: auto`: the new rung continues from the newest checkpoint (or from step 0), and the
global batch, optimizer, schedule and precision stay as configured. A launch that ends in a hang
(exit 124, trainer/runtime/hang.py) starts again on the same rung from the newest checkpoint, up
to `run.max_restarts` times (docs/resilience.md). So that a hang can be restarted, the engine
never runs in this process while restarts are allowed: one rank is `python -m trainer` as a
child, as torchrun starts several (with run.max_restarts=0 one rank runs here).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from launcher.plan.job import next_rung, resolve_plan
from launcher.plan.planner import NoFitError
from launcher.plan.unestimated import planning_keys_forced
from launcher.run.launch import launch_spec, run_command, shell_join, under_launcher
from launcher.run.preflight import (
    check_inputs_are_not_run_files,
    check_resume,
    check_rows,
    check_run_dir,
    ensure_run_dir,
    tokenize_data,
)
from launcher.run.probe import replan, written_probe
from launcher.run.torchrun_output import TorchrunOutput
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig, check_run_time_extras, write_config
from trainer.core.contract import (
    CONFIG_ERROR_FILE,
    CONFIG_FILE,
    ESCALATIONS_FILE,
    EXIT_HANG,
    EXIT_OOM,
    EXIT_REPLAN,
    EXIT_SIGNAL,
    EXIT_USAGE,
    HANG_DIR,
    HANG_REPORT_FILE,
    LATEST_LINK,
    OOM_REPORT_FILE,
    PLAN_FILE,
    PROBE_FILE,
    TORCHRUN_LOG,
)
from trainer.core.files import absolute_path, append_line, read_json_object, write_json
from trainer.core.run_lock import LOCK_OWNER_ENV, acquire_run_lock, check_run_lock

log = logging.getLogger(__name__)


def train_command(cfg: JobConfig, dry_run: bool = False, probe_only: bool = False) -> int:
    """`oomless train`; `probe_only`: `plan --probe`'s one measured step (never re-planned)."""
    cfg = cfg.model_copy(
        update={"run": cfg.run.model_copy(update={"dir": absolute_path(cfg.run.dir)})}
    )
    with contextlib.ExitStack() as held:  # the run-dir lock, once the input has been checked
        return _train(cfg, dry_run, held, probe_only)


def _train(cfg: JobConfig, dry_run: bool, held: contextlib.ExitStack, probe_only: bool) -> int:
    """Plan, launch, and on an out-of-memory exit climb the ladder and resume, until the run
    ends, fails otherwise, or no higher rung fits; a first step over the budget is planned again
    once (launcher/run/probe.py)."""
    run_dir = Path(cfg.run.dir)
    if not dry_run:
        if cfg.hardware.nodes > 1 and not under_launcher():
            raise ConfigError(
                "hardware.nodes",
                f"{cfg.hardware.nodes} nodes: `oomless train` starts processes on this machine "
                "only",
                "use `oomless submit` (Slurm), or run the command of `oomless plan --emit "
                "torchrun` on each node",
            )
        check_run_dir(run_dir)
        check_inputs_are_not_run_files(cfg)
        check_run_lock(run_dir)  # a live run's files stay as they are; it is taken after checks
        check_rows(cfg)  # torch-free: a broken data file answers before anything imports torch
        check_run_time_extras(cfg)  # what only the run needs, on this machine (not for plan)
    failed: list[str] = []
    memory_scale = 1.0
    attempt = num_restarts = 0
    may_replan, replanned_from = True, None
    while True:
        resolved, plan_json = resolve_plan(cfg, exclude=failed, memory_scale=memory_scale)
        if attempt == 0:
            check_resume(resolved)  # before anything is written into run.dir
        argv, env, spawn = launch_spec(resolved, run_dir / CONFIG_FILE)
        plan_json["command"] = argv
        plan_json["probe"] = {
            "may_replan": may_replan and not probe_only and not planning_keys_forced(cfg),
            "only": probe_only,
            "replanned": replanned_from,
        }
        if dry_run:
            print(json.dumps(plan_json, indent=2))
            print(shell_join(argv))
            return 0
        if attempt == 0:  # bad input stops here, before anything is written or launched
            if not under_launcher():  # srun tasks would write one cache at once: rank 0 does
                tokenize_data(resolved)
            ensure_run_dir(run_dir)
            # one run per run.dir, for the life of this one
            held.enter_context(acquire_run_lock(run_dir))
        started = time.time()
        rc = _launch(resolved, plan_json, argv, env, spawn)
        probe = written_probe(run_dir, started)
        if rc == EXIT_REPLAN and probe:
            replanned = replan(cfg, resolved, plan_json, probe, failed, memory_scale)
            if isinstance(replanned, int):
                return replanned
            cfg, memory_scale, replanned_from = replanned
            may_replan = False
            attempt += 1
            continue
        if rc == EXIT_HANG and num_restarts < cfg.run.num_restarts_allowed:
            num_restarts += 1
            cfg = _restart_after_hang(cfg, resolved, num_restarts)
            attempt += 1
            continue
        if rc != EXIT_OOM or not cfg.escalation.enabled:
            return rc
        attempt += 1
        if attempt > cfg.escalation.max_attempts:
            log.error("out of memory; escalation.max_attempts=%d reached", attempt - 1)
            return rc
        climbed = _climb(cfg, resolved, plan_json, failed, memory_scale)
        if climbed is None:
            return rc
        cfg, failed, memory_scale = climbed


def _restart_after_hang(cfg: JobConfig, resolved: JobConfig, num_restarts: int) -> JobConfig:
    """After a hang (exit 124, trainer/runtime/hang.py): say it, record it in escalations.jsonl
    (same rung), and resume from the newest checkpoint; the config to plan next."""
    run_dir = Path(cfg.run.dir)
    report = read_json_object(run_dir / HANG_DIR / HANG_REPORT_FILE)
    newest = _newest_checkpoint(run_dir)
    record = {
        "step": report.get("step"),
        "from": resolved.strategy,
        "to": resolved.strategy,
        "reason": f"hang: {report.get('line', 'a step outlasted run.hang_timeout_s')}",
        "estimated_peak_bytes": None,
        "measured_peak_bytes": None,
    }
    append_line(run_dir / ESCALATIONS_FILE, json.dumps(record))
    log.warning(
        "restarting after the hang (%d of run.max_restarts=%d) from %s; the stacks are in %s",
        num_restarts,
        cfg.run.num_restarts_allowed,
        newest or "the beginning",
        run_dir / HANG_DIR,
    )
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})


def _launch(resolved: JobConfig, plan_json: dict, argv, env, spawn) -> int:
    """One attempt: the resolved config and plan into run.dir, the ranks run; the exit code,
    with a worker's bad-input line printed (exit 2) and an out-of-memory report read as 75."""
    run_dir = Path(resolved.run.dir)
    write_config(resolved, run_dir)
    write_json(run_dir / PLAN_FILE, plan_json)
    report_path = run_dir / OOM_REPORT_FILE
    report_path.unlink(missing_ok=True)
    config_error = run_dir / CONFIG_ERROR_FILE
    config_error.unlink(missing_ok=True)
    hang_report = run_dir / HANG_DIR / HANG_REPORT_FILE
    started = time.time()
    rc = _run(resolved, argv, env, spawn)
    if rc not in (0, EXIT_SIGNAL) and _written_since(hang_report, started):
        line = read_json_object(hang_report).get("line", "hang")
        print(f"oomless: {line}; every rank's stack is in {hang_report.parent}", file=sys.stderr)
        return EXIT_HANG  # torchrun reports the rank's 124 as 1
    if rc not in (0, EXIT_OOM, EXIT_SIGNAL) and config_error.exists():
        # a worker found bad input (data rows, an unusable strategy) after the launch
        print(config_error.read_text().strip(), file=sys.stderr)
        return EXIT_USAGE
    if rc not in (0, EXIT_OOM, EXIT_SIGNAL) and report_path.exists():
        rc = EXIT_OOM  # torchrun reports a failed worker as 1; the report says why
    probe = run_dir / PROBE_FILE
    if rc not in (0, EXIT_OOM, EXIT_SIGNAL) and _written_since(probe, started):
        if read_json_object(probe).get("action") == "replan":
            rc = EXIT_REPLAN  # torchrun reports the ranks' 76 as 1
    return rc


def _climb(
    cfg: JobConfig, resolved: JobConfig, plan_json: dict, failed: list[str], memory_scale: float
):
    """After an out-of-memory exit on `resolved.strategy` (planned as `plan_json`): (the config
    to plan next, the rungs to exclude, the memory scale measured), with the escalation recorded
    and said; None when no higher rung fits."""
    run_dir = Path(cfg.run.dir)
    report = read_json_object(run_dir / OOM_REPORT_FILE)
    failed = [*failed, resolved.strategy]
    left_forced = cfg.strategy if cfg.strategy != "auto" else None
    if left_forced:  # a forced rung is where the ladder starts: climb from it
        cfg, failed = climb_from_forced(cfg, failed)
    ceiling = plan_json["estimate"]["device"]["peak_tensor_bytes"] / memory_scale
    memory_scale = max(memory_scale, _measured_over_estimated(report))
    try:
        next_cfg, failed = next_rung(cfg, failed, memory_scale, ceiling)
    except (NoFitError, ConfigError) as err:  # nothing higher fits
        log.error("out of memory on %s and no higher rung fits: %s", resolved.strategy, err)
        return None
    record = {
        "step": report.get("step"),
        "from": resolved.strategy,
        "to": next_cfg.strategy,
        "reason": f"out of memory in {report.get('phase', '?')} at micro-batch "
        f"{report.get('micro_batch_size')}"
        + (f"; left the forced strategy {left_forced}" if left_forced else ""),
        "estimated_peak_bytes": report.get("estimated_peak_bytes"),
        "measured_peak_bytes": report.get("measured_peak_bytes"),
    }
    append_line(run_dir / ESCALATIONS_FILE, json.dumps(record))  # one write: a kill cannot tear it
    log.warning(
        "escalating %s -> %s after out of memory at step %s%s; resuming from the newest checkpoint",
        record["from"],
        record["to"],
        record["step"],
        f", leaving the forced strategy {left_forced} (escalation.enabled=false stops "
        "there instead)"
        if left_forced
        else "",
    )
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})
    return cfg, failed, memory_scale


def climb_from_forced(cfg: JobConfig, failed: list[str]) -> tuple[JobConfig, list[str]]:
    """After a forced rung ran out of memory: plan `auto` over the rungs above it on the ladder
    (the same math; only where the bytes live changes)."""
    names = list(strategies.names())
    below = names[: names.index(cfg.strategy) + 1]
    return cfg.model_copy(update={"strategy": "auto"}), sorted(
        set(failed) | set(below), key=names.index
    )


def _set_allocator_env(env: dict[str, str]) -> None:
    """The launch environment (the allocator's configuration) for an engine run in this process:
    the caching allocator reads it when CUDA starts, and takes it at run time once started (the
    hardware probe may have started it)."""
    os.environ.update(env)
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
    torch = sys.modules.get("torch")
    if conf and torch is not None and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)


def _run(cfg: JobConfig, argv: list[str], env: dict[str, str], spawn: bool) -> int:
    if not spawn:
        from trainer.engine import run_training

        _set_allocator_env(env)
        try:
            return run_training(cfg)
        finally:
            _release_device_memory()
    run_dir = Path(cfg.run.dir)
    newest_before = _newest_checkpoint(run_dir)
    started = time.time()
    output = TorchrunOutput(run_dir / TORCHRUN_LOG, sys.stderr)
    rc = run_command(argv, dict(env, **{LOCK_OWNER_ENV: str(os.getpid())}), output)
    if rc > 128 and not output.killed and "torch.distributed.run" not in argv:
        with contextlib.suppress(ValueError):  # one process, no torchrun to report its end
            name = signal.Signals(rc - 128).name
            if name not in ("SIGTERM", "SIGINT"):
                output.killed[0] = name
    if rc == EXIT_SIGNAL and _newest_checkpoint(run_dir) == newest_before:
        log.warning(
            "stopped by a signal before this launch wrote a checkpoint; run it again to start "
            "from %s",
            newest_before or "the beginning",
        )
    if output.config_error and rc != 0 and not (run_dir / CONFIG_ERROR_FILE).exists():
        print(output.config_error, file=sys.stderr)  # the ranks could not leave it (a full disk)
        return EXIT_USAGE
    explained = (
        (run_dir / OOM_REPORT_FILE).exists()
        or (run_dir / CONFIG_ERROR_FILE).exists()
        or _written_since(run_dir / HANG_DIR / HANG_REPORT_FILE, started)
    )
    if output.killed and rc not in (0, EXIT_SIGNAL) and not explained:
        rank, signame = min(output.killed.items())
        newest = _newest_checkpoint(run_dir)
        print(
            f"oomless: rank {rank} was killed ({signame}; the kernel's out-of-memory killer or a "
            f"user); the run stopped; run it again to resume from {newest or 'the beginning'} "
            f"(details: {output.log_path})",
            file=sys.stderr,
        )
        return rc
    if output.num_diverted and rc not in (0, EXIT_SIGNAL) and not explained:
        # out of memory and bad input have their own lines (the rank's, then the supervisor's)
        log.error("torchrun: the workers failed (exit %d); its report: %s", rc, output.log_path)
    return rc


def _written_since(path: Path, start: float) -> bool:
    """`path` exists and was written by this launch (a report of an earlier hang is kept)."""
    try:
        return path.stat().st_mtime >= start - 1.0
    except OSError:
        return False


def _newest_checkpoint(run_dir: Path) -> str | None:
    """What `checkpoints/latest` names now (None: no checkpoint yet)."""
    latest = run_dir / "checkpoints" / LATEST_LINK
    try:
        return latest.read_text().strip() or None
    except OSError:
        return None


def _release_device_memory() -> None:
    """After an in-process attempt, give its cached memory back before the next rung starts."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measured_over_estimated(report: dict[str, Any]) -> float:
    measured, estimated = report.get("measured_peak_bytes"), report.get("estimated_peak_bytes")
    if not measured or not estimated:
        return 1.0
    return max(1.0, measured / estimated)
