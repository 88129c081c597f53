"""`oomless plan --probe`: one step of the job in a temporary directory, measured by the launch
probe (trainer/observe/probe.py), printed against the estimate for device and host; exit 0 within
the plan's budget, 3 over it. The measurement calibrates later plans (launcher/run/probe.py)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from launcher.run.supervisor import train_command
from trainer.core.config import JobConfig
from trainer.core.contract import EXIT_NO_FIT, PROBE_FILE
from trainer.core.files import read_json_object
from trainer.core.units import GIB


def probe_config(cfg: JobConfig, run_dir: Path) -> JobConfig:
    """The job as `plan --probe` runs it: one step into `run_dir`, nothing saved, no trackers,
    no escalation or restarts, evaluation off."""
    return cfg.model_copy(
        update={
            "train": cfg.train.model_copy(update={"steps": 1, "eval_every": 0, "warmup_steps": 0}),
            "run": cfg.run.model_copy(update={
                "dir": str(run_dir), "checkpoint_every": 0, "save_final": False, "trackers": [],
                "resume": "never", "max_restarts": 0,
            }),
            "escalation": cfg.escalation.model_copy(update={"enabled": False}),
        }
    )  # fmt: skip


def probe_command(cfg: JobConfig) -> int:
    """`oomless plan --probe`: measure the job's first step; 0 within the budget, 3 over it."""
    with tempfile.TemporaryDirectory(prefix="oomless-probe-") as tmp:
        run_dir = Path(tmp) / "probe"
        rc = train_command(probe_config(cfg, run_dir), probe_only=True)
        probe = read_json_object(run_dir / PROBE_FILE) if (run_dir / PROBE_FILE).exists() else {}
    if not probe:
        print("oomless plan --probe: the step did not finish; nothing was measured",
              file=sys.stderr)  # fmt: skip
        return rc or 1
    print(render(probe))
    return EXIT_NO_FIT if probe.get("over_budget") else 0


def render(probe: dict[str, Any]) -> str:
    """Measured against estimated, per rank (device) and per node (host)."""
    lines = [
        f"launch probe: {probe['strategy']} on {probe['device']}, step {probe['step']}"
        + (f" (measured x{probe['probe_scale']:g}, debug.probe_scale)"
           if probe.get("probe_scale", 1) != 1 else ""),
        f"{'':8} {'measured':>12} {'estimated':>12} {'ratio':>7} {'budget':>12}",
    ]  # fmt: skip
    budget = probe["budget"]
    rows = [(f"rank {r['rank']}", r["device"], budget["device_bytes"], "device")
            for r in probe["ranks"]]  # fmt: skip
    rows += [(f"node {n['first_rank']}", n["host"], budget["host_bytes"], "host")
             for n in probe["nodes"]]  # fmt: skip
    for label, m, limit, what in rows:
        lines.append(
            f"{label:8} {m['measured_bytes'] / GIB:9.2f} GiB {m['estimated_bytes'] / GIB:8.2f} GiB "
            f"{m['ratio']:7.2f} {limit / GIB:8.2f} GiB  {what}"
        )
    lines.append(probe["line"])
    return "\n".join(lines)
