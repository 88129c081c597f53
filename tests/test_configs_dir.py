"""Every job file shipped in configs/ loads and validates offline; the preset index (inside the
package, trainer/core/presets/) is sound."""

from __future__ import annotations

import json

import pytest
import yaml

from launcher.estimate.shape import PRESETS
from tests.conftest import REPO
from trainer.core.config import load_config

INDEX = PRESETS / "index.yaml"
JOBS = sorted((REPO / "configs").rglob("*.yaml"))


def test_there_are_example_jobs():
    names = {p.relative_to(REPO / "configs").as_posix() for p in JOBS}
    assert "demo.yaml" in names
    assert len([n for n in names if n.startswith("examples/")]) >= 3


@pytest.mark.parametrize("path", JOBS, ids=[p.relative_to(REPO).as_posix() for p in JOBS])
def test_job_file_validates_and_says_how_to_run_it(path):
    cfg = load_config(path)
    assert cfg.data.seq_len >= 8
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "oomless" in path.read_text().split("\n\n")[0]


def test_preset_index_points_at_hf_configs():
    index = yaml.safe_load(INDEX.read_text())
    assert len(set(index.values())) >= 5
    for hub_id, filename in index.items():
        hf = json.loads((PRESETS / filename).read_text())
        assert hf["model_type"] in ("llama", "qwen2", "mistral"), hub_id
        assert hf["num_hidden_layers"] > 0 and hf["vocab_size"] > 0
