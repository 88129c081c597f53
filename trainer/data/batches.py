"""Batches: documents packed into windows, the windows of each optimizer step chosen by the seed
and the step alone, the held-out set, and what the engine gets (`build_data`)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.core.config import ConfigError, JobConfig
from trainer.data.documents import (
    Documents,
    build_tokenizer,
    data_cache_dir,
    tokenize_all,
    tokenize_source,
)
from trainer.data.pairs import PAIR_INDEX, PairWindows, pair_subset
from trainer.loss import IGNORE_INDEX
from trainer.runtime.dist import after_rank0, slow_down

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Windows


@dataclass
class Windows:
    """Fixed-length training windows: [num_windows, seq_len] arrays."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, indices: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        return {
            "input_ids": torch.from_numpy(self.input_ids[idx]),
            "labels": torch.from_numpy(self.labels[idx]),
            "position_ids": torch.from_numpy(self.position_ids[idx]),
            "doc_ids": torch.from_numpy(self.doc_ids[idx]),
        }


def pack(docs: Documents, seq_len: int, pad_id: int, split_docs: bool, pack_docs: bool) -> Windows:
    """Lay documents into windows (see the module docstring)."""
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for i in range(docs.num_docs):
        ids, mask = docs.doc(i)
        while len(ids):
            room = seq_len - used
            if not pack_docs and rows[-1]:
                room = 0
            if len(ids) > room and not (split_docs and room >= 2):
                if rows[-1]:
                    rows.append([])
                    used = 0
                    continue
                ids, mask = ids[:seq_len], mask[:seq_len]  # longer than a window: truncated
            take = min(len(ids), seq_len - used)
            rows[-1].append((ids[:take], mask[:take]))
            used += take
            ids, mask = ids[take:], mask[take:]
            if used == seq_len:
                rows.append([])
                used = 0
    if not rows[-1]:
        rows.pop()
    n = len(rows)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((n, seq_len), dtype=np.int64)
    doc_ids = np.full((n, seq_len), -1, dtype=np.int64)
    for r, segments in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(segments):
            end = at + len(ids)
            input_ids[r, at:end] = ids
            lab = np.where(mask, ids, IGNORE_INDEX)
            lab[0] = IGNORE_INDEX  # nothing predicts a document's first token
            labels[r, at:end] = lab
            position_ids[r, at:end] = np.arange(len(ids))
            doc_ids[r, at:end] = d
            at = end
        position_ids[r, at:] = np.arange(seq_len - at)  # padding: harmless positions
    return Windows(input_ids, labels, position_ids, doc_ids)


# ---------------------------------------------------------------------------------------------
# Streams


class TrainStream:
    """Training windows addressed by optimizer step (stateless: the step is the position)."""

    def __init__(self, windows: Windows, seed: int):
        self.windows = windows
        self.seed = seed
        self.num_windows = len(windows)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            rng = np.random.default_rng([self.seed, epoch])
            self._perms = {epoch: rng.permutation(self.num_windows)}
        return self._perms[epoch]

    def global_batch(self, step: int, global_batch_size: int) -> list[int]:
        """The window indices of step `step`'s global batch, in order."""
        out = []
        for g in range(step * global_batch_size, (step + 1) * global_batch_size):
            epoch, i = divmod(g, self.num_windows)
            out.append(int(self._perm(epoch)[i]))
        return out

    def micro_batches(
        self, step: int, rank: int, world_size: int, micro_batch_size: int, global_batch_size: int
    ) -> list[dict[str, torch.Tensor]]:
        """This rank's contiguous share of the step's global batch, cut into micro-batches."""
        per_rank = global_batch_size // world_size
        mine = self.global_batch(step, global_batch_size)[rank * per_rank : (rank + 1) * per_rank]
        return [
            self.windows.batch(mine[i : i + micro_batch_size])
            for i in range(0, per_rank, micro_batch_size)
        ]


