"""A build lock left in torch's extensions dir by a killed DeepSpeed op build is removed at the
next start (it made every later DeepSpeed process wait forever); a live build's lock is kept."""

from __future__ import annotations

import logging
import os
import time

from trainer.backends.deepspeed import STALE_BUILD_LOCK_S, clear_stale_build_locks


def test_stale_build_locks_are_removed_and_live_ones_kept(tmp_path, caplog):
    stale = tmp_path / "py311_cpu" / "cpu_adam" / "lock"  # ~/.cache/torch_extensions layout
    stale_flat = tmp_path / "async_io" / "lock"  # TORCH_EXTENSIONS_DIR layout
    live = tmp_path / "deepspeed_shm_comm" / "lock"
    for lock in (stale, stale_flat, live):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60
    for lock in (stale, stale_flat):
        os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        clear_stale_build_locks(tmp_path)
    assert not stale.exists() and not stale_flat.exists() and live.exists()
    assert "stale build lock" in caplog.text and str(stale) in caplog.text
