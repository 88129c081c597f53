"""Path tests that a config check may run on any string a user wrote (never an OSError)."""

from __future__ import annotations

from pathlib import Path


def exists(path: Path) -> bool:
    """`path.exists()`, False for a name the OS refuses as a path (too long, a NUL byte)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def is_dir(path: Path) -> bool:
    """`path.is_dir()`, False for a name the OS refuses as a path."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def has_local_parent(path: Path, base: Path | None = None) -> bool:
    """`data/train` whose `data/` exists here: meant as a local path, not a hub id."""
    parent = path.parent
    return parent != (base or Path(".")) and parent != Path(".") and is_dir(parent)
