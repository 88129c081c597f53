"""The one error a user's bad input raises, everywhere in oomless: its `str()` is the line printed
before exit 2 (the key, what is wrong, how to fix it)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

# a line break or other control character a message quotes from the input: written escaped
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class ConfigError(ValueError):
    """A bad config value. `str()` is the one line the user sees: key, problem, fix (a line
    break quoted from the input is escaped, `\\n`, so the line stays one)."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        line = f"config error: {key}: {problem}; {fix}"
        super().__init__(_CONTROL.sub(lambda m: repr(m.group())[1:-1], line))


def not_writable(
    key: str, path: object, err: OSError, what: str = "cannot be written"
) -> ConfigError:
    """The one line for a directory the user named that cannot be written."""
    return ConfigError(
        key,
        f"'{path}' {what} ({err.strerror or str(err) or type(err).__name__})",
        f"point {key} at a writable directory",
    )


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # std::io::Error, as safetensors says it


def disk_full(err: BaseException | None) -> OSError | None:
    """The error in `err`'s chain that says the disk is full (no space, a quota, a file-size
    limit), as an OSError; None when it is another error. DCP's per-rank failures and
    safetensors' Rust I/O errors (not OSErrors) are looked into too."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (m := _RUST_OS_ERROR.search(str(e)[-2000:])):
            code = int(m.group(1))
        if code in DISK_FULL_ERRNOS:
            if isinstance(e, OSError) and e.strerror:
                return e
            return OSError(code, os.strerror(code))
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (error, tb)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__cause__, e.__context__])
    return None


def no_space(
    key: str,
    path: Path,
    what: str,
    needed_bytes: int | None,
    err: OSError,
    fix: str,
    note: str = "",
) -> ConfigError:
    """The one line for a write that found the disk full: where, what, the bytes it needs (about)
    and the bytes free there now (after what was half-written is removed)."""
    need = f"needs about {needed_bytes:,} bytes, " if needed_bytes else ""
    return ConfigError(
        key,
        f"could not write {what} to {path}: {err.strerror} ({need}{free_bytes(path):,} free{note})",
        fix,
    )


def free_bytes(path: Path) -> int:
    """Bytes free for this user on the file system that holds `path` (or its nearest parent)."""
    existing = next((p for p in (Path(path), *Path(path).parents) if p.exists()), Path("/"))
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return 0
