"""Checkpoint format pieces that need no training: layout, safety, completeness."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import TINY_LLAMA
from trainer.checkpoint.checkpointer import STATE_FILE, Checkpointer, load_checkpoint
from trainer.checkpoint.layout import (
    SafeFileSystemReader,
    flatten_state,
    load_template,
    unflatten_state,
)
from trainer.checkpoint.store import find_latest
from trainer.core.config import ConfigError, build_config


def _state() -> dict:
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {
        "model": {"layer.weight": w, "layer.bias": torch.ones(2)},
        "optim": {
            "layer.weight": {
                "exp_avg": w * 0.1,
                "exp_avg_sq": w * 0.01,
                "step": torch.tensor(3.0),
            }
        },
    }


def test_flat_layout_round_trips_and_is_keyed_by_parameter_name():
    flat = flatten_state(_state())
    assert set(flat) == {
        "model/layer.weight",
        "model/layer.bias",
        "optim/layer.weight/exp_avg",
        "optim/layer.weight/exp_avg_sq",
        "optim/layer.weight/step",
    }
    back = unflatten_state(flat)
    assert torch.equal(
        back["optim"]["layer.weight"]["exp_avg"], _state()["optim"]["layer.weight"]["exp_avg"]
    )
    assert torch.equal(back["model"]["layer.bias"], torch.ones(2))


def test_template_gives_every_parameter_optimizer_slots():
    template = load_template(_state())
    assert set(template["optim"]) == {"layer.weight", "layer.bias"}
    assert template["optim"]["layer.bias"]["exp_avg"].shape == (2,)


def _cfg(tmp_path, **train):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    return build_config(
        {
            "model": {"config": TINY_LLAMA, "tokenizer": str(tmp_path)},
            "data": {"path": str(data), "seq_len": 16},
            "train": {"global_batch_size": 4, "micro_batch_size": 1, **train},
            "strategy": "single",
            "run": {"dir": str(tmp_path / "run")},
        }
    )


def test_save_then_load_into_a_fresh_template(tmp_path):
    """The resume path in one process: a parameter never stepped keeps a fresh optimizer slot."""
    cfg = _cfg(tmp_path)
    run_dir = tmp_path / "run"
    path = Checkpointer(run_dir, cfg, None, 0).save(7, _state(), {"scaler": {}})
    assert path == run_dir / "checkpoints" / "step_7"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_7"
    fresh = {"model": {k: torch.zeros_like(v) for k, v in _state()["model"].items()}, "optim": {}}
    state = load_checkpoint(path, load_template(fresh), cfg)
    assert state["step"] == 7
    loaded = state["backend"]
    assert torch.equal(loaded["model"]["layer.weight"], _state()["model"]["layer.weight"])
    assert torch.equal(
        loaded["optim"]["layer.weight"]["exp_avg_sq"],
        _state()["optim"]["layer.weight"]["exp_avg_sq"],
    )
    assert float(loaded["optim"]["layer.weight"]["step"]) == 3.0
    assert "layer.bias" not in loaded["optim"]


def test_resume_with_different_training_settings_is_refused(tmp_path):
    path = Checkpointer(tmp_path / "run", _cfg(tmp_path), None, 0).save(1, _state(), {})
    with pytest.raises(ConfigError, match="trained with different settings"):
        load_checkpoint(path, load_template(_state()), _cfg(tmp_path, lr=1.0))
    # where the bytes live may change: micro-batch is not a training semantic
    load_checkpoint(path, load_template(_state()), _cfg(tmp_path, micro_batch_size=2))


def test_old_checkpoints_are_pruned_after_the_new_one_is_complete(tmp_path):
    cfg = _cfg(tmp_path)  # run.keep_checkpoints defaults to 2
    for step in (1, 2, 3):
        Checkpointer(tmp_path / "run", cfg, None, 0).save(step, _state(), {})
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["latest", "step_2", "step_3"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_that_names_arbitrary_callables_is_refused(tmp_path):
    dcp.save(
        flatten_state(_state()), storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True
    )
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_incomplete_checkpoints_are_skipped(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for step, complete in ((10, True), (20, False), (30, None)):
        d = root / (f"step_{step}" if complete is not None else f"step_{step}.tmp")
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"x")
        if complete:
            (d / STATE_FILE).write_text("{}")
            (d / "manifest.json").write_text('{"algorithm": "sha256", "files": {}}')
    assert find_latest(tmp_path) == root / "step_10"
    assert "step_20" in caplog.text and "incomplete" in caplog.text
