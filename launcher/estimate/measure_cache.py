"""Where measurements of a model's layers are cached: one JSON file per key under
`$XDG_CACHE_HOME/oomless/activations`, written whole or not at all (a failed write only costs
the next plan the measurement again)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cache_file(*key: Any, cache_dir: Path | None = None) -> Path:
    """The file a measurement of `key` (its parts: version, libraries, config, settings) is
    cached in."""
    digest = hashlib.sha256("\n".join(map(str, key)).encode()).hexdigest()
    return (cache_dir or default_cache_dir()) / f"{digest}.json"


def write_cache(path: Path, record: Any) -> None:
    """`record` as JSON at `path`, through a temporary file so a reader never sees half."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError as e:
        log.debug("measurement cache not written: %s", e)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "oomless" / "activations"
