"""`oomless plan` through its command-line entry: JSON, the emitted launch artefacts, errors."""

from __future__ import annotations

import json
import re

import pytest

from launcher.cli import main

PRESET_8B = "configs/models/llama-3.1-8b.yaml"
EIGHT_H100 = ["hardware.devices_per_node=8", "hardware.device_memory=80GiB"]
HOST = "hardware.host_memory=1TiB"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_8b_on_eight_80gib_gpus_from_a_machine_without_gpus_is_sharded(capsys):
    rc, out, err = _plan(capsys, PRESET_8B, *EIGHT_H100, "--json")
    assert rc == 0, err
    plan = json.loads(out)
    keys = {"strategy", "world_size", "nodes", "devices_per_node", "micro_batch_size"}
    keys |= {"grad_accum", "activation_checkpointing", "estimate", "reasons", "alternatives"}
    assert keys | {"command"} <= plan.keys()
    assert plan["strategy"] in ("fsdp", "zero3") and plan["world_size"] == 8
    assert plan["micro_batch_size"] * plan["grad_accum"] * 8 == 64
    ddp = next(a for a in plan["alternatives"] if a["strategy"] == "ddp")
    assert not ddp["fits"] and "GiB" in ddp["why_not"]  # a full replica + AdamW: ~128 GB
    assert plan["estimate"]["device"]["total_bytes"] <= 0.9 * 80 * 2**30
    assert "torch.distributed.run" in " ".join(plan["command"])


def test_emit_deepspeed_is_the_config_our_zero_backend_runs(capsys):
    rc, out, err = _plan(capsys, PRESET_8B, *EIGHT_H100, "strategy=zero3_offload", "--emit",
                         "deepspeed")  # fmt: skip
    assert rc == 0, err
    ds = json.loads(out)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert (
        ds["train_batch_size"]
        == 64
        == (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8)
    )
    assert ds["optimizer"]["params"]["lr"] == 1e-5  # the preset's learning rate
    assert ds["torch_autocast"]["dtype"] == "bfloat16"


def test_emit_deepspeed_for_a_plan_that_is_not_zero_says_how_to_get_one(capsys):
    rc, out, err = _plan(
        capsys, PRESET_8B, *EIGHT_H100, HOST, "strategy=fsdp", "--emit", "deepspeed"
    )
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--emit deepspeed" in err and "strategy=zero2" in err


def test_emit_sbatch_and_torchrun_and_accelerate(capsys, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    rc, out, err = _plan(capsys, PRESET_8B, *EIGHT_H100, "hardware.nodes=2", "--emit", "sbatch")
    assert rc == 0, err
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in out
    assert "#SBATCH --gpus-per-node=8" in out and "--requeue" in out
    rc, out, err = _plan(capsys, "configs/demo.yaml", "hardware.device=cpu",
                         "hardware.devices_per_node=2", "--emit", "torchrun")  # fmt: skip
    assert rc == 0, err
    assert "--standalone" in out and "--nproc_per_node 2" in out and "-m trainer" in out
    assert "PYTORCH_CUDA_ALLOC_CONF" not in out  # CPU ranks: no CUDA allocator
    rc, out, err = _plan(capsys, PRESET_8B, *EIGHT_H100, "--emit", "torchrun")
    assert rc == 0, err
    assert out.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ")
    assert "-m torch.distributed.run --standalone" in out
    rc, out, err = _plan(capsys, PRESET_8B, *EIGHT_H100, "strategy=fsdp", "--emit", "accelerate")
    assert rc == 0, err
    assert "distributed_type: FSDP" in out and "num_processes: 8" in out


def test_demo_on_two_cpu_processes(capsys):
    rc, out, err = _plan(capsys, "configs/demo.yaml", "hardware.device=cpu",
                         "hardware.devices_per_node=2", "--json")  # fmt: skip
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["world_size"] == 2 and plan["strategy"] != "single"
    assert plan["micro_batch_size"] * plan["grad_accum"] * 2 == 16  # the demo's global batch


def test_the_oomless_command_flushes_its_plan_and_exit_code_before_leaving_early(tmp_path):
    """`oomless plan` skips the interpreter's teardown (launcher/cli.py `console_main`): the
    whole plan JSON still reaches a pipe, and a bad input still exits 2 with one line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run = [sys.executable, "-m", "launcher.cli", "plan"]
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe buffers
    ok = subprocess.run([*run, "configs/demo.yaml", "--json"], cwd=repo, capture_output=True,
                        text=True, timeout=120, env=buffered)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["strategy"]
    bad = subprocess.run([*run, str(tmp_path / "missing.yaml")], cwd=repo, capture_output=True,
                         text=True, timeout=120, env=buffered)  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1 and "config file not found" in bad.stderr


def test_flags_and_overrides_come_in_any_order_after_the_config(capsys):
    """docs/interface.md: `plan job.yaml --json hardware.device=cpu` is the same command as
    `plan job.yaml hardware.device=cpu --json`; an unknown flag is still one line, exit 2."""
    plans = []
    for args in (
        ["--json", "hardware.device=cpu", "train.global_batch_size=4"],
        ["hardware.device=cpu", "--json", "train.global_batch_size=4"],
        ["hardware.device=cpu", "train.global_batch_size=4", "--json"],
    ):
        rc, out, err = _plan(capsys, "configs/demo.yaml", *args)
        assert rc == 0, err
        plans.append(json.loads(out))
    assert plans[0] == plans[1] == plans[2]
    assert plans[0]["micro_batch_size"] * plans[0]["grad_accum"] == 4  # the override after --json
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "configs/demo.yaml", "--json", "--bogus", "train.steps=2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bogus" in err


HINT = re.compile(
    r"would fit with (?:(?P<device>[\d.]+ [MG]iB) per device)?(?: and )?"
    r"(?:(?P<host>[\d.]+ [MG]iB) host memory per node)?"
)


@pytest.mark.parametrize(
    "sizes",
    [
        ["hardware.host_memory=3GiB"],  # 3.36 GiB needed: was "would fit with 3 GiB"
        ["hardware.host_memory=2GiB"],
        ["hardware.host_memory=1GiB"],  # was no hint at all
        ["hardware.device_memory=512MiB"],  # was "1 x 0 GiB cpu"
        ["hardware.device_memory=512MiB", "hardware.host_memory=1GiB"],
        ["hardware.device_memory=1.1GiB", "hardware.host_memory=3.1GiB"],
    ],
)
def test_an_exit_3_names_memory_with_which_the_plan_then_fits(capsys, sizes):
    """The exit-3 line always offers something, its sizes are rounded up, and following it
    gives a plan (docs/interface.md, exit 3); a size under 1 GiB prints in MiB."""
    job = ["configs/demo.yaml", "hardware.device=cpu", *sizes]
    rc, out, err = _plan(capsys, *job)
    assert rc == 3, err
    line = err.strip().splitlines()[-1]
    assert " 0 GiB" not in line and ("512 MiB" in line) == ("device_memory=512MiB" in sizes[0])
    hint = HINT.search(line)
    assert hint and (hint["device"] or hint["host"]), line
    follow = [f"hardware.{key}_memory={hint[key].replace(' ', '')}" for key in ("device", "host")
              if hint[key]]  # fmt: skip
    rc, out, err = _plan(capsys, *job, *follow, "--json")
    assert rc == 0, (line, err)
