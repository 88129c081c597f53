"""The canonical state as torch.distributed.checkpoint holds it: the flat `model/NAME`,
`optim/NAME/KEY` layout, the template DCP fills on load, the metadata reader that unpickles
only DCP's own classes, and the whole weights of a checkpoint (docs/checkpoints.md)."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from trainer.runtime.dist import (
    is_distributed,
)

# ---------------------------------------------------------------------------------------------
# Canonical state <-> flat DCP dict


def flatten_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in state["model"].items():
        flat[f"model/{name}"] = tensor
    for name, moments in state["optim"].items():
        for key, tensor in moments.items():
            flat[f"optim/{name}/{key}"] = torch.as_tensor(tensor)
    return flat


def unflatten_state(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for key, tensor in flat.items():
        kind, rest = key.split("/", 1)
        if kind == "model":
            state["model"][rest] = tensor
        else:
            name, moment = rest.rsplit("/", 1)
            state["optim"].setdefault(name, {})[moment] = tensor
    return state


def load_template(state: dict[str, Any]) -> dict[str, Any]:
    """The backend's own state with optimizer entries for every parameter, for DCP to fill.

    Before the first optimizer step AdamW has no state; zeros of the parameter's own layout
    (sharded or not) give DCP the shapes to load into.
    """
    optim = dict(state["optim"])
    for name, param in state["model"].items():
        if name not in optim:
            optim[name] = {
                "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param),
                "step": torch.zeros((), dtype=torch.float32),
            }
    return {"model": state["model"], "optim": optim}


# ---------------------------------------------------------------------------------------------
# Safe metadata reading


# What DCP's .metadata pickle may name: its own metadata classes plus a few plain value types.
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    *(
        ("torch", str(dtype).removeprefix("torch."))
        for dtype in (
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.float64,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
        )
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: refused")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader with a restricted unpickler for `.metadata` (the tensors use weights_only)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(self.path) / ".metadata"
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------------------------------
# Export


def read_full_weights(path: Path) -> dict[str, torch.Tensor]:
    """Full fp32 model weights from a checkpoint, in one process (no process group)."""
    reader = SafeFileSystemReader(str(path))
    metadata = reader.read_metadata()
    flat = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model/")
    }
    with warnings.catch_warnings():  # one process on purpose: torch warns that it assumes so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(flat, storage_reader=SafeFileSystemReader(str(path)), no_dist=not is_distributed())
    return {key.removeprefix("model/"): t for key, t in flat.items()}
