"""What `oomless train` and `oomless plan --probe` do with the launch probe's measurement
(trainer/observe/probe.py writes run.dir/probe.json after a launch's first step).

After each launch: a probe measured without `debug.probe_scale` is kept for later plans
(launcher/plan/calibration.py). A launch that stopped over its device budget (exit 76) is planned
again with the measured figure (the estimate scaled by measured / estimated, as after an
out-of-memory) and started again from the state before its first step: the newest checkpoint, or
step 0. One line says what was measured and what changed; escalations.jsonl keeps it.
`oomless plan --probe` is launcher/report/probe_report.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from launcher.plan import calibration
from launcher.plan.job import resolve_plan
from launcher.plan.planner import NoFitError
from trainer.core.config import ConfigError, JobConfig
from trainer.core.contract import ESCALATIONS_FILE, EXIT_NO_FIT, PROBE_FILE
from trainer.core.files import append_line, read_json_object

log = logging.getLogger(__name__)

# what a re-plan may change, as plan.json names it
_PLAN_KEYS = ("strategy", "micro_batch_size", "grad_accum", "activation_checkpointing",
              "checkpointed_layers", "chunked_loss", "offload_activations")  # fmt: skip


def written_probe(run_dir: Path, started: float) -> dict[str, Any] | None:
    """probe.json as this launch wrote it (None: it wrote none); kept for later plans when it
    measured for real."""
    path = run_dir / PROBE_FILE
    try:
        if path.stat().st_mtime < started - 1.0:
            return None
    except OSError:
        return None
    probe = read_json_object(path)
    if probe and (probe.get("probe_scale") or 1.0) == 1.0:
        kept = calibration.record(probe)
        if kept is not None:
            log.info("launch probe: kept for later plans on this hardware in %s", kept)
    return probe or None


def measured_scale(probe: dict[str, Any]) -> float:
    """The largest rank's measured device bytes over the estimate's (at least 1)."""
    ratios = [(r.get("device") or {}).get("ratio") or 1.0 for r in probe.get("ranks", [])]
    return max([1.0, *ratios])


def replan(
    cfg: JobConfig, resolved: JobConfig, plan_json: dict[str, Any], probe: dict[str, Any],
    failed: list[str], memory_scale: float,
) -> tuple[JobConfig, float, dict[str, Any]] | int:  # fmt: skip
    """After a launch stopped over its budget: (the config to run next, the memory scale, what
    was re-planned for the next probe.json to say), the change said in one line and kept in
    escalations.jsonl; EXIT_NO_FIT when nothing fits at the measured scale."""
    scale = max(memory_scale, measured_scale(probe))
    try:
        _, new_plan = resolve_plan(cfg, exclude=failed, memory_scale=scale)
    except (NoFitError, ConfigError) as err:
        log.error("%s; at the measured scale (%.2f) no plan fits: %s", probe["line"], scale, err)
        return EXIT_NO_FIT
    changed = [
        f"{key} {plan_json.get(key)} -> {new_plan.get(key)}"
        for key in _PLAN_KEYS
        if plan_json.get(key) != new_plan.get(key)
    ]
    what = ", ".join(changed) or "the same plan (its estimate now scaled)"
    log.warning("%s; re-planned: %s", probe["line"], what)
    record = {
        "step": probe.get("step"),
        "from": resolved.strategy,
        "to": new_plan.get("strategy"),
        "reason": f"launch probe: measured {scale:.2f}x the estimate, over the budget; {what}",
        "estimated_peak_bytes": plan_json["estimate"]["device"]["total_bytes"],
        "measured_peak_bytes": max(r["device"]["measured_bytes"] for r in probe["ranks"]),
    }
    append_line(Path(cfg.run.dir) / ESCALATIONS_FILE, json.dumps(record))
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})
    return cfg, scale, {"line": probe["line"], "changed": what, "memory_scale": scale}
