"""The training objective: summed next-token cross-entropy, so the engine can weight by tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(sum of token losses, number of target tokens) for one micro-batch.

    Labels are aligned with input_ids (not shifted); position t predicts labels[t + 1]. The logits
    are upcast to fp32 for the loss, as HF does: the estimator counts that copy.
    """
    labels = batch["labels"]
    logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
    targets = labels[:, 1:]
    loss_sum = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, int((targets != IGNORE_INDEX).sum())
