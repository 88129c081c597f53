"""`parallel.expert`: every job it cannot run is one line (exit 2) naming the key, the problem and
what works, found before anything is launched (trainer/core/config/expert_checks.py,
trainer/core/parallel_dims.py, trainer/parallel/dims.py). In process: no launch, no model."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

from launcher.cli import main
from tests.conftest import write_demo_job
from trainer.core.config import ConfigError, load_config
from trainer.core.expert_plan import expert_plan
from trainer.core.parallel_dims import ParallelDims, expert_sizes

# the architectures' plans as the installed transformers declares them (`make test-floor` runs
# the lowest transformers pyproject.toml allows, whose configs may declare none)
pytestmark = pytest.mark.skipif(
    not (expert_plan("qwen3_moe") and expert_plan("gpt_oss")),
    reason="the installed transformers declares no base_model_ep_plan for qwen3_moe and gpt_oss",
)

_SMALL = {
    "vocab_size": 45, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
}  # fmt: skip
QWEN3_MOE = {"model_type": "qwen3_moe", **_SMALL, "intermediate_size": 64,
             "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
GPT_OSS_128 = {"model_type": "gpt_oss", **_SMALL, "intermediate_size": 32,
               "num_local_experts": 128, "num_experts_per_tok": 2}  # fmt: skip


def _job(tmp_path: Path, model: dict, devices: int = 2) -> Path:
    return write_demo_job(
        tmp_path / "job.yaml",
        model={"config": model},
        hardware={"devices_per_node": devices},
        train={"global_batch_size": 12, "micro_batch_size": 1},
    )


def _refusal(tmp_path: Path, model: dict, *overrides: str, devices: int = 2) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(_job(tmp_path, model, devices), list(overrides))
    line = str(err.value)
    assert "\n" not in line
    return line


def test_a_forced_degree_loads_on_an_moe_model_and_the_fsdp_rungs(tmp_path):
    for strategy in ("fsdp", "fsdp_offload", "auto"):
        cfg = load_config(_job(tmp_path, QWEN3_MOE), ["parallel.expert=2", f"strategy={strategy}"])
        assert cfg.parallel.expert == 2
    lora = ["finetune.method=lora", "finetune.lora.target_modules=[q_proj, v_proj]"]
    assert load_config(_job(tmp_path, QWEN3_MOE), ["parallel.expert=2", *lora]).parallel.expert == 2


@pytest.mark.parametrize(
    ("model", "overrides", "devices", "words"),
    [
        (GPT_OSS_128, ["parallel.expert=3"], 6,
         "parallel.expert: 3 does not divide the model's 128 experts per MoE layer; "
         "use parallel.expert=1 or 2"),
        (GPT_OSS_128, ["parallel.expert=3"], 4,
         "parallel.expert: 3 does not divide the 4 data x sequence ranks; "
         "use parallel.expert=1 or 2 or 4"),
        ({**QWEN3_MOE, "model_type": "qwen3"}, ["parallel.expert=2"], 2,
         "parallel.expert: 2 on model_type qwen3: transformers declares no expert-parallel plan"),
        (QWEN3_MOE, ["parallel.expert=2", "parallel.tensor=2"], 4,
         "parallel.expert: 2 with parallel.tensor=2: expert and tensor parallel do not combine; "
         "set parallel.tensor=1, or parallel.expert=1"),
        (QWEN3_MOE, ["parallel.expert=2", "strategy=zero3"], 2,
         "parallel.expert: 2 with strategy=zero3: expert parallel runs on fsdp and fsdp_offload"),
        (QWEN3_MOE, ["parallel.expert=2", "finetune.method=qlora", "precision=bf16"], 2,
         "use parallel.expert=1 (strategy=fsdp takes QLoRA with whole experts)"),
        (QWEN3_MOE, ["parallel.expert=2", "finetune.method=lora",
                     "finetune.lora.target_modules=[q_proj, gate_up_proj]"], 2,
         "finetune.lora.target_modules: gate_up_proj names the experts' 3-D parameters"),
    ],
)  # fmt: skip
def test_a_degree_the_job_cannot_take_is_one_line_naming_what_works(
    tmp_path, model, overrides, devices, words
):
    assert words in _refusal(tmp_path, model, *overrides, devices=devices)


def test_the_command_line_exits_2_with_the_one_line(tmp_path, capsys):
    job = _job(tmp_path, GPT_OSS_128, devices=6)
    try:
        rc = main(["plan", str(job), "parallel.expert=3"])
    except SystemExit as stop:
        rc = stop.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "use parallel.expert=1 or 2" in err


def test_every_degree_a_refusal_suggests_passes_the_check():
    for world, experts in ((8, 128), (6, 4), (2, 3), (4, 0)):
        for ep in expert_sizes(world, experts):
            assert ParallelDims(world, 1, 1, ep).expert_problem(experts) is None
    assert ParallelDims(8, 2, 1, 4).expert_data == 2  # 8 token ranks, 2 copies of each expert


def test_the_plan_carries_a_forced_degree_and_its_reason(tmp_path, capsys):
    """`oomless train --dry-run` on a forced rung (no activations traced): the plan's JSON, as
    `plan --json` writes it, gives the degree, and a reason says the planner did not weigh it."""
    job = str(_job(tmp_path, QWEN3_MOE))
    argv = ["train", job, "strategy=fsdp", f"run.dir={tmp_path / 'run'}", "--dry-run"]
    plans = []
    for degree in ("parallel.expert=2", "parallel.expert=auto"):
        assert main([*argv, degree]) == 0
        out = capsys.readouterr().out
        plans.append(json.loads(out[: out.rindex("}") + 1]))
    assert plans[0]["parallel"] == {"data": 2, "sequence": 1, "tensor": 1, "expert": 2}
    assert any(r.startswith("expert parallel 2: ") for r in plans[0]["reasons"])
    assert plans[1]["parallel"]["expert"] == 1


def test_a_transformers_without_the_expert_split_is_one_line_naming_its_version(
    tmp_path, monkeypatch
):
    """Checked by every rank before a process group exists (trainer/parallel/dims.py)."""
    from transformers import AutoConfig

    from trainer.parallel import expert
    from trainer.parallel.dims import run_dims

    cfg = load_config(_job(tmp_path, QWEN3_MOE), ["parallel.expert=2"])
    hf_config = AutoConfig.for_model(**QWEN3_MOE)
    if expert.installed():  # else the line below is the installed version's own
        assert run_dims(cfg, 2, hf_config).expert == 2
    monkeypatch.setattr(expert, "_apply_function", lambda: None)
    with pytest.raises(ConfigError) as err:
        run_dims(cfg, 2, hf_config)
    assert f"which transformers {version('transformers')} lacks" in str(err.value)
    assert "install transformers>=5.24, or use parallel.expert=1" in str(err.value)
