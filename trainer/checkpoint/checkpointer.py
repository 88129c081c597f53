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

import json
import logging
import os
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save

from trainer.checkpoint.layout import SafeFileSystemReader, flatten_state, unflatten_state
from trainer.checkpoint.manifest import (
    STATE_FILE,
    HashingFileSystem,
    digests_of,
    write_manifest,
)
from trainer.checkpoint.store import (
    abandon_later,
    checkpoints_dir,
    fsync_dir,
    fsync_tree,
    is_complete,
    prune,
    step_of,
    write_json_durably,
    write_latest,
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
from trainer.core.methods import reference_source
from trainer.model.finetune import base_pointer, check_same_base
from trainer.objectives.reference_key import base_identity, check_same_reference
from trainer.optim import fp32_moments
from trainer.runtime.dist import (
    after_rank0,
    all_reduce_max,
    is_distributed,
    slow_down,
    wait_for_future,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
# A one-process run saves and loads without a process group (no_dist) on purpose; torch warns
# on every save that it assumes so.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent is",
    category=UserWarning,
)

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
        self.reference: dict[str, Any] | None = None  # dpo: the reference's base, once hashed
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
        self._needed_bytes = _state_bytes(flat, dist.get_world_size() if is_distributed() else 1)
        with _disk_full_is_one_line(self.root, step, tmp, self._needed_bytes):
            if self.rank == 0:
                if tmp.is_symlink():  # a planted link: removed, never followed out of run.dir
                    tmp.unlink()
                shutil.rmtree(tmp, ignore_errors=True)
            together(lambda: _make_tmp(tmp, self.rank))
            rng = tmp / "rng" / f"rank_{self.rank}.safetensors"
            together(lambda: _write_bytes(rng, save(rng_state())))
            writer = dcp.FileSystemWriter(str(tmp))
            writer.fs = fs = HashingFileSystem()  # checksums for the manifest, while writing
            if asynchronous:
                group = self._background_group()
                future = together(
                    lambda: dcp.async_save(
                        flat, storage_writer=writer, process_group=group, no_dist=group is None
                    ),
                    fs,
                )
                self._pending = (future, step, tmp, trainer_state, fs)
                return self.root / f"step_{step}"
            together(
                lambda: dcp.save(flat, storage_writer=writer, no_dist=not is_distributed()), fs
            )
            return self._complete(step, tmp, trainer_state, fs)

    def _background_group(self) -> Any:
        """A process group of its own for DCP's collectives in a background write: on the
        default group they would interleave with training's and mismatch (gloo aborts)."""
        if not is_distributed():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @property
    def step_in_flight(self) -> int | None:
        """The step of a checkpoint still being written in the background, if any."""
        return self._pending[1] if self._pending is not None else None

    def finish(self) -> None:
        """Complete a checkpoint still being written in the background (a collective)."""
        if self._pending is None:
            return
        future, step, tmp, trainer_state, fs = self._pending
        self._pending = None
        what = f"the background write of checkpoint step_{step}"
        with _disk_full_is_one_line(self.root, step, tmp, self._needed_bytes):
            together(lambda: wait_for_future(future, what, self.cfg.dist.timeout_s), fs)
            self._complete(step, tmp, trainer_state, fs)

    def _complete(
        self, step: int, tmp: Path, trainer_state: dict[str, Any], fs: HashingFileSystem
    ) -> Path:
        cfg, crash = self.cfg, lambda what: _crash.reached(self.cfg, what)
        final = self.root / f"step_{step}"
        crash("shards and rng written")
        mine = [Path(p) for p in fs.written] + [tmp / "rng" / f"rank_{self.rank}.safetensors"]
        parts = _gather(
            together(lambda: digests_of(tmp, [p for p in mine if p.is_file()], fs.written))
        )

        def complete_on_rank0() -> None:  # the others wait on it, not on dist.timeout_s
            slow_down(cfg, "checkpoint_s")
            write_config(cfg, tmp)
            crash("config written")
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp / "tokenizer")
                crash("tokenizer written")
            write_manifest(tmp, parts)
            fsync_tree(tmp, lambda name: crash(f"fsync {name}"))
            state = dict(trainer_state, step=step, config_hash=semantic_hash(cfg))
            if self.data_fingerprint is not None:
                state["data_fingerprint"] = self.data_fingerprint
            if cfg.finetune.method != "full":  # adapters only: say which base they belong to
                state["base"] = self.base or base_pointer(cfg.model)
                self.base = state["base"]
            if reference_source(cfg.objective.type, cfg.finetune.method) is not None:
                # DPO: the base its reference comes from, by content (a resume checks it)
                self.reference = self.reference or base_identity(cfg.model)
                state["reference"] = self.reference
            write_json_durably(tmp / STATE_FILE, state)
            crash("trainer state written")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            crash("renamed")
            fsync_dir(self.root)
            write_latest(self.root, final.name, crash)
            prune(self.root, cfg.run.keep_checkpoints)
            crash("pruned")

        # a full disk on rank 0 is every rank's: they leave the save together, with one line
        full = after_rank0(
            f"writing checkpoint {final.name}",
            lambda: _full_disk_in(complete_on_rank0),
            clock_s=cfg.dist.timeout_s,
        )
        together(lambda: _raise(full))
        return final


