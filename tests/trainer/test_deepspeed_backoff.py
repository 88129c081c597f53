"""An OOM back-off on a DeepSpeed rung (2 CPU ranks): the re-cut batch learns exactly what the
uninterrupted run learns (ZeRO's accumulation boundary and partial gradients reset).

This file is also the torchrun worker: `torchrun ... test_deepspeed_backoff.py BASE WORK`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

STRATEGIES = ("zero2", "zero3")
OOM = "debug.inject_oom={step: 3, rank: 1, times: 1, where: backward}"


def _worker(base: str, work: Path) -> int:
    from launcher.config import load_config
    from trainer.engine import run_training

    for strategy in STRATEGIES:
        for name, extra in ((f"{strategy}_ref", []), (f"{strategy}_oom", [OOM])):
            cfg = load_config(base, [f"strategy={strategy}", *extra, f"run.dir={work / name}"])
            if run_training(cfg) != 0:
                return 1
    return 0


@pytest.mark.slow
def test_backoff_on_rank_1_keeps_the_losses(tmp_path):
    from tests.conftest import PYTHON, REPO, python_env
    from tests.trainer.test_distributed import STEPS, _base_config, _metrics

    base = _base_config(tmp_path)
    r = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         __file__, str(base), str(tmp_path)],
        capture_output=True, text=True, env=python_env(), cwd=REPO, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for strategy in STRATEGIES:
        ref, oom = _metrics(tmp_path / f"{strategy}_ref"), _metrics(tmp_path / f"{strategy}_oom")
        assert [m["micro_batch_size"] for m in oom] == [4, 4] + [2] * (STEPS - 2), strategy
        for a, b in zip(oom, ref, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (strategy, a["step"])


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], Path(sys.argv[2])))
