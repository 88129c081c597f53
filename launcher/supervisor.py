"""`oomless train`: plan, write the run dir, launch, and climb the ladder on out-of-memory.

The supervisor is the only place that decides how processes start; the engine runs the same way
on every rank whatever started it. When a launch exits 75 (out of memory after the in-process
back-off), the supervisor reads `oom-report.json`, scales the estimate by what was measured so it
does not pick a rung that will OOM again, re-plans without the failed rung, and relaunches with
`run.resume: auto`: the new rung continues from the newest checkpoint (or from step 0), and the
global batch, optimizer, schedule and precision stay as configured.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from launcher.plan import NoFitError
from launcher.preflight import check_rows, check_run_dir, ensure_run_dir, tokenize_data
from trainer.core import strategies
from trainer.core.config import ConfigError, JobConfig, write_config
from trainer.core.contract import (
    CONFIG_ERROR_FILE,
    CONFIG_FILE,
    ESCALATIONS_FILE,
    EXIT_OOM,
    EXIT_SIGNAL,
    EXIT_USAGE,
    OOM_REPORT_FILE,
    PLAN_FILE,
    TORCHRUN_LOG,
)
from trainer.core.files import append_line, read_json_object, write_atomic
from trainer.core.run_lock import LOCK_OWNER_ENV, acquire_run_lock, check_run_lock

log = logging.getLogger(__name__)


def train_command(cfg: JobConfig, dry_run: bool = False) -> int:
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": _abs(cfg.run.dir)})})
    with contextlib.ExitStack() as held:  # the run-dir lock, once the input has been checked
        return _train(cfg, dry_run, held)


def _train(cfg: JobConfig, dry_run: bool, held: contextlib.ExitStack) -> int:
    """Plan, launch, and on an out-of-memory exit climb the ladder and resume, until the run
    ends, fails otherwise, or no higher rung fits."""
    run_dir = Path(cfg.run.dir)
    if not dry_run:
        check_run_dir(run_dir)
        check_run_lock(run_dir)  # a live run's files stay as they are; it is taken after checks
        check_rows(cfg)  # torch-free: a broken data file answers before anything imports torch
    failed: list[str] = []
    memory_scale = 1.0
    attempt = 0
    while True:
        resolved, plan_json = resolve_plan(cfg, exclude=failed, memory_scale=memory_scale)
        if attempt == 0:
            check_resume(resolved)  # before anything is written into run.dir
        argv, env, spawn = launch_spec(resolved, run_dir / CONFIG_FILE)
        plan_json["command"] = argv
        if dry_run:
            print(json.dumps(plan_json, indent=2))
            print(" ".join(argv))
            return 0
        if attempt == 0:  # bad input stops here, before anything is written or launched
            if not _under_launcher():  # srun tasks would write one cache at once: rank 0 does
                tokenize_data(resolved)
            ensure_run_dir(run_dir)
            # one run per run.dir, for the life of this one
            held.enter_context(acquire_run_lock(run_dir))
        rc = _launch(resolved, plan_json, argv, env, spawn)
        if rc != EXIT_OOM or not cfg.escalation.enabled:
            return rc
        attempt += 1
        if attempt > cfg.escalation.max_attempts:
            log.error("out of memory; escalation.max_attempts=%d reached", attempt - 1)
            return rc
        climbed = _climb(cfg, resolved, failed, memory_scale)
        if climbed is None:
            return rc
        cfg, failed, memory_scale = climbed


def _launch(resolved: JobConfig, plan_json: dict, argv, env, spawn) -> int:
    """One attempt: the resolved config and plan into run.dir, the ranks run; the exit code,
    with a worker's bad-input line printed (exit 2) and an out-of-memory report read as 75."""
    run_dir = Path(resolved.run.dir)
    write_config(resolved, run_dir)
    _write_json(run_dir / PLAN_FILE, plan_json)
    report_path = run_dir / OOM_REPORT_FILE
    report_path.unlink(missing_ok=True)
    config_error = run_dir / CONFIG_ERROR_FILE
    config_error.unlink(missing_ok=True)
    rc = _run(resolved, argv, env, spawn)
    if rc not in (0, EXIT_OOM, EXIT_SIGNAL) and config_error.exists():
        # a worker found bad input (data rows, an unusable strategy) after the launch
        print(config_error.read_text().strip(), file=sys.stderr)
        return EXIT_USAGE
    if rc not in (0, EXIT_OOM, EXIT_SIGNAL) and report_path.exists():
        rc = EXIT_OOM  # torchrun reports a failed worker as 1; the report says why
    return rc


def _climb(cfg: JobConfig, resolved: JobConfig, failed: list[str], memory_scale: float):
    """After an out-of-memory exit on `resolved.strategy`: (the config to plan next, the rungs
    to exclude, the memory scale measured), with the escalation recorded and said; None when
    no higher rung fits."""
    run_dir = Path(cfg.run.dir)
    report = read_json_object(run_dir / OOM_REPORT_FILE)
    failed = [*failed, resolved.strategy]
    left_forced = cfg.strategy if cfg.strategy != "auto" else None
    if left_forced:  # a forced rung is where the ladder starts: climb from it
        cfg, failed = climb_from_forced(cfg, failed)
    memory_scale = max(memory_scale, _measured_over_estimated(report))
    try:
        next_cfg, _ = resolve_plan(cfg, exclude=failed, memory_scale=memory_scale)
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


