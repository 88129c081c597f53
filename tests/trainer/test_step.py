"""The optimizer step on the single backend: accumulation equivalence and token weighting."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.conftest import TINY_LLAMA
from trainer.backends import BackendContext, OptimizerSpec, build_backend
from trainer.core.config import build_config
from trainer.loss import IGNORE_INDEX
from trainer.model.build import HFModelFactory, decoder_layers, set_activation_checkpointing
from trainer.step import train_step

SEQ = 16


def _backend(tmp_path, micro: int, accum: int, precision: str = "fp32", ac: str = "none"):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    cfg = build_config(
        {
            "model": {"config": TINY_LLAMA, "tokenizer": str(tmp_path)},
            "data": {"path": str(data), "seq_len": SEQ},
            "train": {"global_batch_size": micro * accum, "micro_batch_size": micro},
            "strategy": "single",
        }
    )
    ctx = BackendContext(
        cfg=cfg,
        device=torch.device("cpu"),
        rank=0,
        local_rank=0,
        world_size=1,
        precision=precision,
        activation_checkpointing=ac,
        micro_batch_size=micro,
        grad_accum=accum,
    )
    backend = build_backend("single", ctx)
    optim = OptimizerSpec(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    model = backend.setup(HFModelFactory(cfg.model, seed=0), optim)
    return model, backend


def _global_batch(num_rows: int = 4) -> dict[str, torch.Tensor]:
    """Rows with very different numbers of target tokens (padding and prompt masking)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (num_rows, SEQ), generator=g)
    labels = ids.clone()
    doc_ids = torch.zeros_like(ids)
    for row, num_valid in enumerate([SEQ, 5, 11, 3][:num_rows]):
        labels[row, num_valid:] = IGNORE_INDEX
        doc_ids[row, num_valid:] = -1
    labels[1, :3] = IGNORE_INDEX  # a prompt whose tokens carry no loss
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.arange(SEQ).repeat(num_rows, 1),
        "doc_ids": doc_ids,
    }


def _split(batch: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + micro] for k, v in batch.items()} for i in range(0, n, micro)]


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_accumulation_4x1_equals_1x4(tmp_path):
    batch = _global_batch()
    model_a, backend_a = _backend(tmp_path, micro=1, accum=4)
    model_b, backend_b = _backend(tmp_path, micro=4, accum=1)
    before = _params(model_a)
    assert torch.equal(before, _params(model_b))
    for _ in range(3):
        res_a = train_step(model_a, backend_a, _split(batch, 1), torch.device("cpu"))
        res_b = train_step(model_b, backend_b, _split(batch, 4), torch.device("cpu"))
        assert abs(res_a.loss - res_b.loss) <= 1e-5 * abs(res_b.loss)
        assert abs(res_a.grad_norm - res_b.grad_norm) <= 1e-5 * res_b.grad_norm
    after_a, after_b = _params(model_a), _params(model_b)
    update_a, update_b = after_a - before, after_b - before
    assert update_b.abs().max() > 1e-4  # the step really moved the weights
    rel = (update_a - update_b).norm() / update_b.norm()
    assert rel <= 1e-5, f"accumulated update differs by {rel:.2e} relative"


def test_loss_is_token_weighted_over_the_global_batch(tmp_path):
    """Uneven padding: the loss is total token loss / total target tokens, not a mean of means."""
    batch = _global_batch()
    model, backend = _backend(tmp_path, micro=1, accum=4)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        token_losses = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).view_as(targets)
        mask = targets != IGNORE_INDEX
        expected = float(token_losses[mask].mean())
        mean_of_row_means = float(
            torch.stack([token_losses[r][mask[r]].mean() for r in range(4)]).mean()
        )
    assert abs(expected - mean_of_row_means) > 1e-3  # the two definitions really differ here
    result = train_step(model, backend, _split(batch, 1), torch.device("cpu"))
    assert abs(result.loss - expected) <= 1e-6 * expected
    assert result.num_tokens == int((batch["doc_ids"] >= 0).sum())


def test_bf16_step_stays_close_to_fp32(tmp_path):
    batch = _global_batch()
    model_32, backend_32 = _backend(tmp_path, micro=2, accum=2, precision="fp32")
    model_16, backend_16 = _backend(tmp_path, micro=2, accum=2, precision="bf16")
    res_32 = train_step(model_32, backend_32, _split(batch, 2), torch.device("cpu"))
    res_16 = train_step(model_16, backend_16, _split(batch, 2), torch.device("cpu"))
    assert abs(res_32.loss - res_16.loss) <= 2e-2 * res_32.loss
    # master weights stay fp32 under mixed precision
    assert all(p.dtype == torch.float32 for p in model_16.parameters())


def _count_layer_forwards(model: torch.nn.Module) -> list[int]:
    """Forward calls of each decoder layer, counted from now on, recomputation included (which
    runs no module hooks: the layer's `forward` itself is counted)."""
    calls = []
    for i, layer in enumerate(decoder_layers(model)):
        calls.append(0)
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)

        def counted(*args, _forward=inner.forward, _i=i, **kwargs):
            calls[_i] += 1
            return _forward(*args, **kwargs)

        inner.forward = counted
    return calls


def test_the_back_off_can_raise_checkpointing_on_a_built_model(tmp_path):
    """set_activation_checkpointing switches recomputation on a model built with `none`."""
    model, backend = _backend(tmp_path, micro=2, accum=2, ac="none")
    set_activation_checkpointing(model, "full")
    calls = _count_layer_forwards(model)
    train_step(model, backend, _split(_global_batch(), 2), torch.device("cpu"))
    assert calls == [4, 4]


def test_activation_checkpointing_changes_memory_not_math(tmp_path):
    """full / selective recompute layers in backward: same loss and same update as none."""
    batch = _global_batch()
    results = {}
    for level in ("none", "selective", "full"):
        model, backend = _backend(tmp_path, micro=2, accum=2, ac=level)
        calls = _count_layer_forwards(model)
        before = _params(model)
        res = train_step(model, backend, _split(batch, 2), torch.device("cpu"))
        results[level] = (res.loss, _params(model) - before)
        # two micro-batches: a layer runs once per micro-batch, twice if it is recomputed
        assert calls == {"none": [2, 2], "selective": [4, 2], "full": [4, 4]}[level]
    loss_none, update_none = results["none"]
    for level in ("selective", "full"):
        loss, update = results[level]
        assert abs(loss - loss_none) <= 1e-6 * loss_none
        assert (update - update_none).norm() <= 1e-5 * update_none.norm()
