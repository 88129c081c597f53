"""Plans of preference objectives (launcher/plan/preference.py): micro-batches count pairs, and
the plan names where DPO's reference comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher.plan.hardware import detect_hardware
from launcher.plan.job import resolve_plan
from launcher.plan.planner import make_plan
from tests.conftest import oomless
from trainer.core.config import load_config

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
DPO = ["data.format=preference", "objective.type=dpo", "hardware.device=cuda"]


def _on(gpus: int, gib: int) -> list[str]:
    return [f"hardware.devices_per_node={gpus}", f"hardware.device_memory={gib}GiB"]


@pytest.mark.parametrize(
    ("preset", "overrides", "reference"),
    [
        ("llama-3.1-8b", ["finetune.method=full", *_on(8, 80)], "precomputed"),
        ("llama-3.1-8b", ["finetune.method=lora", *_on(1, 24)], "adapters_off"),
        ("llama-3.1-70b", ["finetune.method=lora", *_on(8, 80)], "adapters_off"),
    ],
)
def test_the_issue_s_three_dpo_plans_fit_and_name_the_reference(
    tmp_path, preset, overrides, reference
):
    cfg = load_config(MODELS / f"{preset}.yaml", [*DPO, *overrides, f"run.dir={tmp_path}"])
    resolved, plan = resolve_plan(cfg)
    assert plan["reference"] == reference and plan["estimate"]["fits"], plan
    assert plan["sequence_parallel"] == 1  # a pair's log-probs are sums over whole sequences
    assert any(r.startswith("reference (dpo): ") for r in plan["reasons"]), plan["reasons"]
    assert resolved.objective.type == "dpo"


def test_oomless_plan_says_the_reference_and_exits_0():
    r = oomless("plan", str(MODELS / "llama-3.1-8b.yaml"), *DPO, *_on(8, 80))
    assert r.returncode == 0, r.stderr
    pairs = re.search(r"(\d+) pair\(s\) = (\d+) sequences", r.stdout)
    assert "; reference precomputed" in r.stdout and pairs, r.stdout
    assert int(pairs[2]) == 2 * int(pairs[1])


def test_a_pair_is_two_sequences_of_activations_and_orpo_has_no_reference(tmp_path):
    """ORPO at micro-batch 1 (pair) is estimated as SFT at micro-batch 2 (sequences)."""
    fixed = ["strategy=single", "memory.activation_checkpointing=none", "memory.chunked_loss=false",
             "memory.offload_activations=false", *_on(1, 80)]  # fmt: skip
    base = [f"run.dir={tmp_path}", "hardware.device=cuda", *fixed]
    sft = load_config(MODELS / "llama-3.1-8b.yaml", [*base, "train.micro_batch_size=2"])
    orpo = load_config(
        MODELS / "llama-3.1-8b.yaml",
        [*base, "train.micro_batch_size=1", "data.format=preference", "objective.type=orpo"],
    )
    sft_plan, orpo_plan = (make_plan(c, detect_hardware(c.hardware)) for c in (sft, orpo))
    assert orpo_plan.micro_batch_size == 1 and sft_plan.micro_batch_size == 2
    breakdown = orpo_plan.estimate.device_breakdown
    assert breakdown == sft_plan.estimate.device_breakdown and breakdown["activations"] > 0
    assert resolve_plan(orpo)[1]["reference"] == "none"
    assert "reference" not in resolve_plan(sft)[1]
