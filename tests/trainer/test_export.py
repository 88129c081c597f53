"""`oomless export`: a checkpoint becomes an HF directory that reproduces the trained model."""

from __future__ import annotations

import subprocess

import torch

from tests.conftest import PYTHON, REPO, TINY_LLAMA, python_env
from tests.trainer.test_step import SEQ, _backend, _global_batch, _split
from trainer.backends import BackendContext, OptimizerSpec, build_backend
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.core.config import build_config
from trainer.model.build import HFModelFactory
from trainer.step import train_step


def test_export_reproduces_the_trained_logits(tmp_path):
    _trained_export_matches(tmp_path, *_backend(tmp_path, micro=2, accum=2))


def test_export_of_a_model_fine_tuned_from_pretrained_weights_reproduces_its_logits(tmp_path):
    """`model.name_or_path` a saved model with tied embeddings (what transformers' loading and
    export must agree on): the exported directory gives the engine model's logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    params = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    torch.manual_seed(7)
    pretrained = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**params, "tie_word_embeddings": True}), dtype=torch.float32
    )
    pretrained.save_pretrained(tmp_path / "pretrained")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    cfg = build_config(
        {
            "model": {"name_or_path": str(tmp_path / "pretrained"), "tokenizer": str(tmp_path)},
            "data": {"path": str(data), "seq_len": SEQ},
            "train": {"global_batch_size": 4, "micro_batch_size": 2},
            "strategy": "single",
        }
    )
    ctx = BackendContext(cfg, torch.device("cpu"), 0, 0, 1, "fp32", "none", 2, 2)
    backend = build_backend("single", ctx)
    optim = OptimizerSpec(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    model = backend.setup(HFModelFactory(cfg.model, seed=0), optim)
    with torch.no_grad():  # the engine starts from the saved weights
        want = pretrained(input_ids=_global_batch()["input_ids"]).logits
        assert torch.equal(model(input_ids=_global_batch()["input_ids"]).logits, want)
    _trained_export_matches(tmp_path, model, backend)


def _trained_export_matches(tmp_path, model, backend) -> None:
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
    # one line on stderr, none of torch's ("torch.distributed is disabled, ..."); the path on stdout
    (said,) = r.stderr.splitlines()
    assert said.startswith("wrote the model (") and said.endswith(f" from {ckpt}"), r.stderr
    assert r.stdout == f"{out}\n"

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
