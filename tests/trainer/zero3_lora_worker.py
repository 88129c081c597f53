"""One rank of ZeRO-3 holding a LoRA or QLoRA model under `precision: bf16` (a process group of
one): what its parameter partitions hold, by dtype, and QLoRA's quantisation states, as JSON on
stdout. A process of its own, since ZeRO-3 patches torch's linear for the rest of the process.

    python -m tests.trainer.zero3_lora_worker RUN_DIR lora|qlora
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


def _state_bytes(obj: object) -> int:
    """Bytes of the tensors a bitsandbytes QuantState holds, its nested state's included."""
    return sum(
        v.numel() * v.element_size() if isinstance(v, torch.Tensor) else _state_bytes(v)
        for v in vars(obj).values()
        if isinstance(v, torch.Tensor) or hasattr(v, "absmax")
    )


def main(run_dir: Path, method: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("gloo")
    job = write_demo_job(run_dir / "job.yaml", strategy="zero3", precision="bf16",
                         finetune={"method": method, "lora": {"r": 4}})  # fmt: skip
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
    for module in model.modules():  # each Linear4bit keeps its weight's state
        state = getattr(module, "quant_state", None)
        if state is not None:
            held["quantisation states"] += _state_bytes(state)
    print(json.dumps(dict(held)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