def _gather(part: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's part (a collective, in place of a barrier); [part] without a process group."""
    if not is_distributed():
        return [part]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


# what DCP writes per tensor and rank beside its data: the record's headers and its metadata
# entry (measured: 1.6-1.9 KiB; 40% of a checkpoint of the 21k-parameter demo model)
DCP_BYTES_PER_ITEM = 2048


def _state_bytes(flat: dict[str, torch.Tensor], world_size: int) -> int:
    """About what a checkpoint of the whole state needs: its tensors' bytes (a sharded tensor
    counts whole) and DCP's records of every rank's tensors."""
    data = sum(t.numel() * t.element_size() for t in flat.values())
    return data + len(flat) * world_size * DCP_BYTES_PER_ITEM


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


def _raise(err: BaseException | None) -> None:
    if err is not None:
        raise err


def together(work: Callable[[], T], fs: HashingFileSystem | None = None) -> T:
    """`work` on every rank, then one collective in which the ranks agree on how it went, so
    that a failure on one rank never leaves another in a collective it has left:
    - a full disk on any rank (in `work`'s error, or met by `fs` on this rank: DCP hands the
      other ranks its errors without their cause) is raised on every rank, as that OSError;
    - another error is raised by the ranks that had it; the others stop (SystemExit(1), their
      log naming the rank whose error says why);
    - else `work`'s result."""
    result: Any = None
    err: BaseException | None = None
    try:
        result = work()
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        err = e
    full = disk_full(err) or (fs.full if fs is not None and err is not None else None)
    mine = None if err is None else (full.errno, full.strerror) if full else repr(err)[:300]
    parts = [mine]
    if is_distributed():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    first_full = next((p for p in parts if isinstance(p, tuple)), None)
    if first_full is not None:
        raise full or OSError(*first_full)
    if err is not None:
        raise err
    failed = next((rank for rank, p in enumerate(parts) if p is not None), None)
    if failed is not None:
        log.info("rank %d failed while writing a checkpoint: %s; stopping", failed, parts[failed])
        raise SystemExit(1)
    return result


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
        problem, fix = [None], [None]
        if not is_distributed() or dist.get_rank() == 0:  # the others are not in the dir now
            shutil.rmtree(tmp, ignore_errors=True)
            error = _no_space_line(root, step, needed_bytes, full)
            problem, fix = [error.problem], [error.fix]
        if is_distributed():  # rank 0's line (its free bytes after the removal) on every rank
            dist.broadcast_object_list(problem, src=0)
            dist.broadcast_object_list(fix, src=0)
        raise ConfigError("run.dir", problem[0], fix[0]) from None


def _no_space_line(root: Path, step: int, needed_bytes: int, full: OSError) -> ConfigError:
    """The one line of a checkpoint that did not fit: where, how much, what is kept."""
    complete = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and is_complete(p)),
        key=step_of,
        reverse=True,
    )
    previous = complete[0].name if complete else None
    if complete:  # the checkpoint before is about the size this one needs
        on_disk = sum(f.stat().st_size for f in complete[0].rglob("*") if f.is_file())
        needed_bytes = max(needed_bytes, on_disk)
    kept = f"; {previous} is kept" if previous else "; there is no earlier checkpoint"
    again = f"resumes from {previous}" if previous else "starts over"
    return no_space(
        "run.dir",
        root,
        f"checkpoint step_{step}",
        needed_bytes,
        full,
        f"free space there (or set run.dir elsewhere) and run again: it {again}",
        kept,
    )


def check_resumable(
    path: Path,
    cfg: JobConfig,
    data_fingerprint: str | Callable[[], str] | None = None,
    announce: bool = False,
) -> dict[str, Any]:
    """The checkpoint's trainer state, or a ConfigError when resuming it with `cfg` would change
    what is learned: a MATH_KEYS value (each named with both values), the training data's
    content (`data_fingerprint`, a callable is only called when the checkpoint holds one), or
    (DPO) the base its reference comes from, by every byte (`reference` in the state).
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
    if reference_source(cfg.objective.type, cfg.finetune.method) is not None:
        check_same_reference(state.get("reference"), cfg.model, path)
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
    other = _other_form_request(template, metadata)
    dcp.load(
        {**flat, **other},
        storage_reader=SafeFileSystemReader(str(path)),
        no_dist=not is_distributed(),
    )
    state["backend"] = unflatten_state(flat)
    for name, saved in unflatten_state(other)["optim"].items():
        if "exp_avg" not in saved:  # codes, for a loader that keeps fp32 moments
            saved = fp32_moments(template["model"][name].shape, saved)
        state["backend"]["optim"][name].update(saved)
    if not is_distributed() or dist.get_rank() == 0:
        abandon_later(path, Path(cfg.run.dir))
    return state


def _other_form_request(template: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """Whole tensors to read for the moments of adamw_8bit that the checkpoint holds in the other
    form than the loading rung keeps (trainer/optim.py): codes where it keeps fp32 moments (also
    a checkpoint written before that form), fp32 moments where it keeps codes."""
    request = {}
    for name, moments in template["optim"].items():
        prefix = f"optim/{name}/"
        wants, other = ("exp_avg", "state1") if "exp_avg" in moments else ("state1", "exp_avg")
        if wants not in moments or prefix + wants in metadata or prefix + other not in metadata:
            continue
        keys = ("state1", "state2", "absmax1", "absmax2", "exp_avg", "exp_avg_sq")
        for key in (k for k in keys if prefix + k in metadata):
            meta = metadata[prefix + key]
            request[prefix + key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return request


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
