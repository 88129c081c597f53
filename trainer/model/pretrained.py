"""Pretrained weights read per rank from safetensors files: each rank reads only what it holds.

A sharded rung builds its model on the meta device and materialises only its own part (FSDP2: a
DTensor's local rows along dim 0; ZeRO-3: a parameter's flat partition). Here each rank reads those
bytes straight from the checkpoint's safetensors files (`model.safetensors`, or the shards that
`model.safetensors.index.json` maps) into its parameters, converting to the dtype it keeps (fp32
master weights): no rank holds the whole model, none holds a second copy, and none waits for
another (no collective runs while loading). The file format is read directly (an 8-byte header
length, a JSON header of dtype, shape and byte offsets, then the data), with plain `readinto` into
the parameter's memory, not an mmap whose touched pages would stay in the process's resident set.

Names: a parameter named as in the HF model is looked up as is, then without / with the base
model's prefix (`model.`); a tied `lm_head.weight` is the embedding (one parameter). A checkpoint
this cannot map completely (.bin files, renamed or missing keys, other shapes) makes the caller
fall back to transformers' own loading on rank 0 and a broadcast, with one log line.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.core.errors import ConfigError
from trainer.core.files import write_atomic
from trainer.core.host_memory import reset_peak, rss_bytes, rss_peak_bytes

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def canonical_name(name: str) -> str:
    """Parameter name as in the plain HF model (wrappers' prefixes removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint directory, by name: headers only until read."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [SINGLE_FILE]
        self.entries: dict[str, _Entry] = {}
        for name in files:
            self.entries.update(_read_header(directory / name))

    @staticmethod
    def find(directory: Path) -> SafetensorsCheckpoint | None:
        """The checkpoint in `directory`, or None where it holds no safetensors weights."""
        if (directory / INDEX_FILE).is_file() or (directory / SINGLE_FILE).is_file():
            return SafetensorsCheckpoint(directory)
        return None

    def read(self, key: str, out: torch.Tensor, start: int = 0) -> int:
        """Fill `out` with the tensor's elements from flat index `start` on (row-major), converted
        to `out`'s dtype; returns the bytes read. Rows along dim 0 and ZeRO's flat partitions are
        both one contiguous run of the file."""
        entry = self.entries[key]
        count = out.numel()
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        direct = out.device.type == "cpu" and out.dtype == entry.dtype and out.is_contiguous()
        buffer = out if direct else torch.empty(count, dtype=entry.dtype)
        view = memoryview(buffer.detach().view(-1).view(torch.uint8).numpy())
        with open(entry.file, "rb", buffering=0) as f:
            f.seek(entry.offset + start * itemsize)
            done = 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise OSError(f"{entry.file}: {key} ends early")
                done += got
        if not direct:
            with torch.no_grad():
                out.copy_(buffer.view(out.shape))
        return count * itemsize


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _read_header(path: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file holds, after the checks the safetensors library makes: a
    sane header length, JSON, and byte ranges that lie in the file, do not overlap, cover the
    data exactly and match dtype x shape. A file failing them is refused in one line."""
    file_bytes = path.stat().st_size
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if file_bytes < 8 or size > min(MAX_HEADER_BYTES, file_bytes - 8):
            raise _bad_file(path, f"its header length {size} exceeds the file ({file_bytes} bytes)")
        try:
            header = json.loads(f.read(size).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise _bad_file(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad_file(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    entries = {key: _entry(path, key, v, 8 + size) for key, v in header.items()}
    data_bytes, end = file_bytes - 8 - size, 0
    for key, (begin, stop) in sorted(
        ((k, tuple(header[k]["data_offsets"])) for k in header), key=lambda kv: kv[1]
    ):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise _bad_file(path, f"tensor {key} {what} (offset {begin}, expected {end})")
        end = stop
    if end != data_bytes:
        raise _bad_file(path, f"its tensors cover {end} of the {data_bytes} data bytes")
    return {key: entry for key, entry in entries.items() if entry is not None}


def _entry(path: Path, key: str, value: Any, base: int) -> _Entry | None:
    """One tensor's entry, checked; None for a valid dtype this reader does not read (the caller
    then falls back to transformers' loading)."""
    try:
        dtype, shape = value["dtype"], [int(d) for d in value["shape"]]
        begin, stop = (int(x) for x in value["data_offsets"])
    except (TypeError, KeyError, ValueError):
        raise _bad_file(path, f"tensor {key} has no valid dtype, shape and data_offsets") from None
    if min(shape, default=0) < 0 or not 0 <= begin <= stop:
        raise _bad_file(path, f"tensor {key} has a negative size or offset")
    if dtype not in _DTYPES:
        return None
    itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
    if stop - begin != math.prod(shape) * itemsize:
        raise _bad_file(
            path,
            f"tensor {key} spans {stop - begin} bytes, its {dtype} shape {shape} needs "
            f"{math.prod(shape) * itemsize}",
        )
    return _Entry(path, _DTYPES[dtype], tuple(shape), base + begin)


def _bad_file(path: Path, problem: str) -> ConfigError:
    return ConfigError(
        "model.name_or_path",
        f"{path} is not a valid safetensors file: {problem}",
        "download or save the model again (the safetensors library refuses this file too)",
    )


@dataclass
class LoadStats:
    """What one rank's load read and cost; written to `run.dir/load_rank{R}.json`."""

    seconds: float = 0.0
    read_bytes: int = 0  # from the files
    held_bytes: int = 0  # this rank's part, in the dtype it keeps
    largest_tensor_bytes: int = 0  # of the whole model, fp32
    rss_before_bytes: int = 0
    rss_peak_bytes: int = 0  # the process's resident high-water mark while loading


def checkpoint_keys(model: nn.Module, ckpt: SafetensorsCheckpoint) -> dict[str, str] | None:
    """Model state name -> checkpoint key, for every parameter and persistent buffer of the
    (meta or materialised) model, with wrappers' prefixes removed; None if any cannot be mapped
    to a tensor of the same shape."""
    prefix = getattr(model, "base_model_prefix", "") or "model"
    wanted = {canonical_name(n): _global_shape(t) for n, t in state_tensors(model)}
    keys = {}
    for name, shape in wanted.items():
        candidates = [name, name.removeprefix(f"{prefix}."), f"{prefix}.{name}"]
        key = next((k for k in candidates if k in ckpt.entries), None)
        if key is None or ckpt.entries[key].shape != shape:
            log.info("pretrained: %s has no tensor of shape %s in the safetensors", name, shape)
            return None
        keys[name] = key
    return keys


def _global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape: a ZeRO-3 parameter is empty outside its gathers."""
    return tuple(getattr(tensor, "ds_shape", None) or tensor.shape)


def state_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (a tied one once) and persistent buffers: what a state dict must fill."""
    tensors: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                tensors.append((f"{module_name}.{name}" if module_name else name, buf))
    return tensors


def load_fsdp_shards(model: nn.Module, ckpt: SafetensorsCheckpoint) -> LoadStats | None:
    """Fill a model sharded by FSDP2 and split by tensor parallel (after `to_empty`) from the
    checkpoint: each rank reads its own block of every parameter. None (nothing read) if the
    checkpoint does not map onto it or a placement is not one of a block."""
    keys = checkpoint_keys(model, ckpt)
    if keys is None:
        return None
    plan = []
    for name, tensor in state_tensors(model):
        block = local_block(tensor)
        if block is None:
            return None  # another layout: let the broadcast place it
        local, offsets = block
        key = keys[canonical_name(name)]
        runs = contiguous_runs(local, offsets, tuple(tensor.shape))
        plan.extend((key, out, start) for out, start in runs)
    return _timed_load(ckpt, plan, model)


def local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(this rank's part of a parameter or buffer, the index of its first element in the whole
    tensor along every dimension): a DTensor's local block (FSDP2's rows, a tensor split's rows
    or columns, both), a plain tensor whole. None where the local part is not one block."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor.detach(), (0,) * tensor.dim()
    local = tensor.to_local().detach()
    shape, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if tuple(local.shape) != tuple(shape):
        return None
    return local, tuple(offsets)


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(this rank's part of an FSDP2 parameter, the flat index of its first element in the
    whole tensor) where that part is one run of whole rows; None otherwise."""
    block = local_block(tensor)
    if block is None:
        return None
    runs = contiguous_runs(*block, tuple(tensor.shape))
    return runs[0] if len(runs) == 1 else None


def contiguous_runs(
    local: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]
) -> list[tuple[torch.Tensor, int]]:
    """The block `local` (at `offsets` in a tensor of `shape`) as runs of the row-major file:
    (a view of `local`, the flat index of its first element). One run for whole rows (FSDP2's
    dim-0 shards); one per row for a block of columns (a row-wise tensor split)."""
    if not local.dim() or not local.numel():
        return [(local, 0)]
    partial = [d for d in range(local.dim()) if local.shape[d] != shape[d]]
    last = partial[-1] if partial else 0
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    runs = []
    for index in itertools.product(*(range(local.shape[d]) for d in range(last))):
        start = sum((offsets[d] + i) * strides[d] for d, i in enumerate(index))
        start += offsets[last] * strides[last]
        runs.append((local[index] if index else local, start))
    return runs


def load_zero3_partitions(model: nn.Module, ckpt: SafetensorsCheckpoint) -> LoadStats | None:
    """Fill a model built under `deepspeed.zero.Init` from the checkpoint: each rank reads the
    flat partition of every parameter it owns (`ds_tensor`; rank r holds elements
    [r * partition, (r + 1) * partition) of the flattened tensor, the last one padded). None if
    the checkpoint does not map onto the model."""
    import torch.distributed as dist

    keys = checkpoint_keys(model, ckpt)
    if keys is None:
        return None
    plan = []
    for name, tensor in state_tensors(model):
        part = getattr(tensor, "ds_tensor", None)
        if part is None:  # a buffer: every rank holds it whole
            plan.append((keys[canonical_name(name)], tensor.data, 0))
            continue
        size = part.ds_numel
        start = min(tensor.ds_numel, size * dist.get_rank(group=tensor.ds_process_group))
        count = min(size, tensor.ds_numel - start)
        flat = part.data.view(-1)
        flat[count:].zero_()
        plan.append((keys[canonical_name(name)], flat[:count], start))
    return _timed_load(ckpt, plan, model)


def _timed_load(
    ckpt: SafetensorsCheckpoint, plan: list[tuple[str, torch.Tensor, int]], model: nn.Module
) -> LoadStats:
    stats = LoadStats()
    with measured(stats):
        for key, out, first in plan:
            if out.numel():
                stats.read_bytes += ckpt.read(key, out, first)
            stats.held_bytes += out.numel() * out.element_size()
    stats.largest_tensor_bytes = max(
        (4 * math.prod(_global_shape(t)) for _, t in state_tensors(model)), default=0
    )
    return stats


@contextlib.contextmanager
def measured(stats: LoadStats) -> Iterator[LoadStats]:
    """Time the block and record the process's resident set before it and its high-water mark
    during it in `stats`; memory freed earlier is handed back first, so that the baseline is
    what the process holds."""
    release_freed_memory()
    stats.rss_before_bytes = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    yield stats
    stats.seconds = time.perf_counter() - start
    stats.rss_peak_bytes = max(rss_peak_bytes(), stats.rss_before_bytes)


def report_load(stats: LoadStats, rank: int, run_dir: Path | None, what: str) -> None:
    """One log line from rank 0, and every rank's numbers in `run_dir/load_rank{R}.json`."""
    if rank == 0:
        log.info(
            "pretrained weights: each rank read its %s from the safetensors files (rank 0: "
            "%.2f GiB in %.1f s, host peak +%.2f GiB)",
            what,
            stats.read_bytes / 2**30,
            stats.seconds,
            (stats.rss_peak_bytes - stats.rss_before_bytes) / 2**30,
        )
    if run_dir is not None and run_dir.is_dir():
        write_atomic(run_dir / f"load_rank{rank}.json", json.dumps(asdict(stats)) + "\n")


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`; a no-op elsewhere):
    after freeing many temporaries of mixed sizes the resident set otherwise keeps them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_checkpoint(name_or_path: str, revision: str | None) -> SafetensorsCheckpoint | None:
    """The safetensors checkpoint of a local model directory or a Hub id (its files fetched into
    the Hub cache, or found there offline); None where there are none (e.g. .bin files)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return SafetensorsCheckpoint.find(local)
    try:
        from huggingface_hub import snapshot_download

        directory = snapshot_download(
            name_or_path,
            revision=revision,
            allow_patterns=[SINGLE_FILE, INDEX_FILE, "model-*.safetensors"],
        )
    except Exception as err:  # noqa: BLE001 - any failure here means: let transformers try
        log.debug("no safetensors for %s: %s", name_or_path, err)
        return None
    return SafetensorsCheckpoint.find(Path(directory))


def load_per_rank(
    model: nn.Module, factory: Any, loader: Callable[..., LoadStats | None], ctx: Any, what: str
) -> bool:
    """Fill the sharded `model` with `loader` (`load_fsdp_shards`, `load_zero3_partitions`)
    from the factory's pretrained safetensors; False (nothing read) for random init or where the
    checkpoint cannot be read this way, said in one line: the caller then broadcasts."""
    source = getattr(factory, "model_cfg", None)  # None: another factory (LoRA's adapters)
    name = getattr(source, "name_or_path", None)
    if name is None or not hasattr(factory, "pretrained_checkpoint"):
        return False
    ckpt = factory.pretrained_checkpoint()
    stats = loader(model, ckpt) if ckpt is not None else None
    if stats is None:
        if ctx.rank == 0:
            why = "no safetensors weights" if ckpt is None else "keys or a layout not read per rank"
            log.info(
                "model.name_or_path: %s in %s: rank 0 loads the whole model with transformers "
                "and sends each rank its part",
                why,
                name,
            )
        return False
    report_load(stats, ctx.rank, Path(ctx.cfg.run.dir), what)
    return True
