"""Tiled MLP (trainer/memory/tiled_mlp.py) on one process: the same loss and gradients as the plain
MLP, with a fraction of the activations saved for backward; the training runs with it on are in
tests/trainer/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch

from trainer.core.config import ConfigError
from trainer.loss import compute_loss
from trainer.memory.tiled_mlp import apply_tiled_mlp, tiled_mlp_chunk_tokens


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _step(model, batch, unique: bool = False) -> tuple[float, dict[str, torch.Tensor], int]:
    """(loss, gradients, bytes saved for backward during forward; with `unique` each tensor
    counted once)."""
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        saved[key if unique else len(saved)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads, sum(saved.values())


def test_tiled_mlp_gives_the_same_loss_and_gradients_with_less_saved() -> None:
    ids = torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(256).expand(2, -1)}
    plain = _model()
    loss, grads, saved = _step(plain, batch)
    tiled = _model()
    assert apply_tiled_mlp(tiled, None) == 32  # the hidden size by default
    assert tiled_mlp_chunk_tokens(tiled) == 32 and tiled_mlp_chunk_tokens(plain) is None
    tiled_loss, tiled_grads, tiled_saved = _step(tiled, batch)
    assert tiled_loss == pytest.approx(loss, abs=1e-5)
    for name, g in grads.items():
        assert torch.allclose(tiled_grads[name], g, atol=1e-5), name
    # per layer the plain MLP keeps gate, up and their product ([tokens, 512] each); tiled, the
    # input of each chunk: the model's saved bytes drop by more than half
    assert tiled_saved < 0.5 * saved, (tiled_saved, saved)


def test_a_model_without_mlp_modules_is_a_config_error() -> None:
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    with pytest.raises(ConfigError, match="memory.tiled_mlp"):
        apply_tiled_mlp(model, 4)


def test_recomputed_norms_give_the_same_gradients_and_save_4_bytes_per_token_and_unit_each():
    """With the tiled MLP every norm keeps only its input for backward
    (trainer/memory/tiled_mlp.py `apply_recomputed_norms`): bitwise the same loss and
    gradients, in bf16 (FSDP's 16-bit stream: an fp32 copy and the normalised output dropped,
    the 16-bit input kept) and fp32 (the normalised input dropped); 2 layers x 2 norms and the
    final one (the estimate's NORM_RECOMPUTED)."""
    from trainer.memory.tiled_mlp import apply_recomputed_norms
    from trainer.model.build import decoder_layers

    tokens, hidden = 256, 32
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(tokens)[None]}
    for dtype in (torch.bfloat16, torch.float32):
        plain, recomputed = _model().to(dtype), _model().to(dtype)
        apply_recomputed_norms(recomputed, decoder_layers(recomputed))
        loss, grads, saved = _step(plain, batch, unique=True)
        loss_r, grads_r, saved_r = _step(recomputed, batch, unique=True)
        assert loss_r == loss
        assert all(torch.equal(grads_r[name], g) for name, g in grads.items())
        # 4 bytes per token and unit, and each norm's rsqrt ([tokens, 1] fp32) and weight
        drop = saved - saved_r
        assert (
            5 * 4 * tokens * hidden <= drop <= 5 * (4 * tokens * hidden + 4 * tokens + 4 * hidden)
        )
