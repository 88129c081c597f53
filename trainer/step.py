"""One optimizer step: micro-batches with accumulation, the objective's loss a mean over the
units of the whole global batch (target tokens; preference pairs)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from trainer.backends import Backend
from trainer.objectives import NEXT_TOKEN, Objective
from trainer.observe.phases import OPTIMIZER, mark_in_profile
from trainer.runtime.dist import all_reduce_sum
from trainer.runtime.oom import NO_FAULTS, FaultInjector, OutOfMemoryInStep, agree, is_oom

T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    step_time_s: float
    stats: dict[str, float] = field(default_factory=dict)  # the objective's (rewards)


def train_step(
    model: torch.nn.Module,
    backend: Backend,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    faults: FaultInjector = NO_FAULTS,
    objective: Objective = NEXT_TOKEN,
    token_group: Any = None,
) -> StepResult:
    """One optimizer step over this rank's micro-batches; the loss is reduced over the ranks of
    `token_group` (None: all; a tensor group's ranks hold the same tokens, counted once).

    Raises StepAborted on every rank together when any rank ran out of memory up to the entry of
    the optimizer step; the caller drops the partial gradients and retries the step with smaller
    micro-batches. An OOM inside the optimizer step raises OutOfMemoryInStep on that rank only.
    """
    start = time.perf_counter()
    local_units = sum(objective.units(b) for b in batches)
    local_tokens = sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    global_units, global_tokens = all_reduce_sum([local_units, local_tokens], device, token_group)
    denominator = max(global_units, 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stats_sum = None
    for i, batch in enumerate(batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        last = i == len(batches) - 1
        with accumulation_context(backend, last):
            # One agreement covers forward and the entry of backward (the injection point sits
            # before backward's collectives); a second one follows backward itself and, after
            # the last micro-batch, the entry of the optimizer step: an OOM there on one rank
            # is known to every rank before any of them enters the step's collectives.
            micro_loss_sum, stats = _guarded(
                "forward",
                device,
                _forward_then_enter_backward,
                model,
                backend,
                batch,
                faults,
                objective,
            )
            backward = _backward_then_enter_optimizer if last else _backward
            _guarded("backward", device, backward, backend, micro_loss_sum / denominator, faults)
        loss_sum += micro_loss_sum.detach()
        stats_sum = stats if stats_sum is None else stats_sum + stats
        del micro_loss_sum
    mark_in_profile(OPTIMIZER)
    try:
        grad_norm = backend.step()
    except Exception as err:
        # Past the last agreement: a peer may already wait in the step's collectives, and a
        # retry could apply part of the update twice. Give up without another collective.
        raise OutOfMemoryInStep(_oom_or_raise(err)) from None
    stats_list = [] if stats_sum is None else stats_sum.tolist()
    total_loss, *total_stats = all_reduce_sum([float(loss_sum), *stats_list], device, token_group)
    return StepResult(
        loss=total_loss / denominator,
        grad_norm=grad_norm,
        num_tokens=int(global_tokens),
        step_time_s=time.perf_counter() - start,
        stats=objective.summary(total_stats, denominator),
    )


def accumulation_context(backend: Backend, last: bool) -> contextlib.AbstractContextManager:
    """Every micro-batch but the last of a step accumulates without gradient sync."""
    return contextlib.nullcontext() if last else backend.no_sync()


def micro_batch_loss(
    model: torch.nn.Module, backend: Backend, batch, objective: Objective = NEXT_TOKEN
) -> torch.Tensor:
    """One micro-batch's forward and summed loss, under the backend's compute context."""
    return micro_batch_loss_and_stats(model, backend, batch, objective)[0]


def micro_batch_loss_and_stats(
    model: torch.nn.Module, backend: Backend, batch, objective: Objective
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The objective's summed loss and stats of one micro-batch, under the compute context."""
    with backend.compute_context():
        return objective.loss_sum(model, batch)


def _forward_then_enter_backward(
    model, backend: Backend, batch, faults: FaultInjector, objective: Objective
):
    faults.at("forward")
    result = micro_batch_loss_and_stats(model, backend, batch, objective)
    faults.at("backward")
    return result


def _backward(backend: Backend, loss: torch.Tensor, faults: FaultInjector) -> None:
    backend.backward(loss)


def _backward_then_enter_optimizer(
    backend: Backend, loss: torch.Tensor, faults: FaultInjector
) -> None:
    backend.backward(loss)
    faults.at("optimizer")


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
