"""`oomless submit`: an sbatch script sized by the plan, written to the run dir, then sbatch'ed.

Rendering is pure (`render_sbatch`); `submit_command` writes the run dir and calls sbatch.
The script asks for exactly what the plan needs: nodes, GPUs per node, host memory from the
estimate (offload rungs need a lot), CPU cores, and the time limit, sized to what the partition's
nodes have as `sinfo` reports them at submit time (launcher/slurm/nodes.py; exit 3 when the plan
cannot be had there). One srun task per node runs torchrun with a static rendezvous on the job's
first node; `$SLURM_NODEID` is expanded on each node. Preemption: `--signal=USR1` reaches the
ranks `grace_s` before the end; they checkpoint and exit 0, the script requeues the job
(trainer/runtime/slurm_requeue.py), and `run.resume: auto` continues from that checkpoint.
docs/slurm.md has the user's side.

Every value is quoted for the place it lands in: `#SBATCH` lines are split by sbatch itself (blanks
separate, `"` and `\\` are its quoting), the script body by bash, and the command inside the
single-quoted `bash -c '...'` by bash twice. A line break, NUL or other control character in any
value could only start a new script line, so it is refused (exit 2).
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from string import Template

from launcher.plan.headroom import plan_headroom
from launcher.plan.job import resolve_plan
from launcher.plan.planner import NoFitError
from launcher.run.launch import allocator_env, refuse_control_chars
from launcher.run.preflight import (
    check_inputs_are_not_run_files,
    check_resume,
    check_rows,
    check_run_dir,
    ensure_run_dir,
    tokenize_data,
)
from launcher.slurm.nodes import PartitionNodes, SlurmRequest, read_partition, size_request
from trainer.core.config import ConfigError, JobConfig, dump_config, write_config
from trainer.core.contract import CONFIG_FILE, JOB_FILE, PLAN_FILE
from trainer.core.files import absolute_path, write_atomic, write_json
from trainer.core.run_lock import check_run_lock
from trainer.core.units import GIB, MIB

TEMPLATE = resources.files("launcher.slurm") / "templates" / "submit.sbatch.tmpl"
CPUS_PER_RANK = 8
MIN_MEM_BYTES = 16 * GIB


class _SbatchTemplate(Template):
    delimiter = "%%"  # shell's own $ stays untouched


def host_bytes_needed(cfg: JobConfig, plan_json: dict) -> int:
    """Host memory per node the plan needs, with the config's headroom."""
    host_bytes = plan_json.get("estimate", {}).get("host", {}).get("total_bytes") or 0
    return int(host_bytes * (1 + plan_headroom(cfg).host))


def size_for_partition(cfg: JobConfig, plan_json: dict, nodes: PartitionNodes) -> SlurmRequest:
    """CPUs and memory that the partition's nodes can give (NoFitError when the plan's cannot)."""
    hw = cfg.hardware
    per_node = hw.devices_per_node or 1
    return size_request(
        nodes,
        num_nodes=hw.nodes,
        gpus_per_node=per_node if hw.device != "cpu" else 0,
        ranks_per_node=per_node,
        host_bytes_needed=host_bytes_needed(cfg, plan_json),
        cpus_wanted=CPUS_PER_RANK * per_node,
        min_mem_bytes=MIN_MEM_BYTES,
    )


def render_sbatch(
    cfg: JobConfig,
    plan_json: dict,
    run_dir: Path,
    python: str,
    request: SlurmRequest | None = None,
) -> str:
    """The sbatch script for a resolved config and its plan (docs/interface.md plan JSON); `request`
    is what the partition's nodes can give (`size_for_partition`), else the plan's own sizes."""
    _refuse_line_breaks(cfg, run_dir, python)
    hw = cfg.hardware
    per_node = hw.devices_per_node or 1
    if request is None:
        request = SlurmRequest(
            cpus_per_task=CPUS_PER_RANK * per_node,
            mem_bytes=math.ceil(max(MIN_MEM_BYTES, host_bytes_needed(cfg, plan_json)) / GIB) * GIB,
        )
    optional = [
        f"#SBATCH --{key}={_sbatch_value(value)}"
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
        JOB_NAME=_sbatch_value(Path(cfg.run.dir).name or "oomless"),
        NODES=hw.nodes,
        CPUS_PER_TASK=request.cpus_per_task,
        MEM=_mem(request.mem_bytes),
        TIME=cfg.slurm.time,
        OUTPUT=_sbatch_value(str(run_dir).replace("%", "%%") + "/slurm-%j.out"),
        RUN_DIR=shlex.quote(str(run_dir)),
        GRACE_S=cfg.slurm.grace_s,
        OPTIONAL_SBATCH="\n".join(optional),
        SETUP="\n".join(cfg.slurm.setup),
        PYTHON=_in_single_quotes(shlex.quote(python)),
        PROCS_PER_NODE=per_node,
        MAX_RESTARTS=cfg.dist.max_restarts,
        CONFIG=_in_single_quotes(shlex.quote(str(run_dir / CONFIG_FILE))),
        NO_KILL="#SBATCH --no-kill\n" if cfg.elastic.min_nodes else "",
        ELASTIC=_elastic_block(cfg, run_dir, python),
        ALLOC_CONF=_alloc_conf(cfg),
    )


