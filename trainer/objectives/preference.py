"""The preference objectives on a micro-batch of pairs (rows interleaved: chosen, rejected,
...; trainer/data/pairs.py), each a mean over the pairs of the global batch. TRL's formulas
(`DPOTrainer` sigmoid loss, `CPOTrainer` simpo, `ORPOTrainer`), written here:

- dpo: -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), pi and ref each sequence's summed
  log-probability of its answer's tokens; the reference's come from `reference`.
  Rewards: beta * (pi - ref).
- simpo: -logsigmoid(beta * (pi_c / n_c - pi_r / n_r) - gamma), the log-probabilities averaged
  over each answer's tokens. Rewards: beta * pi / n.
- orpo: -pi_c / n_c - beta * logsigmoid(log odds(pi_c / n_c) - log odds(pi_r / n_r)), with log
  odds(p) = p - log(1 - exp(p)). The cross-entropy term is the chosen answer's mean over its
  tokens, per pair (TRL's is a mean over the chosen tokens of its whole batch: the two agree
  when the chosen answers are equally long); ours keeps one mean, over pairs, so it is the same
  however the batch is cut. Rewards: beta * pi / n.

Stats, summed over pairs: the reward margin (chosen - rejected), whether the chosen reward is
the larger, and the policy's summed log-probabilities of the chosen and rejected answers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.core.config import ObjectiveConfig
from trainer.data.pairs import PAIR_INDEX
from trainer.loss import IGNORE_INDEX, row_loss_sums, targets_of

Batch = dict[str, torch.Tensor]
STAT_NAMES = ("reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2. A mean
    log-probability of exactly 0 (an answer the model is certain of, in floating point) is
    taken as -1e-12 (log odds 27.6, no gradient), not as the infinite odds that make ORPO NaN."""
    x = x.clamp(max=-1e-12)
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PreferenceObjective:
    """dpo, orpo or simpo over the pairs of a micro-batch (module docstring)."""

    preference = True

    def __init__(self, cfg: ObjectiveConfig, reference=None):
        if cfg.needs_reference and reference is None:
            raise ValueError(f"objective.type={cfg.type} needs a reference")
        self.type = cfg.type
        self.beta = cfg.beta
        self.gamma = cfg.simpo_gamma
        self.reference = reference

    def units(self, batch: Batch) -> int:
        return int((batch[PAIR_INDEX] >= 0).sum())

    def loss_sum(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        ref = None
        if self.reference is not None:  # first: its no-grad forward is gone before the policy's
            ref = -self.reference.row_losses(model, batch).detach()
        logp = -row_loss_sums(model, batch)
        num_targets = (targets_of(batch) != IGNORE_INDEX).sum(-1).clamp(min=1)
        losses, rewards = self.pair_losses(logp, num_targets, ref)
        real = (batch[PAIR_INDEX] >= 0).to(losses.dtype)
        margin = (rewards[:, 0] - rewards[:, 1]).detach()
        stats = torch.stack(
            [
                margin * real,
                (margin > 0).to(real.dtype) * real,
                logp[0::2].detach() * real,
                logp[1::2].detach() * real,
            ]
        )
        return (losses * real).sum(), stats.sum(-1).double()

    def pair_losses(
        self, logp: torch.Tensor, num_targets: torch.Tensor, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([pairs] losses, [pairs, 2] chosen and rejected rewards) from the rows' summed
        log-probabilities (interleaved), their target counts and the reference's."""
        if self.type == "dpo":
            assert ref is not None
            rewards = self.beta * (logp - ref).view(-1, 2)
            return -F.logsigmoid(rewards[:, 0] - rewards[:, 1]), rewards
        mean = (logp / num_targets).view(-1, 2)
        rewards = (self.beta * mean).detach()
        chosen, rejected = mean[:, 0], mean[:, 1]
        if self.type == "simpo":
            return -F.logsigmoid(self.beta * (chosen - rejected) - self.gamma), rewards
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        return -chosen - self.beta * F.logsigmoid(log_odds), rewards

    def summary(self, stats: list[float], num_units: float) -> dict[str, float]:
        pairs = max(num_units, 1.0)
        return {name: value / pairs for name, value in zip(STAT_NAMES, stats, strict=True)}
