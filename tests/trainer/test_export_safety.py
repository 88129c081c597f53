"""`oomless export` never deletes what it did not write and never runs a checkpoint's code."""

from __future__ import annotations

import json

import pytest
import yaml

from launcher.cli import main
from tests.conftest import TINY_LLAMA
from tests.trainer.test_step import _backend
from trainer.checkpoint.checkpointer import Checkpointer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with one complete checkpoint, a metrics file and a config."""
    tmp = tmp_path_factory.mktemp("export")
    model, backend = _backend(tmp, micro=1, accum=1)
    run_dir = tmp / "run"
    ckpt = Checkpointer(run_dir, backend.ctx.cfg, None, rank=0).save(1, backend.state_dict(), {})
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 4.8}\n')
    (run_dir / "config.yaml").write_text("model: {}\n")
    return run_dir, ckpt


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _export(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["export", *map(str, args)])
    return rc, capsys.readouterr().err


def test_export_refuses_a_nonempty_out(run, tmp_path, capsys):
    run_dir, ckpt = run
    models = tmp_path / "models"
    models.mkdir()
    (models / "keep.txt").write_text("the user's file")
    sibling = tmp_path / "models.tmp"  # the name main's export wiped before writing
    sibling.mkdir()
    (sibling / "mine.txt").write_text("also the user's")

    rc, err = _export(capsys, ckpt, models)
    assert rc == 2 and err.count("\n") == 1 and "OUT_DIR" in err and "--overwrite" in err, err
    assert (models / "keep.txt").read_text() == "the user's file"

    rc, err = _export(capsys, ckpt, models, "--overwrite")
    assert rc == 0, err
    assert (models / "model.safetensors").is_file() and not (models / "keep.txt").exists()
    assert (sibling / "mine.txt").read_text() == "also the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "models.tmp"]  # no leftovers

    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = _export(capsys, run_dir, empty)  # a run dir exports its newest checkpoint
    assert rc == 0 and (empty / "config.json").is_file(), err


def test_export_refuses_an_out_inside_the_run(run, tmp_path, capsys):
    run_dir, ckpt = run
    before = _files(run_dir)
    for out, extra in (
        (run_dir, []),  # `oomless export RUN RUN` deleted every checkpoint on main
        (run_dir / "exported", []),
        (ckpt, ["--overwrite"]),
        (ckpt / "hf", []),
        (run_dir.parent, ["--overwrite"]),  # replacing a parent would delete the run
    ):
        rc, err = _export(capsys, ckpt, out, *extra)
        assert rc == 2 and err.count("\n") == 1 and "OUT_DIR" in err, (out, err)
    assert _files(run_dir) == before
    assert not (run_dir / "exported").exists()


def test_export_never_trusts_the_checkpoints_remote_code(run, tmp_path, capsys):
    _, ckpt = run
    marker = tmp_path / "PWNED"
    remote = tmp_path / "remote_model"
    remote.mkdir()
    (remote / "configuration_pwned.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import LlamaConfig\n\n\n"
        "class PwnedConfig(LlamaConfig):\n"
        "    model_type = 'pwned_llama'\n"
    )
    hf = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    hf.update(model_type="pwned_llama", auto_map={"AutoConfig": "configuration_pwned.PwnedConfig"})
    (remote / "config.json").write_text(json.dumps(hf))
    # Someone else's checkpoint: its config.yaml asks for the model's own code to run.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for f in ckpt.rglob("*"):
        if f.is_file():
            (theirs / f.relative_to(ckpt)).parent.mkdir(parents=True, exist_ok=True)
            (theirs / f.relative_to(ckpt)).write_bytes(f.read_bytes())
    cfg = yaml.safe_load((theirs / "config.yaml").read_text())
    cfg["model"] = {"name_or_path": str(remote), "trust_remote_code": True}
    (theirs / "config.yaml").write_text(yaml.safe_dump(cfg))
    (theirs / "manifest.json").unlink()  # whoever edits a checkpoint can drop or redo its manifest

    rc, err = _export(capsys, theirs, tmp_path / "out")
    assert not marker.exists(), "export ran the checkpoint's code"
    assert rc == 2 and err.count("\n") == 1 and "--trust-remote-code" in err, err
    assert not (tmp_path / "out").exists()
