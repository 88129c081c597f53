"""Elastic Slurm jobs (`elastic.min_nodes`): go on with the nodes left after one is lost.

`oomless submit` asks for `--no-kill` (a failed node leaves the job; the allocation stays) and the
batch script runs its srun step in a loop (launcher/slurm/templates/submit.sbatch.tmpl). When a
step fails, the script runs `python -m launcher.slurm.elastic RUN_DIR NUM_NODES`: it finds which
of the job's nodes are still up (scontrol, sinfo), and when a node was lost and at least
`elastic.min_nodes` are left, re-plans the submitted config (run.dir/job.yaml) for them — the same
global batch; micro-batch, accumulation and rung re-chosen — writes config.yaml and plan.json,
records "node lost: 2 -> 1 nodes" in escalations.jsonl, and prints `NUM_NODES HOST,HOST` for the
next srun, which resumes from the last checkpoint. Otherwise it says why and exits 1, and the job
ends with the step's exit code. docs/resilience.md.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from launcher.plan.job import resolve_plan
from launcher.plan.planner import NoFitError
from trainer.core.config import ConfigError, JobConfig, load_config, write_config
from trainer.core.contract import ESCALATIONS_FILE, JOB_FILE, LATEST_LINK, PLAN_FILE
from trainer.core.files import append_line, write_json
from trainer.core.logs import setup_logging

log = logging.getLogger(__name__)
SLURM_TIMEOUT_S = 60
UP_STATES = ("idle", "mix", "alloc", "completing")  # sinfo's %T, a suffix stripped
NODE_LOST = "node lost"


class JobEnds(Exception):
    """Why the job does not go on with fewer nodes (said in one line; the job ends)."""


def nodes_up(job_id: str) -> list[str]:
    """The job's nodes (its allocation now, as slurmctld keeps it) whose state is up."""
    job = _slurm(["scontrol", "show", "job", "-o", job_id])
    fields = dict(item.split("=", 1) for item in job.split() if "=" in item)
    hosts = _slurm(["scontrol", "show", "hostnames", fields.get("NodeList", "")]).split()
    states = _slurm(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %T"]).splitlines()
    up = set()
    for line in states:
        name, state = line.split()[:2]
        # a trailing `*` is a node that does not respond; `~`, `#`, `%`... are power states
        if not state.endswith("*") and state.rstrip("~#!%$@^-+").startswith(UP_STATES):
            up.add(name)
    return [h for h in hosts if h in up]


def continue_on(cfg: JobConfig, run_dir: Path, num_before: int, up: list[str]) -> JobConfig:
    """The config for the nodes `up`, planned and written into run_dir, the loss recorded;
    JobEnds when the job should end instead."""
    min_nodes = cfg.elastic.min_nodes or num_before
    if len(up) >= num_before:
        raise JobEnds(f"the step failed with all {num_before} node(s) up (not a lost node)")
    resume = f"resume when nodes are back: sbatch {run_dir / 'submit.sbatch'}"
    if len(up) < min_nodes:
        raise JobEnds(
            f"{len(up)} of {num_before} node(s) left, below elastic.min_nodes={min_nodes}; {resume}"
        )
    restarts = _num_node_losses(run_dir)
    if restarts >= cfg.run.num_restarts_allowed:
        raise JobEnds(f"{restarts} node losses already, run.max_restarts reached; {resume}")
    hardware = cfg.hardware.model_copy(update={"nodes": len(up)})
    run = cfg.run.model_copy(update={"resume": "auto"})
    resolved, plan_json = resolve_plan(cfg.model_copy(update={"hardware": hardware, "run": run}))
    write_config(resolved, run_dir)
    write_json(run_dir / PLAN_FILE, plan_json)
    record = {
        "step": _newest_step(run_dir),
        "from": cfg.strategy if cfg.strategy != "auto" else None,
        "to": resolved.strategy,
        "reason": f"{NODE_LOST}: {num_before} -> {len(up)} nodes (left: {', '.join(up)})",
        "estimated_peak_bytes": plan_json["estimate"]["device"]["peak_tensor_bytes"],
        "measured_peak_bytes": None,
    }
    append_line(run_dir / ESCALATIONS_FILE, json.dumps(record))
    log.warning(
        "%s: %d -> %d nodes; re-planned: %s, micro-batch %d x accumulation %d; resuming from %s",
        NODE_LOST,
        num_before,
        len(up),
        resolved.strategy,
        resolved.train.micro_batch_size,
        plan_json["grad_accum"],
        f"step {record['step']}" if record["step"] else "the beginning",
    )
    return resolved


def main(argv: list[str]) -> int:
    setup_logging(0, 1)
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m launcher.slurm.elastic RUN_DIR NUM_NODES", file=sys.stderr)
        return 2
    run_dir, num_before = Path(argv[0]), int(argv[1])
    try:
        cfg = load_config(run_dir / JOB_FILE)
        up = nodes_up(os.environ["SLURM_JOB_ID"])
        continue_on(cfg, run_dir, num_before, up)
    except (JobEnds, ConfigError, NoFitError, RuntimeError, KeyError) as err:
        print(f"oomless: not continuing on fewer nodes: {err}", file=sys.stderr)
        return 1
    print(f"{len(up)} {','.join(up)}")
    return 0


def _num_node_losses(run_dir: Path) -> int:
    try:
        lines = (run_dir / ESCALATIONS_FILE).read_text().splitlines()
    except OSError:
        return 0
    return sum(NODE_LOST in json.loads(line).get("reason", "") for line in lines if line.strip())


def _newest_step(run_dir: Path) -> int | None:
    try:
        name = (run_dir / "checkpoints" / LATEST_LINK).read_text().strip()
    except OSError:
        return None
    return int(name.rsplit("_", 1)[1]) if name.startswith("step_") else None


def _slurm(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"{argv[0]} {argv[1]}: {err}") from None
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed: {out.stderr.strip()[:200]}")
    return out.stdout


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
