"""The training objective: summed next-token cross-entropy, so the engine can weight by tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.chunked_loss import IGNORE_INDEX, chunked_head

__all__ = ["IGNORE_INDEX", "compute_loss", "next_token_loss_sum", "shifted_targets"]


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of token losses of one micro-batch (the step counts the target tokens once, for
    the whole global batch, before any forward: no host sync here).

    Labels are aligned with input_ids (not shifted); position t predicts labels[t + 1].
    """
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch.get("position_ids")}
    head = chunked_head(model)  # chunked loss on: the output layer computes it chunk by chunk
    if head is None:
        return next_token_loss_sum(model(**inputs).logits, batch["labels"])
    with head.loss_targets(shifted_targets(batch["labels"])):
        carrier = model(**inputs).logits
    return head.take_loss(carrier)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """What each position predicts: the next label (the last position predicts nothing)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of every position's prediction of the next label.

    The labels are shifted (the last position predicts nothing), not the logits: the loss reads
    the logits in place, so neither forward nor backward copies the tokens x vocab tensor for a
    slice. 16-bit logits are upcast to fp32 for the loss, as HF does: the estimator counts that
    copy.
    """
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        shifted_targets(labels).reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
