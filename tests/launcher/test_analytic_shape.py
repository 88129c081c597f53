"""The torch-free parameter count of the known block types equals the meta-device count, and
`oomless plan` on a config never seen before answers without importing torch (cold start)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import yaml

from launcher.estimate.analytic_shape import (
    ANALYTIC_TYPES,
    analytic_shape_fields,
    counts_analytically,
)
from launcher.estimate.shape import PRESETS, ModelShape, shape_of
from tests.conftest import REPO

SMALL = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VARIANTS = [
    # every type with its config class's defaults for heads, head_dim, ties and biases
    *({"model_type": t, **SMALL} for t in ANALYTIC_TYPES),
    # grouped-query attention, tied embeddings, an explicit head_dim
    *(
        {"model_type": t, **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True}
        for t in ANALYTIC_TYPES
    ),
    {"model_type": "llama", **SMALL, "head_dim": 24, "num_key_value_heads": 1},
    {"model_type": "gemma", **SMALL, "head_dim": 8, "tie_word_embeddings": False},
    # biases where the type has a switch for them
    {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True},
    {"model_type": "gemma", **SMALL, "attention_bias": True, "head_dim": 16},
    # nulls as config.json writes them
    {"model_type": "llama", **SMALL, "num_key_value_heads": None, "head_dim": None},
]


def _presets() -> list[dict]:
    files = sorted(p.name for p in PRESETS.iterdir() if p.name.endswith(".json"))
    return [json.loads((PRESETS / f).read_text()) for f in files if f != "shapes.json"]


@pytest.mark.parametrize(
    "config", _presets() + VARIANTS, ids=lambda c: f"{c['model_type']}-{len(json.dumps(c))}"
)
def test_the_arithmetic_count_is_the_meta_model_count(config):
    assert counts_analytically(config)
    counted = ModelShape(**analytic_shape_fields(config))  # the dense defaults for MoE fields
    assert asdict(counted) == asdict(shape_of(json.dumps(config, sort_keys=True)))


def test_remote_code_and_unknown_types_go_to_the_meta_model():
    assert not counts_analytically({"model_type": "gpt_neox", **SMALL})
    assert not counts_analytically({"model_type": "llama", "auto_map": {"x": "y"}, **SMALL})


def test_plan_on_a_config_never_seen_does_not_import_torch(tmp_path):
    """A llama shape that is no preset and not cached: the plan is computed without torch."""
    job = yaml.safe_load((REPO / "configs/models/llama-3.1-8b.yaml").read_text())
    config = json.loads((PRESETS / "llama-3.1-8b.json").read_text())
    job["model"] = {"config": {**config, "num_hidden_layers": 31}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    code = (
        "import sys; from launcher.cli import main; "
        "rc = main(['plan', sys.argv[1], 'hardware.devices_per_node=8', "
        "'hardware.device_memory=80GiB', 'hardware.host_memory=1TiB', '--json']); "
        "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, "
        "'transformers': 'transformers' in sys.modules}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", f"import json; {code}", str(tmp_path / "job.yaml")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path / "cache")},
        timeout=120,
    )
    *plan, answer = proc.stdout.strip().splitlines()
    assert json.loads(answer) == {"rc": 0, "torch": False, "transformers": False}, proc.stderr
    assert json.loads("\n".join(plan))["world_size"] == 8
    assert not (tmp_path / "cache").exists()  # nothing had to be cached
