"""Checkpoints: sharded, atomic, portable between strategies and world sizes; HF export.

Layout of `run.dir/checkpoints/step_N/`:
  .metadata, *.distcp       torch.distributed.checkpoint of the canonical state, keyed by
                            parameter name: `model/NAME` (fp32 master weights) and
                            `optim/NAME/{exp_avg,exp_avg_sq,step}` (adamw_8bit: the codes
                            and block scales of block-aligned matrices, trainer/optim.py);
                            every rank writes its own shard (sharded tensors stay sharded)
  rng/rank_R.safetensors    every rank's RNG states
  manifest.json             every other file's size and checksum (trainer/checkpoint/manifest.py)
  trainer_state.json        step, plan, config hash, grad-scaler state; written last: a directory
                            without it was cut off mid-write and is never loaded
  config.yaml, tokenizer/   what `oomless export` needs to write an HF model directory
`checkpoints/latest` names the newest complete checkpoint and is updated after the rename.
A resume from an earlier checkpoint of the same run moves the later ones to checkpoints/abandoned/.
Resume verifies the manifest first: a damaged checkpoint is skipped with one line naming the file.

Loading never unpickles arbitrary objects: tensors come back with `weights_only=True` and DCP's
pickled metadata is read with an unpickler that admits only DCP's metadata classes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save

from trainer.checkpoint.manifest import (
    MANIFEST_FILE,
    STATE_FILE,
    HashingFileSystem,
    damage,
    digests_of,
    write_manifest,
)
from trainer.core.config import (
    ConfigError,
    JobConfig,
    read_yaml,
    resume_differences,
    semantic_hash,
    write_config,
)
from trainer.core.errors import disk_full, no_space
from trainer.model.finetune import base_pointer, check_same_base
from trainer.optim import from_legacy_8bit
from trainer.runtime.dist import (
    after_rank0,
    all_reduce_max,
    is_distributed,
    slow_down,
    wait_for_future,
)

log = logging.getLogger(__name__)
# A one-process run saves and loads without a process group (no_dist) on purpose; torch warns
# on every save that it assumes so.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent is",
    category=UserWarning,
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
        key=lambda p: _step_of(p),
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
    """A skipped checkpoint is said once per process (the launcher and the engine both look)."""
    for line in lines:
        if line not in _reported:
            _reported.add(line)
            log.warning("%s", line)


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


def _step_of(path: Path) -> int:
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


# ---------------------------------------------------------------------------------------------
# Save and load


class Checkpointer:
    """Writes checkpoints/step_N atomically; every rank calls `save` and `finish` together.

    With `run.async_checkpoint`, `save` blocks training only while DCP stages the state in host
    memory; the files are written in the background and the checkpoint is completed (trainer
    state, rename, `latest`) at the next `save` or at `finish`.
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: JobConfig,
        tokenizer: Any,
        rank: int,
        data_fingerprint: str | None = None,
    ):
        self.root = checkpoints_dir(run_dir)
        self.cfg = cfg
        self.data_fingerprint = data_fingerprint
        self.tokenizer = tokenizer
        self.rank = rank
        self._pending: tuple[Any, int, Path, dict[str, Any], HashingFileSystem] | None = None
        self.base: dict[str, Any] | None = None  # lora/qlora: the base pointer, once computed
        self._group: Any = None  # for background writes, made at the first
        self._needed_bytes = 0  # the size of the state being saved, for a full disk's line

    def save(
        self,
        step: int,
        backend_state: dict[str, Any],
        trainer_state: dict[str, Any],
        asynchronous: bool = False,
    ) -> Path:
        self.finish()
        tmp = self.root / f"step_{step}.tmp"
        flat = flatten_state(backend_state)
        self._needed_bytes = _state_bytes(flat)
        with _disk_full_is_one_line(self.root, step, tmp, self._needed_bytes):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            _agree_on_full_disk(_full_disk_in(lambda: _make_tmp(tmp, self.rank)))
            rng = tmp / "rng" / f"rank_{self.rank}.safetensors"
            _agree_on_full_disk(_full_disk_in(lambda: _write_bytes(rng, save(rng_state()))))
            writer = dcp.FileSystemWriter(str(tmp))
            writer.fs = fs = HashingFileSystem()  # checksums for the manifest, while writing
            if asynchronous:
                future = dcp.async_save(
                    flat,
                    storage_writer=writer,
                    process_group=self._background_group(),
                    no_dist=not is_distributed(),
                )
                self._pending = (future, step, tmp, trainer_state, fs)
                return self.root / f"step_{step}"
            dcp.save(flat, storage_writer=writer, no_dist=not is_distributed())
            return self._complete(step, tmp, trainer_state, fs)

    def _background_group(self) -> Any:
        """A process group of its own for DCP's collectives in a background write: on the
        default group they would interleave with training's and mismatch (gloo aborts)."""
        if not is_distributed():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def finish(self) -> None:
        """Complete a checkpoint still being written in the background (a collective)."""
        if self._pending is None:
            return
        future, step, tmp, trainer_state, fs = self._pending
        self._pending = None
        with _disk_full_is_one_line(self.root, step, tmp, self._needed_bytes):
            wait_for_future(
                future, f"the background write of checkpoint step_{step}", self.cfg.dist.timeout_s
            )
            self._complete(step, tmp, trainer_state, fs)

    def _complete(
        self, step: int, tmp: Path, trainer_state: dict[str, Any], fs: HashingFileSystem
    ) -> Path:
        cfg, crash = self.cfg, lambda what: _crash.reached(self.cfg, what)
        final = self.root / f"step_{step}"
        crash("shards and rng written")
        mine = [Path(p) for p in fs.written] + [tmp / "rng" / f"rank_{self.rank}.safetensors"]
        parts = _gather(digests_of(tmp, (p for p in mine if p.is_file()), fs.written))

        def complete_on_rank0() -> None:  # the others wait on it, not on dist.timeout_s
            slow_down(cfg, "checkpoint_s")
            write_config(cfg, tmp)
            crash("config written")
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp / "tokenizer")
                crash("tokenizer written")
            write_manifest(tmp, parts)
            _fsync_tree(tmp, lambda name: crash(f"fsync {name}"))
            state = dict(trainer_state, step=step, config_hash=semantic_hash(cfg))
            if self.data_fingerprint is not None:
                state["data_fingerprint"] = self.data_fingerprint
            if cfg.finetune.method != "full":  # adapters only: say which base they belong to
                state["base"] = self.base or base_pointer(cfg.model)
                self.base = state["base"]
            _write_json_durably(tmp / STATE_FILE, state)
            crash("trainer state written")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            crash("renamed")
            _fsync_dir(self.root)
            _write_latest(self.root, final.name, crash)
            _prune(self.root, cfg.run.keep_checkpoints)
            crash("pruned")

        # a full disk on rank 0 is every rank's: they leave the save together, with one line
        full = after_rank0(
            f"writing checkpoint {final.name}",
            lambda: _full_disk_in(complete_on_rank0),
            clock_s=cfg.dist.timeout_s,
        )
        _agree_on_full_disk(full)
        return final


