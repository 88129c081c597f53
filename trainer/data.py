"""Data: read with HF `datasets`, tokenise once (cached), pack into windows, pick batches by step.

Formats (`data.format`):
- `text`: loss on every token. Documents are concatenated and split across windows.
- `prompt_completion`: loss on the completion only. Documents are packed whole (a document longer
  than `data.seq_len` is truncated, and counted in the log).
- `chat`: a list of {role, content} messages rendered with the tokenizer's chat template; loss on
  the assistant turns only (found by rendering growing prefixes of the conversation). Packed whole.

Packing: every window holds `data.seq_len` tokens; `position_ids` restart at 0 at each document
and the first token of a document is never a target, so nothing is predicted across documents.
With `attention_mask=None`, no KV cache (the engine builds models with `use_cache=False`) and packed
`position_ids`, transformers (sdpa/eager/flex on models that use its masking utilities, e.g.
Llama, Qwen2, Mistral, Gemma) builds a block-diagonal causal mask from the position resets, so
tokens attend only within their document (tests check this). A model
that ignores `position_ids` for masking would attend across documents of one window; set
`data.pack: false` for such models (one document per window, padded).

Order: the global batch of optimizer step `s` is a fixed set of windows chosen by `train.seed` and
`s` alone (epochs reshuffle with the seed and the epoch), independent of world size and
micro-batch. The step is therefore the whole data position: resuming, changing the strategy or
backing off the micro-batch sees the same data.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.core.config import ConfigError, DataConfig, JobConfig, ModelConfig
from trainer.core.errors import disk_full, free_bytes, no_space, not_writable
from trainer.core.rows import bad_row_error, data_files, field, messages, no_rows_error, read_rows
from trainer.loss import IGNORE_INDEX
from trainer.runtime.dist import after_rank0, slow_down

log = logging.getLogger(__name__)

_CACHE_VERSION = "2"


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(model_cfg: ModelConfig) -> Any:
    """The tokenizer of `model.tokenizer`, else of `model.name_or_path`; with a pad token."""
    from transformers import AutoTokenizer

    source = model_cfg.tokenizer or model_cfg.name_or_path
    if source is None:
        raise ConfigError(
            "model.tokenizer",
            "an inline model.config needs a tokenizer",
            "set model.tokenizer to a tokenizer dir or hub id",
        )
    key = "model.tokenizer" if model_cfg.tokenizer else "model.name_or_path"
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=model_cfg.trust_remote_code, revision=model_cfg.revision
        )
    except (OSError, ValueError) as err:
        raise ConfigError(
            key,
            f"cannot load a tokenizer from '{source}' ({str(err).splitlines()[0]})",
            "give a local tokenizer directory, or run where the Hugging Face Hub is reachable",
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Documents: (ids, target mask) per example


@dataclass
class Documents:
    """Tokenised examples, flat: doc i is tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray  # int64
    targets: np.ndarray  # bool: this token is a loss target
    offsets: np.ndarray  # int64, len = num_docs + 1

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.targets[a:b]

    def subset(self, indices: np.ndarray) -> Documents:
        parts = [self.doc(int(i)) for i in indices]
        lengths = np.array([len(t) for t, _ in parts], dtype=np.int64)
        return Documents(
            np.concatenate([t for t, _ in parts]) if parts else np.zeros(0, np.int64),
            np.concatenate([m for _, m in parts]) if parts else np.zeros(0, bool),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        )


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _example(row: dict[str, Any], data: DataConfig, tokenizer: Any) -> tuple[list[int], list[bool]]:
    """Token ids and target mask of one row; raises ValueError naming what is wrong."""
    eos = [tokenizer.eos_token_id] if data.append_eos and tokenizer.eos_token_id is not None else []
    if data.format == "text":
        text = field(row, data.text_field)
        ids = _encode(tokenizer, text, special=True) + eos
        return ids, [True] * len(ids)
    if data.format == "prompt_completion":
        prompt = field(row, data.prompt_field)
        completion = field(row, data.completion_field)
        p = _encode(tokenizer, prompt, special=True)
        c = _encode(tokenizer, completion, special=False) + eos
        return p + c, [False] * len(p) + [True] * len(c)
    return _chat_example(messages(row, data.messages_field), tokenizer)


