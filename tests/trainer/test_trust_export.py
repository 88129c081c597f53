"""`oomless export` of a finished LoRA run: `RUN/final --merge` works, `--merge` refuses
a base whose weights changed, OUT_DIR never replaces the run, the base model, the data or the
current directory, and exported models generate with the KV cache on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import PYTHON, REPO, TINY_LLAMA, python_env, run_bounded, write_demo_job

pytestmark = pytest.mark.slow

DEMO = REPO / "configs" / "demo"
LORA = {"method": "lora", "lora": {"r": 2, "alpha": 4}}


def _oomless(*args, cwd: Path) -> tuple[int, str, str]:
    r = run_bounded(
        [PYTHON, "-m", "launcher.cli", *map(str, args)], timeout=300, env=python_env(), cwd=cwd
    )
    return r.returncode, r.stdout, r.stderr


def _save_base(path: Path, seed: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    config.vocab_size = 45
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A 3-step LoRA run on a pretrained base in its own directory, with its own copy of the
    data and tokenizer (what the export must never replace), and its final/ adapter dir."""
    work = tmp_path_factory.mktemp("trust_export")
    _save_base(work / "base", seed=0)
    shutil.copytree(DEMO / "tokenizer", work / "tokenizer")
    (work / "data").mkdir()
    shutil.copy(DEMO / "train.jsonl", work / "data" / "train.jsonl")
    job = write_demo_job(
        work / "job.yaml",
        train={"steps": 3, "global_batch_size": 4, "micro_batch_size": 2},
        strategy="single",
        finetune=LORA,
        run={"checkpoint_every": 2, "save_final": True, "dir": str(work / "run")},
    )
    tree = yaml.safe_load(job.read_text())
    tree["model"] = {"name_or_path": str(work / "base"), "tokenizer": str(work / "tokenizer")}
    tree["data"]["path"] = str(work / "data" / "train.jsonl")
    job.write_text(yaml.safe_dump(tree))
    code, _, err = _oomless("train", job, IN_THIS_PROCESS, cwd=work)
    assert code == 0, err[-3000:]
    return work


def test_a_lora_runs_final_merges_like_its_last_checkpoint(lora_run, tmp_path):
    run = lora_run / "run"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    code, out, err = _oomless("export", run / "final", tmp_path / "merged", "--merge", cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert out == f"{tmp_path / 'merged'}\n"  # the path on stdout, for scripts
    code, _, err = _oomless(
        "export", run / "checkpoints" / "step_3", tmp_path / "from_ckpt", "--merge", cwd=tmp_path
    )
    assert code == 0, err[-3000:]
    got = load_file(tmp_path / "merged" / "model.safetensors")
    want = load_file(tmp_path / "from_ckpt" / "model.safetensors")
    assert got.keys() == want.keys() and not any(".lora_" in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got)
    base = load_file(lora_run / "base" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], base[q])  # the adapters are in it
    # exported models generate with the KV cache on (training turns it off)
    for name in ("merged", "from_ckpt"):
        generation = json.loads((tmp_path / name / "generation_config.json").read_text())
        assert generation.get("use_cache", True) is True, generation
        assert json.loads((tmp_path / name / "config.json").read_text())["use_cache"] is True
    # and final/ also exports as the adapter dir it is
    code, _, err = _oomless("export", run / "final", tmp_path / "adapter", cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_merge_refuses_a_base_whose_weights_changed(lora_run, tmp_path):
    run, weights = lora_run / "run", lora_run / "base" / "model.safetensors"
    original = weights.read_bytes()
    _save_base(lora_run / "base", seed=1)  # the same path, other weights
    try:
        for source in (run / "final", run / "checkpoints" / "step_3"):
            code, out, err = _oomless(
                "export", source, tmp_path / "merged", "--merge", cwd=tmp_path
            )
            assert code == 2 and err.count("\n") == 1 and out == "", err[-3000:]
            assert err.startswith("config error: --merge:") and "another base" in err, err
            assert not (tmp_path / "merged").exists()
        # the adapters alone do not depend on the base's weights: that export still works
        code, _, err = _oomless("export", run / "final", tmp_path / "adapter", cwd=tmp_path)
        assert code == 0, err[-3000:]
    finally:
        weights.write_bytes(original)


def test_overwrite_never_replaces_the_run_the_base_the_data_or_the_current_dir(lora_run, tmp_path):
    final = lora_run / "run" / "final"
    cwd = tmp_path / "cwd"
    (cwd / "notes").mkdir(parents=True)
    (cwd / "notes" / "keep.txt").write_text("the user's file")
    before = {p: _files(p) for p in (lora_run, cwd)}
    for out, what in (
        (".", "the current directory"),
        (cwd.parent, "the current directory"),  # a parent of it
        (lora_run / "base", "the base model"),
        (lora_run / "data", "the data"),
        (lora_run / "tokenizer", "the tokenizer"),
        (lora_run / "run", "the run"),
        (lora_run, "the run"),  # holds the run, the base and the data
    ):
        code, out_text, err = _oomless("export", final, out, "--overwrite", cwd=cwd)
        assert code == 2 and err.count("\n") == 1 and out_text == "", (out, err)
        assert err.startswith("config error: OUT_DIR:") and what in err, (out, err)
    assert {p: _files(p) for p in (lora_run, cwd)} == before
    # a new directory inside the current one is what export is for
    code, out_text, err = _oomless("export", final, "exported", cwd=cwd)
    assert code == 0 and out_text == f"{cwd / 'exported'}\n", err[-3000:]