def check_resume(cfg: JobConfig) -> None:
    """ConfigError (exit 2) when the checkpoint this run would resume was trained with other
    math or on other data; the changes that keep the math are logged."""
    from trainer.checkpoint import check_resumable, resolve_resume

    path = resolve_resume(cfg)
    if path is None:
        return

    def fingerprint() -> str:
        from trainer.data import train_data_fingerprint

        return train_data_fingerprint(cfg)

    check_resumable(path, cfg, fingerprint, announce=True)


def climb_from_forced(cfg: JobConfig, failed: list[str]) -> tuple[JobConfig, list[str]]:
    """After a forced rung ran out of memory: plan `auto` over the rungs above it on the ladder
    (the same math; only where the bytes live changes)."""
    names = list(strategies.names())
    below = names[: names.index(cfg.strategy) + 1]
    return cfg.model_copy(update={"strategy": "auto"}), sorted(
        set(failed) | set(below), key=names.index
    )


def resolve_plan(
    cfg: JobConfig, exclude: list[str] | None = None, memory_scale: float = 1.0
) -> tuple[JobConfig, dict[str, Any]]:
    """The resolved config (every `auto` made concrete) and the plan JSON for plan.json."""
    resolved, plan, hw = plan_job(cfg, exclude, memory_scale)
    return resolved, plan.to_json(hw, cfg.memory.headroom, command=[])


def plan_job(
    cfg: JobConfig, exclude: list[str] | None = None, memory_scale: float = 1.0
) -> tuple[JobConfig, Any, Any]:
    """(resolved config, Plan, Hardware) for this job on the detected hardware."""
    from launcher.hardware import detect_hardware
    from launcher.plan import apply_plan, make_plan

    hw = detect_hardware(cfg.hardware)
    try:
        shape = _forced_shape(cfg)
        plan = make_plan(cfg, hw, shape, exclude=exclude or (), memory_scale=memory_scale)
    except (NoFitError, ConfigError):
        raise
    except Exception as err:  # the model's shape or activations cannot be worked out
        plan = _without_estimate(cfg, hw, err)
    return apply_plan(cfg, plan, hw), plan, hw


def _forced_shape(cfg: JobConfig) -> Any:
    """With every planning key set there is nothing to choose: the model's shape with a bound
    on activations of blocks the analytic model does not know, rather than minutes of tracing
    before the run starts. None otherwise (the planner measures)."""
    from launcher.activations import with_activations
    from launcher.model_shape import model_shape
    from launcher.unestimated import planning_keys_forced

    if not planning_keys_forced(cfg):
        return None
    return with_activations(model_shape(cfg.model), cfg, measure=False)


def _without_estimate(cfg: JobConfig, hw: Any, err: Exception) -> Any:
    """A model transformers builds but the estimate cannot read: with every planning key
    forced it trains as configured (one warning line), else a one-line config error."""
    from launcher.unestimated import planning_keys_forced, unestimated_plan, unestimated_warning

    why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    if not planning_keys_forced(cfg):
        raise ConfigError(
            "model",
            f"its memory cannot be estimated ({why})",
            "set strategy, train.micro_batch_size and memory.activation_checkpointing to train "
            "it as configured without an estimate",
        ) from None
    log.warning(unestimated_warning(why))
    return unestimated_plan(cfg, hw, why)


def launch_spec(cfg: JobConfig, config_path: Path) -> tuple[list[str], dict[str, str], bool]:
    """(argv, env, spawn): torchrun for several processes, else this process runs the engine."""
    world_size = cfg.hardware.nodes * (cfg.hardware.devices_per_node or 1)
    if world_size > 1 and not _under_launcher():
        from launcher.launch import build_torchrun_command

        argv, env = build_torchrun_command(cfg, config_path)
        return argv, env, True
    return [sys.executable, "-m", "trainer", str(config_path)], {}, False


def _run(cfg: JobConfig, argv: list[str], env: dict[str, str], spawn: bool) -> int:
    if not spawn:
        from trainer.engine import run_training

        try:
            return run_training(cfg)
        finally:
            _release_device_memory()
    from launcher.launch import run_command
    from launcher.torchrun_output import TorchrunOutput

    log.info("launching: %s", " ".join(argv))
    output = TorchrunOutput(Path(cfg.run.dir) / TORCHRUN_LOG, sys.stderr)
    rc = run_command(argv, dict(env, **{LOCK_OWNER_ENV: str(os.getpid())}), output)
    run_dir = Path(cfg.run.dir)
    explained = (run_dir / OOM_REPORT_FILE).exists() or (run_dir / CONFIG_ERROR_FILE).exists()
    if output.num_diverted and rc not in (0, EXIT_SIGNAL) and not explained:
        # out of memory and bad input have their own lines (the rank's, then the supervisor's)
        log.error("torchrun: the workers failed (exit %d); its report: %s", rc, output.log_path)
    return rc


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


def _under_launcher() -> bool:
    """Already one rank of torchrun, or one of several srun tasks: run here, spawn nothing."""
    env = os.environ
    return (
        "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env or int(env.get("SLURM_NTASKS", "1")) > 1
    )


def _abs(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")
