"""The out-of-memory back-off inside the process: what the engine does when a step or an
evaluation runs out of memory on any rank, without changing what is learned.

A step halves the micro-batch (the accumulation grows to keep the global batch); at micro-batch 1
it switches on chunked loss, then activation offload, then recomputes more layers, up to `full`.
An evaluation halves its batch. When nothing is left, `OutOfMemoryGaveUp` carries the step to the
engine, which writes oom-report.json (`report_oom`) and exits 75 so the supervisor climbs a rung.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.backends import Backend, BackendContext
from trainer.core.contract import EXIT_OOM, PLAN_FILE
from trainer.core.strategies import AC_LEVELS
from trainer.evaluate import evaluate
from trainer.memory.levers import LEVER_NAMES
from trainer.model.build import set_activation_checkpointing
from trainer.objectives import NEXT_TOKEN, Objective
from trainer.parallel.split import BatchSplit
from trainer.runtime.dist import all_reduce_max, all_reduce_sum
from trainer.runtime.oom import (
    FaultInjector,
    OutOfMemoryInStep,
    StepAborted,
    free_memory,
    memory_summary,
    write_oom_report,
)
from trainer.step import train_step

log = logging.getLogger(__name__)


class OutOfMemoryGaveUp(Exception):
    def __init__(self, aborted: StepAborted, num_backoffs: int):
        super().__init__(str(aborted))
        self.aborted = aborted
        self.num_backoffs = num_backoffs


def _halved(size: int, per_rank: int) -> int | None:
    """The largest divisor of per_rank at most half of size (None at 1)."""
    for candidate in range(size // 2, 0, -1):
        if per_rank % candidate == 0:
            return candidate
    return None


def step_with_backoff(
    model: torch.nn.Module,
    backend: Backend,
    data: Any,
    split: BatchSplit,
    step: int,
    ctx: BackendContext,
    faults: FaultInjector,
    objective: Objective = NEXT_TOKEN,
):
    """Run the step; on an OOM on any rank, all ranks halve the micro-batch and redo it; at
    micro-batch 1 they switch on chunked loss, then activation offload, then raise the
    activation checkpointing level, up to `full` (each keeps the math)."""
    num_backoffs = 0
    while True:
        batches = [
            split.sliced(batch)
            for batch in data.train.micro_batches(
                step,
                split.data_rank,
                split.dims.data,
                split.micro_batch_size,
                ctx.cfg.train.global_batch_size,
            )
        ]
        try:
            return train_step(
                model, backend, batches, ctx.device, faults, objective, split.token_group
            )
        except StepAborted as err:
            del batches
            backend.drop_grads()
            split.levers.drop_partial_step()
            free_memory(ctx.device)
            smaller = _halved(split.micro_batch_size, split.per_rank)
            if smaller is None and (lever := split.levers.next_off()) is not None:
                num_backoffs += 1
                log.warning(
                    "step %d: out of memory in %s at micro-batch 1; retrying with %s on",
                    step + 1,
                    err.phase,
                    LEVER_NAMES[lever],
                )
                split.levers.set(lever, True)
                continue
            if smaller is None:  # at micro-batch 1: recompute more layers, if any are left
                level = split.activation_checkpointing
                if level == AC_LEVELS[-1]:
                    raise OutOfMemoryGaveUp(err, num_backoffs) from None
                higher = AC_LEVELS[AC_LEVELS.index(level) + 1]
                num_backoffs += 1
                log.warning(
                    "step %d: out of memory in %s at micro-batch 1; retrying with activation "
                    "checkpointing %s (was %s)",
                    step + 1,
                    err.phase,
                    higher,
                    level,
                )
                set_activation_checkpointing(model, higher)
                split.activation_checkpointing = higher
                continue
            num_backoffs += 1
            log.warning(
                "step %d: out of memory in %s; retrying with micro-batch %d x accumulation %d "
                "(was %d x %d); the global batch is unchanged",
                step + 1,
                err.phase,
                smaller,
                split.per_rank // smaller,
                split.micro_batch_size,
                split.grad_accum,
            )
            split.micro_batch_size = smaller
            backend.set_micro_batch(smaller, split.grad_accum)


def evaluate_with_backoff(
    model: torch.nn.Module,
    backend: Backend,
    eval_set: Any,
    split: BatchSplit,
    ctx: BackendContext,
    faults: FaultInjector,
    objective: Objective = NEXT_TOKEN,
) -> dict[str, float]:
    """Evaluate; an OOM halves the eval batch and starts the evaluation over; at eval batch 1
    it gives up like a training step (OutOfMemoryGaveUp: report, exit 75, climb)."""
    num_backoffs = 0
    while True:
        batches = eval_set.batches(split.eval_batch_size, split.data_rank, split.dims.data)
        try:
            return evaluate(
                model,
                (split.sliced(b) for b in itertools.islice(batches, ctx.cfg.train.eval_batches)),
                backend.compute_context,
                ctx.device,
                faults,
                split.sequence_group,
                objective,
                split.token_group,
            )
        except StepAborted as err:
            free_memory(ctx.device)
            if split.eval_batch_size == 1:
                raise OutOfMemoryGaveUp(err, num_backoffs) from None
            num_backoffs += 1
            split.eval_batch_size //= 2
            log.warning("eval: out of memory; eval batch halved to %d", split.eval_batch_size)


def report_oom(
    run_dir: Path,
    err: OutOfMemoryGaveUp,
    step: int,
    split: BatchSplit,
    backend: Backend,
    ctx: BackendContext,
) -> None:
    """oom-report.json for the supervisor, which re-plans one rung up from it (all ranks)."""
    failing = all_reduce_sum(
        [
            1.0 if (r == ctx.rank and err.aborted.local_error) else 0.0
            for r in range(ctx.world_size)
        ],
        ctx.device,
    )
    measured = int(all_reduce_max(backend.memory_stats()["peak_device_bytes"], ctx.device))
    if ctx.rank != 0:
        return
    ranks = [r for r, v in enumerate(failing) if v > 0]
    error = err.aborted.local_error or err.aborted
    write_report(
        run_dir, err.aborted.phase, error, ranks, measured, err.num_backoffs, step, split, ctx
    )


def report_oom_alone(
    run_dir: Path,
    err: OutOfMemoryInStep,
    step: int,
    split: BatchSplit,
    backend: Backend,
    ctx: BackendContext,
) -> None:
    """The report of a rank that ran out of memory inside the optimizer step: written by that
    rank without any collective (the others may be inside one); they are stopped by torchrun."""
    measured = int(backend.memory_stats()["peak_device_bytes"])
    write_report(run_dir, err.phase, err.local_error, [ctx.rank], measured, 0, step, split, ctx)


def write_report(
    run_dir: Path,
    phase: str,
    error: BaseException,
    ranks: list[int],
    measured_peak_bytes: int,
    num_backoffs: int,
    step: int,
    split: BatchSplit,
    ctx: BackendContext,
) -> None:
    plan_path = run_dir / PLAN_FILE
    estimate = json.loads(plan_path.read_text()).get("estimate", {}) if plan_path.exists() else {}
    report = {
        "step": step + 1,
        "phase": phase,
        "strategy": ctx.cfg.strategy,
        "world_size": ctx.world_size,
        "micro_batch_size": split.micro_batch_size,
        "activation_checkpointing": split.activation_checkpointing,
        **(split.levers.state() if split.levers else {}),
        "num_backoffs": num_backoffs,
        "ranks": ranks,
        "error": str(error),
        # what the measurement is comparable with: allocator peak on CUDA, process RSS on CPU
        "estimated_peak_bytes": estimate.get("device", {}).get(
            "peak_tensor_bytes" if ctx.device.type == "cuda" else "total_bytes"
        ),
        "measured_peak_bytes": measured_peak_bytes,
        "memory": memory_summary(ctx.device),
    }
    path = write_oom_report(run_dir, report, ctx.rank)
    log.error(
        "out of memory at step %d on %s in %s at micro-batch %d: wrote %s (exit %d)",
        step + 1,
        ctx.cfg.strategy,
        phase,
        split.micro_batch_size,
        path,
        EXIT_OOM,
    )
