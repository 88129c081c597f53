"""Documents: the rows of a data source read with HF `datasets`, tokenised with their loss masks
(formats: trainer/data/__init__.py), and the tokenised cache that `train` fills once before
launch."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.core.config import ConfigError, DataConfig, JobConfig, ModelConfig
from trainer.core.errors import disk_full, free_bytes, no_space, not_writable
from trainer.core.rows import (
    bad_row_error,
    data_files,
    field,
    messages,
    no_rows_error,
    preference_pair,
    read_rows,
)

log = logging.getLogger(__name__)

_CACHE_VERSION = "3"  # 3: preference pairs cut off to no answer token are dropped


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


Example = tuple[list[int], list[bool]]


def _examples(row: dict[str, Any], data: DataConfig, tokenizer: Any) -> list[Example]:
    """The documents of one row: one, or a preference pair's two (prompt + chosen, prompt +
    rejected: the prompt's tokens are never targets); raises ValueError naming what is wrong."""
    if data.format != "preference":
        return [_example(row, data, tokenizer)]
    prompt, *answers = preference_pair(row, data)
    if isinstance(prompt, list):
        return [_chat_example([*prompt, *a], tokenizer, first_target=len(prompt)) for a in answers]
    eos = [tokenizer.eos_token_id] if data.append_eos and tokenizer.eos_token_id is not None else []
    p = _encode(tokenizer, prompt, special=True)
    out = []
    for answer in answers:
        a = _encode(tokenizer, answer, special=False) + eos
        out.append((p + a, [False] * len(p) + [True] * len(a)))
    return out


def _example(row: dict[str, Any], data: DataConfig, tokenizer: Any) -> Example:
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


def _chat_example(messages: list[dict[str, str]], tokenizer: Any, first_target: int = 0) -> Example:
    """Render prefixes of the conversation; the tokens each assistant turn from message
    `first_target` on adds are targets."""
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
        mask += [msg["role"] == "assistant" and i >= first_target] * len(added)
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
    cut_off: list[str] = []  # preference pairs whose answer seq_len cut off: dropped
    for num_rows, (source, row_number, row) in enumerate(read_rows(path, key, data), start=1):
        try:
            examples = _examples(row, data, tokenizer)
            if not all(any(mask) for _, mask in examples):
                raise ValueError("has no tokens to learn from")
        except ValueError as err:
            if data.on_bad_row == "error":
                raise bad_row_error(key, source, row_number, err) from None
            num_skipped += 1
            continue
        examples, num_cut, emptied = _truncated(examples, data.seq_len, data.format)
        num_truncated += num_cut
        num_emptied += emptied
        # a half with no answer token left has no log-probability: the pair is dropped
        if data.format == "preference" and not all(any(m[1:]) for _, m in examples):
            cut_off.append(f"{source} row {row_number}")
            continue
        for ids, mask in examples:
            tokens += ids
            targets += mask
            offsets.append(len(tokens))
        if num_rows % 50_000 == 0:
            log.info("tokenised %d rows of %s", num_rows, path)
    if len(offsets) == 1 and cut_off:
        raise ConfigError(
            key,
            f"data.seq_len={data.seq_len} cuts off the answers of every pair of '{path}' "
            f"(e.g. {cut_off[0]}): no pair is left to learn from",
            "raise data.seq_len or shorten the prompts",
        )
    if len(offsets) == 1:
        raise no_rows_error(key, path)
    docs = Documents(
        np.asarray(tokens, dtype=np.int64),
        np.asarray(targets, dtype=bool),
        np.asarray(offsets, dtype=np.int64),
    )
    check_targets(docs, key, path, data)  # before the warnings: an exit 2 is one line
    _warn(path, data, num_skipped, num_truncated, num_emptied, cut_off)
    return docs


def _truncated(examples: list[Example], seq_len: int, fmt: str) -> tuple[list[Example], int, int]:
    """(the examples cut at seq_len, how many were cut, how many of those kept no target token
    past the first, which nothing predicts). Text documents are split into windows instead."""
    if fmt == "text":
        return examples, 0, 0
    out, num_cut, emptied = [], 0, 0
    for ids, mask in examples:
        if len(ids) > seq_len:
            ids, mask = ids[:seq_len], mask[:seq_len]
            num_cut += 1
            emptied += not any(mask[1:])
        out.append((ids, mask))
    return out, num_cut, emptied


def _warn(
    path: str,
    data: DataConfig,
    num_skipped: int,
    num_truncated: int,
    num_emptied: int,
    cut_off: list[str],
) -> None:
    if num_skipped:
        log.warning("%s: skipped %d malformed rows (data.on_bad_row=skip)", path, num_skipped)
    if cut_off:
        shown = ", ".join(cut_off[:3]) + (
            f" and {len(cut_off) - 3} more" if len(cut_off) > 3 else ""
        )
        log.warning(
            "%s: dropped %d preference pair%s with no answer token left within data.seq_len=%d "
            "(%s); raise data.seq_len or shorten those prompts to keep them",
            path,
            len(cut_off),
            "" if len(cut_off) == 1 else "s",
            data.seq_len,
            shown,
        )
    if num_truncated:
        log.warning(
            "%s: %d examples longer than seq_len were truncated (%d of them to no target token)",
            path,
            num_truncated,
            num_emptied,
        )


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
            "chosen_field",
            "rejected_field",
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
    last: a cut-off save is tokenised again, and nothing partial is left). Jobs sharing a cache
    dir may save the same key at once: the first rename wins and the others drop theirs (the
    same bytes); a complete cache is never removed. A cache dir that cannot be written, or is
    full, is the user's to fix (exit 2), found before anything is written into run.dir."""
    arrays = {name: getattr(docs, name) for name in ("tokens", "targets", "offsets")}
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / "done").write_text("ok\n")
        _rename_into_place(tmp, cache)
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


def _rename_into_place(tmp: Path, cache: Path) -> None:
    """`tmp` (whole) becomes `cache`. A `cache` already there with `done` is another process's
    whole save: ours is dropped. One without `done` is a save cut off before: moved aside (one
    process wins that rename) and removed, then ours goes in; every dir named `cache` is whole
    from the moment it appears, since `done` is written before the rename."""
    for _ in range(2):
        try:
            tmp.rename(cache)
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if (cache / "done").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        stale = cache.with_name(f"{cache.name}.{os.getpid()}.stale")
        try:
            cache.rename(stale)
        except FileNotFoundError:
            continue  # another process moved it aside first
        if (stale / "done").is_file():  # whole after all: another save landed meanwhile
            try:
                stale.rename(cache)
                continue
            except OSError:
                pass
        shutil.rmtree(stale, ignore_errors=True)
    if not (cache / "done").is_file():
        raise OSError(errno.EEXIST, f"{cache} is written by another process too")
    shutil.rmtree(tmp, ignore_errors=True)


def _load_docs(cache: Path) -> Documents:
    return Documents(
        *(np.load(cache / f"{n}.npy", allow_pickle=False) for n in ("tokens", "targets", "offsets"))
    )


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
