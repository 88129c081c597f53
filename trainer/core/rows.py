"""Data rows: find the files, read their rows, check each row's fields (torch-free).

This is the part of the data pipeline that needs neither torch nor a tokenizer, so the launcher
runs it before anything is written or launched (`check_rows`): an empty file, a broken JSON line
or a row without its field stops `oomless train` with exit 2 in the time it takes to read the
file. `trainer/data/` tokenises the same rows.

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
CHAT_ROLES = ("system", "user", "assistant", "tool")
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
            yield from _read_json_rows(f, key, data.max_line_bytes)
        elif f.suffix == ".txt":
            yield from _read_text_rows(f, key, data)
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


def _read_json_rows(f: Path, key: str, max_line_bytes: int) -> Iterator[tuple[str, int, Any]]:
    """JSON lines (or a JSON array) read as written: `datasets`' JSON loader re-types a column
    whose rows mix types (a string "2" beside an int 2 becomes 2) and cannot name a broken line.
    Lines end at newlines only (a raw U+2028 inside a JSON string is text, not a line break)."""
    if f.suffix == ".json" and _starts_with(f, b"["):
        text = _decode_utf8(f.read_bytes(), f, key)
        try:
            rows = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            raise ConfigError(key, f"{f} is not valid JSON ({err})", "fix the file") from None
        for i, row in enumerate(rows if isinstance(rows, list) else [rows]):
            yield str(f), i + 1, row if isinstance(row, dict) else {}
        return
    for number, line in _lines(f, key, max_line_bytes):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            row = None
        yield str(f), number, row if isinstance(row, dict) else {"__invalid__": line[:80]}


def _starts_with(f: Path, prefix: bytes) -> bool:
    """The file's first non-blank bytes are `prefix` (read 64 KiB at most)."""
    with f.open("rb") as stream:
        return stream.read(2**16).lstrip().startswith(prefix)


def _lines(f: Path, key: str, max_line_bytes: int) -> Iterator[tuple[int, str]]:
    """(1-based line number, text with its line end) of every line of a UTF-8 file, read one
    line at a time; ConfigError naming the line when one is not UTF-8 or holds more than
    `data.max_line_bytes` bytes before its line end (a multi-megabyte line would take minutes
    and gigabytes to tokenise)."""
    with f.open("rb") as stream:
        number = 0
        while raw := stream.readline(max_line_bytes + 2):  # room for a CRLF line end
            number += 1
            if len(raw.rstrip(b"\r\n")) > max_line_bytes:
                raise ConfigError(
                    key,
                    f"{f} line {number} is longer than data.max_line_bytes={max_line_bytes:,}",
                    "split the line, or raise data.max_line_bytes (e.g. data.max_line_bytes=8MiB)",
                )
            yield number, _decode_utf8(raw, f, key, number - 1)


def _decode_utf8(raw: bytes, f: Path, key: str, lines_before: int = 0) -> str:
    """`raw` as UTF-8 text; ConfigError naming the file, line and byte when it is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = lines_before + raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            key,
            f"{f} line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x})",
            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None


def _read_text_rows(f: Path, key: str, data: DataConfig) -> Iterator[tuple[str, int, Any]]:
    """A plain-text file as documents per `data.text_unit`; the row number is the line number
    where the document starts. Blank text holds no document and is skipped. Every line is
    checked (UTF-8, `data.max_line_bytes`) first; line ends read as `open()` reads them."""
    lines = [line for _, line in _lines(f, key, data.max_line_bytes)]
    text = "".join(lines).replace("\r\n", "\n").replace("\r", "\n")
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
    elif data.format == "preference":
        preference_pair(row, data)
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
    for i, m in enumerate(msgs, start=1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError(f"field '{name}' has a message without role/content")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(
                f"field '{name}' message {i} has role {json.dumps(m['role'])[:40]}, "
                f"not one of {', '.join(CHAT_ROLES)}"
            )
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"field '{name}' has no assistant turn")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


Turn = str | list[dict[str, str]]


def preference_pair(row: dict[str, Any], data: DataConfig) -> tuple[Turn, Turn, Turn]:
    """(prompt, chosen, rejected) of a preference row: three strings, or three lists of chat
    messages (TRL's conversational form: the prompt's turns, then the chosen and the rejected
    answer's); raises ValueError naming the field that is wrong."""
    names = (data.prompt_field, data.chosen_field, data.rejected_field)
    if "__invalid__" in row:
        field(row, names[0])  # raises: not a JSON object
    prompt = row.get(names[0])
    empty = prompt == [] or (isinstance(prompt, str) and not prompt.strip())
    if isinstance(prompt, list) or (empty and isinstance(row.get(names[1]), list)):
        # an empty prompt: the answers' turns alone
        turns = [] if empty else _turns(row, names[0], answer=False)
        return (turns, _turns(row, names[1], True), _turns(row, names[2], True))  # type: ignore[return-value]
    if not empty:
        prompt = field(row, names[0])  # only an answer must not be empty (docs/preference.md)
    return (prompt, field(row, names[1]), field(row, names[2]))  # type: ignore[return-value]


def _turns(row: dict[str, Any], name: str, answer: bool) -> list[dict[str, str]]:
    """A prompt's chat messages, or an answer's (which has an assistant turn)."""
    turns = row.get(name)
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"field '{name}' is not a non-empty list of messages (the prompt is one)")
    if answer:
        return messages(row, name)
    # a prompt needs no assistant turn: checked as a conversation it ends
    return messages({name: [*turns, {"role": "assistant", "content": ""}]}, name)[:-1]


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
