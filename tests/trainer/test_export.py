"""`oomless export`: a checkpoint becomes an HF directory that reproduces the trained model."""

from __future__ import annotations

import subprocess

import torch

from tests.conftest import PYTHON, REPO, python_env
from tests.trainer.test_step import _backend, _global_batch, _split
from trainer.checkpoint import Checkpointer
from trainer.step import train_step


def test_export_reproduces_the_trained_logits(tmp_path):
    model, backend = _backend(tmp_path, micro=2, accum=2)
    batch = _global_batch()
    for _ in range(2):
        train_step(model, backend, _split(batch, 2), torch.device("cpu"))
    cfg = backend.ctx.cfg
    ckpt = Checkpointer(tmp_path / "run", cfg, None, rank=0).save(2, backend.state_dict(), {})
    out = tmp_path / "exported"
    r = subprocess.run(
        [PYTHON, "-m", "launcher.cli", "export", str(ckpt), str(out)],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"]).logits
        got = exported(input_ids=batch["input_ids"]).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_export_of_a_missing_checkpoint_is_one_line_exit_2(tmp_path):
    r = subprocess.run(
        [PYTHON, "-m", "launcher.cli", "export", str(tmp_path / "nope"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "not a complete checkpoint" in r.stderr
