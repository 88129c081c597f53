"""The wheel works outside the checkout: built from the source tree, installed into a fresh
virtualenv, run from a directory that is not the repository. The data the code reads at run time
(the hub-id presets, the sbatch template) must travel inside the packages.

The fresh venv sees this environment's installed dependencies through a `.pth` file that names
its site-packages directory (a plain path line: the `.pth` files in that directory, the editable
install of this checkout among them, are not run), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from tests.conftest import PYTHON, REPO, run_bounded
from trainer.core.strategies import names

pytestmark = pytest.mark.slow

TEMPLATE = REPO / "launcher" / "slurm" / "templates" / "submit.sbatch.tmpl"
JOB = {
    "model": {"name_or_path": "meta-llama/Llama-3.1-8B"},
    "data": {"path": "HuggingFaceH4/no_robots", "format": "chat", "seq_len": 4096},
    "train": {"global_batch_size": 64},
    "precision": "bf16",
    "hardware": {
        "device": "cuda",
        "devices_per_node": 8,
        "device_memory": "80GiB",
        "host_memory": "1TiB",
    },
    "run": {"dir": "run"},
}


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the packages and pyproject.toml (the checkout gets no build/)."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("launcher", "trainer"):
        shutil.copytree(REPO / package, src / package, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", src)
    pip = [PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    out = run_bounded([*pip, "-w", str(tmp / "dist"), str(src)], timeout=120)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp / "dist").glob("oomless-*.whl")
    return wheel


def _install(wheel: Path, venv: Path) -> None:
    """A venv without pip that borrows this environment's site-packages, with the wheel in it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = run_bounded(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=30
    ).stdout.strip()
    (Path(purelib) / "_oomless_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index"]
    out = run_bounded([*pip, str(wheel)], timeout=120, env=_env(venv.parent))
    assert out.returncode == 0, out.stderr


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp / "cache")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The venv with the wheel installed; a job file in an empty directory beside it."""
    tmp = tmp_path_factory.mktemp("wheel")
    assert not tmp.is_relative_to(REPO)
    _install(_build_wheel(tmp), tmp / "venv")
    (tmp / "work").mkdir()
    (tmp / "work" / "job.yaml").write_text(yaml.safe_dump(JOB))
    return tmp


def _run(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    return run_bounded(list(argv), timeout=120, env=_env(tmp), cwd=tmp / "work")


def test_the_installed_packages_are_the_wheels(installed):
    code = "import launcher, trainer; print(launcher.__file__); print(trainer.__file__)"
    out = _run(installed, str(installed / "venv" / "bin" / "python"), "-c", code)
    assert out.returncode == 0, out.stderr
    files = [Path(line) for line in out.stdout.split()]
    assert len(files) == 2 and all(f.is_relative_to(installed / "venv") for f in files), files


def test_plan_reads_the_shipped_preset_of_a_hub_id(installed):
    oomless = str(installed / "venv" / "bin" / "oomless")
    out = _run(installed, oomless, "plan", "job.yaml", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["strategy"] in names() and plan["world_size"] == 8
    assert plan["command"][0] == str(installed / "venv" / "bin" / "python")

    unknown = _run(installed, oomless, "plan", "job.yaml", "model.name_or_path=nobody/nothing")
    assert unknown.returncode == 2
    (line,) = unknown.stderr.strip().splitlines()
    assert "model.name_or_path" in line and "meta-llama/Llama-3.1-8B" in line  # the index is there


def test_submit_dry_run_renders_the_shipped_template(installed):
    oomless = str(installed / "venv" / "bin" / "oomless")
    out = _run(installed, oomless, "submit", "job.yaml", "--dry-run")
    assert out.returncode == 0, out.stderr
    script = out.stdout.splitlines()
    assert script[0] == "#!/bin/bash" and "#SBATCH --gpus-per-node=8" in script
    verbatim = [line for line in TEMPLATE.read_text().splitlines() if "%%{" not in line]
    assert len(verbatim) > 20
    assert [line for line in verbatim if line not in script] == []
    assert not (installed / "work" / "run").exists()  # a dry run writes nothing
