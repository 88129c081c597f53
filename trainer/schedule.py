"""Learning-rate schedule: linear warmup, then cosine, linear or constant decay to a floor."""

from __future__ import annotations

import math

from trainer.core.config import TrainConfig


def lr_at(train: TrainConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based); a pure function, so resume is exact."""
    peak = train.lr
    if step < train.warmup_steps:
        return peak * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return peak
    floor = peak * train.min_lr_ratio
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    if train.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
