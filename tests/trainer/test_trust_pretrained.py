"""The per-rank safetensors reader (trainer/model/pretrained.py) checks a file's header as the
safetensors library does: offsets in the file, no overlaps or gaps, sizes matching
dtype x shape, a sane header length. A bad file is refused in one line naming it (exit 2)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors
import torch
import yaml
from safetensors.torch import save_file

from tests.cli_worker import IN_THIS_PROCESS
from tests.conftest import TINY_LLAMA, oomless, write_demo_job
from trainer.core.errors import ConfigError
from trainer.model.pretrained import SINGLE_FILE, SafetensorsCheckpoint

TENSORS = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _write(path: Path, header: dict | bytes, data: bytes, size: int | None = None) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if size is None else size) + blob + data)


def _hostile(directory: Path, case: str) -> Path:
    """A model.safetensors in `directory` made hostile in one way."""
    path = directory / SINGLE_FILE
    save_file(TENSORS, str(path))
    header, data = _split(path)
    a, b = header["a"]["data_offsets"], header["b"]["data_offsets"]
    if case == "header_length_past_the_end":
        _write(path, header, data, size=len(path.read_bytes()) + 100)
    elif case == "header_length_huge":
        _write(path, header, data, size=2**62)
    elif case == "header_not_json":
        _write(path, b"{not json at all}", data)
    elif case == "offsets_past_the_end":
        header["b"]["data_offsets"] = [b[0] + 1 << 20, (b[0] + 1 << 20) + 16]
        _write(path, header, data)
    elif case == "overlapping":  # b reads a's last 16 bytes: two tensors share memory
        header["b"]["data_offsets"] = [a[1] - 16, a[1]]
        _write(path, header, data[: a[1]])
    elif case == "size_not_dtype_times_shape":
        header["a"]["shape"] = [3, 3]
        _write(path, header, data)
    elif case == "trailing_bytes":
        _write(path, header, data + b"\0" * 64)
    elif case == "negative_shape":
        header["b"]["shape"] = [-4]
        _write(path, header, data)
    elif case == "offsets_not_numbers":
        header["b"]["data_offsets"] = ["x", 3]
        _write(path, header, data)
    return path


CASES = [
    "header_length_past_the_end",
    "header_length_huge",
    "header_not_json",
    "offsets_past_the_end",
    "overlapping",
    "size_not_dtype_times_shape",
    "trailing_bytes",
    "negative_shape",
    "offsets_not_numbers",
]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_header_is_refused_in_one_line_naming_the_file(tmp_path, case):
    path = _hostile(tmp_path, case)
    with pytest.raises(Exception):  # noqa: B017 - the library's own error types vary by case
        safetensors.safe_open(str(path), "pt")  # the library refuses the same file
    with pytest.raises(ConfigError) as err:
        SafetensorsCheckpoint(tmp_path)
    line = str(err.value)
    assert "\n" not in line and str(path) in line and "model.name_or_path" in line, line


def test_a_valid_file_reads_back_exactly(tmp_path):
    save_file(TENSORS, str(tmp_path / SINGLE_FILE))
    ckpt = SafetensorsCheckpoint(tmp_path)
    for name, want in TENSORS.items():
        got = torch.empty_like(want)
        ckpt.read(name, got)
        assert torch.equal(got, want)


@pytest.mark.slow
def test_training_from_a_hostile_base_is_exit_2_in_one_line(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = tmp_path / "base"
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    config.vocab_size = 45
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    header, data = _split(base / SINGLE_FILE)
    name = next(k for k in header if k.endswith("q_proj.weight"))
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin - 64, end - 64]  # reads its neighbour's last bytes
    _write(base / SINGLE_FILE, header, data)
    job = write_demo_job(
        tmp_path / "job.yaml",
        train={"steps": 2, "global_batch_size": 4, "micro_batch_size": 2},
        strategy="fsdp",  # a sharded rung: every rank reads its part of the file itself
    )
    tree = yaml.safe_load(job.read_text())
    tree["model"] = {"name_or_path": str(base), "tokenizer": tree["model"]["tokenizer"]}
    job.write_text(yaml.safe_dump(tree))
    r = oomless("train", str(job), f"run.dir={tmp_path / 'run'}", IN_THIS_PROCESS)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "config error" in line]
    assert said and all(str(base / SINGLE_FILE) in line for line in said), r.stderr[-3000:]
    assert "not a valid safetensors file" in said[0]
