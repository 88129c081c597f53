"""Runs the two-process trainings of tests/trainer/dist_runs.py one after another in ONE torchrun
launch (each torchrun start costs seconds, and the process group is reused):
`torchrun ... dist_worker.py BASE_CONFIG WORK_DIR`.

Every run is the real engine (`run_training`) with its own run dir under WORK_DIR; the test reads
their metrics.jsonl files and checkpoints afterwards.
"""

from __future__ import annotations

import sys
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
        code = run_training(cfg)
        if code != 0:
            return code
    if "zero3_split" not in skip:
        probe_deepspeed_state_split(base, work)
    return 0


def probe_deepspeed_state_split(base: str, work: Path) -> None:
    """What each rank keeps of the canonical state a ZeRO-3 checkpoint gathers (the full tensors
    of its own parameters only), written to WORK_DIR/zero3_split_rank{R}.json."""
    import json

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
