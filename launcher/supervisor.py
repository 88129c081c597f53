"""`oomless train`: plan, write the run dir, launch (in process or under torchrun).

The supervisor is the only place that decides how processes start; the engine runs the same way
on every rank whatever started it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from launcher.config import JobConfig, write_config

log = logging.getLogger(__name__)


def train_command(cfg: JobConfig, dry_run: bool = False) -> int:
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": _abs(cfg.run.dir)})})
    resolved, plan_json = resolve_plan(cfg)
    run_dir = Path(resolved.run.dir)
    world_size = resolved.hardware.nodes * (resolved.hardware.devices_per_node or 1)
    spawn = world_size > 1 and not _under_launcher()
    config_path = run_dir / "config.yaml"
    argv, env = _launch_command(resolved, config_path) if spawn else ([], {})
    plan_json["command"] = argv or [sys.executable, "-m", "trainer", str(config_path)]
    if dry_run:
        print(json.dumps(plan_json, indent=2))
        print(" ".join(plan_json["command"]))
        return 0
    write_config(resolved, run_dir)
    _write_json(run_dir / "plan.json", plan_json)
    if not spawn:
        from trainer.engine import run_training

        return run_training(resolved)
    from launcher.launch import run_command

    log.info("launching: %s", " ".join(argv))
    return run_command(argv, env)


def resolve_plan(cfg: JobConfig) -> tuple[JobConfig, dict[str, Any]]:
    """The resolved config (every `auto` made concrete) and the plan JSON for plan.json."""
    from launcher.hardware import detect_hardware
    from launcher.plan import apply_plan, make_plan

    hw = detect_hardware(cfg.hardware)
    plan = make_plan(cfg, hw)
    return apply_plan(cfg, plan, hw), plan.to_json(hw, cfg.memory.headroom, command=[])


def _launch_command(cfg: JobConfig, config_path: Path) -> tuple[list[str], dict[str, str]]:
    from launcher.launch import build_torchrun_command

    return build_torchrun_command(cfg, config_path)


def _under_launcher() -> bool:
    """Already one rank of torchrun (or srun): run here, never spawn a second layer."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _abs(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
