"""The training objective: summed next-token cross-entropy, so the engine can weight by tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.memory.chunked_loss import IGNORE_INDEX, chunked_head, shifted_targets

__all__ = [
    "IGNORE_INDEX",
    "compute_loss",
    "next_token_loss_sum",
    "row_loss_sums",
    "shifted_targets",
    "targets_of",
    "token_loss_sum",
]


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of token losses of one micro-batch (the step counts the target tokens once, for
    the whole global batch, before any forward: no host sync here).

    Labels are aligned with input_ids (not shifted); position t predicts labels[t + 1]. A
    batch split along the sequence (trainer/parallel/sequence.py) carries its `targets`
    instead, taken before the split.
    """
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch.get("position_ids")}
    targets = targets_of(batch)
    head = chunked_head(model)  # chunked loss on: the output layer computes it chunk by chunk
    if head is None:
        return token_loss_sum(model(**inputs).logits, targets)
    with head.loss_targets(targets):
        carrier = model(**inputs).logits
    return head.take_loss(carrier)


def row_loss_sums(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed token losses of each row of one micro-batch ([rows], fp32): minus each
    sequence's log-probability of its targets (the preference objectives' sequences)."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch.get("position_ids")}
    targets = targets_of(batch)
    head = chunked_head(model)
    if head is None:
        logits = model(**inputs).logits
        losses = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        return losses.view(targets.shape).sum(-1)
    with head.loss_targets(targets, per_row=True):
        carrier = model(**inputs).logits
    return head.take_loss(carrier)


def targets_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What each position of the batch predicts: its `targets`, else the shifted labels."""
    targets = batch.get("targets")
    return shifted_targets(batch["labels"]) if targets is None else targets


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of every position's prediction of the next label.

    The labels are shifted (the last position predicts nothing), not the logits: the loss reads
    the logits in place, so neither forward nor backward copies the tokens x vocab tensor for a
    slice. 16-bit logits are upcast to fp32 for the loss, as HF does: the estimator counts that
    copy.
    """
    return token_loss_sum(logits, shifted_targets(labels))


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of every position's logits against its target (fp32)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
