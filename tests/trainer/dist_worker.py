"""Runs the two-process trainings of tests/trainer/dist_runs.py one after another in ONE torchrun
launch (each torchrun start costs seconds, and the process group is reused):
`torchrun ... dist_worker.py BASE_CONFIG WORK_DIR`.

Every run is the real engine (`run_training`) with its own run dir under WORK_DIR; the test reads
their metrics.jsonl files and checkpoints afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
from pathlib import Path

from tests.trainer.dist_runs import RUNS


def main() -> int:
    """argv: BASE_CONFIG WORK_DIR [SKIP]: SKIP is a comma-separated list of run names to leave
    out (the zero3_nvme runs where DeepSpeed's async_io op cannot be built; `zero3_split`: the
    probe below)."""
    base, work = sys.argv[1], Path(sys.argv[2])
    skip = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set()
    from trainer.core.config import load_config
    from trainer.engine import run_training

    for run in RUNS:
        if run.world_size != 2 or run.name in skip:
            continue
        overrides = [o.replace("{work}", str(work)) for o in run.overrides]
        cfg = load_config(base, [*overrides, f"run.dir={work / run.name}"])
        if run.full_disk is not None:
            train_on_a_full_disk(cfg, run.full_disk, work / run.name)
            continue
        code = run_training(cfg)
        if code != 0:
            return code
    if "zero3_split" not in skip:
        probe_deepspeed_state_split(base, work)
    return 0


class _FullAfter:
    """A file that takes `room` bytes, then (after `slow_s`) raises ENOSPC, as a full disk."""

    def __init__(self, raw, room: int, slow_s: float):
        self.raw, self.room, self.slow_s = raw, room, slow_s

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            time.sleep(self.slow_s)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.raw.write(data)

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def train_on_a_full_disk(cfg, full_disk: tuple[int, float], run_dir: Path) -> None:
    """`run_training` with the disk full for one rank's DCP shard of step_4: a write past its
    first KiB (inside torch.save's zip writer, which turns the OSError into "unexpected pos")
    fails. Every rank writes what it raised to RUN_DIR/outcome_rank{R}.json."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from trainer.core.config import ConfigError
    from trainer.engine import run_training

    rank, (full_rank, slow_s) = int(os.environ["RANK"]), full_disk
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            shard = "step_4.tmp" in str(path) and str(path).endswith(".distcp")
            yield _FullAfter(stream, 1024, slow_s) if shard and rank == full_rank else stream

    FileSystem.create_stream = create_stream
    try:
        run_training(cfg)
        outcome = {"raised": None}
    except ConfigError as err:
        outcome = {"raised": "ConfigError", "line": str(err)}
    except BaseException as err:  # noqa: BLE001 - what a rank left with is the result
        outcome = {"raised": type(err).__name__, "line": str(err)[-2000:]}
    finally:
        FileSystem.create_stream = original
    (run_dir / f"outcome_rank{rank}.json").write_text(json.dumps(outcome))


def probe_deepspeed_state_split(base: str, work: Path) -> None:
    """What each rank keeps of the canonical state a ZeRO-3 checkpoint gathers (the full tensors
    of its own parameters only), written to WORK_DIR/zero3_split_rank{R}.json."""
    import torch

    from trainer.backends import BackendContext, build_backend
    from trainer.core.config import load_config
    from trainer.engine import _optimizer_spec
    from trainer.model.build import HFModelFactory
    from trainer.runtime.dist import env_rank

    cfg = load_config(base, ["strategy=zero3", f"run.dir={work / 'zero3_split'}"])
    rank, local_rank, world_size = env_rank()
    ctx = BackendContext(
        cfg=cfg,
        device=torch.device("cpu"),
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        precision=cfg.precision,
        activation_checkpointing="none",
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum=cfg.train.global_batch_size // (cfg.train.micro_batch_size * world_size),
    )
    backend = build_backend("zero3", ctx)
    backend.setup(HFModelFactory(cfg.model, cfg.train.seed), _optimizer_spec(cfg))
    state = backend.state_dict()
    kept = {
        "weights": {name: t.numel() for name, t in state["model"].items()},
        "moments": sorted(state["optim"]),
    }
    (work / f"zero3_split_rank{rank}.json").write_text(json.dumps(kept))


if __name__ == "__main__":
    from trainer.runtime.dist import exit_without_teardown

    exit_without_teardown(main())
