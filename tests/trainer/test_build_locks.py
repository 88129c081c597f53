"""A build lock left in torch's extensions dir by a killed DeepSpeed op build is removed at the
next start (it made every later DeepSpeed process wait forever); a live build's lock is kept."""

from __future__ import annotations

import logging
import os
import time

from trainer.backends.deepspeed import (
    STALE_BUILD_LOCK_S,
    clear_stale_build_locks,
    wait_for_build_locks,
)


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


def test_a_young_build_lock_is_waited_on_with_a_progress_line_and_a_bound(tmp_path, caplog):
    """A lock a Ctrl-C'd build left a moment ago: waited on, saying so and how to clear it, and
    removed once it is `max_age_s` old (torch's own wait has no bound: it hung forever)."""
    from threading import Thread

    left = tmp_path / "cpu_adam" / "lock"
    left.parent.mkdir()
    left.touch()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        wait_for_build_locks(tmp_path, max_age_s=2, progress_s=0.5)
    assert 1.5 <= time.monotonic() - start < 30
    assert not left.exists()
    assert f"waiting for DeepSpeed's op build lock {left}" in caplog.text
    assert f"remove it (rm {left})" in caplog.text

    # a build that ends in time: its lock goes, and the wait ends with it (nothing removed by us)
    live = tmp_path / "cpu_adam" / "lock"
    live.touch()
    Thread(target=lambda: (time.sleep(1), live.unlink()), daemon=True).start()
    start = time.monotonic()
    wait_for_build_locks(tmp_path, max_age_s=600, progress_s=0.5)
    assert 0.5 <= time.monotonic() - start < 30


def test_the_locks_are_looked_for_where_torch_builds_the_ops(tmp_path, monkeypatch):
    """TORCH_EXTENSIONS_DIR moves the builds (and their locks) out of torch's default cache dir:
    a stale lock there is found and removed too (it was looked for in the default dir only)."""
    stale = tmp_path / "cpu_adam" / "lock"
    stale.parent.mkdir()
    stale.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    wait_for_build_locks(max_age_s=60, progress_s=1)
    assert not stale.exists()


def test_a_rung_waits_only_for_the_builds_of_ops_it_loads(tmp_path):
    """async_io builds last (tests/prebuild_ops.py) and only zero3_nvme loads it: its live lock
    held every other DeepSpeed rung for the whole build, past a 300 s part limit in CI."""
    from threading import Thread

    building = tmp_path / "async_io" / "lock"
    building.parent.mkdir()
    building.touch()
    start = time.monotonic()
    wait_for_build_locks(tmp_path, max_age_s=600, progress_s=0.5, skip=("async_io",))
    assert time.monotonic() - start < 1 and building.exists()

    Thread(target=lambda: (time.sleep(1), building.unlink()), daemon=True).start()
    wait_for_build_locks(tmp_path, max_age_s=600, progress_s=0.5)  # zero3_nvme's wait
    assert 0.5 <= time.monotonic() - start < 30
