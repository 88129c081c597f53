"""What the loss rewards (`objective.type`): next-token cross-entropy (sft), or a preference
objective over {prompt, chosen, rejected} pairs (dpo, orpo, simpo; docs/preference.md).

An objective is a loss over one micro-batch, whatever the backend: `loss_sum` gives the sum of
its per-unit losses (sft: per target token; preference: per pair) and the step divides by the
units of the whole global batch (`units`, counted before any forward), so the update does not
depend on how the batch is cut into ranks and micro-batches. `stats` are sums over the same
units, reduced with the loss (the preference objectives' rewards).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from trainer.core.config import JobConfig
from trainer.loss import IGNORE_INDEX, compute_loss, targets_of
from trainer.objectives.preference import PreferenceObjective

Batch = dict[str, torch.Tensor]


class Objective(Protocol):
    preference: bool

    def units(self, batch: Batch) -> int:
        """What the loss is a mean over, in this micro-batch (target tokens, or pairs)."""
        ...

    def loss_sum(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the summed loss, the summed stats or None) of one micro-batch."""
        ...

    def summary(self, stats: list[float], num_units: float) -> dict[str, float]:
        """The metrics.jsonl entries of the global batch's summed stats."""
        ...


class NextToken:
    """sft: summed next-token cross-entropy, a mean over the global batch's target tokens."""

    preference = False

    def units(self, batch: Batch) -> int:
        return int((targets_of(batch) != IGNORE_INDEX).sum())

    def loss_sum(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, None]:
        return compute_loss(model, batch), None

    def summary(self, stats: list[float], num_units: float) -> dict[str, float]:
        return {}


NEXT_TOKEN = NextToken()


def build_objective(cfg: JobConfig, reference=None) -> Objective:
    """The objective of `objective.type`; `reference` is DPO's (trainer/objectives/reference.py)."""
    if not cfg.objective.preference:
        return NEXT_TOKEN
    return PreferenceObjective(cfg.objective, reference)
