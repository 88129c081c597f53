"""Writing run files so that a crash, a full disk, a second reader or a planted link never sees
or gets half of one.

Torch-free: the launcher and the engine both write run files through here. Every rewrite goes
to a fresh temporary file in the same directory (created exclusively, so no existing name is ever
opened), is fsynced, and replaces the old name with one rename: a symbolic link planted at that
name is replaced, never written through. The directory is fsynced after it, so the rename itself
survives a power cut. Appends (metrics.jsonl, escalations.jsonl) are one `os.write` of a whole
line (escalations fsynced), opened with O_NOFOLLOW: a kill leaves the line whole or absent, and a
link at that name is refused with one line. Readers of those files drop a torn line with a
warning (`read_jsonl`). Run files can hold paths and commands: they are written 0600 and new run
directories are made 0700.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.core.contract import (
    ESCALATIONS_FILE,
    HANG_DIR,
    METRICS_FILE,
    PROFILE_DIR,
    TORCHRUN_LOG,
)
from trainer.core.errors import ConfigError

log = logging.getLogger(__name__)

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def write_atomic(path: str | Path, data: str | bytes, mode: int = PRIVATE_FILE_MODE) -> Path:
    """Replace `path` with `data` in one rename: readers see the old file or the new one."""
    raw = data.encode() if isinstance(data, str) else data

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())

    return write_by_name(path, fill, mode)


def write_by_name(path: str | Path, write: Callable[[Path], object], mode: int) -> Path:
    """For a library that writes a file only by name (a profiler's trace): it writes a fresh
    temporary name in the same directory, which replaces `path` in one rename, as in
    `write_atomic`."""
    path = Path(path)
    make_private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def append_line(
    path: str | Path, line: str, durable: bool = True, mode: int = PRIVATE_FILE_MODE
) -> None:
    """Append `line` (one line, newline added) to `path` in one write (fsynced when `durable`:
    a record that must survive a power cut, not a metrics line per step).

    A line torn by an earlier kill is ended first, so the new line stays whole and readable.
    A symbolic link at `path` is refused (ConfigError), never followed.
    """
    path = Path(path)
    data = (line.rstrip("\n") + "\n").encode()
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise link_refused(path) from None
        raise
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        os.write(fd, data)  # one write: O_APPEND puts it at the end whole
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def refuse_links(run_dir: str | Path) -> None:
    """ConfigError when a file oomless appends to in `run_dir`, or a directory it writes files
    into, is a symbolic link (files it rewrites need no check: the rename replaces a link)."""
    # the trackers' libraries write their files by name into these directories of run.dir
    trackers = ("tensorboard", "mlruns", "wandb")
    for name in (METRICS_FILE, ESCALATIONS_FILE, TORCHRUN_LOG, HANG_DIR, PROFILE_DIR, *trackers):
        if (Path(run_dir) / name).is_symlink():
            raise link_refused(Path(run_dir) / name)


def run_subdir(run_dir: str | Path, name: str) -> Path:
    """run_dir/name as a directory of the run's own (made 0700 when missing); a symbolic link
    there is refused (ConfigError), never followed out of run.dir."""
    path = Path(run_dir) / name
    if path.is_symlink():
        raise link_refused(path)
    return make_private_dir(path)


def link_refused(path: Path) -> ConfigError:
    """The one line for a symbolic link found where oomless writes a run file."""
    return ConfigError(
        str(path),
        f"is a symbolic link (to '{os.readlink(path)}'); oomless never writes through one",
        "remove the link (the file is written anew)",
    )


def read_jsonl(path: str | Path, warn: bool = True) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl side file, one per line; [] when there is none.

    Never fails a run: a line that is not a JSON object (torn by a kill, edited by hand) is
    dropped, with one warning when `warn`; a symbolic link is not followed (read as no file).
    """
    path = Path(path)
    if path.is_symlink():
        if warn:
            log.warning("%s is a symbolic link: not read (oomless never follows one)", path)
        return []
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    except OSError as err:  # a directory, unreadable
        if warn:
            log.warning("%s: not read (%s); going on without it", path, err.strerror)
        return []
    records, bad = [], []
    for num, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad.append(num)
    if bad and warn:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        what = "an incomplete last line" if bad == [num] else f"line {bad[0]}{more}"
        log.warning("%s: dropped %s (not a JSON object: cut off by a kill, or edited)", path, what)
    return records


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON object side file (trackers.json, oom-report.json); {} when it is absent, a link,
    or not a JSON object (one warning: the run goes on without what it held)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        if path.is_symlink():
            raise ValueError("a symbolic link, not followed")
        obj = json.loads(path.read_bytes())
        if not isinstance(obj, dict):
            raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    except (OSError, ValueError) as err:
        log.warning("%s: not read (%s); going on without it", path, str(err).splitlines()[0])
        return {}
    return obj


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
