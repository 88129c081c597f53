"""Writing run files so that a crash, a full disk or a second reader never sees half of one.

Torch-free: the launcher and the engine both write run files through here. Every rewrite goes to a
temporary file in the same directory, is fsynced, and replaces the old file with one rename;
the directory is fsynced after it, so the rename itself survives a power cut. Run files can hold
paths and commands: they are written 0600 and new run directories are made 0700.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def write_atomic(path: str | Path, data: str | bytes, mode: int = PRIVATE_FILE_MODE) -> Path:
    """Replace `path` with `data` in one rename: readers see the old file or the new one."""
    path = Path(path)
    make_private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def make_private_dir(path: str | Path) -> Path:
    """mkdir -p; the directories it creates are 0700 (existing ones keep their mode)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
    return path


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask_mode(mode: int = 0o777) -> int:
    """`mode` as the user's umask would leave it for a newly created file or directory."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def write_json(path: str | Path, obj: object) -> Path:
    """`obj` as indented JSON, written atomically."""
    return write_atomic(path, json.dumps(obj, indent=2) + "\n")


def absolute_path(path: str | Path) -> str:
    """`~` expanded, symlinks resolved: the same run dir whatever the working directory."""
    return str(Path(path).expanduser().resolve())
