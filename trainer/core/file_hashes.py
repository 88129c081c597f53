"""Whole-file SHA-256 digests of a model's files, computed once per file version and kept in
oomless's cache (`$XDG_CACHE_HOME/oomless/file_hashes/`, never beside the weights).

A digest is read back only while the file is the one hashed: the same resolved path, size,
mtime_ns, inode and ctime_ns (a file rewritten in place, copied over or touched back gets a new
ctime or inode, so it is hashed again). Every byte counts: a change anywhere in any layer changes
the digest. Torch-free: the launcher's resume checks and the engine both call it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from trainer.core.files import write_atomic

log = logging.getLogger(__name__)

# what a model directory holds that changes its numbers: weights, the config (and a sharded
# checkpoint's index), and the code of a `trust_remote_code` model
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".py")
MODEL_FILE_NAMES = ("config.json",)


def hash_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "oomless" / "file_hashes"


def _version(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ino": st.st_ino,
        "ctime_ns": st.st_ctime_ns,
    }


def file_sha256(path: Path) -> str:
    """The SHA-256 of every byte of `path`: from the cache while the file is unchanged, else
    read whole (and cached when it did not change while being read)."""
    real = Path(os.path.realpath(path))
    before = _version(real.stat())
    entry = hash_cache_dir() / f"{hashlib.sha256(str(real).encode()).hexdigest()[:32]}.json"
    cached = _read_entry(entry)
    if cached.get("path") == str(real) and cached.get("version") == before:
        return str(cached["sha256"])
    with real.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if _version(real.stat()) == before:
        record = {"path": str(real), "version": before, "sha256": digest}
        try:
            write_atomic(entry, json.dumps(record) + "\n")
        except OSError as err:  # costs the hash again next time, nothing more
            log.debug("file hashes: not cached at %s (%s)", entry, err)
    return digest


def _read_entry(entry: Path) -> dict[str, Any]:
    try:
        record = json.loads(entry.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def model_root(name_or_path: str, revision: str | None) -> Path | None:
    """The local directory of a model: the path itself, or a Hub id's snapshot in the local
    Hub cache; None where there is none (not downloaded)."""
    root = Path(name_or_path).expanduser()
    if root.is_dir():
        return root
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the local cache (or no hub): nothing to hash
        return None


def model_file_digests(root: Path) -> dict[str, str]:
    """{path relative to root: sha256} of every file under `root` that changes the model's
    numbers (`MODEL_FILE_SUFFIXES`, `MODEL_FILE_NAMES`, `*.index.json`), hidden dirs aside."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        name = path.name
        if (
            path.suffix in MODEL_FILE_SUFFIXES
            or name in MODEL_FILE_NAMES
            or name.endswith(".index.json")
        ):
            out[rel.as_posix()] = file_sha256(path)
    return out
