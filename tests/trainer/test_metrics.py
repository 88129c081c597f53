"""metrics.jsonl on resume: a torn last line is dropped, a failed rewrite loses nothing."""

from __future__ import annotations

import json
import logging
import subprocess

from tests.conftest import PYTHON, REPO, python_env
from trainer.observe.metrics import MetricsLog


def _lines(steps) -> str:
    return "".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in steps)


def test_resume_drops_a_torn_metrics_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_lines([1, 2, 3]) + '{"step": 4, "lo')  # the writer died mid-line
    with caplog.at_level(logging.WARNING):
        MetricsLog(tmp_path, total_steps=10, enabled=True).truncate_after(2)
    assert path.read_text() == _lines([1, 2])
    assert "incomplete last line" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


def test_item3_failed_metrics_rewrite_keeps_the_old_file(tmp_path):
    """A full disk during the rewrite (a real EFBIG from RLIMIT_FSIZE) leaves the file as it was."""
    path = tmp_path / "metrics.jsonl"
    before = _lines(range(1, 41))
    path.write_text(before)
    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from trainer.observe.metrics import MetricsLog\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))\n"
        "try:\n"
        "    MetricsLog(Path(sys.argv[1]), 40, True).truncate_after(30)\n"
        "except OSError as err:\n"
        "    print(err.errno)\n"
    )
    r = subprocess.run(
        [PYTHON, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "27", r.stderr  # EFBIG: the write failed
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_resume_drops_a_line_that_is_not_a_step_with_one_warning(tmp_path, caplog):
    """A user's note (an object without `step`, a string, plain text) between the steps: one
    warning and the run goes on (before: KeyError: 'step')."""
    path = tmp_path / "metrics.jsonl"
    notes = '{"note": "lr looked high"}\n"just a string"\nplain text\n{"step": "3"}\n'
    path.write_text(_lines([1]) + notes + _lines([2, 3]))
    with caplog.at_level(logging.WARNING):
        MetricsLog(tmp_path, total_steps=10, enabled=True).truncate_after(2)
    assert path.read_text() == _lines([1, 2])
    said = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "dropped 4 lines" in said[0] and "line 2, 3, 4, 5" in said[0], said


def test_a_full_disk_at_a_metrics_line_is_one_warning_and_training_goes_on(tmp_path, caplog):
    """Rank 0 alone writes metrics.jsonl: an ENOSPC there must not raise (the other ranks would
    wait in the next collective); the checkpoint after it says what to do. metrics.jsonl here is
    a /dev/full node: the kernel's own ENOSPC on every write."""
    import os
    import stat

    import pytest

    try:
        os.mknod(tmp_path / "metrics.jsonl", stat.S_IFCHR | 0o600, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("making a /dev/full node needs root")
    metrics = MetricsLog(tmp_path, total_steps=3, enabled=True)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            metrics.write({"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
                           "tokens_per_s": 1.0})  # fmt: skip
    said = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "No space left on device" in said[0] and "step 1" in said[0], said
