"""One rank of ZeRO-3 holding a LoRA model under `precision: bf16` (a process group of one):
what its parameter partitions hold, by dtype, as JSON on stdout. A process of its own, since
ZeRO-3 patches torch's linear for the rest of the process.

    python -m tests.trainer.zero3_lora_worker RUN_DIR
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from tests.conftest import write_demo_job
from trainer.backends import BackendContext, OptimizerSpec, build_backend
from trainer.core.config import load_config
from trainer.model.build import HFModelFactory
from trainer.model.finetune import build_factory


def main(run_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("gloo")
    job = write_demo_job(run_dir / "job.yaml", strategy="zero3", precision="bf16",
                         finetune={"method": "lora", "lora": {"r": 4}})  # fmt: skip
    cfg = load_config(job)
    ctx = BackendContext(cfg, torch.device("cpu"), 0, 0, 1, "bf16", "none", 2, 1)
    backend = build_backend("zero3", ctx)
    factory = build_factory(HFModelFactory(cfg.model, seed=0), cfg)
    optim = OptimizerSpec(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=0.0)
    model = backend.setup(factory, optim)
    held: Counter[str] = Counter()
    for _, p in model.named_parameters():
        part = p.ds_tensor
        kind = "trained" if p.requires_grad else "frozen"
        held[f"{kind} {str(part.dtype).removeprefix('torch.')}"] += (
            part.numel() * part.element_size()
        )
    print(json.dumps(dict(held)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
