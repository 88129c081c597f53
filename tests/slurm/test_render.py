"""The sbatch script `oomless submit` writes: sized by the plan, node rank read on each node."""

from __future__ import annotations

import subprocess

from tests.conftest import PYTHON, REPO, python_env

DEMO = REPO / "configs" / "demo.yaml"


def _submit_dry_run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "launcher.cli", "submit", str(DEMO), *overrides, "--dry-run"],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=REPO,
        timeout=120,
    )


def test_two_gpu_nodes(tmp_path):
    r = _submit_dry_run(
        f"run.dir={tmp_path / 'run'}",
        "hardware.device=cuda",
        "hardware.nodes=2",
        "hardware.devices_per_node=4",
        "hardware.device_memory=80GiB",
        "hardware.host_memory=512GiB",
        "strategy=fsdp",
        "slurm.account=proj1",
        "slurm.time=02:00:00",
        "slurm.grace_s=300",
        "slurm.extra=[--exclusive]",
        "slurm.setup=[module load cuda/12.4]",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    script = r.stdout
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --account=proj1",
        "#SBATCH --time=02:00:00",
        "#SBATCH --signal=USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --exclusive",
        "module load cuda/12.4",
        "--nproc_per_node 4",
    ):
        assert line in script, line
    assert f"#SBATCH --output={tmp_path / 'run'}/slurm-%j.out" in script
    # $SLURM_NODEID must reach each node unexpanded: it sits inside the single-quoted command.
    srun = script[script.index("srun ") :]
    assert srun.index("'") < srun.index('"$SLURM_NODEID"') < srun.rindex("'")
    assert "head -n1" in script and '--master_addr "$OOMLESS_HEAD_NODE"' in script
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_cpu_nodes_request_no_gpus_and_enough_memory(tmp_path):
    r = _submit_dry_run(
        f"run.dir={tmp_path / 'run'}",
        "hardware.device=cpu",
        "hardware.nodes=2",
        "hardware.devices_per_node=1",
        "strategy=ddp",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--gpus-per-node" not in r.stdout
    mem = next(x for x in r.stdout.splitlines() if x.startswith("#SBATCH --mem="))
    assert int(mem.removeprefix("#SBATCH --mem=").removesuffix("G")) >= 16
