"""Data rows: find the files, read their rows, check each row's fields (torch-free).

This is the part of the data pipeline that needs neither torch nor a tokenizer, so the launcher
runs it before anything is written or launched (`check_rows`): an empty file, a broken JSON line
or a row without its field stops `oomless train` with exit 2 in the time it takes to read the
file. `trainer/data.py` tokenises the same rows.

Plain-text files (`.txt`) are split by `data.text_unit`: `document` (the default: a file is one
document, as a book or a source file is), `paragraph` (blocks separated by blank lines) or `line`
(every non-blank line). Blank lines and blank files are never an error: they hold no document.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.core.config import ConfigError, DataConfig

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")


def data_files(path: str, key: str) -> list[Path] | None:
    """Local files to read (None: a hub dataset id)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in LOADERS and f.is_file())
        if not files:
            raise ConfigError(key, f"'{path}' has no {'/'.join(LOADERS)} files", "point at data")
        kinds = {LOADERS[f.suffix] for f in files}
        if len(kinds) > 1:
            raise ConfigError(key, f"'{path}' mixes {sorted(kinds)} files", "use one file kind")
        return files
    return None


def read_rows(path: str, key: str, data: DataConfig) -> Iterator[tuple[str, int, Any]]:
    """(source name, 1-based row number, row) for every example, in order."""
    files = data_files(path, key)
    if files is None:  # a hub dataset id
        yield from _read_hub_rows(path, key)
        return
    for f in files:
        if f.suffix in (".jsonl", ".json"):
            yield from _read_json_rows(f, key)
        elif f.suffix == ".txt":
            yield from _read_text_rows(f, data)
        else:
            yield from _read_table_rows(f, key)


def _read_hub_rows(path: str, key: str) -> Iterator[tuple[str, int, Any]]:
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()
    try:
        ds = load_dataset(path, split="train")
    except Exception as err:  # offline, unknown id, no train split
        raise ConfigError(
            key,
            f"cannot load dataset '{path}' ({str(err).splitlines()[0][:200]})",
            "give a local jsonl/json/parquet/txt/csv file or dir, or run online",
        ) from None
    for i, row in enumerate(ds):
        yield path, i + 1, row


def _read_table_rows(f: Path, key: str) -> Iterator[tuple[str, int, Any]]:
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()
    try:
        ds = load_dataset(LOADERS[f.suffix], data_files=str(f), split="train")
    except Exception as err:
        raise ConfigError(
            key, f"cannot read {f} ({str(err).splitlines()[0][:200]})", "fix the file"
        ) from None
    for i, row in enumerate(ds):
        yield str(f), i + 1, row


def _read_json_rows(f: Path, key: str) -> Iterator[tuple[str, int, Any]]:
    """JSON lines (or a JSON array) read as written: `datasets`' JSON loader re-types a column
    whose rows mix types (a string "2" beside an int 2 becomes 2) and cannot name a broken line."""
    text = f.read_text()
    if f.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(key, f"{f} is not valid JSON ({err})", "fix the file") from None
        for i, row in enumerate(rows):
            yield str(f), i + 1, row if isinstance(row, dict) else {}
        return
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        yield str(f), i + 1, row if isinstance(row, dict) else {"__invalid__": line[:80]}


def _read_text_rows(f: Path, data: DataConfig) -> Iterator[tuple[str, int, Any]]:
    """A plain-text file as documents per `data.text_unit`; the row number is the line number
    where the document starts. Blank text holds no document and is skipped."""
    text = f.read_text(errors="replace")
    if data.text_unit == "document":
        if text.strip():
            yield str(f), 1, {data.text_field: text}
        return
    if data.text_unit == "line":
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                yield str(f), i + 1, {data.text_field: line}
        return
    start = 0
    for match in [*_PARAGRAPH_BREAK.finditer(text), None]:
        end = match.start() if match else len(text)
        block = text[start:end]
        if block.strip():
            yield str(f), text.count("\n", 0, start) + 1, {data.text_field: block.strip("\n")}
        if match:
            start = match.end()


def check_fields(row: dict[str, Any], data: DataConfig) -> None:
    """Raise ValueError naming what is wrong with a row for `data.format` (no tokenizer)."""
    if data.format == "text":
        field(row, data.text_field)
    elif data.format == "prompt_completion":
        field(row, data.prompt_field)
        field(row, data.completion_field)
    else:
        messages(row, data.messages_field)


def field(row: dict[str, Any], name: str) -> str:
    if "__invalid__" in row:
        raise ValueError(f"is not a JSON object: {row['__invalid__']!r}")
    if name not in row or row[name] is None:
        raise ValueError(f"has no '{name}' field")
    value = row[name]
    if not isinstance(value, str):
        raise ValueError(f"field '{name}' is a {type(value).__name__}, not text")
    if not value.strip():
        raise ValueError(f"field '{name}' is empty")
    return value


def messages(row: dict[str, Any], name: str) -> list[dict[str, str]]:
    if "__invalid__" in row:
        raise ValueError(f"is not a JSON object: {row['__invalid__']!r}")
    msgs = row.get(name)
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"field '{name}' is not a non-empty list of messages")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError(f"field '{name}' has a message without role/content")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"field '{name}' has no assistant turn")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def bad_row_error(key: str, source: str, row_number: int, err: ValueError) -> ConfigError:
    return ConfigError(
        key,
        f"{source} row {row_number} {err}",
        "fix the row, or set data.on_bad_row=skip to skip such rows",
    )


def no_rows_error(key: str, path: str) -> ConfigError:
    return ConfigError(key, f"'{path}' has no usable rows", "check data.format and the fields")


def check_rows(data: DataConfig) -> None:
    """Read every source's rows and check their fields, as tokenising will (exit 2 early).

    Local files only: a hub dataset is read (and checked) by tokenising it.
    """
    sources = [("data.path", data.path)] + (
        [("data.eval_path", data.eval_path)] * bool(data.eval_path)
    )
    for key, path in sources:
        if data_files(path, key) is None:
            continue
        num_usable = 0
        for source, row_number, row in read_rows(path, key, data):
            try:
                check_fields(row, data)
            except ValueError as err:
                if data.on_bad_row == "error":
                    raise bad_row_error(key, source, row_number, err) from None
                continue
            num_usable += 1
        if not num_usable:
            raise no_rows_error(key, path)
