"""Checks before anything is written into run.dir or launched: bad input exits 2 in one line.

- `check_run_dir`: run.dir is a directory (or can become one) that this user can write, and a
  run never writes over a file the user put there (their job file, a saved plan.json): a
  directory not marked by a run (`.oomless-run`, written first by `ensure_run_dir`) that holds a
  file by a name the run writes is refused. A directory from before the marker that holds what
  only a run writes (metrics.jsonl, checkpoints/latest, ...) is a run's, and is marked when taken.
- `check_rows`: every row of the local data reads and has its fields (torch-free, so a broken
  file answers as fast as it is read; it runs before the plan).
- `tokenize_data`: an inline `model.config` checked by its transformers config class
  (`check_model`), then the data tokenised once into the cache, so a problem only transformers
  or the tokenizer sees stops here too, and the ranks start on a warm cache.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

from trainer.core.config import ConfigError, JobConfig
from trainer.core.contract import (
    CHECKPOINTS_DIR,
    CONFIG_ERROR_FILE,
    CONFIG_FILE,
    ESCALATIONS_FILE,
    FINAL_DIR,
    HANG_DIR,
    HANG_REPORT_FILE,
    JOB_FILE,
    LATEST_LINK,
    METRICS_FILE,
    OOM_REPORT_FILE,
    PLAN_FILE,
    PROBE_FILE,
    PROFILE_DIR,
    RUN_LOCK_FILE,
    RUN_MARKER,
    TORCHRUN_LOG,
    TRACKERS_FILE,
)
from trainer.core.errors import disk_full, no_space, not_writable
from trainer.core.files import refuse_links, write_atomic

log = logging.getLogger(__name__)


def check_run_dir(path: str | Path) -> None:
    """Raise ConfigError when run.dir is a file, lies under a file, or cannot be written.

    Nothing is created here; `ensure_run_dir` creates it once the other checks have passed.
    A symbolic link planted where oomless appends a run file is refused too.
    """
    p = Path(path)
    existing = next(q for q in (p, *p.parents) if q.exists())
    if not existing.is_dir():
        where = "is a file" if existing == p else f"lies under '{existing}', which is a file"
        raise ConfigError("run.dir", f"'{p}' {where}", "point run.dir at a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            "run.dir",
            f"'{p}' cannot be written ('{existing}' is not writable by this user)",
            "point run.dir at a writable directory",
        )
    if existing == p:
        check_run_owner(p)
        refuse_links(p)


# what only a run writes: a directory that holds one is a run's from before RUN_MARKER
_ONLY_A_RUN_WRITES = (
    METRICS_FILE,
    ESCALATIONS_FILE,
    RUN_LOCK_FILE,
    OOM_REPORT_FILE,
    TORCHRUN_LOG,
    f"{CHECKPOINTS_DIR}/{LATEST_LINK}",
    f"{HANG_DIR}/{HANG_REPORT_FILE}",
)
# what a run (or `oomless submit`) writes at run.dir's top, where a user's file would be lost
_A_RUN_WRITES = (
    CONFIG_FILE,
    PLAN_FILE,
    JOB_FILE,
    "submit.sbatch",
    "trainjob.yaml",
    CONFIG_ERROR_FILE,
    TRACKERS_FILE,
    PROBE_FILE,
    "requeue.json",
    FINAL_DIR,
    CHECKPOINTS_DIR,
    HANG_DIR,
    PROFILE_DIR,
)


def check_inputs_are_not_run_files(cfg: JobConfig) -> None:
    """ConfigError (exit 2) when an input (the data, the model, the tokenizer) is, or lies in,
    a file or directory of run.dir that the run writes (`data.path=exp/metrics.jsonl
    run.dir=exp`, `model.name_or_path=exp/final run.dir=exp`): the run would overwrite it."""
    run_dir = Path(cfg.run.dir).expanduser().resolve()
    inputs = {
        "data.path": cfg.data.path,
        "data.eval_path": cfg.data.eval_path,
        "model.name_or_path": cfg.model.name_or_path,
        "model.tokenizer": cfg.model.tokenizer,
    }
    written = (*_ONLY_A_RUN_WRITES, *_A_RUN_WRITES, RUN_MARKER)
    for key, value in inputs.items():
        if not value or not os.path.lexists(Path(value).expanduser()):
            continue  # a hub id, or nothing there
        path = Path(value).expanduser().resolve()
        for name in written:
            if path == run_dir / name or (run_dir / name) in path.parents:
                raise ConfigError(
                    key,
                    f"'{value}' is run.dir's {name}, which this run writes",
                    "move it out of run.dir, or point run.dir elsewhere",
                )


def check_run_owner(run_dir: Path) -> None:
    """ConfigError (exit 2) when the existing directory `run_dir` is not a run's (marked by one,
    or from before the marker holding what only a run writes) and holds a file that the run
    would overwrite: the user's job file, a plan.json they saved."""
    if (run_dir / RUN_MARKER).exists():
        return
    if any(os.path.lexists(run_dir / name) for name in _ONLY_A_RUN_WRITES):
        return  # a run's directory from before the marker: it resumes
    if _holds_a_checkpoint(run_dir / CHECKPOINTS_DIR):
        return  # a checkpoint put there to resume from (`run.resume: auto` finds it)
    names = set(os.listdir(run_dir))
    clobbered = [n for n in _A_RUN_WRITES if n in names]
    clobbered += sorted(n for n in names if n.startswith("load_rank") and n.endswith(".json"))
    if clobbered:
        raise ConfigError(
            "run.dir",
            f"'{run_dir}' is not a run's directory (no {RUN_MARKER}) and holds "
            f"{run_dir / clobbered[0]}, which this run would overwrite",
            "point run.dir at a new or empty directory, or move that file out of it",
        )


