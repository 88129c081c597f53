"""torchrun --max-restarts 1 after a rank died: the new ranks meet in a clean store namespace.

torchrun keeps one TCPStore for the job and hands it to every attempt; the process group's keys
(each rank's gloo address) do not name the attempt. Here rank 1 of the restarted group is slow to
start, so rank 0 reads what the killed rank 1 left there first: without a namespace per attempt
it connects to a dead port and gloo's connectFullMesh times out.

This file is also the torchrun worker: `torchrun ... test_restart_store.py`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest


def _worker() -> int:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from trainer.runtime.dist import init_distributed

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if attempt == 1 and rank == 1:
        time.sleep(3)  # rank 0 reaches the store first and reads whatever rank 1 left there
    cfg = SimpleNamespace(strategy="fsdp", dist=SimpleNamespace(timeout_s=20))
    init_distributed(cfg, torch.device("cpu"))
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {rank}: all_reduce {total.item():g}", flush=True)
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 0:
        dist.barrier()  # fails when rank 1 is gone; torchrun restarts both
    return 0


@pytest.mark.slow
def test_restarted_ranks_connect_after_a_rank_was_killed():
    from tests.conftest import PYTHON, REPO, python_env, run_bounded

    r = run_bounded(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--max-restarts", "1", __file__],
        env=python_env(), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        assert f"attempt 1 rank {rank}: all_reduce 2" in r.stdout, r.stdout


if __name__ == "__main__":
    from trainer.runtime.dist import exit_without_teardown

    exit_without_teardown(_worker())
