"""A checkpoint's manifest: every file's size and checksum, computed while the file is written and
verified before the checkpoint is loaded.

DCP's files go through `HashingFileSystem`, which hashes each byte as it passes to the file, so a
checksum costs no second read; the few small files written otherwise (RNG states, the config, the
tokenizer) are hashed after they are written. `manifest.json` names each file under the checkpoint
with its size in bytes and its digest (xxh3-128 where the `xxhash` package is installed, else
sha256). `damage` reads it back: a missing or truncated file, or one whose bytes changed, is what
it reports; a checkpoint without a manifest (written before there were manifests) is not checked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import threading
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from trainer.core.errors import disk_full

MANIFEST_FILE = "manifest.json"
STATE_FILE = "trainer_state.json"
NOT_HASHED = (MANIFEST_FILE, STATE_FILE)  # the manifest itself; the state is JSON-checked
ALGORITHM = "xxh3_128" if importlib.util.find_spec("xxhash") else "sha256"
_CHUNK_BYTES = 8 << 20


def new_hash(algorithm: str = ALGORITHM) -> Any:
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    digest = new_hash(algorithm)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class _HashingStream:
    """A file opened for writing, hashing what is written through it (DCP writes sequentially:
    `write` and `tell` are all it uses, besides closing, flushing and fsync)."""

    def __init__(self, raw: Any):
        self.raw, self.digest, self.num_bytes = raw, new_hash(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self.digest.update(view[:written])
        self.num_bytes += written
        return written

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        if name in ("seek", "truncate"):  # would make the running digest wrong
            raise AttributeError(name)
        return getattr(self.raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording (size, digest) of every file it writes, and the first
    disk-full error met while writing (`full`): DCP sends a rank's error to the others pickled,
    which drops its cause (torch.save's "unexpected pos" RuntimeError over the OSError), so the
    rank that met it keeps it here."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, tuple[int, str]] = {}
        self.full: OSError | None = None
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        try:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = _HashingStream(stream)
                yield hashing
        except BaseException as err:
            self.full = self.full or disk_full(err)
            raise
        with self._lock:
            self.written[str(path)] = (hashing.num_bytes, hashing.digest.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if str(path) in self.written:
                self.written[str(new_path)] = self.written.pop(str(path))


def digests_of(root: Path, files: Iterable[Path], known: dict[str, tuple[int, str]]) -> dict:
    """{path relative to root: [size, digest]} of `files`: from `known` (hashed while written)
    where it holds the file at its present size, else read back."""
    out: dict[str, list[Any]] = {}
    for path in files:
        size = path.stat().st_size
        entry = known.get(str(path))
        digest = entry[1] if entry is not None and entry[0] == size else file_digest(path)
        out[str(path.relative_to(root))] = [size, digest]
    return out


def write_manifest(root: Path, parts: list[dict[str, list[Any]]]) -> dict[str, Any]:
    """manifest.json for every file under `root` (but itself and the trainer state): the ranks'
    `parts` (their own files, hashed while written), the rest hashed now. Returns it."""
    known = {str(root / rel): tuple(entry) for part in parts for rel, entry in part.items()}
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and str(p.relative_to(root)) not in NOT_HASHED
    )
    manifest = {"algorithm": ALGORITHM, "files": digests_of(root, files, known)}
    with (root / MANIFEST_FILE).open("w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files, in words naming the file; None when they
    match the manifest (or there is no manifest: an older checkpoint). A manifest that is not
    one oomless writes (not JSON, an unknown algorithm, an entry that is not [size, digest])
    is damage too: what it would vouch for cannot be checked."""
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"{path / STATE_FILE} is not readable JSON"
    if not (path / MANIFEST_FILE).is_file():
        return None
    entries = _manifest_entries(path)
    if isinstance(entries, str):
        return entries
    algorithm, files = entries
    for file, size, _ in files:  # sizes first: a truncated file is found without reading
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} is {file.stat().st_size} bytes, the manifest says {size} (truncated?)"
    if algorithm == "xxh3_128" and ALGORITHM != algorithm:
        return None  # written where xxhash was installed, read where it is not: sizes only
    for file, _, digest in files:
        if file_digest(file, algorithm) != digest:
            return f"{file} does not match its checksum (its bytes changed since it was written)"
    return None


KNOWN_ALGORITHMS = ("xxh3_128", "sha256")  # what write_manifest ever writes


def _manifest_entries(path: Path) -> tuple[str, list[tuple[Path, int, str]]] | str:
    """(algorithm, [(file, size, digest)]) of a checkpoint's manifest, or what is wrong with it."""
    where = path / MANIFEST_FILE
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError):
        return f"{where} is not readable JSON"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"{where} is not a manifest (no 'files' mapping)"
    algorithm = manifest.get("algorithm")
    if algorithm not in KNOWN_ALGORITHMS:
        return f"{where} names an unknown checksum algorithm ({_short(algorithm)})"
    entries = []
    for rel, entry in sorted(manifest["files"].items()):
        name = Path(rel)
        if name.is_absolute() or ".." in name.parts:
            return f"{where} names a file outside the checkpoint ({_short(rel)})"
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and entry[0] >= 0
            and isinstance(entry[1], str)
        ):
            return f"{where} has {_short(entry)} for {_short(rel)}, not [size in bytes, digest]"
        entries.append((path / name, entry[0], entry[1]))
    return algorithm, entries


def _short(value: Any) -> str:
    """A value from a file, quoted for one line (at most 40 characters)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
