"""Launch commands, built as data: `(argv, env)` for torchrun; `run_command` is the one side effect.

Single node: `torchrun --standalone`. Several nodes: c10d rendezvous on the head node; each node
runs the same command with its own `--node_rank` (from the environment, evaluated on that node).

A command printed for a user to run (`--emit torchrun`, the plan's command line) is `shell_join`
quoted: `shlex.split` of it gives the argv back, whatever a path holds. Every emitter refuses a
control character in a value it writes (`refuse_control_chars`): in a script, a manifest's
comment or a printed command it could only start a new line.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.estimate.peak import ALLOC_CONF_VARS
from trainer.core.config import ConfigError, JobConfig
from trainer.core.contract import EXIT_SIGNAL

if TYPE_CHECKING:
    from launcher.run.torchrun_output import TorchrunOutput

log = logging.getLogger(__name__)
RDZV_PORT = 29500
NODE_RANK_VAR = "$NODE_RANK"
HEAD_NODE_VAR = "$HEAD_NODE"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def build_torchrun_command(
    cfg: JobConfig,
    config_path: Path,
    node_rank: str = NODE_RANK_VAR,
    head_node: str = HEAD_NODE_VAR,
) -> tuple[list[str], dict[str, str]]:
    """torchrun argv for the resolved config, and the environment its children need.

    For several nodes `node_rank` and `head_node` are left as shell variables by default, so the
    printed command is the one to run on every node.
    """
    hw = cfg.hardware
    per_node = hw.devices_per_node or 1
    argv = [sys.executable, "-m", "torch.distributed.run"]
    if hw.nodes == 1:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        # elastic.min_nodes: an elastic rendezvous (MIN:MAX nodes); after a lost node torchrun
        # restarts the workers on those left, which resume from the newest checkpoint
        nnodes = f"{cfg.elastic.min_nodes}:{hw.nodes}" if cfg.elastic.min_nodes else str(hw.nodes)
        argv += [
            "--nnodes",
            nnodes,
            "--node_rank",
            node_rank,
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{head_node}:{RDZV_PORT}",
            "--rdzv_id",
            f"oomless-{Path(cfg.run.dir).name}",
        ]
    argv += [
        "--nproc_per_node",
        str(per_node),
        "--max_restarts",
        str(_max_restarts(cfg)),
        "-m",
        "trainer",
        str(config_path),
    ]
    env = allocator_env(cfg)
    if hw.device == "cpu":
        # CPU ranks share the cores: one intra-op thread each unless the user said otherwise.
        cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(max(1, cores // per_node)))
    return argv, env


def allocator_env(cfg: JobConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for CUDA ranks, unless the user's
    environment configures the caching allocator already (theirs wins).

    Expandable segments grow one mapping per stream instead of leaving freed blocks of other
    sizes stranded (torchtitan launches with it); the estimate's allocator reserve assumes it
    (launcher/estimate/peak.py `expandable_segments`)."""
    if cfg.hardware.device != "cuda" or any(k in environ for k in ALLOC_CONF_VARS):
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS}


