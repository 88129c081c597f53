"""Reading data rows (trainer/core/rows.py): the bounds on a line, UTF-8, and line ends."""

from __future__ import annotations

import json

import pytest

from trainer.core.config import ConfigError, DataConfig
from trainer.core.rows import check_rows, read_rows


def _rows(path, **data) -> list[tuple[int, dict]]:
    cfg = DataConfig(path=str(path), **data)
    return [(number, row) for _, number, row in read_rows(str(path), "data.path", cfg)]


@pytest.mark.parametrize("end", ["\n", "\r\n", ""], ids=["lf", "crlf", "eof"])
def test_a_line_of_exactly_the_limit_is_read_and_one_byte_more_is_refused(tmp_path, end):
    """The limit counts the bytes before the line end."""
    row = {"text": "x" * (100 - len('{"text": ""}'))}
    line = json.dumps(row)
    assert len(line) == 100
    data = tmp_path / "d.jsonl"
    data.write_text(line + end, newline="")
    assert _rows(data, max_line_bytes=100) == [(1, row)]
    with pytest.raises(ConfigError) as err:
        _rows(data, max_line_bytes=99)
    assert str(err.value) == (
        f"config error: data.path: {data} line 1 is longer than data.max_line_bytes=99; "
        "split the line, or raise data.max_line_bytes (e.g. data.max_line_bytes=8MiB)"
    )


def test_raising_max_line_bytes_lets_a_long_line_through(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "y" * 3 * 2**20}) + "\n" + json.dumps({"text": "z"}))
    with pytest.raises(ConfigError, match="line 1 is longer than data.max_line_bytes=1,048,576"):
        check_rows(DataConfig(path=str(data)))
    check_rows(DataConfig(path=str(data), max_line_bytes="4MiB"))  # no error
    assert [n for n, _ in _rows(data, max_line_bytes="4MiB")] == [1, 2]


def test_the_first_bad_byte_is_named_by_its_line(tmp_path):
    data = tmp_path / "d.txt"
    data.write_bytes(b"fine\n\nalso fine\nnot \xe9t\xe9 utf-8\n")
    with pytest.raises(ConfigError) as err:
        check_rows(DataConfig(path=str(data)))
    assert f"{data} line 4 is not UTF-8 text (byte 0xe9)" in str(err.value)


def test_json_lines_break_at_newlines_only(tmp_path):
    """A raw U+2028 or a form feed inside a JSON string is text, not the end of a row."""
    data = tmp_path / "d.jsonl"
    rows = [{"text": "one\u2028two"}, {"text": "three\x0cfour"}, {"text": "five"}]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows))
    assert _rows(data) == [(1, rows[0]), (2, rows[1]), (3, rows[2])]


@pytest.mark.parametrize("unit", ["document", "paragraph", "line"])
def test_text_files_read_as_open_reads_them(tmp_path, unit):
    """CRLF and CR line ends read as universal newlines, as before the lines were bounded."""
    data = tmp_path / "d.txt"
    data.write_bytes(b"a\r\nb\r\n\r\nc\rd\n")
    expected = {
        "document": [(1, {"text": "a\nb\n\nc\nd\n"})],
        "paragraph": [(1, {"text": "a\nb"}), (4, {"text": "c\nd"})],
        "line": [(1, {"text": "a"}), (2, {"text": "b"}), (4, {"text": "c"}), (5, {"text": "d"})],
    }[unit]
    assert _rows(data, text_unit=unit) == expected


def test_a_broken_json_line_is_shown_without_its_line_end(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\r\n{"text" "b"}\r\n')
    with pytest.raises(ConfigError) as err:
        check_rows(DataConfig(path=str(data)))
    assert str(err.value).endswith(
        f'{data} row 2 is not a JSON object: \'{{"text" "b"}}\'; '
        "fix the row, or set data.on_bad_row=skip to skip such rows"
    )