def _holds_a_checkpoint(checkpoints: Path) -> bool:
    """Whether `checkpoints` is a directory holding a `step_N` directory (only a run writes one;
    a user may copy one in to resume from it)."""
    if not checkpoints.is_dir() or checkpoints.is_symlink():
        return False
    return any(p.name.startswith("step_") and p.is_dir() for p in checkpoints.iterdir())


_MARKER_TEXT = "a run directory of oomless: a run writes here (docs/interface.md)\n"


def ensure_run_dir(path: str | Path) -> None:
    """Create run.dir and mark it a run's (RUN_MARKER, first); a failure (a read-only or virtual
    file system) is a config error."""
    p = Path(path)
    marker = p / RUN_MARKER
    try:
        p.mkdir(parents=True, exist_ok=True)
        if not marker.is_file() or marker.is_symlink():
            write_atomic(marker, _MARKER_TEXT)
    except OSError as err:
        full = disk_full(err)
        if full is not None:
            fix = "free space there or set run.dir elsewhere"
            needed = len(_MARKER_TEXT)
            raise no_space("run.dir", marker, "the run's marker", needed, full, fix) from None
        raise not_writable("run.dir", p, err) from None
    # run.dir, and its checkpoints/ where an earlier run left one (a mount of its own may be
    # read-only): found here, not after the first steps
    for where in (p, p / "checkpoints"):
        if where.is_dir():
            try:
                fd, probe = tempfile.mkstemp(prefix=".oomless-write-test.", dir=where)
                os.close(fd)
                os.unlink(probe)
            except OSError as err:
                raise not_writable("run.dir", where, err) from None


def check_rows(cfg: JobConfig) -> None:
    """Read every row of the local data and check its fields (torch-free: a broken file answers
    as fast as it is read)."""
    from trainer.core.rows import check_rows as check_data_rows

    check_data_rows(cfg.data)


# sizes of an HF config that must be positive where a model has them
_DIMENSIONS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def check_model(cfg: JobConfig) -> None:
    """An inline `model.config` that transformers refuses (an unknown model_type, heads that do
    not divide the hidden size) or with a size below 1 stops here with one line, not as a
    traceback in every rank. Only the config class is built: the model classes are not
    imported here (importing them prints other libraries' warnings)."""
    if cfg.model.config is None:  # a pretrained model's config is its own
        return
    from transformers import CONFIG_MAPPING

    params = dict(cfg.model.config)
    model_type = params.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            "model.config.model_type",
            f"'{model_type}' is not a model type this transformers knows",
            "use one of its model types (llama, qwen2, mistral, gemma3_text, ...)",
        )
    _check_sizes(params)  # before transformers sees them: it warns about a negative vocab
    try:
        hf = CONFIG_MAPPING[model_type](**params)
    except Exception as err:  # transformers' checks raise ValueError, TypeError, its own kinds
        said = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(
            "model.config",
            f"transformers refuses it ({type(err).__name__}: {said[:240]})",
            "fix model.config: its keys are those of the model type's Hugging Face config",
        ) from None
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    _check_sizes({name: getattr(text, name, None) for name in _DIMENSIONS})


def check_rope_scaling(cfg: JobConfig) -> None:
    """`model.rope_scaling` checked by transformers' own rope validation on the model's config
    (offline: inline, local dir or shipped preset), so a rope type's missing key is one line
    here, not a KeyError in every rank after the run's files were written."""
    if cfg.model.rope_scaling is None:
        return
    from transformers import CONFIG_MAPPING

    from trainer.core.hf_config import hf_config_dict
    from trainer.model.build import apply_rope_scaling

    try:
        params = dict(hf_config_dict(cfg.model.config, cfg.model.name_or_path))
    except ConfigError:  # a hub id without a shipped preset: checked when the model loads
        return
    model_type = params.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        return  # remote code: its own config class checks it when the model loads
    apply_rope_scaling(CONFIG_MAPPING[model_type](**params), cfg.model.rope_scaling)


def _check_sizes(sizes: dict) -> None:
    for name in _DIMENSIONS:
        value = sizes.get(name)
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"model.config.{name}", f"is {value}", "give a positive size")


def tokenize_data(cfg: JobConfig) -> None:
    """Check an inline model config, then tokenise the data into the cache the ranks read (what
    only transformers or the tokenizer sees stops here)."""
    from trainer.data import build_tokenizer, split_eval, tokenize_all

    check_model(cfg)
    check_rope_scaling(cfg)
    start = time.perf_counter()
    tokenizer = build_tokenizer(cfg.model)
    train_docs, eval_docs = split_eval(cfg, *tokenize_all(cfg, tokenizer))
    log.info(
        "data tokenised in %.1f s: %d training documents%s",
        time.perf_counter() - start,
        train_docs.num_docs,
        f", {eval_docs.num_docs} eval documents" if eval_docs is not None else "",
    )


def check_resume(cfg: JobConfig) -> None:
    """ConfigError (exit 2) when the checkpoint this run would resume was trained with other
    math or on other data; the changes that keep the math are logged."""
    from trainer.checkpoint.checkpointer import check_resumable  # engine code: torch
    from trainer.checkpoint.store import resolve_resume
    from trainer.data import train_data_fingerprint

    path = resolve_resume(cfg)
    if path is None:
        return

    def fingerprint() -> str:
        return train_data_fingerprint(cfg)

    check_resumable(path, cfg, fingerprint, announce=True)
