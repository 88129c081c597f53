"""torchrun commands as data; run_command: exit codes and signal forwarding, real processes."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from launcher.run.launch import allocator_env, build_torchrun_command, launch_spec, run_command
from tests.conftest import TINY_LLAMA
from trainer.core.config import build_config


def _cfg(**hardware):
    return build_config(
        {
            "model": {"config": dict(TINY_LLAMA)},
            "data": {"path": "some/dataset", "seq_len": 64},
            "hardware": hardware,
            "run": {"dir": "runs/exp7"},
            "dist": {"max_restarts": 2},
        }
    )


def test_single_node_is_standalone_with_restarts_from_config():
    argv, env = build_torchrun_command(_cfg(device="cpu", devices_per_node=2), Path("c.yaml"))
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    joined = " ".join(argv)
    assert "--standalone --nnodes 1" in joined
    assert "--nproc_per_node 2 --max_restarts 2 -m trainer c.yaml" in joined
    cores = os.cpu_count() or 1
    assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", str(max(1, cores // 2)))


def test_several_nodes_rendezvous_on_the_head_node_with_the_rank_left_to_each_node(monkeypatch):
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # no setting of the user's
        monkeypatch.delenv(var, raising=False)
    cfg = _cfg(device="cuda", nodes=4, devices_per_node=8, device_memory="80GiB")
    argv, env = build_torchrun_command(cfg, Path("c.yaml"))
    joined = " ".join(argv)
    assert "--standalone" not in joined
    assert "--nnodes 4 --node_rank $NODE_RANK --rdzv_backend c10d" in joined
    assert "--rdzv_endpoint $HEAD_NODE:29500 --rdzv_id oomless-exp7" in joined
    assert "--nproc_per_node 8" in joined
    # GPU ranks: no thread pinning; the caching allocator with expandable segments
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_elastic_min_nodes_is_an_elastic_rendezvous_that_restarts_on_the_nodes_left():
    cfg = _cfg(device="cuda", nodes=4, devices_per_node=8, device_memory="80GiB")
    cfg = cfg.model_copy(update={"elastic": cfg.elastic.model_copy(update={"min_nodes": 2})})
    joined = " ".join(build_torchrun_command(cfg, Path("c.yaml"))[0])
    # run.max_restarts auto (3) is above dist.max_restarts (2): a lost node restarts the group
    assert "--nnodes 2:4 --node_rank $NODE_RANK" in joined and "--max_restarts 3 " in joined


def test_cuda_ranks_get_expandable_segments_unless_the_user_configured_the_allocator():
    cuda = _cfg(device="cuda", devices_per_node=8, device_memory="80GiB")
    assert allocator_env(cuda, environ={}) == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"
    }
    # the user's own setting (either name PyTorch reads) goes to the ranks as it is
    assert allocator_env(cuda, environ={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert allocator_env(cuda, environ={"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
    assert allocator_env(_cfg(device="cpu", devices_per_node=2), environ={}) == {}


def test_a_single_cuda_device_runs_as_a_child_that_a_hang_may_end(monkeypatch):
    """One rank is `python -m trainer` as a child while a hang may be restarted (the watchdog
    ends the hung process, the supervisor outlives it); with run.max_restarts=0, here."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    one = _cfg(device="cuda", devices_per_node=1, device_memory="80GiB")
    argv, env, spawn = launch_spec(one, Path("c.yaml"))
    assert spawn and argv == [sys.executable, "-m", "trainer", "c.yaml"]
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # set before CUDA starts
    here = one.model_copy(update={"run": one.run.model_copy(update={"max_restarts": 0})})
    argv, env, spawn = launch_spec(here, Path("c.yaml"))
    assert not spawn and argv[-2:] == ["trainer", "c.yaml"] and env


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_run_command_returns_the_exit_code_and_128_plus_a_killing_signal():
    assert run_command(_child("import sys; sys.exit(3)"), {}) == 3
    assert run_command(_child("import os; os.kill(os.getpid(), 9)"), {}) == 137
    assert run_command(_child("import os, sys; sys.exit(os.environ['X'] == 'y')"), {"X": "y"}) == 1


def test_usr1_to_the_launcher_reaches_the_child_as_sigterm_and_returns_143(tmp_path):
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
        "sys.exit(0)\n"
    )

    def preempt() -> None:
        for _ in range(300):
            if ready.exists():
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            threading.Event().wait(0.1)

    threading.Thread(target=preempt, daemon=True).start()
    assert run_command(_child(code), {}) == 143  # stopped by a signal: 143 whatever the child said
