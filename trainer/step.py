"""One optimizer step: micro-batches with accumulation, token-weighted over the global batch."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from trainer.backends import Backend
from trainer.dist import all_reduce_sum
from trainer.loss import IGNORE_INDEX, compute_loss


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    step_time_s: float


def train_step(
    model: torch.nn.Module,
    backend: Backend,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
) -> StepResult:
    """One optimizer step over this rank's micro-batches; the loss is reduced over all ranks."""
    start = time.perf_counter()
    local_targets = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    local_tokens = sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    global_targets, global_tokens = all_reduce_sum([local_targets, local_tokens], device)
    denominator = max(global_targets, 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        last = i == len(batches) - 1
        with backend.no_sync() if not last else contextlib.nullcontext():
            with backend.compute_context():
                micro_loss_sum, _ = compute_loss(model, batch)
            backend.backward(micro_loss_sum / denominator)
        loss_sum += micro_loss_sum.detach()
    grad_norm = backend.step()
    (total_loss,) = all_reduce_sum([float(loss_sum)], device)
    return StepResult(
        loss=total_loss / denominator,
        grad_norm=grad_norm,
        num_tokens=int(global_tokens),
        step_time_s=time.perf_counter() - start,
    )
