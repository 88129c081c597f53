"""DPO's reference: where each sequence's reference log-probability comes from (the planner's
choice, trainer/core/methods.py `reference_source`, shown in the plan as `reference`). Both are
exact: the reference is the model training starts from.

- `AdaptersOff` (lora, qlora): the same model with its adapters switched off (peft's
  `disable_adapter`), in a no-grad forward of each micro-batch before the policy's. No copy of
  the weights; one more forward per micro-batch.
- `Precomputed` (full fine-tunes): one no-grad pass over every pair (training and held-out)
  with the initial weights, before step 1 and before a resume loads a checkpoint, each rank a
  share of the pairs, joined over the ranks. The log-probs are cached beside the tokenised data
  (keyed by the data, the model's weights, seq_len, precision and seed) and read back by pair
  index, so a change of micro-batch, rung or world size, and a resume, read the same numbers.
  The cache key holds everything the numbers depend on, the base's every byte included
  (trainer/objectives/reference_key.py); a checkpoint keeps the base's identity and a resume
  from another base is refused.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainer.core.config import JobConfig
from trainer.core.methods import reference_source
from trainer.data.documents import data_cache_dir
from trainer.data.pairs import PAIR_INDEX, PairWindows
from trainer.loss import row_loss_sums
from trainer.objectives.reference_key import reference_cache_key
from trainer.runtime.dist import all_reduce_max, is_distributed

log = logging.getLogger(__name__)
Batch = dict[str, torch.Tensor]


class AdaptersOff:
    """The base model under the adapters: a no-grad forward with them switched off."""

    def row_losses(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        from peft import PeftModel  # an optional extra (oomless[lora]); present under lora

        peft_model = next(m for m in model.modules() if isinstance(m, PeftModel))
        with torch.no_grad(), peft_model.disable_adapter():
            return row_loss_sums(model, batch)


class Precomputed:
    """The reference's summed token losses of every pair's two rows, looked up by pair index."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # [pairs, 2] fp64: (chosen, rejected) of pair i

    def row_losses(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        rows = self.table[batch[PAIR_INDEX].clamp(min=0)].reshape(-1)  # interleaved, as the rows
        return rows.to(torch.float32)


def build_reference(
    cfg: JobConfig,
    model: nn.Module,
    compute_context: Callable[[], AbstractContextManager],
    data,
    share: tuple[int, int, int],
    device: torch.device,
) -> AdaptersOff | Precomputed | None:
    """DPO's reference for this job; the precomputed pass runs (or its cache is read) here, while
    `model` holds the initial weights. `share`: (data rank, data ranks, pairs per forward)."""
    source = reference_source(cfg.objective.type, cfg.finetune.method)
    if source is None:
        return None
    if source == "adapters_off":
        return AdaptersOff()
    sets = [data.train.windows] + ([data.eval.windows] if data.eval is not None else [])
    path = _cache_path(cfg, data, sets)
    missing = all_reduce_max(float(not path.is_file()), device)  # every rank computes, or none
    if not missing:
        log.info("reference: precomputed log-probs read from %s", path)
        table = np.load(path, allow_pickle=False)
        return Precomputed(torch.from_numpy(table).to(device))
    start = time.perf_counter()
    table = _reference_pass(model, compute_context, sets, share, device)
    if not is_distributed() or dist.get_rank() == 0:
        _save(path, table.cpu().numpy())
    log.info(
        "reference: one no-grad pass over %d pairs in %.1f s (cached at %s)",
        len(table),
        time.perf_counter() - start,
        path,
    )
    return Precomputed(table)


@torch.no_grad()
def _reference_pass(
    model: nn.Module,
    compute_context: Callable[[], AbstractContextManager],
    sets: list[PairWindows],
    share: tuple[int, int, int],
    device: torch.device,
) -> torch.Tensor:
    """[pairs, 2] summed token losses of every pair: each data rank forwards its share (the same
    number of forwards on every rank: the sharded rungs' forwards are collectives), then one
    all-reduce joins them."""
    data_rank, num_ranks, per_forward = share
    total = sum(len(s) for s in sets)
    table = torch.zeros(total, 2, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        for windows in sets:
            mine = list(range(data_rank, len(windows), num_ranks))
            num_forwards = math.ceil(math.ceil(len(windows) / num_ranks) / per_forward)
            for f in range(num_forwards):
                chunk = mine[f * per_forward : (f + 1) * per_forward]
                batch = windows.batch(chunk or [0])  # a rank with none left still joins
                batch = {k: v.to(device) for k, v in batch.items()}
                with compute_context():
                    losses = row_loss_sums(model, batch).view(-1, 2)
                if chunk:
                    table[batch[PAIR_INDEX]] = losses.double()
    finally:
        model.train(was_training)
    if is_distributed():
        dist.all_reduce(table)
    return table


def _cache_path(cfg: JobConfig, data, sets: list[PairWindows]) -> Path:
    """Beside the tokenised data, keyed by everything the reference's numbers depend on
    (trainer/objectives/reference_key.py). Rank 0 hashes (the base's files, once per version,
    cached) and tells the others."""
    digest = [None]
    if not is_distributed() or dist.get_rank() == 0:
        digest[0] = reference_cache_key(cfg, data, [len(s) for s in sets])
    if is_distributed():
        dist.broadcast_object_list(digest, src=0)
    return data_cache_dir(cfg.data) / "reference" / f"{digest[0]}.npy"


def _save(path: Path, table: np.ndarray) -> None:
    """Into the cache, whole or not at all (a temporary file renamed); a cache that cannot be
    written costs the pass again next time, nothing more."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, table, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        log.warning("reference: could not cache the log-probs at %s (%s)", path, err)
