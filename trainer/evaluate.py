"""Held-out evaluation: token-weighted loss and exact match per document, reduced over ranks;
for a preference objective, its loss and rewards over the held-out pairs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.loss import IGNORE_INDEX, targets_of
from trainer.objectives import NEXT_TOKEN, Objective
from trainer.runtime.dist import all_reduce_sum
from trainer.runtime.oom import NO_FAULTS, FaultInjector, agree, is_oom


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    compute_context: Callable[[], AbstractContextManager],
    device: torch.device,
    faults: FaultInjector = NO_FAULTS,
    sequence_group: Any = None,
    objective: Objective = NEXT_TOKEN,
    token_group: Any = None,
) -> dict[str, float]:
    """{'eval_loss', 'eval_exact_match'} over the given batches of every rank (a preference
    objective: {'eval_loss', 'eval_reward_margin', 'eval_reward_accuracy', ...}).

    A document counts as an exact match when argmax predicts every one of its target tokens
    under teacher forcing (for a prompt/completion task: the whole completion is right). Batches
    split along the sequence (`sequence_group`: the ranks holding the other slices) score a
    document from the counts of every slice.
    """
    if objective.preference:
        return _evaluate_pairs(
            model, batches, compute_context, device, faults, objective, token_group
        )
    was_training = model.training
    model.eval()
    loss_sum = num_tokens = num_docs = num_correct = 0.0
    try:
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            logits = _agreed_forward(compute_context, device, faults, _logits, model, batch)
            logits = logits.float()
            targets = targets_of(batch)
            loss_sum += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)),
                    targets.reshape(-1),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
            )
            has_target = targets != IGNORE_INDEX
            num_tokens += float(has_target.sum())
            # a target's document is its position's (nothing is predicted across documents)
            docs, correct = _exact_match_counts(
                logits.argmax(-1) == targets, has_target, batch["doc_ids"], sequence_group
            )
            num_docs += docs
            num_correct += correct
    finally:
        model.train(was_training)
    loss_sum, num_tokens, num_docs, num_correct = all_reduce_sum(
        [loss_sum, num_tokens, num_docs, num_correct], device, token_group
    )
    return {
        "eval_loss": loss_sum / max(num_tokens, 1.0),
        "eval_exact_match": num_correct / max(num_docs, 1.0),
    }


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits


def _agreed_forward(
    compute_context: Callable[[], AbstractContextManager],
    device: torch.device,
    faults: FaultInjector,
    forward: Callable[..., Any],
    *args: Any,
) -> Any:
    """`forward(*args)` under the compute context; an OOM on any rank is StepAborted on every
    rank."""
    result, failed = None, None
    try:
        faults.at("eval")
        with compute_context():
            result = forward(*args)
    except Exception as err:
        if not is_oom(err):
            raise
        err.__traceback__ = None
        failed = err
    agree(failed, "eval", device)
    return result


def _evaluate_pairs(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    compute_context: Callable[[], AbstractContextManager],
    device: torch.device,
    faults: FaultInjector,
    objective: Objective,
    token_group: Any = None,
) -> dict[str, float]:
    """The objective's loss and stats, means over the held-out pairs of every rank."""
    was_training = model.training
    model.eval()
    sums: list[float] = []
    try:
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss_sum, stats = _agreed_forward(
                compute_context, device, faults, objective.loss_sum, model, batch
            )
            values = [float(loss_sum), float(objective.units(batch)), *stats.tolist()]
            sums = values if not sums else [a + b for a, b in zip(sums, values, strict=True)]
    finally:
        model.train(was_training)
    loss_sum, num_pairs, *stats = all_reduce_sum(sums, device, token_group)
    summary = objective.summary(stats, num_pairs)
    return {"eval_loss": loss_sum / max(num_pairs, 1.0)} | {
        f"eval_{name}": value for name, value in summary.items()
    }


def _exact_match_counts(
    hit: torch.Tensor, has_target: torch.Tensor, doc_ids: torch.Tensor, sequence_group: Any
) -> tuple[float, float]:
    """(documents with targets, documents whose targets are all hit) in a [m, L] batch; with a
    sequence group, of the whole sequences (counted once, by the group's first rank)."""
    num_rows, length = hit.shape
    num_slices = dist.get_world_size(sequence_group) if sequence_group is not None else 1
    max_docs = length * num_slices + 1  # documents per row, at most
    # One bucket per (row, document); padding (doc id -1) and non-targets fall out via the masks.
    key = torch.arange(num_rows, device=hit.device)[:, None] * max_docs + doc_ids.clamp(min=-1) + 1
    key = key[has_target]
    misses = (~hit)[has_target].float()
    num_buckets = num_rows * max_docs
    targets_per_doc = torch.zeros(num_buckets, device=hit.device).index_add_(
        0, key, torch.ones_like(misses)
    )
    misses_per_doc = torch.zeros(num_buckets, device=hit.device).index_add_(0, key, misses)
    if sequence_group is not None:
        counts = torch.stack([targets_per_doc, misses_per_doc])
        dist.all_reduce(counts, group=sequence_group)
        if dist.get_rank(sequence_group) != 0:
            return 0.0, 0.0
        targets_per_doc, misses_per_doc = counts
    scored = targets_per_doc > 0
    return float(scored.sum()), float((scored & (misses_per_doc == 0)).sum())