def _alloc_conf(cfg: JobConfig) -> str:
    """CUDA ranks: the caching allocator with expandable segments (launcher/run/launch.py
    `allocator_env`), unless the job's environment configures it already."""
    env = allocator_env(cfg, environ={})
    if not env:
        return ""
    ((name, value),) = env.items()
    unset = '[ -n "${PYTORCH_CUDA_ALLOC_CONF:-}${PYTORCH_ALLOC_CONF:-}" ]'
    return (
        "# CUDA ranks: expandable segments, unless the job's environment configures the allocator\n"
        f"{unset} || export {name}={value}\n"
    )


def _elastic_block(cfg: JobConfig, run_dir: Path, python: str) -> str:
    """With elastic.min_nodes: after a failed step, the nodes to go on with (re-planned by
    launcher/slurm/elastic.py), or the end of the job."""
    if not cfg.elastic.min_nodes:
        return ""
    replan = f"{shlex.quote(python)} -m launcher.slurm.elastic {shlex.quote(str(run_dir))}"
    return (
        'if [ "$rc" -ne 0 ]; then\n'
        f'  next=$({replan} "$nodes") || exit "$rc"\n'
        '  read -r nodes nodelist <<< "$next"\n'
        '  export OOMLESS_HEAD_NODE="${nodelist%%,*}"\n'
        '  echo "oomless: continuing on $nodes node(s): $nodelist"\n'
        "  continue\n"
        "fi\n"
    )


def _mem(num_bytes: int) -> str:
    """`--mem`: whole GiB as `NG`, else whole MiB (`NM`, a node's memory as sinfo reports it)."""
    return f"{num_bytes // GIB}G" if num_bytes % GIB == 0 else f"{num_bytes // MIB}M"


_SBATCH_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def _sbatch_value(value: str) -> str:
    """VALUE for an `#SBATCH --opt=VALUE` line, as sbatch reads it back (one argument)."""
    if _SBATCH_PLAIN.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _in_single_quotes(shell_word: str) -> str:
    """A shell word placed inside a single-quoted string: each `'` closes, escapes and reopens."""
    return shell_word.replace("'", "'\\''")


def _refuse_line_breaks(cfg: JobConfig, run_dir: Path, python: str) -> None:
    """A control character (a line break, NUL, ...) in a value the script holds: exit 2."""
    values = {f"slurm.{k}": v for k, v in cfg.slurm.model_dump().items()}
    values.update({"run.dir": str(run_dir), "python": python})
    refuse_control_chars(values, "the sbatch script")


def _request_for_partition(cfg: JobConfig, plan_json: dict, dry_run: bool) -> SlurmRequest | None:
    """Requests sized to the partition's nodes as sinfo reports them now (None: no sinfo here).

    A plan the nodes cannot hold exits 3; under --dry-run (a script for another cluster, say)
    that is said on stderr and the script keeps the plan's own sizes."""
    try:
        nodes = read_partition(cfg.slurm.partition)
        request = size_for_partition(cfg, plan_json, nodes) if nodes is not None else None
    except NoFitError as err:
        if not dry_run:
            raise
        print(f"oomless submit: would exit 3 here: {err}", file=sys.stderr)
        return None
    if dry_run and nodes is None:
        print("oomless submit: no sinfo here: requests sized by the plan alone", file=sys.stderr)
    elif dry_run and request is not None:
        print(
            f"oomless submit: sinfo: {nodes.describe()}; asking --cpus-per-task="
            f"{request.cpus_per_task} --mem={_mem(request.mem_bytes)} per node",
            file=sys.stderr,
        )
    return request


def submit_command(cfg: JobConfig, dry_run: bool) -> int:
    """`oomless submit`: plan, write run dir + submit.sbatch, sbatch it, print the job id."""
    cfg = cfg.model_copy(
        update={"run": cfg.run.model_copy(update={"dir": absolute_path(cfg.run.dir)})}
    )
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})
    run_dir = Path(cfg.run.dir)
    if not dry_run:
        check_run_dir(run_dir)
        check_inputs_are_not_run_files(cfg)
        check_rows(cfg)  # torch-free, before the plan: a broken file answers at once
    resolved, plan_json = resolve_plan(cfg)
    _refuse_line_breaks(resolved, run_dir, sys.executable)
    request = _request_for_partition(resolved, plan_json, dry_run)
    script = render_sbatch(resolved, plan_json, run_dir, sys.executable, request)
    if dry_run:
        sys.stdout.write(script)
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError("submit", "sbatch is not on PATH", "run on a Slurm login node")

    check_run_lock(run_dir)  # a live job's config, plan and script stay as they are
    check_resume(resolved)  # before anything is written into run.dir
    tokenize_data(resolved)  # what only the tokenizer sees stops here, not in the queue
    ensure_run_dir(run_dir)
    write_config(resolved, run_dir)
    if cfg.elastic.min_nodes:  # what a re-plan for fewer nodes starts from
        write_atomic(run_dir / JOB_FILE, dump_config(cfg))
    write_json(run_dir / PLAN_FILE, plan_json)
    path = write_atomic(run_dir / "submit.sbatch", script)  # 0600: it holds paths and commands
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"oomless submit: sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return out.returncode
    job_id = out.stdout.strip().split(";")[0]
    print(job_id)
    return 0
