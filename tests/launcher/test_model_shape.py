"""Model shapes from HF configs alone: published parameter counts of the shipped presets, and the
on-disk cache that spares the next plan the imports of torch and transformers."""

from __future__ import annotations

import json

import pytest

from launcher.estimate.shape import PRESETS, ModelShape, model_shape, preset_shapes
from trainer.core.config import ConfigError, ModelConfig

# Parameter counts the model cards publish (safetensors index totals).
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "mistralai/Mistral-7B-v0.3": 7_248_023_552,
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "TinyLlama/TinyLlama_v1.1": 1_100_048_384,
}


@pytest.mark.parametrize("hub_id", PUBLISHED)
def test_presets_have_the_published_parameter_counts(hub_id, tmp_path):
    """Counted on the meta device now, and as shipped in trainer/core/presets/shapes.json."""
    fresh = model_shape(ModelConfig(name_or_path=hub_id), cache_dir=tmp_path, shipped=False)
    assert fresh.num_params == PUBLISHED[hub_id]
    assert fresh.num_root_params + fresh.num_layers * fresh.num_layer_params == fresh.num_params
    assert model_shape(ModelConfig(name_or_path=hub_id), cache_dir=tmp_path / "x") == fresh


def test_the_shipped_preset_shapes_are_what_the_meta_model_gives():
    """trainer/core/presets/shapes.json is current (else: python -m launcher.estimate.shape)."""
    shipped = json.loads((PRESETS / "shapes.json").read_text())
    assert shipped == preset_shapes()
    assert {entry["preset"] for entry in shipped.values()} == {
        p.name for p in PRESETS.iterdir() if p.name.endswith(".json") and p.name != "shapes.json"
    }


# A block type counted on the meta device (llama and the other modelled types are arithmetic).
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}


def test_the_second_call_reads_the_cache_and_a_damaged_entry_is_recomputed(tmp_path):
    cfg = ModelConfig(config=TINY_GPT2)
    first = model_shape(cfg, cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    assert ModelShape(**json.loads(entry.read_text())) == first
    # the cache is what the next call returns: a changed entry shows through ...
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "num_layers": 99}))
    assert model_shape(cfg, cache_dir=tmp_path).num_layers == 99
    # ... and a damaged one is computed again and rewritten
    entry.write_text("{not json")
    assert model_shape(cfg, cache_dir=tmp_path) == first
    assert ModelShape(**json.loads(entry.read_text())) == first
    # another config is another entry
    model_shape(ModelConfig(config={**TINY_GPT2, "n_layer": 3}), cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_an_unwritable_cache_still_gives_the_shape(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    shape = model_shape(ModelConfig(config=TINY_GPT2), cache_dir=blocked / "shapes")
    assert shape.num_layers == 2


def test_an_unknown_hub_id_says_what_would_work(tmp_path):
    with pytest.raises(ConfigError) as e:
        model_shape(ModelConfig(name_or_path="someone/unknown-model"), cache_dir=tmp_path)
    assert "model.name_or_path" in str(e.value) and "meta-llama/Llama-3.1-8B" in str(e.value)


def test_layers_of_different_sizes_count_as_their_mean_with_the_largest_kept(tmp_path):
    """DeepSeek-V3's first dense layers below its MoE ones: a layer counts as the layers' mean,
    so that the root (never sharded per layer, gathered whole by FSDP) is the embeddings, the
    final norm and the head alone, and the largest layer is what a sharded rung gathers. (The
    first layer counted as every layer made DeepSeek-V3's root 634B of its 671B parameters.)"""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from trainer.model.build import decoder_layers

    config = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128,
              "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "n_routed_experts": 16, "num_experts_per_tok": 2,
              "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
              "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
              "v_head_dim": 16, "vocab_size": 256}  # fmt: skip
    shape = model_shape(ModelConfig(config=config), cache_dir=tmp_path, shipped=False)
    assert shape.num_root_params == 2 * 256 * 64 + 64  # embeddings, head, final norm
    assert shape.num_layers * shape.num_layer_params + shape.num_root_params == shape.num_params
    params = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(DeepseekV3Config(**params))
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    assert sizes[0] < sizes[1] == shape.top_layer_params  # a dense layer, then MoE ones
    assert model_shape(ModelConfig(config=config), cache_dir=tmp_path) == shape  # cached as is
