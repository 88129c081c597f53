"""LoRA, QLoRA and 8-bit AdamW in the estimate and the planner: the byte counts against
what peft and bitsandbytes allocate, and the plans a one-GPU fine-tuner asks for."""

from __future__ import annotations

import json

import pytest
import torch

from launcher.cli import main
from launcher.estimate.methods import (
    adam_state_bytes,
    adapter_tensors,
    layer_tensors,
    nf4_bytes,
    root_tensors,
)
from launcher.estimate.peak import estimate
from launcher.estimate.shape import model_shape, shape_of
from trainer.core.config import ConfigError, ModelConfig
from trainer.core.step_spec import FULL, Finetune, StepSpec
from trainer.core.units import GIB

PRESET_8B = "configs/models/llama-3.1-8b.yaml"
ONE_4090 = [
    "hardware.devices_per_node=1",
    "hardware.device_memory=24GiB",
    "hardware.host_memory=64GiB",
]
TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _adapter_params(shape, ft: Finetune) -> int:
    """Trainable parameters of the whole model under LoRA: r x (in + out) per targeted linear."""
    return shape.num_layers * sum(adapter_tensors(shape, ft))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def _meta_model(config: dict):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    params = dict(config)
    hf = CONFIG_MAPPING[params.pop("model_type")](**params)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize(
    "model_type, targets",
    [
        ("llama", "all-linear"),
        ("qwen2", "all-linear"),  # q/k/v biases
        ("phi3", "all-linear"),  # fused qkv and gate/up
        ("mistral", ("q_proj", "v_proj")),
    ],
)
def test_adapter_count_is_what_peft_makes_trainable(model_type, targets):
    from peft import LoraConfig, get_peft_model

    config = {"model_type": model_type, **TINY}
    shape = shape_of(json.dumps(config, sort_keys=True))
    ft = Finetune(method="lora", r=8, target_modules=targets)
    lora = LoraConfig(r=8, target_modules=targets if isinstance(targets, str) else list(targets))
    model = get_peft_model(_meta_model(config), lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert _adapter_params(shape, ft) == trainable
    # every tensor of the model is counted once, by size (8-bit moments depend on sizes)
    base = sorted(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    ours = sorted(shape.num_layers * layer_tensors(shape) + root_tensors(shape))
    assert ours == base


def test_a_target_that_is_no_linear_of_the_block_is_a_config_error():
    shape = model_shape(ModelConfig(name_or_path="meta-llama/Llama-3.1-8B"))
    with pytest.raises(ConfigError, match="finetune.lora.target_modules.*qkv_proj"):
        _adapter_params(shape, Finetune(method="lora", target_modules=("qkv_proj",)))


def test_nf4_bytes_are_what_bitsandbytes_stores():
    import bitsandbytes as bnb

    weight = torch.randn(352, 128, dtype=torch.bfloat16)
    packed = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")._quantize("cpu")
    state = packed.quant_state

    def nbytes(obj) -> int:
        return sum(
            v.numel() * v.element_size() if isinstance(v, torch.Tensor) else nbytes(v)
            for v in vars(obj).values()
            if isinstance(v, torch.Tensor) or hasattr(v, "absmax")
        )

    assert state.nested and state.blocksize == 64  # double quantisation, as QLoRA runs it
    assert nf4_bytes(weight.numel()) == packed.numel() * packed.element_size() + nbytes(state)


def test_8bit_moments_are_what_bitsandbytes_adamw8bit_holds():
    import bitsandbytes as bnb

    params = [torch.nn.Parameter(torch.randn(n)) for n in (5000, 4096, 100, 70000)]
    opt = bnb.optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    held = {
        v.data_ptr(): v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    }
    sizes = [p.numel() for p in params]
    assert adam_state_bytes(sizes, "adamw_8bit") == sum(held.values())
    assert adam_state_bytes(sizes, "adamw") == 8 * sum(sizes)


def test_model_states_of_8b_per_method():
    """Llama-3.1-8B on one device: full 16 bytes per parameter, LoRA the bf16 base plus 16
    bytes per adapter parameter, QLoRA ~0.52 bytes per linear weight; 8-bit moments ~2 bytes."""
    shape = model_shape(ModelConfig(name_or_path="meta-llama/Llama-3.1-8B"))

    def states(ft: Finetune, strategy: str = "single", world: int = 1) -> dict[str, int]:
        est = estimate(
            shape,
            StepSpec(
                strategy=strategy,
                world_size=world,
                devices_per_node=world,
                micro_batch_size=1,
                seq_len=2048,
                activation_checkpointing="full",
                precision="bf16",
                finetune=ft,
            ),
        )
        return {k: est.device_breakdown[k] for k in ("params", "grads", "optimizer")}

    n = shape.num_params
    lora = Finetune(method="lora")
    adapters = _adapter_params(shape, lora)
    assert adapters == 41_943_040  # r=16 on all seven linears of 32 blocks
    assert states(FULL) == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
    assert states(lora) == {"params": 2 * n + 4 * adapters, "grads": 4 * adapters,
                            "optimizer": 8 * adapters}  # fmt: skip
    qlora = states(Finetune(method="qlora"))
    linears = shape.num_layers * (shape.num_layer_params - 2 * shape.hidden_size)
    frozen = qlora["params"] - 4 * adapters - 2 * (n - linears)
    assert 0.515 < frozen / linears < 0.517
    eight = states(Finetune(optimizer="adamw_8bit"))
    assert 2.03 * n < eight["optimizer"] < 2.04 * n and eight["params"] == 4 * n
    # sharded: FSDP over 4 ranks divides the frozen base and the adapters' states alike
    fsdp = states(lora, "fsdp", 4)
    assert fsdp["params"] == (2 * n + 4 * adapters) // 4 and fsdp["optimizer"] == 2 * adapters


def test_a_pretrained_frozen_base_loads_on_the_host_in_16_bits():
    """LoRA and QLoRA on a replica rung load the base's files straight in bf16
    (trainer/model/finetune.py): 2 bytes per parameter on the host while loading, where a full
    fine-tune (fp32 masters) and a random init (drawn in fp32) take 4."""
    shape = model_shape(ModelConfig(name_or_path="meta-llama/Llama-3.1-8B"))

    def loading(ft: Finetune, strategy: str = "single", world: int = 1) -> int:
        est = estimate(
            shape,
            StepSpec(
                strategy=strategy,
                world_size=world,
                devices_per_node=world,
                micro_batch_size=1,
                seq_len=2048,
                activation_checkpointing="full",
                precision="bf16",
                finetune=ft,
            ),
        )
        return est.host_breakdown["initial_weights"]

    n = shape.num_params
    assert loading(FULL) == 4 * n
    assert loading(Finetune(method="lora")) == 2 * n == loading(Finetune(method="qlora"))
    assert loading(Finetune(method="lora"), "ddp", 2) == 2 * 2 * n  # each rank its replica
    assert loading(Finetune(method="lora", pretrained=False)) == 4 * n


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_qlora_8b_plans_on_one_24gib_gpu(capsys):
    rc, out, err = _cli(capsys, "plan", PRESET_8B, "finetune.method=qlora", *ONE_4090, "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["world_size"] == 1
    assert plan["estimate"]["device"]["total_bytes"] <= 0.9 * 24 * GIB
    rungs = {a["strategy"]: a for a in plan["alternatives"]}
    assert not rungs["zero2"]["fits"] and "qlora" in rungs["zero2"]["why_not"]


def test_lora_8b_plans_on_one_24gib_gpu_at_seq_2048(capsys):
    rc, out, err = _cli(capsys, "plan", PRESET_8B, "finetune.method=lora", "data.seq_len=2048",
                        *ONE_4090)  # fmt: skip
    assert rc == 0, err
    assert out.startswith("plan: single on 1 node(s) x 1 device(s)")


def test_estimate_models_the_8bit_optimizer_key(capsys):
    rc, out, _ = _cli(capsys, "estimate", PRESET_8B, "train.optimizer=adamw_8bit", *ONE_4090)
    assert rc == 0 and "single" in out


def test_full_8b_on_one_24gib_gpu_exits_3_naming_lora(capsys):
    rc, out, err = _cli(capsys, "plan", PRESET_8B, "data.seq_len=2048", *ONE_4090, "--json")
    assert rc == 3
    assert "finetune.method=lora would fit on single (" in err and "GiB of 24 GiB)" in err
    assert len(err.strip().splitlines()) == 1
    answer = json.loads(out)
    assert answer["fits"] is False and answer["error"] in err
    # bf16 weights with 8-bit moments (every weight still trains) come first; LoRA fits, so
    # QLoRA (a bigger change) is not offered
    pure, lora = answer["alternatives"]
    assert pure["overrides"] == ["precision=bf16_pure", "train.optimizer=adamw_8bit"]
    assert lora["change"] == "finetune.method=lora" and lora["overrides"] == [lora["change"]]
    assert (lora["strategy"], lora["world_size"], lora["fits"]) == ("single", 1, True)
    assert lora["device_peak_bytes"] < lora["device_total_bytes"] <= 0.9 * 24 * GIB
    # what it names plans as named
    rc, out, err = _cli(capsys, "plan", PRESET_8B, "data.seq_len=2048", *ONE_4090,
                        *lora["overrides"], "--json")  # fmt: skip
    plan = json.loads(out)
    assert rc == 0 and plan["strategy"] == "single"
    assert plan["estimate"]["device"]["total_bytes"] == lora["device_total_bytes"]


def test_the_8bit_optimizer_is_named_when_it_alone_makes_a_full_fine_tune_fit(capsys):
    """Llama-3.2-1B on one 18 GiB device with 16 GiB of host memory: fp32 AdamW needs ~20 GiB,
    8-bit moments fit on `single` (still every weight trains); LoRA fits too and is named."""
    rc, _, err = _cli(capsys, "plan", PRESET_8B, "model.name_or_path=meta-llama/Llama-3.2-1B",
                      "data.seq_len=2048", "hardware.devices_per_node=1",
                      "hardware.device_memory=18GiB", "hardware.host_memory=16GiB")  # fmt: skip
    assert rc == 3
    assert "; or train.optimizer=adamw_8bit would fit on single (" in err
    assert err.index("adamw_8bit would fit") < err.index("finetune.method=lora would fit")


def test_a_forced_rung_that_does_not_fit_says_which_method_would(capsys):
    rc, out, err = _cli(capsys, "plan", PRESET_8B, "data.seq_len=2048", "strategy=single",
                        *ONE_4090)  # fmt: skip
    assert rc == 0, err
    why = out.split("why:")[1].split("rungs:")[0]
    assert "forced by the config" in why and "finetune.method=lora would fit on single" in why


def test_the_cost_model_counts_adapter_matmuls_and_dequantisation():
    """LoRA skips the frozen weights' gradients (4N + 6A FLOPs per token, not 6N); QLoRA adds a
    memory-bound dequantisation of every 4-bit weight per pass, which a smaller micro-batch
    repeats more often; only the adapters' gradients are reduced across ranks."""
    from launcher.plan.cost import Links, step_time_s
    from launcher.plan.hardware import detect_hardware
    from launcher.plan.ladder import job_step
    from trainer.core import strategies
    from trainer.core.config import load_config

    def seconds(method: str, micro: int = 1, strategy: str = "single", ranks: int = 1) -> float:
        cfg = load_config(PRESET_8B, [f"finetune.method={method}", "data.seq_len=2048",
                                      f"hardware.devices_per_node={ranks}",
                                      "hardware.device_memory=24GiB"])  # fmt: skip
        shape, hw = model_shape(cfg.model), detect_hardware(cfg.hardware)
        spec = job_step(cfg, hw, strategies.row(strategy), micro, "none")
        return step_time_s(shape, spec, hw, Links.of(cfg.hardware, hw.device))

    full, lora, qlora = seconds("full"), seconds("lora"), seconds("qlora")
    assert 0.65 < lora / full < 0.72  # (4N + 6A + attention) / (6N + attention)
    assert lora < qlora < 1.05 * lora
    assert seconds("qlora", micro=8) - seconds("lora", micro=8) < (qlora - lora) / 4
    # ddp x8 all-reduces the adapters' gradients only: what the backward does not hide (the
    # last layer's share; launcher/plan/cost.py overlapped_s) is far smaller than full's
    lora_excess = seconds("lora", strategy="ddp", ranks=8) / (lora / 8) - 1
    full_excess = seconds("full", strategy="ddp", ranks=8) / (full / 8) - 1
    assert 0 < 50 * lora_excess < full_excess, (lora_excess, full_excess)
