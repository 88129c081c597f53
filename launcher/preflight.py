"""Checks before anything is written into run.dir or launched: bad input exits 2 in one line.

- `check_run_dir`: run.dir is a directory (or can become one) that this user can write.
- `check_rows`: every row of the local data reads and has its fields (torch-free, so a broken
  file answers as fast as it is read; it runs before the plan).
- `tokenize_data`: the data tokenised once into the cache, so a problem only the tokenizer sees
  stops here too and the ranks start on a warm cache.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

from trainer.core.config import ConfigError, JobConfig
from trainer.core.files import refuse_links

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
        refuse_links(p)


def ensure_run_dir(path: str | Path) -> None:
    """Create run.dir; a failure (a read-only or virtual file system) is a config error."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".oomless-write-test.", dir=p)  # never an existing name
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            "run.dir",
            f"'{p}' cannot be written ({err.strerror})",
            "point run.dir at a writable directory",
        ) from None


def check_rows(cfg: JobConfig) -> None:
    """Read every row of the local data and check its fields (torch-free: a broken file answers
    as fast as it is read)."""
    from trainer.core.rows import check_rows as check_data_rows

    check_data_rows(cfg.data)


def tokenize_data(cfg: JobConfig) -> None:
    """Tokenise the data into the cache the ranks read (what only the tokenizer sees stops here)."""
    from trainer.data import build_tokenizer, split_eval, tokenize_all

    start = time.perf_counter()
    tokenizer = build_tokenizer(cfg.model)
    train_docs, eval_docs = split_eval(cfg, *tokenize_all(cfg, tokenizer))
    log.info(
        "data tokenised in %.1f s: %d training documents%s",
        time.perf_counter() - start,
        train_docs.num_docs,
        f", {eval_docs.num_docs} eval documents" if eval_docs is not None else "",
    )
