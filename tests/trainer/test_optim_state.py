"""The checkpoint's form of 8-bit AdamW state (trainer/optim.py), without a training: the same
moments whatever layout wrote them, re-quantised into the blocks the loading rung keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.backends import OptimizerSpec
from trainer.optim import (
    build_optimizer,
    canonical_8bit_moments,
    fp32_moments,
    load_8bit_moments,
)

bnb = pytest.importorskip("bitsandbytes")


def _stepped(shape: tuple[int, ...], seed: int = 0) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    """bitsandbytes' AdamW8bit on one replica parameter, after two steps."""
    torch.manual_seed(seed)
    p = nn.Parameter(torch.randn(shape))
    optimizer = build_optimizer(
        [p],
        OptimizerSpec(
            lr=1e-2,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            grad_clip=0.0,
            name="adamw_8bit",
        ),
    )
    for _ in range(2):
        p.grad = torch.randn(shape)
        optimizer.step()
    return p, optimizer


def _fp32_moments(p: nn.Parameter, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    F = bnb.functional
    return tuple(
        F.dequantize_blockwise(state[c], absmax=state[a], code=state[q], blocksize=256).view(
            p.shape
        )
        for c, a, q in (("state1", "absmax1", "qmap1"), ("state2", "absmax2", "qmap2"))
    )


def test_a_replica_saves_its_codes_and_an_fsdp_shard_is_given_them_as_fp32_moments():
    """A matrix whose rows do not hold whole blocks: a replica's codes run across rows. They are
    saved as they are (a replica resumes them bit for bit); a loader that keeps fp32 moments gets
    them dequantised."""
    p, optimizer = _stepped((64, 96))  # 6144 values: 8-bit here, blocks across rows
    state = optimizer.state[p]
    assert state["state1"].dtype == torch.uint8
    saved = canonical_8bit_moments(p, state)
    assert set(saved) == {"state1", "state2", "absmax1", "absmax2"}
    assert saved["absmax1"].shape == (24,)  # 6144 / 256 blocks over the flattened matrix
    moments = fp32_moments(p.shape, saved)
    exp_avg, exp_avg_sq = _fp32_moments(p, state)
    assert torch.equal(moments["exp_avg"], exp_avg)
    assert torch.equal(moments["exp_avg_sq"], exp_avg_sq)
    assert moments["exp_avg"].abs().max() > 0


def test_fp32_moments_are_quantised_back_into_the_blocks_the_loading_state_keeps():
    """Re-quantising lands on the same moments to 8-bit precision (a block whose largest value
    has no code of exactly 1.0 takes a slightly smaller scale, so a code may move by one)."""
    p, optimizer = _stepped((64, 96))
    before = _fp32_moments(p, optimizer.state[p])
    saved = canonical_8bit_moments(p, optimizer.state[p])
    q, fresh = _stepped((64, 96), seed=1)  # another state of the same layout, overwritten
    load_8bit_moments(fresh.state[q], saved)
    for got, want in zip(_fp32_moments(q, fresh.state[q]), before, strict=True):
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        assert (got - want).abs().mean() <= 1e-3 * want.abs().max()


def test_a_block_aligned_matrix_keeps_its_codes_and_block_scales_by_rows():
    p, optimizer = _stepped((32, 512))
    saved = canonical_8bit_moments(p, optimizer.state[p])
    assert saved["state1"].dtype == torch.uint8 and saved["absmax1"].shape == (32, 2)
    q, fresh = _stepped((32, 512), seed=1)
    load_8bit_moments(fresh.state[q], saved)
    assert torch.equal(fresh.state[q]["state2"], optimizer.state[p]["state2"])
    assert torch.equal(fresh.state[q]["absmax2"], optimizer.state[p]["absmax2"])


def test_fp32_moments_of_a_checkpoint_from_before_the_two_forms():
    """Its small tensors kept bitsandbytes' fp32 moments as state1/state2."""
    small = {"state1": torch.ones(4, 4), "state2": torch.full((4, 4), 2.0)}
    assert torch.equal(fp32_moments(torch.Size([4, 4]), small)["exp_avg_sq"], small["state2"])


@pytest.mark.parametrize("shape", [(256, 256), (40, 40)])  # 8-bit moments; fp32 (under 4096)
def test_bf16_pure_with_8bit_moments_rounds_its_updates_stochastically(shape):
    """Updates of 1e-5 to weights near 1.0 are 1/400 of a bf16 step there: rounded to nearest
    (bitsandbytes' own step) the weights never move; rounded stochastically they move by the
    update on average, as torchao's AdamW moves them under bf16_pure."""
    steps, lr = 100, 1e-5

    def mean_move(bf16_pure: bool) -> float:
        torch.manual_seed(0)
        p = nn.Parameter(torch.ones(shape, dtype=torch.bfloat16))
        spec = OptimizerSpec(
            lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_clip=0.0,
            name="adamw_8bit", bf16_pure=bf16_pure,
        )  # fmt: skip
        optimizer = build_optimizer([p], spec)
        for _ in range(steps):
            p.grad = torch.full(shape, 0.5, dtype=torch.bfloat16)
            optimizer.step()
        return float((1.0 - p.detach().float()).mean())

    assert abs(mean_move(bf16_pure=True) - steps * lr) <= 0.25 * steps * lr
    assert mean_move(bf16_pure=False) <= 0.1 * steps * lr