class EvalSet:
    """Held-out windows, the same every time, sharded by rank."""

    def __init__(self, windows: Windows):
        self.windows = windows
        self.num_windows = len(windows)

    def batches(
        self, batch_size: int, rank: int, world_size: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Every rank yields the same number of batches (short ones padded with no-target rows)."""
        per_rank = -(-self.num_windows // world_size)
        mine = list(range(rank * per_rank, min((rank + 1) * per_rank, self.num_windows)))
        for i in range(0, per_rank, batch_size):
            chunk = mine[i : i + batch_size]
            batch = self.windows.batch(chunk) if chunk else None
            missing = min(batch_size, per_rank - i) - len(chunk)
            if missing:
                batch = _pad_rows(batch, missing, self.windows)
            yield batch


def _pad_rows(batch: dict[str, torch.Tensor] | None, n: int, w: Windows) -> dict[str, torch.Tensor]:
    filler = w.batch([0] * n)
    filler["labels"].fill_(IGNORE_INDEX)
    filler["doc_ids"].fill_(-1)
    if PAIR_INDEX in filler:
        filler[PAIR_INDEX].fill_(-1)
    if batch is None:
        return filler
    return {k: torch.cat([batch[k], filler[k]]) for k in batch}


@dataclass
class DataBundle:
    train: TrainStream
    eval: EvalSet | None
    fingerprint: str  # of the tokenised training data (checkpoints refuse a resume on other data)
    eval_fingerprint: str | None = None  # of the held-out data read from data.eval_path


def docs_fingerprint(docs: Documents) -> str:
    """Hash of tokenised documents: what the model learns from, whatever path or cache it came
    through."""
    h = hashlib.sha256()
    for name in ("tokens", "targets", "offsets"):
        h.update(np.ascontiguousarray(getattr(docs, name)).tobytes())
    return h.hexdigest()[:16]


def train_data_fingerprint(cfg: JobConfig) -> str:
    """`docs_fingerprint` of data.path, in this process (from the tokenised cache when there)."""
    data = cfg.data
    cache_dir = data_cache_dir(data)
    docs = tokenize_source(data.path, "data.path", data, build_tokenizer(cfg.model), cache_dir)
    return docs_fingerprint(docs)


def split_eval(
    cfg: JobConfig, train_docs: Documents, eval_docs: Documents | None
) -> tuple[Documents, Documents | None]:
    """Hold out `data.eval_fraction` of the training documents (of preference pairs: of the
    pairs) when there is no eval_path."""
    data = cfg.data
    if eval_docs is None and data.eval_fraction > 0:
        pairs = data.format == "preference"
        num_examples = train_docs.num_docs // 2 if pairs else train_docs.num_docs
        order = np.random.default_rng([cfg.train.seed, 7]).permutation(num_examples)
        num_eval = max(1, round(data.eval_fraction * num_examples))
        if num_eval >= num_examples:
            raise ConfigError(
                "data.eval_fraction", "leaves no training documents", "use a smaller fraction"
            )
        subset = pair_subset if pairs else Documents.subset
        eval_docs = subset(train_docs, np.sort(order[:num_eval]))
        train_docs = subset(train_docs, np.sort(order[num_eval:]))
    return train_docs, eval_docs


def build_data(cfg: JobConfig, tokenizer: Any) -> DataBundle:
    """Tokenise (rank 0 first, others then read its cache), split off eval, pack."""
    data = cfg.data

    def tokenize_first() -> tuple[Documents, Documents | None]:
        slow_down(cfg, "tokenize_s")
        return tokenize_all(cfg, tokenizer)

    # rank 0 tokenises and caches; the others then read the cache (the launcher has usually
    # tokenised already; under srun on a cold cache this is the long part)
    train_docs, eval_docs = after_rank0(
        "tokenising the data",
        tokenize_first,
        lambda: tokenize_all(cfg, tokenizer),
        clock_s=cfg.dist.timeout_s,
    )
    fingerprint = docs_fingerprint(train_docs)
    eval_fingerprint = docs_fingerprint(eval_docs) if eval_docs is not None else None
    train_docs, eval_docs = split_eval(cfg, train_docs, eval_docs)
    pad_id = tokenizer.pad_token_id
    if data.format == "preference":  # one window per half of a pair (trainer/data/pairs.py)
        train_windows = PairWindows(pack(train_docs, data.seq_len, pad_id, False, False))
    else:
        train_windows = pack(train_docs, data.seq_len, pad_id, data.format == "text", data.pack)
    if len(train_windows) < 1:
        raise ConfigError("data.path", "produced no training windows", "add data")
    log.info(
        "data: %d training documents in %d windows of %d tokens%s",
        train_docs.num_docs,
        len(train_windows),
        data.seq_len,
        f"; {eval_docs.num_docs} eval documents" if eval_docs is not None else "",
    )
    eval_set = None
    if eval_docs is not None and data.format == "preference":
        eval_windows = pack(eval_docs, data.seq_len, pad_id, False, False)
        eval_set = EvalSet(PairWindows(eval_windows, first_index=len(train_windows)))
    elif eval_docs is not None:
        eval_set = EvalSet(pack(eval_docs, data.seq_len, pad_id, False, data.pack))
    train = TrainStream(train_windows, cfg.train.seed)
    return DataBundle(train, eval_set, fingerprint, eval_fingerprint)
