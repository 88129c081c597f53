"""`oomless submit`: an sbatch script sized by the plan, written to the run dir, then sbatch'ed.

Rendering is pure (`render_sbatch`); `submit_command` writes the run dir and calls sbatch.
The script asks for exactly what the plan needs: nodes, GPUs per node, host memory from the
estimate (offload rungs need a lot), CPU cores, and the time limit. One srun task per node runs
torchrun with a static rendezvous on the job's first node; `$SLURM_NODEID` is expanded on each
node. Preemption: `--signal=USR1` reaches the ranks `grace_s` before the end; they checkpoint,
rank 0 requeues the job (trainer/slurm_requeue.py), and `run.resume: auto` continues from that
checkpoint. docs/slurm.md has the user's side.
"""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from string import Template

from trainer.config import ConfigError, JobConfig, write_config
from trainer.contract import CONFIG_FILE, PLAN_FILE
from trainer.units import GIB

TEMPLATE = Path(__file__).resolve().parents[1] / "slurm" / "submit.sbatch.tmpl"
CPUS_PER_RANK = 8
MIN_MEM_BYTES = 16 * GIB


class _SbatchTemplate(Template):
    delimiter = "%%"  # shell's own $ stays untouched


def render_sbatch(cfg: JobConfig, plan_json: dict, run_dir: Path, python: str) -> str:
    """The sbatch script for a resolved config and its plan (INTERFACE.md plan JSON)."""
    hw = cfg.hardware
    per_node = hw.devices_per_node or 1
    host_bytes = plan_json.get("estimate", {}).get("host", {}).get("total_bytes") or 0
    mem_gib = max(MIN_MEM_BYTES, int(host_bytes * (1 + cfg.memory.headroom))) / GIB
    optional = [
        f"#SBATCH --{key}={value}"
        for key, value in (
            ("partition", cfg.slurm.partition),
            ("account", cfg.slurm.account),
            ("qos", cfg.slurm.qos),
            ("constraint", cfg.slurm.constraint),
        )
        if value
    ]
    if hw.device != "cpu":
        optional.append(f"#SBATCH --gpus-per-node={per_node}")
    optional += [
        line if line.startswith("#SBATCH") else f"#SBATCH {line}" for line in cfg.slurm.extra
    ]
    return _SbatchTemplate(TEMPLATE.read_text()).substitute(
        SCRIPT=shlex.quote(str(run_dir / "submit.sbatch")),
        JOB_NAME=Path(cfg.run.dir).name or "oomless",
        NODES=hw.nodes,
        CPUS_PER_TASK=CPUS_PER_RANK * per_node,
        MEM=f"{math.ceil(mem_gib)}G",
        TIME=cfg.slurm.time,
        RUN_DIR=str(run_dir),
        GRACE_S=cfg.slurm.grace_s,
        OPTIONAL_SBATCH="\n".join(optional),
        SETUP="\n".join(cfg.slurm.setup),
        PYTHON=shlex.quote(python),
        PROCS_PER_NODE=per_node,
        MAX_RESTARTS=cfg.dist.max_restarts,
        CONFIG=shlex.quote(str(run_dir / CONFIG_FILE)),
    )


def submit_command(cfg: JobConfig, dry_run: bool) -> int:
    """`oomless submit`: plan, write run dir + submit.sbatch, sbatch it, print the job id."""
    from launcher.supervisor import _abs, _write_json, resolve_plan

    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": _abs(cfg.run.dir)})})
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})
    resolved, plan_json = resolve_plan(cfg)
    run_dir = Path(resolved.run.dir)
    script = render_sbatch(resolved, plan_json, run_dir, sys.executable)
    if dry_run:
        sys.stdout.write(script)
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError("submit", "sbatch is not on PATH", "run on a Slurm login node")
    write_config(resolved, run_dir)
    _write_json(run_dir / PLAN_FILE, plan_json)
    path = run_dir / "submit.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"oomless submit: sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return out.returncode
    job_id = out.stdout.strip().split(";")[0]
    print(job_id)
    return 0
