"""The DeepSpeed config comes from our config (no "auto"); planning never imports DeepSpeed."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, TINY_LLAMA, python_env
from trainer.backends.deepspeed_config import build_deepspeed_config
from trainer.core.config import build_config


def _cfg(tmp_path, strategy, **extra):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    return build_config(
        {
            "model": {"config": TINY_LLAMA, "tokenizer": str(tmp_path)},
            "data": {"path": str(data), "seq_len": 32},
            "train": {"global_batch_size": 32, "grad_clip": 0.5},
            "strategy": strategy,
            **extra,
        }
    )


@pytest.mark.parametrize(
    "strategy, stage, opt_dev, param_dev",
    [
        ("zero1", 1, None, None),
        ("zero2", 2, None, None),
        ("zero3", 3, None, None),
        ("zero3_offload", 3, "cpu", None),
        ("zero3_offload_params", 3, "cpu", "cpu"),
    ],
)
def test_every_rung_and_the_batch_arithmetic(tmp_path, strategy, stage, opt_dev, param_dev):
    ds = build_deepspeed_config(_cfg(tmp_path, strategy), world_size=4, micro_batch_size=2,
                                grad_accum=4)  # fmt: skip
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("offload_optimizer", {}).get("device") == opt_dev
    assert zero.get("offload_param", {}).get("device") == param_dev
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.5
    assert '"auto"' not in json.dumps(ds)
    # fp32 parameters, gradients and AdamW state; bf16 compute by autocast inside the engine,
    # with fp32 all-gathers and gradient reductions (no lower-precision communication)
    assert "bf16" not in ds and "fp16" not in ds
    assert ds["torch_autocast"] == {
        "enabled": True,
        "dtype": "bfloat16",
        "lower_precision_safe_modules": [],
    }


def test_fp32_runs_without_autocast(tmp_path):
    ds = build_deepspeed_config(_cfg(tmp_path, "zero3", precision="fp32"), world_size=2,
                                micro_batch_size=1, grad_accum=16)  # fmt: skip
    assert "torch_autocast" not in ds and ds["train_batch_size"] == 32


def test_nvme_and_overrides_merge_last(tmp_path):
    cfg = _cfg(
        tmp_path,
        "zero3_nvme",
        deepspeed={
            "nvme_path": "/local_nvme",
            "overrides": {"zero_optimization": {"overlap_comm": True}, "steps_per_print": 10},
        },
    )
    ds = build_deepspeed_config(cfg, world_size=1, micro_batch_size=4, grad_accum=8)
    zero = ds["zero_optimization"]
    assert zero["offload_param"] == {
        "device": "nvme",
        "nvme_path": "/local_nvme",
        "pin_memory": False,
    }
    assert zero["overlap_comm"] is True and zero["stage"] == 3  # merged, not replaced
    assert ds["steps_per_print"] == 10


def test_planning_and_importing_never_import_deepspeed():
    code = (
        "import sys; import trainer, launcher, launcher.cli, trainer.engine\n"
        "from launcher.cli import main\n"
        "main(['plan', 'configs/models/llama-3.1-8b.yaml', 'hardware.devices_per_node=8',"
        " 'hardware.device_memory=80GiB', 'hardware.host_memory=1TiB', '--json'])\n"
        "main(['estimate', 'configs/models/llama-3.1-8b.yaml', 'hardware.devices_per_node=8',"
        " 'hardware.device_memory=80GiB', 'hardware.host_memory=1TiB', '--json'])\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
        "print('clean')\n"
    )
    r = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=python_env(),
                       cwd=REPO, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().endswith("clean"), r.stderr[-2000:]
