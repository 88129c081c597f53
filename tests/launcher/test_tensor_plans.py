"""Tensor parallel in the planner (launcher/plan/splits.py, launcher/estimate/tensor_split.py):
the degree chosen from defaults for 70B and 405B jobs and left at 1 for an 8B one, each with its
reason; a forced degree the model cannot take, or an architecture without a plan, is one line
(exit 2) naming what works; the emitters carry the degree; one rank of a tensor group traced
(launcher/estimate/trace.py: transformers' plan applied over a fake process group) against the
estimate. Pure planning through the command line, and fake-tensor traces: no GPU, no launch."""

from __future__ import annotations

import json

import pytest
import yaml

from launcher.cli import main
from launcher.estimate.peak import estimate
from launcher.estimate.shape import shape_of
from launcher.estimate.trace import trace_step
from tests.launcher.test_estimate_trace import hf_config
from tests.launcher.test_lowbit_plans import LLAMA_405B, PRESET_8B, PRESET_70B, _gpus
from trainer.core.step_spec import StepSpec
from trainer.parallel.tensor import installed

LONG = ["data.seq_len=8192"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    try:
        rc = main(["plan", *args])
    except SystemExit as stop:
        rc = stop.code
    out, err = capsys.readouterr()
    return rc, out, err


def _json_plan(capsys, *args: str) -> dict:
    rc, out, err = _plan(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def _nodes(nodes: int, host: str) -> list[str]:
    return [*_gpus(8, "80GiB", host), f"hardware.nodes={nodes}"]


def _reason(plan: dict) -> str:
    (line,) = [r for r in plan["reasons"] if "by tensor degree" in r]
    return line


def test_70b_at_8k_on_two_nodes_weighs_every_degree_and_a_split_fits_without_offload(capsys):
    """From defaults the reason weighs each degree inside the node; forced to 8, the split's
    smaller share of activations lets plain fsdp fit where unsplit it needs fsdp_offload."""
    plan = _json_plan(capsys, PRESET_70B, *LONG, *_nodes(2, "1280GiB"))
    why = _reason(plan)
    assert all(f"{tp}: " in why for tp in (1, 2, 4, 8)), why
    assert "20 GB/s inter-node" in why and "150 GB/s intra-node" in why
    assert "fsdp" not in [alt["strategy"] for alt in plan["alternatives"] if alt["fits"]]
    split = _json_plan(capsys, PRESET_70B, *LONG, *_nodes(2, "1280GiB"), "parallel.tensor=8")
    assert split["strategy"] == "fsdp"
    assert split["parallel"] == {"data": 2, "sequence": 1, "tensor": 8, "expert": 1}


def test_405b_at_8k_on_sixteen_nodes_splits_eight_ways(capsys, tmp_path):
    job = tmp_path / "405b.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"config": LLAMA_405B},
        "data": {"path": "HuggingFaceH4/no_robots", "format": "chat"},
        "train": {"global_batch_size": 128},
    }))  # fmt: skip
    plan = _json_plan(capsys, str(job), *LONG, *_nodes(16, "2TiB"))
    assert plan["parallel"] == {"data": 16, "sequence": 1, "tensor": 8, "expert": 1}, plan[
        "parallel"
    ]
    assert "tensor parallel 8 inside each node" in _reason(plan)


def test_8b_on_one_node_stays_unsplit_and_says_why(capsys):
    plan = _json_plan(capsys, PRESET_8B, *LONG, *_nodes(1, "1280GiB"))
    assert plan["parallel"]["tensor"] == 1
    assert _reason(plan).startswith("no tensor split (tensor parallel 1): predicted step time")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["parallel.tensor=3", *_gpus(8, "80GiB", "1TiB")],
            "parallel.tensor: 3 does not divide the world of 8 ranks; "
            "use parallel.tensor=1 or 2 or 4 or 8",
        ),
        (
            ["parallel.tensor=3", *_gpus(6, "80GiB", "1TiB"), "train.global_batch_size=12"],
            "parallel.tensor: 3 does not divide the model's 32 attention heads and 8 key/value "
            "heads (each tensor rank holds whole ones); use parallel.tensor=1 or 2",
        ),
        (
            ["parallel.tensor=2", "strategy=zero3", *_gpus(8, "80GiB", "1TiB")],
            "use strategy=single or fsdp or fsdp_offload (or auto)",
        ),
        (
            ["parallel.tensor=2", "finetune.method=lora", *_gpus(8, "80GiB", "1TiB")],
            "use finetune.method=full, or parallel.tensor=1",
        ),
    ],
)
def test_a_degree_the_job_cannot_take_is_one_line_naming_what_works(capsys, args, words):
    rc, _, err = _plan(capsys, PRESET_8B, *args)
    assert rc == 2
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_an_architecture_without_a_plan_is_refused_before_its_shape_is_built(capsys, tmp_path):
    """gpt_oss declares a plan for its embedding only (transformers' base_model_tp_plan)."""
    job = tmp_path / "gpt_oss.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"config": {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
                             "num_hidden_layers": 24, "num_attention_heads": 64,
                             "num_key_value_heads": 8, "head_dim": 64}},
        "data": {"path": "HuggingFaceH4/no_robots", "format": "chat", "seq_len": 2048},
    }))  # fmt: skip
    rc, _, err = _plan(capsys, str(job), "parallel.tensor=2", *_gpus(8, "80GiB", "1TiB"))
    assert rc == 2
    assert "2 on model_type gpt_oss: transformers declares no tensor-parallel plan" in err
    assert "use parallel.tensor=1" in err


def test_the_emitters_carry_the_degree(capsys):
    job = [PRESET_70B, *LONG, *_nodes(2, "1280GiB"), "parallel.tensor=8"]
    rc, out, err = _plan(capsys, *job, "--emit", "accelerate")
    assert rc == 0, err
    parallelism = yaml.safe_load(out)["parallelism_config"]
    assert parallelism["parallelism_config_tp_size"] == 8
    assert parallelism["parallelism_config_dp_shard_size"] == 2
    rc, out, err = _plan(capsys, *job, "k8s.image=r/i:1", "k8s.pvc=runs", "--emit", "trainjob")
    assert rc == 0, err
    config_map = next(yaml.safe_load_all(out))
    resolved = yaml.safe_load(config_map["data"]["config.yaml"])
    assert resolved["parallel"]["tensor"] == 8


# one rank of a tensor group of 2, alone (single) and under FSDP over 2 more ranks, at two
# sequence lengths and checkpointing levels
TENSOR_TRACES = (
    ("single", 2, 2048, "none"),
    ("single", 2, 1024, "full"),
    ("fsdp", 4, 2048, "none"),
    ("fsdp", 4, 1024, "full"),
)


@pytest.mark.skipif(not installed(), reason="this transformers cannot apply a tensor plan")
def test_the_estimate_of_one_rank_of_a_tensor_group_follows_the_trace():
    config = hf_config("llama", "medium")
    shape = shape_of(json.dumps(config, sort_keys=True))
    errors = {}
    for strategy, world, seq, ckpt in TENSOR_TRACES:
        spec = StepSpec(strategy, world, 1, seq, ckpt, devices_per_node=world, tensor_parallel=2)
        traced = trace_step(config, spec).peak_bytes
        errors[(strategy, seq)] = (estimate(shape, spec).peak_tensor_bytes - traced) / traced
    assert max(abs(e) for e in errors.values()) <= 0.03, errors