def _chat_example(messages: list[dict[str, str]], tokenizer: Any) -> tuple[list[int], list[bool]]:
    """Render prefixes of the conversation; the tokens each assistant turn adds are targets."""
    ids: list[int] = []
    mask: list[bool] = []
    for i, msg in enumerate(messages):
        rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
        if hasattr(rendered, "keys"):  # some versions return a BatchEncoding
            rendered = rendered["input_ids"]
        if rendered[: len(ids)] != ids:
            raise ValueError("chat template does not render conversation prefixes stably")
        added = list(rendered[len(ids) :])
        ids += added
        mask += [msg["role"] == "assistant"] * len(added)
    return ids, mask


def tokenize_source(
    path: str, key: str, data: DataConfig, tokenizer: Any, cache_dir: Path
) -> Documents:
    """Tokenise every row of a source once; later calls read the cache (keyed by content)."""
    cache = cache_dir / _cache_key(path, data, tokenizer)
    if (cache / "done").is_file():
        docs = _load_docs(cache)
        check_targets(docs, key, path, data)
        return docs
    docs = _tokenize_rows(path, key, data, tokenizer)
    _save_docs(cache, docs)
    return docs


def _tokenize_rows(path: str, key: str, data: DataConfig, tokenizer: Any) -> Documents:
    tokens: list[int] = []
    targets: list[bool] = []
    offsets = [0]
    num_skipped = num_truncated = num_emptied = 0
    for num_rows, (source, row_number, row) in enumerate(read_rows(path, key, data), start=1):
        try:
            ids, mask = _example(row, data, tokenizer)
            if not any(mask):
                raise ValueError("has no tokens to learn from")
        except ValueError as err:
            if data.on_bad_row == "error":
                raise bad_row_error(key, source, row_number, err) from None
            num_skipped += 1
            continue
        if data.format != "text" and len(ids) > data.seq_len:
            ids, mask = ids[: data.seq_len], mask[: data.seq_len]
            num_truncated += 1
            num_emptied += not any(mask[1:])
        tokens += ids
        targets += mask
        offsets.append(len(tokens))
        if num_rows % 50_000 == 0:
            log.info("tokenised %d rows of %s", num_rows, path)
    if len(offsets) == 1:
        raise no_rows_error(key, path)
    docs = Documents(
        np.asarray(tokens, dtype=np.int64),
        np.asarray(targets, dtype=bool),
        np.asarray(offsets, dtype=np.int64),
    )
    check_targets(docs, key, path, data)  # before the warnings: an exit 2 is one line
    if num_skipped:
        log.warning("%s: skipped %d malformed rows (data.on_bad_row=skip)", path, num_skipped)
    if num_truncated:
        log.warning(
            "%s: %d examples longer than seq_len were truncated (%d of them to no target token)",
            path,
            num_truncated,
            num_emptied,
        )
    return docs


def check_targets(docs: Documents, key: str, path: str, data: DataConfig) -> None:
    """ConfigError when no document has a token to learn from once packed (a document's first
    token is never a target): training on it would print loss 0 and learn nothing."""
    firsts = docs.offsets[:-1][np.diff(docs.offsets) > 0]
    if int(docs.targets.sum()) - int(docs.targets[firsts].sum()) > 0:
        return
    raise ConfigError(
        key,
        f"'{path}' has no token to learn from within data.seq_len={data.seq_len} (every "
        "completion or assistant turn is cut off by the window or empty)",
        "raise data.seq_len, shorten the prompts, or check data.format and its fields",
    )


def _cache_key(path: str, data: DataConfig, tokenizer: Any) -> str:
    h = hashlib.sha256(_CACHE_VERSION.encode())
    files = data_files(path, "data.path")
    for f in files or []:
        h.update(str(f).encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    if files is None:
        h.update(path.encode())
    fields = data.model_dump(
        include={
            "format",
            "seq_len",
            "text_field",
            "prompt_field",
            "completion_field",
            "messages_field",
            "text_unit",
            "append_eos",
            "on_bad_row",
        }
    )
    h.update(json.dumps(fields, sort_keys=True).encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode() if tokenizer.is_fast else b"slow")
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:24]


