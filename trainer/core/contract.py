"""What processes outside this one rely on (docs/interface.md): exit codes and run-dir file names.

Torch-free: the launcher, the engine and the tests all read these names from here.
"""

from __future__ import annotations

from pathlib import Path

# Exit codes
EXIT_OK = 0
EXIT_USAGE = 2  # invalid config, data or usage: one line on stderr
EXIT_NO_FIT = 3  # fits on no strategy of the hardware given
EXIT_OOM = 75  # out of device memory after in-process recovery (the supervisor escalates)
EXIT_SIGNAL = 143  # stopped by SIGTERM/SIGUSR1 after writing a checkpoint
EXIT_HANG = 124  # a step or collective outlasted run.hang_timeout_s; stacks in run.dir/hang/
EXIT_CUT_OFF = 130  # interrupted (Ctrl-C, repeated signals) before a checkpoint was written
# the launch probe measured the first step over the plan's budget (run.dir/probe.json): the
# engine stopped before the second step and `oomless train` plans again with what it measured
EXIT_REPLAN = 76

# Files under run.dir
# Written first into a run.dir a run takes: a run writes only into a directory that is new, empty
# or holds this marker (launcher/run/preflight.py `check_run_dir`)
RUN_MARKER = ".oomless-run"
CONFIG_FILE = "config.yaml"  # the resolved config every rank runs
# `oomless submit` with elastic.min_nodes: the config as submitted, before the plan resolved it;
# what a re-plan for the nodes left starts from (launcher/slurm/elastic.py)
JOB_FILE = "job.yaml"
PLAN_FILE = "plan.json"
METRICS_FILE = "metrics.jsonl"
OOM_REPORT_FILE = "oom-report.json"
ESCALATIONS_FILE = "escalations.jsonl"
# the launch probe: each rank's first step measured against the plan's estimate and budget
# (trainer/observe/probe.py); `oomless report` shows it
PROBE_FILE = "probe.json"
# Written by `python -m trainer` when a rank stops on a ConfigError (bad data rows, an unusable
# strategy): torchrun reports every failed worker as exit 1, and this file tells `oomless train`
# that it was bad input (exit 2) and what the line was.
CONFIG_ERROR_FILE = "config-error.txt"
# Held for the life of a run (pid, host, Slurm job): a second start on the run.dir exits 2.
RUN_LOCK_FILE = "run.lock"
CHECKPOINTS_DIR = "checkpoints"
LATEST_LINK = "latest"
FINAL_DIR = "final"
TRACKERS_FILE = "trackers.json"  # the tracker run ids a resumed or escalated run continues
TORCHRUN_LOG = "torchrun.log"  # torchrun's own lines and failure reports, kept out of the output
# A hang (trainer/runtime/hang.py): hang/rank{N}.txt, every rank's Python stacks, and
# hang/report.json, the step, the ranks that did not arrive and the collective the others wait in
HANG_DIR = "hang"
HANG_REPORT_FILE = "report.json"
PROFILE_DIR = "profile"  # debug.profile: rank{N}.trace.json, rank{N}.memory_snapshot.pickle


def trace_path(run_dir: Path, rank: int) -> Path:
    """debug.profile's Chrome trace of one rank in a run directory."""
    return run_dir / PROFILE_DIR / f"rank{rank}.trace.json"
