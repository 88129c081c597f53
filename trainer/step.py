"""One optimizer step: micro-batches with accumulation, token-weighted over the global batch."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from trainer.backends import Backend
from trainer.dist import all_reduce_sum
from trainer.loss import IGNORE_INDEX, compute_loss
from trainer.oom import NO_FAULTS, FaultInjector, StepAborted, agree, is_oom

T = TypeVar("T")


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
    faults: FaultInjector = NO_FAULTS,
) -> StepResult:
    """One optimizer step over this rank's micro-batches; the loss is reduced over all ranks.

    Raises StepAborted on every rank together when any rank ran out of memory; the caller drops
    the partial gradients and retries the step with smaller micro-batches.
    """
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
            # One agreement covers forward and the entry of backward (the injection point sits
            # before backward's collectives); a second one follows backward itself.
            micro_loss_sum = _guarded(
                "forward", device, _forward_then_enter_backward, model, backend, batch, faults
            )
            _guarded("backward", device, backend.backward, micro_loss_sum / denominator)
        loss_sum += micro_loss_sum.detach()
        del micro_loss_sum
    failed: BaseException | None = None
    grad_norm = float("nan")
    try:
        grad_norm = _optimizer_step(backend, faults)
    except Exception as err:
        failed = _oom_or_raise(err)
    # The optimizer's agreement rides on the loss reduction: one collective for both.
    total_loss, num_failed = all_reduce_sum([float(loss_sum), float(failed is not None)], device)
    if num_failed:
        raise StepAborted(getattr(failed, "oom_phase", "optimizer"), failed)
    return StepResult(
        loss=total_loss / denominator,
        grad_norm=grad_norm,
        num_tokens=int(global_tokens),
        step_time_s=time.perf_counter() - start,
    )


def _forward_then_enter_backward(model, backend: Backend, batch, faults: FaultInjector):
    faults.at("forward")
    with backend.compute_context():
        loss_sum, _ = compute_loss(model, batch)
    faults.at("backward")
    return loss_sum


def _optimizer_step(backend: Backend, faults: FaultInjector) -> float:
    faults.at("optimizer")
    return backend.step()


def _guarded(phase: str, device: torch.device, fn: Callable[..., T], *args: Any) -> T:
    """Run fn; an OOM on any rank becomes StepAborted on every rank (one scalar collective)."""
    failed: BaseException | None = None
    result: Any = None
    try:
        result = fn(*args)
    except Exception as err:
        failed = _oom_or_raise(err)
    agree(failed, phase, device)
    return result


def _oom_or_raise(err: Exception) -> BaseException:
    if not is_oom(err):
        raise err
    err.__traceback__ = None  # the traceback pins the activations we want freed
    return err
