"""The checkpoints of a run dir: which are complete and intact, the newest one, `latest`,
durable writes, pruning, and the branch a rollback abandons (docs/checkpoints.md)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint.layout import SafeFileSystemReader
from trainer.checkpoint.manifest import MANIFEST_FILE, STATE_FILE, damage
from trainer.core.config import ConfigError, JobConfig
from trainer.core.files import PRIVATE_FILE_MODE, write_by_name
from trainer.core.run_lock import LOCK_OWNER_ENV
from trainer.observe.metrics import strict_json

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Finding checkpoints


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; incomplete and damaged ones
    are reported (one line each) and skipped. A ConfigError when every complete one is damaged:
    resuming none of them silently would start the run over."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    candidates = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")),
        key=lambda p: step_of(p),
        reverse=True,
    )
    skipped, damaged = [], []
    for path in candidates:
        if not is_complete(path):
            skipped.append(f"checkpoint {path} is incomplete (cut off mid-write): skipped")
        elif (why := checkpoint_damage(path)) is None:
            _report_once(skipped)
            return path
        else:
            damaged.append(why)
            skipped.append(f"checkpoint {path.name} is damaged: {why}; skipped")
    if damaged:  # the one line is this error, not the skipped ones
        raise ConfigError(
            "run.resume",
            f"every checkpoint in {root} is damaged ({len(damaged)}; newest: {damaged[0]})",
            "restore them from a copy, or set run.resume=never (or a new run.dir) to start over",
        )
    _report_once(skipped)
    return None


_reported: set[str] = set()


def _report_once(lines: list[str]) -> None:
    """A skipped checkpoint is said once per process (the launcher and the engine both look);
    by an engine that `oomless train` started, not at all: the launcher looked first and said it."""
    level = logging.DEBUG if LOCK_OWNER_ENV in os.environ else logging.WARNING
    for line in lines:
        if line not in _reported:
            _reported.add(line)
            log.log(level, "%s", line)


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint (`damage`: its files against its manifest), in
    words naming the file; without a manifest, DCP's .metadata is read and every shard must hold
    the byte ranges it names (a truncated or missing shard is found, flipped bytes are not)."""
    why = damage(path)
    if why is not None or (path / MANIFEST_FILE).is_file():
        return why
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
        ends: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            end = int(info.offset) + int(info.length)
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    except Exception as err:  # a garbled pickle raises anything: it is damage, said in a line
        return f"{path / '.metadata'} is not readable ({type(err).__name__})"
    for rel, end in sorted(ends.items()):
        shard = path / rel
        if not shard.is_file():
            return f"{shard} is missing"
        if shard.stat().st_size < end:
            return f"{shard} is {shard.stat().st_size} bytes, .metadata needs {end} (truncated?)"
    return None


def check_intact(path: Path, key: str) -> None:
    """A ConfigError naming the file when a complete checkpoint is damaged (`checkpoint_damage`)."""
    why = checkpoint_damage(path)
    if why is not None:
        raise ConfigError(
            key, f"checkpoint {path} is damaged: {why}", "give another checkpoint (an older step_N)"
        )


def step_of(path: Path) -> int:
    digits = path.name.removeprefix("step_").split(".")[0]
    return int(digits) if digits.isdigit() else -1


def resolve_resume(cfg: JobConfig) -> Path | None:
    """The checkpoint to resume from, per `run.resume` (auto | never | PATH)."""
    if cfg.run.resume == "never":
        return None
    if cfg.run.resume == "auto":
        return find_latest(Path(cfg.run.dir))
    path = Path(cfg.run.resume).expanduser()
    if not is_complete(path):
        raise ConfigError(
            "run.resume", f"'{path}' is not a complete checkpoint", "give a checkpoints/step_N dir"
        )
    check_intact(path, "run.resume")
    return path


ABANDONED_DIR = "abandoned"


def abandon_later(path: Path, run_dir: Path) -> list[Path]:
    """A run that resumes from an earlier checkpoint of its own run dir abandons the later ones:
    they move to checkpoints/abandoned/ (one warning) and `latest` names `path`, so that the next
    `run.resume: auto` follows this branch, not the abandoned one. Returns where they went."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir() or path.resolve().parent != root.resolve():
        return []  # another run's checkpoint: this run's own are not a branch of it
    step = step_of(path)
    later = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
        key=step_of,
    )
    later = [p for p in later if step_of(p) > step]
    if not later:
        return []
    aside = root / ABANDONED_DIR
    aside.mkdir(exist_ok=True)
    moved = []
    for p in later:
        target, n = aside / p.name, 1
        while target.exists():  # abandoned twice: keep both
            target, n = aside / f"{p.name}.{n}", n + 1
        p.rename(target)
        moved.append(target)
    fsync_dir(aside)
    write_latest(root, path.name, lambda what: None)
    log.warning(
        "resuming from %s: the later checkpoints of this run (%s) are an abandoned branch, "
        "moved to %s; run.resume=auto now follows this one",
        path.name,
        ", ".join(p.name for p in later),
        aside,
    )
    return moved


def write_json_durably(path: Path, obj: dict[str, Any]) -> None:
    """Strict JSON (a NaN or infinity as null), fsynced."""
    with path.open("w") as f:
        f.write(strict_json(obj, indent=2))
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: Path, after_each: Callable[[str], None]) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
            after_each(str(p.relative_to(root)))
    for d in sorted(p for p in root.rglob("*") if p.is_dir()):
        fsync_dir(d)
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(root: Path, name: str, after_each: Callable[[str], None]) -> None:
    """`latest` replaced through a fresh temporary name (a planted link is never written)."""

    def fill(tmp: Path) -> None:
        tmp.write_text(name + "\n")  # a name mkstemp just made: no link can be there
        after_each("latest.tmp written")
        with tmp.open("rb") as f:
            os.fsync(f.fileno())

    write_by_name(root / "latest", fill, PRIVATE_FILE_MODE)
    after_each("latest replaced")


def prune(root: Path, keep: int) -> None:
    complete = sorted(
        (p for p in root.iterdir() if p.is_dir() and is_complete(p)), key=step_of, reverse=True
    )
    for old in complete[keep:]:
        (old / STATE_FILE).unlink()  # incomplete first, so a cut-off prune is never loaded
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