# the printed multi-node command's shell variables, expanded on each node: `"$NODE_RANK"`
_SHELL_VARIABLE = re.compile(f"({re.escape(NODE_RANK_VAR)}|{re.escape(HEAD_NODE_VAR)})(:[0-9]+)?")
# C0 and C1 controls, DEL, and Unicode's line and paragraph separators (YAML reads U+0085,
# U+2028 and U+2029 as line breaks); a tab breaks no line and stays allowed
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def shell_join(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """argv (after `NAME=value` assignments of `env`) as one shell command line: every word
    quoted (`shlex.split` gives argv back); the multi-node placeholders `$NODE_RANK` and
    `$HEAD_NODE` in double quotes, so the shell of each node expands them."""
    words = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    for arg in argv:
        words.append(f'"{arg}"' if _SHELL_VARIABLE.fullmatch(arg) else shlex.quote(arg))
    return " ".join(words)


def refuse_control_chars(values: Mapping[str, object], what: str) -> None:
    """ConfigError (exit 2, one line naming the key) when a string value, or an item of a list
    value, holds a control character or a line break: in `what` (a script, a manifest, a
    command line) it could only start a line of its own."""
    for key, value in values.items():
        for item in value if isinstance(value, list) else [value]:
            found = _CONTROL.search(item) if isinstance(item, str) else None
            if found:
                raise ConfigError(
                    key,
                    f"{item!r} holds a line break or control character ({found.group()!r}), "
                    f"which would break {what}",
                    "give one line per item"
                    if isinstance(value, list)
                    else f"give {key} without it",
                )


def _max_restarts(cfg: JobConfig) -> int:
    """torchrun's worker-group restarts: dist.max_restarts, or with elastic.min_nodes on
    several nodes at least run.max_restarts (a lost node is a restart of the group)."""
    if cfg.elastic.min_nodes and cfg.hardware.nodes > 1:
        return max(cfg.dist.max_restarts, cfg.run.num_restarts_allowed)
    return cfg.dist.max_restarts


def run_command(argv: list[str], env: dict[str, str], output: TorchrunOutput | None = None) -> int:
    """Run argv in its own session, forward stop signals to it, return its exit code. With
    `output`, its stderr goes through that filter (torchrun's own report into a file).

    The child gets SIGTERM when this process dies (PR_SET_PDEATHSIG), even by SIGKILL.
    torchrun turns SIGTERM/SIGINT into a stop of its workers (which checkpoint and exit 143);
    SIGUSR1, which torchrun does not handle, is forwarded as SIGTERM. A run stopped that way
    returns 143 (docs/interface.md: stopped by a signal after writing a checkpoint).
    """
    from trainer.core.run_lock import die_with_parent

    child_env = dict(os.environ, **env)
    stopped: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:
        stopped.append(signum)
        for proc in started:
            proc.send_signal(signal.SIGTERM if signum == signal.SIGUSR1 else signum)

    # forwarding first: a signal from here on stops the child, even one that comes as it starts
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        log.info("launching: %s", shell_join(argv))
        # Its own session (a Ctrl-C reaches it once, through us), but it dies with us: a
        # supervisor killed with SIGKILL sends torchrun SIGTERM, and torchrun stops the workers.
        proc = subprocess.Popen(
            argv,
            env=child_env,
            start_new_session=True,
            preexec_fn=die_with_parent,
            stderr=subprocess.PIPE if output is not None else None,
            text=True,
            bufsize=1,
        )
        started.append(proc)
        if stopped:  # it came while the child started: it has not seen it
            proc.send_signal(signal.SIGTERM)
        pump = output.pump(proc.stderr) if output is not None and proc.stderr else None
        rc = proc.wait()
        if pump is not None:
            pump.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped and rc != 0:
        return EXIT_SIGNAL
    return 128 - rc if rc < 0 else rc


def launch_spec(cfg: JobConfig, config_path: Path) -> tuple[list[str], dict[str, str], bool]:
    """(argv, env, spawn): torchrun for several processes; for one, `python -m trainer` as a
    child when a hang may be restarted (the watchdog ends the hung process with exit 124, and
    the supervisor must outlive it), else this process runs the engine (with `env` set in its
    own environment before CUDA starts)."""
    world_size = cfg.hardware.nodes * (cfg.hardware.devices_per_node or 1)
    if world_size > 1 and not under_launcher():
        argv, env = build_torchrun_command(cfg, config_path)
        return argv, env, True
    spawn = cfg.run.num_restarts_allowed > 0 and not under_launcher()
    return [sys.executable, "-m", "trainer", str(config_path)], allocator_env(cfg), spawn


def under_launcher() -> bool:
    """Already one rank of torchrun, or one of several srun tasks: run here, spawn nothing."""
    env = os.environ
    return (
        "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env or int(env.get("SLURM_NTASKS", "1")) > 1
    )
