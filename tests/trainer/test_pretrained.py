"""Reading pretrained weights per rank from safetensors (trainer/model/pretrained.py): the parts a
rank reads are the checkpoint's values in the dtype it keeps, names map as transformers maps them,
and formats it cannot read are left to transformers. The two-rank loads (FSDP shards, ZeRO-3
partitions, rank 0's host peak) are checked in tests/trainer/test_distributed.py."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY_LLAMA
from trainer.core.config import ModelConfig
from trainer.model.build import HFModelFactory
from trainer.model.pretrained import SafetensorsCheckpoint, checkpoint_keys, resolve_checkpoint


def _model(**overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    params = {k: v for k, v in {**TINY_LLAMA, **overrides}.items() if k != "model_type"}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**params), dtype=torch.float32)


def test_rows_and_flat_ranges_are_read_converted_to_fp32(tmp_path):
    _model().to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    ckpt = SafetensorsCheckpoint.find(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    stored = {}
    for f in tmp_path.glob("*.safetensors"):
        stored.update(load_file(f))
    assert set(ckpt.entries) == set(stored)
    for key, want in stored.items():
        got = torch.empty(want.shape, dtype=torch.float32)
        assert ckpt.read(key, got) == 2 * want.numel()  # bf16 bytes read
        assert torch.equal(got, want.float()), key
    key = "model.layers.1.mlp.down_proj.weight"  # 32 x 64: an FSDP shard is rows 16..31
    rows = torch.empty(16, 64)
    ckpt.read(key, rows, start=16 * 64)
    assert torch.equal(rows, stored[key][16:].float())
    flat = torch.empty(100)  # a ZeRO-3 partition: a flat range across rows
    ckpt.read(key, flat, start=1000)
    assert torch.equal(flat, stored[key].flatten()[1000:1100].float())


def test_keys_without_the_base_prefix_and_tied_heads_map(tmp_path):
    model = _model(tie_word_embeddings=True)
    base = {
        k.removeprefix("model."): v for k, v in model.state_dict().items() if k != "lm_head.weight"
    }
    save_file({k: v.contiguous() for k, v in base.items()}, tmp_path / "model.safetensors")
    keys = checkpoint_keys(model, SafetensorsCheckpoint.find(tmp_path))
    assert keys["model.embed_tokens.weight"] == "embed_tokens.weight"
    assert "lm_head.weight" not in keys  # tied: the embedding, read once
    # an untied head missing from the checkpoint: not mappable, transformers loads it instead
    assert checkpoint_keys(_model(), SafetensorsCheckpoint.find(tmp_path)) is None


def test_a_bin_checkpoint_is_left_to_transformers(tmp_path):
    model = _model()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert resolve_checkpoint(str(tmp_path), None) is None
    # ... which still loads it (the rank-0 path of sharded rungs, and every replica)
    factory = HFModelFactory(ModelConfig(name_or_path=str(tmp_path)), seed=0)
    assert factory.pretrained_checkpoint() is None
    loaded = factory.build("cpu").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
