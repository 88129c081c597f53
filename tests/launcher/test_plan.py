"""The planner on fake hardware: a table of cases, the batch rules, forcing, nothing-fits."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.plan.hardware import Hardware
from launcher.plan.headroom import plan_headroom
from launcher.plan.ladder import shortfall
from launcher.plan.planner import NoFitError, make_plan
from trainer.core.config import ConfigError, build_config, parse_size

CASES = yaml.safe_load((Path(__file__).parent / "plan_cases.yaml").read_text())
HUB_IDS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "tinyllama-1.1b": "TinyLlama/TinyLlama_v1.1",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "mistral-7b-v0.3": "mistralai/Mistral-7B-v0.3",
}


def _job(model: str, seq: int = 4096, **extra):
    tree = {
        "model": {"name_or_path": HUB_IDS[model]},
        "data": {"path": "some/dataset", "seq_len": seq},
        "train": {"global_batch_size": 64},
        "precision": "bf16",
    }
    tree.update(extra)
    return build_config(tree)


def _hw(case) -> Hardware:
    return Hardware(
        device="cuda",
        nodes=case.get("nodes", 1),
        devices_per_node=case["devices"],
        device_memory_bytes=parse_size(case["device_memory"]),
        host_memory_bytes=parse_size(case["host"]),
        device_name="test GPU",
        peak_flops=989e12,
    )


def test_the_case_table_is_big_enough():
    assert len(CASES) >= 15


def _case_id(c: dict) -> str:
    return f"{c['model']}-{c.get('nodes', 1)}x{c['devices']}x{c['device_memory']}-{c['host']}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_plan_case(case):
    cfg = _job(case["model"], case.get("seq", 4096))
    hw = _hw(case)
    if case.get("exit") == 3:
        with pytest.raises(NoFitError) as err:
            make_plan(cfg, hw)
        assert "would fit" in str(err.value) or "does not fit" in str(err.value)
        return
    plan = make_plan(cfg, hw)
    assert plan.strategy in case["rung"], (plan.strategy, plan.reasons)
    data_ranks = hw.world_size // (plan.long.sequence_parallel * plan.long.tensor_parallel)
    assert plan.micro_batch_size * plan.grad_accum * data_ranks == 64  # exact global batch
    assert shortfall(plan.estimate, hw, plan_headroom(cfg)) is None
    if "checkpointing" in case:
        assert plan.activation_checkpointing == case["checkpointing"]
    fitting = {plan.strategy} | {a.strategy for a in plan.alternatives if a.fits}
    assert set(case.get("fits", [])) <= fitting, (fitting, plan.alternatives)
    rejected = {a.strategy: a.why_not for a in plan.alternatives if not a.fits}
    if hw.world_size > 1:
        assert "needs exactly 1 rank" in rejected["single"]


def test_70b_on_one_gpu_names_the_host_memory_it_would_need():
    with pytest.raises(NoFitError, match=r"would fit with \d+ GiB host memory"):
        make_plan(_job("llama-3.1-70b"), _hw({"devices": 1, "device_memory": "80GiB",
                                             "host": "128GiB"}))  # fmt: skip


def test_a_global_batch_that_cannot_be_split_is_a_config_error():
    cfg = _job("llama-3.2-1b", 2048, train={"global_batch_size": 60})
    with pytest.raises(ConfigError, match="cannot be split evenly over 8 ranks"):
        make_plan(cfg, _hw({"devices": 8, "device_memory": "80GiB", "host": "1TiB"}))


def test_forced_rung_and_micro_batch_are_kept_and_a_misfit_is_said():
    hw = _hw({"devices": 1, "device_memory": "80GiB", "host": "256GiB"})
    plan = make_plan(_job("llama-3.1-8b", strategy="single"), hw)
    assert plan.strategy == "single"
    assert "will not fit" in plan.reasons[0]
    plan = make_plan(_job("llama-3.1-8b", train={"global_batch_size": 64,
                                                 "micro_batch_size": 1}), hw)  # fmt: skip
    assert plan.micro_batch_size == 1 and plan.grad_accum == 64


def test_what_is_learned_never_changes():
    hw = _hw({"devices": 8, "device_memory": "80GiB", "host": "1TiB"})
    cfg = _job("llama-3.1-8b")
    from launcher.plan.planner import apply_plan

    resolved = apply_plan(cfg, make_plan(cfg, hw), hw)
    for key in ("global_batch_size", "lr", "schedule", "steps", "seed", "betas"):
        assert getattr(resolved.train, key) == getattr(cfg.train, key)
    assert resolved.precision == cfg.precision and resolved.strategy != "auto"


def test_bandwidths_from_the_config_drive_the_cost_model():
    hw = _hw({"devices": 8, "device_memory": "80GiB", "host": "1TiB"})
    # the same micro-batch on both (chunked loss would let the fast one take a larger one)
    levers_off = {"chunked_loss": False, "offload_activations": False}
    fast = make_plan(_job("llama-3.1-8b", strategy="fsdp", memory=levers_off), hw)
    slow = make_plan(
        _job(
            "llama-3.1-8b",
            strategy="fsdp",
            memory=levers_off,
            hardware={"intra_node_bandwidth": "15GB"},
        ),
        hw,
    )
    assert slow.step_time_s > fast.step_time_s * 1.2  # comm-bound now: compute hides less of it
    one = _hw({"devices": 1, "device_memory": "80GiB", "host": "256GiB"})
    offload = _job("llama-3.1-8b", strategy="zero3_offload")
    pcie4 = make_plan(offload, one).step_time_s
    pcie3_job = _job("llama-3.1-8b", strategy="zero3_offload", hardware={"pcie_bandwidth": "6GB"})
    pcie3 = make_plan(pcie3_job, one).step_time_s
    assert pcie3 > pcie4


def test_fsdp_accumulates_sharded_when_unsharded_gradients_cost_more():
    """8B on 8x80 GiB at seq 4096: unsharded fp32 accumulation holds 4 bytes per parameter on
    every device, which forces fsdp to a slower micro-batch/recompute; reducing after every
    micro-batch is faster overall, and the resolved config says which the ranks run. (Levers
    off: chunked loss fits micro-batch 8 without accumulation, where the choice is moot.)"""
    from launcher.plan.planner import apply_plan

    hw = _hw({"devices": 8, "device_memory": "80GiB", "host": "1TiB"})
    levers_off = {"chunked_loss": False, "offload_activations": False}
    cfg = _job("llama-3.1-8b", memory=levers_off)
    plan = make_plan(cfg, hw)
    assert plan.strategy == "fsdp" and plan.fsdp_reduce_every_micro_batch is True
    assert plan.grad_accum > 1 and any("after every micro-batch" in r for r in plan.reasons)
    assert apply_plan(cfg, plan, hw).fsdp.reduce_every_micro_batch is True
    assert plan.to_json(hw, plan_headroom(cfg), [])["fsdp_reduce_every_micro_batch"] is True
    # pinned to unsharded accumulation, fsdp's best is slower than the plan above
    pinned = make_plan(
        _job("llama-3.1-8b", memory=levers_off, fsdp={"reduce_every_micro_batch": False}), hw
    )
    fsdp = next(a for a in pinned.alternatives if a.strategy == "fsdp")
    assert pinned.step_time_s * fsdp.relative_step_time > plan.step_time_s * 1.01
    assert pinned.fsdp_reduce_every_micro_batch in (None, False)


def test_chunked_loss_lets_llama_3_2_1b_at_4096_tokens_run_single_without_recompute():
    """Llama-3.2-1B, seq 4096, one 40 GiB GPU: without the levers `single` needs recomputation
    (the 4096 x 128256 logits and their fp32 copies: a quarter of the layers checkpointed);
    with them `single` runs at micro-batch 1 without recomputation, chunked loss in force, and
    the resolved config and plan.json say so."""
    from launcher.plan.planner import apply_plan

    hw = _hw({"devices": 1, "device_memory": "40GiB", "host": "256GiB"})
    off = {"chunked_loss": False, "offload_activations": False}
    before = make_plan(_job("llama-3.2-1b", memory=off), hw)
    single_before = next(a for a in before.alternatives if a.strategy == "single")
    assert single_before.activation_checkpointing != "none"
    cfg = _job("llama-3.2-1b")
    plan = make_plan(cfg, hw)
    assert (plan.strategy, plan.activation_checkpointing) == ("single", "none")
    assert plan.levers.chunked_loss and any("chunked loss" in r for r in plan.reasons)
    assert apply_plan(cfg, plan, hw).memory.chunked_loss is True
    assert plan.to_json(hw, plan_headroom(cfg), [])["chunked_loss"] is True


def test_cpu_ranks_are_not_planned_with_activation_offload():
    """On CPU processes the activations are in host memory already: `auto` never offloads them,
    where the same job on a GPU of that size does (8 GiB: on 24 GiB the copies out would no
    longer hide behind forward, and offload is not chosen)."""
    job = _job("tinyllama-1.1b", seq=2048, train={"global_batch_size": 16})
    on = {}
    for device in ("cuda", "cpu"):
        hw = Hardware(device, 1, 1, 8 * 1024**3, 256 * 1024**3, device, None)
        plan = make_plan(job, hw)
        on[device] = plan.levers.offload_activations or any(
            "offload" in (a.levers or "") for a in plan.alternatives
        )
    assert on == {"cuda": True, "cpu": False}


PRESET_8B = Path(__file__).resolve().parents[2] / "configs" / "models" / "llama-3.1-8b.yaml"
TWO_NODES = ["hardware.nodes=2", "hardware.devices_per_node=8", "hardware.device=cuda",
             "hardware.device_memory=80GiB", "hardware.host_memory=512GiB"]  # fmt: skip


def test_activation_offload_earns_its_place_and_the_sbatch_asks_what_the_plan_needs(tmp_path):
    """8B on 2 x 8 x 80 GiB: plans without offload fit within the cost model's margin, so none
    offloads, and the host and the sbatch `--mem` hold what the job needs, not 248 GiB of
    activations per node (the node's devices share its host memory bandwidth)."""
    from launcher.plan.hardware import detect_hardware
    from launcher.plan.job import resolve_plan
    from launcher.slurm.submit import render_sbatch
    from trainer.core.config import load_config
    from trainer.core.units import GIB

    cfg = load_config(PRESET_8B, [*TWO_NODES, f"run.dir={tmp_path / 'run'}"])
    plan = make_plan(cfg, detect_hardware(cfg.hardware))
    assert not plan.levers.offload_activations
    assert "offloaded_activations" not in plan.estimate.host_breakdown
    assert plan.estimate.host_total_bytes < 40 * GIB
    resolved, plan_json = resolve_plan(cfg)
    script = render_sbatch(resolved, plan_json, tmp_path / "run", "python")
    mem = next(x for x in script.splitlines() if x.startswith("#SBATCH --mem="))
    assert int(mem.removeprefix("#SBATCH --mem=").removesuffix("G")) <= 40


def test_escalation_never_climbs_to_a_rung_with_a_larger_estimated_peak():
    """After fsdp runs out of memory, a plain re-plan without it would take zero2, whose
    estimated peak is above fsdp's; the climb passes it over for a rung whose estimate is at
    most the failed one's."""
    from launcher.plan.job import next_rung, resolve_plan
    from trainer.core.config import load_config

    cfg = load_config(PRESET_8B, [*TWO_NODES[1:], "hardware.nodes=1", "train.micro_batch_size=1",
                                  "memory.activation_checkpointing=full"])  # fmt: skip
    resolved, plan_json = resolve_plan(cfg)
    assert resolved.strategy == "fsdp"
    ceiling = plan_json["estimate"]["device"]["peak_tensor_bytes"]
    plain, plain_json = resolve_plan(cfg, exclude=["fsdp"])
    assert plain.strategy == "zero2"
    assert plain_json["estimate"]["device"]["peak_tensor_bytes"] > ceiling
    climbed, excluded = next_rung(cfg, ["fsdp"], 1.0, ceiling)
    assert climbed.strategy == "zero3" and excluded == ["fsdp", "zero2"]
    again = resolve_plan(cfg, exclude=excluded)[1]
    assert again["estimate"]["device"]["peak_tensor_bytes"] <= ceiling


def test_selective_checkpointing_recomputes_the_fewest_layers_that_fit():
    """Qwen2.5-7B at 8,192 tokens on 8 x 64 GiB: the plan checkpoints 14 of the 28 layers (a
    half) at micro-batch 1 (`memory.checkpointed_layers: auto`: a quarter, a half or three
    quarters); a quarter does not fit. The resolved config, plan.json and the text plan carry
    the count; a forced count is kept."""
    from launcher.estimate.peak import estimate
    from launcher.estimate.shape import model_shape
    from launcher.plan.ladder import job_step
    from launcher.plan.planner import apply_plan
    from launcher.report.plan_report import render_plan
    from trainer.core import strategies

    hw = _hw({"devices": 8, "device_memory": "64GiB", "host": "1TiB"})
    cfg = _job("qwen2.5-7b", seq=8192, memory={"selective": "layers"})
    plan = make_plan(cfg, hw)
    k = plan.checkpointed_layers
    assert (plan.activation_checkpointing, plan.micro_batch_size, k) == ("selective", 1, 14)
    quarter = job_step(
        cfg,
        hw,
        strategies.row(plan.strategy),
        1,
        "selective",
        levers=plan.levers,
        reduce_every_micro=plan.fsdp_reduce_every_micro_batch,
        checkpointed=7,
    )
    assert shortfall(estimate(model_shape(cfg.model), quarter), hw, plan_headroom(cfg)) is not None
    assert apply_plan(cfg, plan, hw).memory.checkpointed_layers == k
    assert plan.to_json(hw, plan_headroom(cfg), [])["checkpointed_layers"] == k
    assert "activation checkpointing selective (14 of the layers)" in render_plan(plan, 1, 1, [])
    memory = {"activation_checkpointing": "selective", "checkpointed_layers": 26,
              "selective": "layers"}  # fmt: skip
    forced = make_plan(_job("qwen2.5-7b", memory=memory), hw)
    assert (forced.activation_checkpointing, forced.checkpointed_layers) == ("selective", 26)
    with pytest.raises(ConfigError, match="40 is more than the model's 28 decoder layers"):
        make_plan(_job("qwen2.5-7b", memory={"checkpointed_layers": 40}), hw)


def test_op_level_checkpointing_is_planned_where_it_is_fastest():
    """Llama-3.1-8B at 8,192 tokens on 8 x 80 GiB: every layer at op level (the matmuls' and
    attention's outputs kept, a third of the matmul work recomputed), micro-batch 2; the
    resolved config and plan.json say so, and whole layers are weighed beside it."""
    from launcher.plan.planner import apply_plan
    from launcher.report.plan_report import render_plan

    hw = _hw({"devices": 8, "device_memory": "80GiB", "host": "1TiB"})
    cfg = _job("llama-3.1-8b", seq=8192)
    plan = make_plan(cfg, hw)
    assert (plan.activation_checkpointing, plan.selective, plan.micro_batch_size) == (
        "selective",
        "ops",
        2,
    )
    assert apply_plan(cfg, plan, hw).memory.selective == "ops"
    assert plan.to_json(hw, plan_headroom(cfg), [])["selective"] == "ops"
    assert "(matmul and attention outputs saved)" in render_plan(plan, 1, 1, [])
    layers = make_plan(_job("llama-3.1-8b", seq=8192, memory={"selective": "layers"}), hw)
    assert layers.step_time_s > plan.step_time_s


def test_a_compiled_plan_says_how_its_layers_are_counted():
    """train.compile: the partition's saved set where it is checked (Llama, full fine-tuning),
    eager layers where not (LoRA's fp32 adapters on a 16-bit base), and DeepSpeed runs eagerly."""
    hw = _hw({"devices": 8, "device_memory": "80GiB", "host": "1TiB"})
    reason = {
        "full": "each layer counts what AOTAutograd's partition saves (silu(gate)",
        "lora": "the layers are counted as eager ones",
    }
    for method, words in reason.items():
        cfg = _job("llama-3.1-8b", train={"global_batch_size": 64, "compile": True},
                   finetune={"method": method}, strategy="fsdp",
                   memory={"activation_checkpointing": "full"})  # fmt: skip
        assert any(words in r for r in make_plan(cfg, hw).reasons), method
    zero3 = make_plan(_job("llama-3.1-8b", train={"global_batch_size": 64, "compile": True},
                           strategy="zero3"), hw)  # fmt: skip
    assert "train.compile is not applied under zero3" in zero3.reasons[-1]


def test_op_level_checkpointing_rules_out_deepspeed_and_says_why():
    """memory.selective=ops forced: DeepSpeed's rungs are not tried with it, and say so, instead
    of the plan failing as if the model could not be estimated."""
    hw = _hw({"devices": 8, "device_memory": "80GiB", "host": "1TiB"})
    ops = {"activation_checkpointing": "selective", "selective": "ops"}
    plan = make_plan(_job("llama-3.1-8b", memory=ops), hw)
    assert plan.strategy in ("ddp", "fsdp", "fsdp_offload")
    why = {a.strategy: a.why_not for a in plan.alternatives if not a.fits}
    assert why["zero3"] == "memory.selective=ops is not run on DeepSpeed's rungs"
