"""Rendered sbatch scripts diffed against tests/slurm/golden/*.sbatch (pure, fast).

Regenerate after an intended template change with `OOMLESS_UPDATE_GOLDEN=1 pytest tests/slurm`
and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.slurm.submit import render_sbatch
from tests.conftest import REPO
from trainer.core.config import load_config

GOLDEN = Path(__file__).parent / "golden"
GIB = 1024**3
PYTHON = "/opt/oomless/venv/bin/python"

# name -> (overrides, host bytes the plan estimates)
CASES: dict[str, tuple[list[str], int]] = {
    "gpu_1node": (
        [
            "hardware.device=cuda",
            "hardware.nodes=1",
            "hardware.devices_per_node=8",
            "strategy=ddp",
            "slurm.partition=gpu",
            "slurm.time=01:00:00",
        ],
        40 * GIB,
    ),
    "gpu_2nodes": (
        [
            "hardware.device=cuda",
            "hardware.nodes=2",
            "hardware.devices_per_node=4",
            "strategy=fsdp",
            "slurm.partition=gpu",
            "slurm.account=proj1",
            "slurm.grace_s=300",
            "slurm.time=02:00:00",
        ],
        100 * GIB,
    ),
    "gpu_16nodes_offload": (
        [
            "hardware.device=cuda",
            "hardware.nodes=16",
            "hardware.devices_per_node=8",
            "strategy=zero3_offload",
            "slurm.partition=gpu",
            "slurm.qos=high",
            "slurm.constraint=h100",
            "slurm.time=2-00:00:00",
            "dist.max_restarts=2",
        ],
        900 * GIB,
    ),
    "cpu_2nodes": (
        [
            "hardware.device=cpu",
            "hardware.nodes=2",
            "hardware.devices_per_node=1",
            "strategy=ddp",
            "slurm.time='30'",
        ],
        2 * GIB,
    ),
    "array_extra_setup": (
        [
            "hardware.device=cuda",
            "hardware.nodes=1",
            "hardware.devices_per_node=2",
            "strategy=fsdp",
            "slurm.extra=['--array=0-3%1', '#SBATCH --exclusive']",
            "slurm.setup=[module load cuda/12.4,source /opt/env.sh]",
        ],
        24 * GIB,
    ),
}


def _render(name: str) -> str:
    overrides, host_bytes = CASES[name]
    run_dir = Path("/scratch/runs") / name
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"run.dir={run_dir}", *overrides])
    plan = {"estimate": {"host": {"total_bytes": host_bytes}}}
    return render_sbatch(cfg, plan, run_dir, PYTHON)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_script_matches_golden(name):
    script = _render(name)
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("OOMLESS_UPDATE_GOLDEN"):
        path.write_text(script)
    assert path.is_file(), f"no golden file {path}; run with OOMLESS_UPDATE_GOLDEN=1"
    assert script == path.read_text(), f"{name}: rendered script differs from {path}"


def test_node_rank_is_expanded_on_each_node():
    """accelerate #2816: $SLURM_NODEID expanded on the submit host made every node rank 0."""
    script = _render("gpu_16nodes_offload")
    srun = script[script.index("\nsrun ") :]
    opening, closing = srun.index("'"), srun.rindex("'")
    assert opening < srun.index('--node_rank "$SLURM_NODEID"') < closing
    assert srun.count("'") == 2  # nothing inside closes the quote early


def test_memory_follows_the_host_estimate():
    script = _render("gpu_16nodes_offload")
    assert "#SBATCH --mem=990G" in script  # 900 GiB estimated + 10% headroom
    assert "#SBATCH --nodes=16" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--nproc_per_node 8" in script and "--max_restarts 2" in script
