"""QLoRA's per-rank quantise-on-load (trainer/model/qlora_load.py) against the replica rungs' build
(trainer/model/finetune.py), in one process: the 4-bit skeleton filled chunk by chunk holds the same
packed bytes, quantisation states, 16-bit tensors and initial adapters, bit for bit, from a
random init and from saved files. The sharded runs are in tests/trainer/test_lowbit.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import write_demo_job
from trainer.core.config import load_config
from trainer.model import qlora_load
from trainer.model.build import HFModelFactory
from trainer.model.finetune import FinetuneFactory

# 40 x 70 = 2800 weights per MLP matrix: 43.75 blocks of 64, so a weight ends inside a block
ODD = {
    "model_type": "qwen2",  # q/k/v biases: 16-bit tensors inside the quantised linears
    "vocab_size": 45,
    "hidden_size": 40,
    "intermediate_size": 70,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _factory(tmp_path, *overrides: str) -> FinetuneFactory:
    job = write_demo_job(
        tmp_path / "job.yaml",
        model={"config": ODD},
        finetune={"method": "qlora", "lora": {"r": 4, "alpha": 8}},
        precision="bf16",
    )
    cfg = load_config(job, list(overrides))
    return FinetuneFactory(HFModelFactory(cfg.model, cfg.train.seed), cfg)


def _filled(factory: FinetuneFactory) -> torch.nn.Module:
    model = factory.build_4bit_skeleton()
    source = qlora_load.tensor_source(model, factory)
    assert source is not None
    model.to_empty(device="cpu")
    qlora_load.fill_4bit_shards(model, source, torch.device("cpu"), factory.seed)
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.is_floating_point() else t


def _same(got: torch.nn.Module, want: torch.nn.Module) -> None:
    params = dict(got.named_parameters())
    for name, t in want.named_parameters():
        assert params[name].dtype == t.dtype, name
        assert torch.equal(_bits(params[name].detach()), _bits(t.detach())), name
    quantised = [(n, m) for n, m in want.named_modules() if type(m).__name__ == "Linear4bit"]
    assert len(quantised) == 2 * 7
    modules = dict(got.named_modules())
    for name, m in quantised:
        a, b = modules[name].quant_state, m.quant_state
        assert a.shape == b.shape and a.dtype == b.dtype and a.blocksize == b.blocksize, name
        for field in ("absmax", "code", "offset"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (name, field)
        assert torch.equal(a.state2.absmax, b.state2.absmax), name


@pytest.mark.parametrize("chunk", [256, 1 << 18])  # many chunks a weight, and one
def test_a_random_init_quantised_chunk_by_chunk_is_the_replicas_model(tmp_path, monkeypatch, chunk):
    monkeypatch.setitem(qlora_load._CHUNK, "cpu", chunk)
    factory = _factory(tmp_path)
    _same(_filled(factory), factory.build("cpu"))


def test_saved_weights_quantised_chunk_by_chunk_are_the_replicas_model(tmp_path, monkeypatch):
    """From fp32 files: each chunk rounded to bf16 as transformers loads them for the replicas
    (`dtype=bf16`), then quantised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setitem(qlora_load._CHUNK, "cpu", 256)
    params = {k: v for k, v in ODD.items() if k != "model_type"}
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **params))
    model.save_pretrained(tmp_path / "saved")
    factory = _factory(tmp_path, f"model.name_or_path={tmp_path / 'saved'}", "model.config=null")
    _same(_filled(factory), factory.build("cpu"))


def test_initial_adapters_depend_on_the_seed_and_the_name_only(tmp_path):
    from trainer.model.finetune import initial_adapter

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    wrapped = name.replace("layers.0.", "layers.0._checkpoint_wrapped_module.")
    a = initial_adapter(name, torch.Size([4, 40]), seed=1)
    assert torch.equal(a, initial_adapter(wrapped, torch.Size([4, 40]), seed=1))
    assert not torch.equal(a, initial_adapter(name, torch.Size([4, 40]), seed=2))
    other = name.replace("q_proj", "k_proj")
    assert not torch.equal(a, initial_adapter(other, torch.Size([4, 40]), seed=1))
    assert a.abs().max() <= 1 / 40**0.5 + 1e-6  # Kaiming-uniform, a = sqrt(5): bound 1/sqrt(fan_in)
    assert not initial_adapter(name.replace("lora_A", "lora_B"), torch.Size([40, 4]), 1).any()


def test_a_checkpoint_not_read_per_rank_gives_no_source(tmp_path):
    """A weight missing from the safetensors (renamed, or in a format this does not read): the
    fsdp backend then quantises the whole base on every rank (one log line) instead."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    params = {k: v for k, v in ODD.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **params)).save_pretrained(
        tmp_path / "saved"
    )
    weights = tmp_path / "saved" / "model.safetensors"
    state = load_file(weights)
    state["model.final_norm.weight"] = state.pop("model.norm.weight")
    save_file(state, weights, metadata={"format": "pt"})
    factory = _factory(tmp_path, f"model.name_or_path={tmp_path / 'saved'}", "model.config=null")
    assert qlora_load.tensor_source(factory.build_4bit_skeleton(), factory) is None