def _gather(part: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's part (a collective, in place of a barrier); [part] without a process group."""
    if not is_distributed():
        return [part]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


def _state_bytes(flat: dict[str, torch.Tensor]) -> int:
    """The bytes of the whole state (a sharded tensor counts whole), what a checkpoint needs."""
    return sum(t.numel() * t.element_size() for t in flat.values())


def _make_tmp(tmp: Path, rank: int) -> None:
    if rank == 0:
        (tmp / "rng").mkdir(parents=True)


def _write_bytes(path: Path, data: bytes) -> None:
    """A small file written with Python's I/O, so a full disk is an OSError (safetensors' own
    writer raises its SafetensorError)."""
    with path.open("wb") as f:
        f.write(data)


def _full_disk_in(work: Callable[[], Any]) -> OSError | None:
    """Run `work`; the disk-full error it raised (`disk_full`), or None. Other errors propagate."""
    try:
        work()
    except BaseException as err:
        full = disk_full(err)
        if full is None:
            raise
        return full
    return None


def _agree_on_full_disk(full: OSError | None) -> None:
    """Every rank learns whether any found the disk full (a collective in place of a barrier)
    and all raise it together, so none is left waiting in the next collective."""
    if is_distributed():
        mine = None if full is None else (full.errno, full.strerror)
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        first = next((p for p in parts if p is not None), None)
        if full is None and first is not None:
            full = OSError(*first)
    if full is not None:
        raise full


@contextmanager
def _disk_full_is_one_line(root: Path, step: int, tmp: Path, needed_bytes: int) -> Iterator[None]:
    """A full disk (or quota, or file size limit) while saving: the half-written directory is
    removed, the previous checkpoint stays, and the error is one line (a ConfigError, exit 2),
    the same on every rank (all of them are here: the failure was agreed on)."""
    try:
        yield
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        full = disk_full(err)
        if full is None:
            raise
        rank0 = not is_distributed() or dist.get_rank() == 0
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        complete = sorted(
            (p for p in root.glob("step_*") if p.is_dir() and is_complete(p)),
            key=_step_of,
            reverse=True,
        )
        previous = complete[0].name if complete else None
        if complete:  # the checkpoint before is about the size this one needs
            on_disk = sum(f.stat().st_size for f in complete[0].rglob("*") if f.is_file())
            needed_bytes = max(needed_bytes, on_disk)
        kept = f"; {previous} is kept" if previous else "; there is no earlier checkpoint"
        again = f"resumes from {previous}" if previous else "starts over"
        error = no_space(
            "run.dir",
            root,
            f"checkpoint step_{step}",
            needed_bytes,
            full,
            f"free space there (or set run.dir elsewhere) and run again: it {again}",
            kept,
        )
        problem = [error.problem]
        if is_distributed():  # rank 0's line (its free bytes after the removal) on every rank
            dist.broadcast_object_list(problem, src=0)
        raise ConfigError(error.key, problem[0], error.fix) from None


def check_resumable(
    path: Path,
    cfg: JobConfig,
    data_fingerprint: str | Callable[[], str] | None = None,
    announce: bool = False,
) -> dict[str, Any]:
    """The checkpoint's trainer state, or a ConfigError when resuming it with `cfg` would change
    what is learned: a MATH_KEYS value (each named with both values) or the training data's
    content (`data_fingerprint`, a callable is only called when the checkpoint holds one).
    Other changes are allowed; with `announce` they are logged."""
    state = json.loads((path / STATE_FILE).read_text())
    saved = (
        read_yaml((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    )
    math, other = resume_differences(saved or {}, cfg)
    fix = "resume with the values it was trained with, or set run.resume=never (or a new run.dir)"
    if math:
        raise ConfigError(
            "run.resume",
            f"checkpoint {path} was trained with different settings ({'; '.join(math)})",
            fix,
        )
    saved_fingerprint = state.get("data_fingerprint")
    if saved_fingerprint is not None and data_fingerprint is not None:
        now = data_fingerprint() if callable(data_fingerprint) else data_fingerprint
        if now != saved_fingerprint:
            raise ConfigError(
                "run.resume",
                f"checkpoint {path} was trained on other data: the tokenised content of "
                f"data.path changed (fingerprint {saved_fingerprint} -> {now})",
                fix,
            )
    if cfg.finetune.method != "full":
        check_same_base(state.get("base"), cfg.model, path)
    if other and announce:
        log.info("resuming %s with changed settings that keep the math: %s", path, "; ".join(other))
    return state


def load_checkpoint(
    path: Path, template: dict[str, Any], cfg: JobConfig, data_fingerprint: str | None = None
) -> dict[str, Any]:
    """Fill the backend's template from a checkpoint; returns the trainer state.

    Refuses a checkpoint trained with other math (`check_resumable`); strategy, world size,
    micro-batch and the other keys outside MATH_KEYS may change.
    """
    state = check_resumable(path, cfg, data_fingerprint)
    metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    stored = set(metadata)
    flat = flatten_state(template)
    missing = sorted(k for k in flat if k.startswith("model/") and k not in stored)
    # Ranks may ask for different keys (DeepSpeed: each rank its own parameters): all of them
    # stop here together, before DCP's collectives, when any misses one.
    if is_distributed() and all_reduce_max(len(missing), torch.device("cpu")) and not missing:
        missing = ["model/(a weight another rank loads)"]
    if missing:
        raise ConfigError(
            "run.resume",
            f"checkpoint {path} has no {missing[0].removeprefix('model/')} ({len(missing)} "
            "weights missing): it belongs to another model",
            "resume with the model it was written for",
        )
    # Parameters that had no optimizer state when saved (never stepped) keep a fresh one.
    flat = {k: v for k, v in flat.items() if k in stored}
    legacy = _legacy_8bit_request(template, metadata)
    dcp.load(
        {**flat, **legacy},
        storage_reader=SafeFileSystemReader(str(path)),
        no_dist=not is_distributed(),
    )
    state["backend"] = unflatten_state(flat)
    for name, saved in unflatten_state(legacy)["optim"].items():
        shape = template["model"][name].shape
        state["backend"]["optim"][name].update(from_legacy_8bit(shape, saved))
    if not is_distributed() or dist.get_rank() == 0:
        abandon_later(path, Path(cfg.run.dir))
    return state


def _legacy_8bit_request(template: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """Whole tensors to read for the moments a checkpoint from before the 8-bit canonical form
    (trainer/optim.py) holds as bitsandbytes kept them, where the template asks for fp32 ones."""
    request = {}
    for name, moments in template["optim"].items():
        prefix = f"optim/{name}/"
        if "exp_avg" not in moments or prefix + "exp_avg" in metadata:
            continue
        if prefix + "state1" not in metadata:
            continue
        for key in ("state1", "state2", "absmax1", "absmax2"):
            if prefix + key in metadata:
                meta = metadata[prefix + key]
                request[prefix + key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return request


ABANDONED_DIR = "abandoned"


def abandon_later(path: Path, run_dir: Path) -> list[Path]:
    """A run that resumes from an earlier checkpoint of its own run dir abandons the later ones:
    they move to checkpoints/abandoned/ (one warning) and `latest` names `path`, so that the next
    `run.resume: auto` follows this branch, not the abandoned one. Returns where they went."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir() or path.resolve().parent != root.resolve():
        return []  # another run's checkpoint: this run's own are not a branch of it
    step = _step_of(path)
    later = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
        key=_step_of,
    )
    later = [p for p in later if _step_of(p) > step]
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
    _fsync_dir(aside)
    _write_latest(root, path.name, lambda what: None)
    log.warning(
        "resuming from %s: the later checkpoints of this run (%s) are an abandoned branch, "
        "moved to %s; run.resume=auto now follows this one",
        path.name,
        ", ".join(p.name for p in later),
        aside,
    )
    return moved


def restore_rng(path: Path, rank: int) -> None:
    """Restore this rank's RNG (a rank with no saved state, after a world-size change, reseeds)."""
    f = path / "rng" / f"rank_{rank}.safetensors"
    if not f.is_file():
        return
    states = load_file(str(f))
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def rng_state() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


class _CrashPoints:
    """Fault injection for tests: `debug.crash_in_save: N` SIGKILLs this process at the N-th
    point inside its saves, counted over the whole process (shards written, each fsync, the
    trainer state, the rename, `latest`, pruning)."""

    def __init__(self) -> None:
        self.count = 0

    def reached(self, cfg: JobConfig, what: str) -> None:
        target = cfg.debug.crash_in_save
        if target is None:
            return
        self.count += 1
        if str(self.count) == str(target):
            log.error("debug.crash_in_save=%s: killed at %s", target, what)
            os.kill(os.getpid(), signal.SIGKILL)


_crash = _CrashPoints()


def _write_json_durably(path: Path, obj: dict[str, Any]) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path, after_each: Callable[[str], None]) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
            after_each(str(p.relative_to(root)))
    for d in sorted(p for p in root.rglob("*") if p.is_dir()):
        _fsync_dir(d)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(root: Path, name: str, after_each: Callable[[str], None]) -> None:
    tmp = root / "latest.tmp"
    tmp.write_text(name + "\n")
    after_each("latest.tmp written")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.replace(root / "latest")
    _fsync_dir(root)
    after_each("latest replaced")


def _prune(root: Path, keep: int) -> None:
    complete = sorted(
        (p for p in root.iterdir() if p.is_dir() and is_complete(p)), key=_step_of, reverse=True
    )
    for old in complete[keep:]:
        (old / STATE_FILE).unlink()  # incomplete first, so a cut-off prune is never loaded
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


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
    dcp.load(flat, storage_reader=SafeFileSystemReader(str(path)), no_dist=not is_distributed())
    return {key.removeprefix("model/"): t for key, t in flat.items()}