def _save_docs(cache: Path, docs: Documents) -> None:
    """Into the cache: written into a temporary sibling renamed into place when whole (`done`
    last: a cut-off save is tokenised again, and nothing partial is left). A cache dir that
    cannot be written, or is full, is the user's to fix (exit 2), found before anything is
    written into run.dir."""
    arrays = {name: getattr(docs, name) for name in ("tokens", "targets", "offsets")}
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / "done").write_text("ok\n")
        if (cache / "done").is_file():  # another process saved it meanwhile
            shutil.rmtree(tmp)
            return
        shutil.rmtree(cache, ignore_errors=True)  # a cut-off save from before (no `done`)
        tmp.rename(cache)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        needed = sum(a.nbytes for a in arrays.values())
        # numpy's short write says "N requested and M written" with no errno
        full = disk_full(err) or (
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if err.errno is None and free_bytes(cache.parent) < needed
            else None
        )
        if full is not None:
            fix = "free space there, or set data.cache_dir to a disk with room"
            raise no_space(
                "data.cache_dir", cache.parent, "the tokenised data", needed, full, fix
            ) from None
        raise not_writable(
            "data.cache_dir", cache.parent, err, "cannot hold the tokenised data"
        ) from None


def _load_docs(cache: Path) -> Documents:
    return Documents(
        *(np.load(cache / f"{n}.npy", allow_pickle=False) for n in ("tokens", "targets", "offsets"))
    )


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
    if batch is None:
        return filler
    return {k: torch.cat([batch[k], filler[k]]) for k in batch}


@dataclass
class DataBundle:
    train: TrainStream
    eval: EvalSet | None
    fingerprint: str  # of the tokenised training data (checkpoints refuse a resume on other data)


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


def data_cache_dir(data: DataConfig) -> Path:
    return Path(data.cache_dir or Path.home() / ".cache" / "oomless" / "data").expanduser()


def tokenize_all(cfg: JobConfig, tokenizer: Any) -> tuple[Documents, Documents | None]:
    """(training documents, eval documents or None) as read: every source tokenised, or read
    from the cache. The launcher calls it before the launch, so bad data stops there and the
    ranks find the cache warm."""
    data = cfg.data
    sources = [("data.path", data.path)] + (
        [("data.eval_path", data.eval_path)] if data.eval_path else []
    )
    docs = {
        key: tokenize_source(p, key, data, tokenizer, data_cache_dir(data)) for key, p in sources
    }
    return docs["data.path"], docs.get("data.eval_path")


def split_eval(
    cfg: JobConfig, train_docs: Documents, eval_docs: Documents | None
) -> tuple[Documents, Documents | None]:
    """Hold out `data.eval_fraction` of the training documents when there is no eval_path."""
    data = cfg.data
    if eval_docs is None and data.eval_fraction > 0:
        order = np.random.default_rng([cfg.train.seed, 7]).permutation(train_docs.num_docs)
        num_eval = max(1, round(data.eval_fraction * train_docs.num_docs))
        if num_eval >= train_docs.num_docs:
            raise ConfigError(
                "data.eval_fraction", "leaves no training documents", "use a smaller fraction"
            )
        eval_docs = train_docs.subset(np.sort(order[:num_eval]))
        train_docs = train_docs.subset(np.sort(order[num_eval:]))
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
    train_docs, eval_docs = split_eval(cfg, train_docs, eval_docs)
    pad_id = tokenizer.pad_token_id
    split_docs = data.format == "text"
    train_windows = pack(train_docs, data.seq_len, pad_id, split_docs, data.pack)
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
    if eval_docs is not None:
        eval_set = EvalSet(pack(eval_docs, data.seq_len, pad_id, False, data.pack))
    return DataBundle(TrainStream(train_windows, cfg.train.seed), eval_set, fingerprint)
