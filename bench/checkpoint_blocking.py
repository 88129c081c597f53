"""How long a checkpoint blocks training: synchronous vs `run.async_checkpoint`, side by side.

A ~110M-parameter Llama shape on the `single` backend with AdamW state present (one step taken),
saved repeatedly through the engine's `Checkpointer`, alternating sync and async saves. Blocked
time = what the training loop waits for: `backend.state_dict()` plus `Checkpointer.save`. For
async saves the background write is then awaited separately (`finish`) and reported too.

    python bench/checkpoint_blocking.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.backends import BackendContext, OptimizerSpec, build_backend  # noqa: E402
from trainer.checkpoint.checkpointer import Checkpointer  # noqa: E402
from trainer.core.config import build_config  # noqa: E402
from trainer.core.units import GIB
from trainer.model.build import HFModelFactory, count_parameters  # noqa: E402
from trainer.step import train_step  # noqa: E402

MODEL = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 9,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="oomless-ckpt-bench-"))
    try:
        data = tmp / "d.jsonl"
        data.write_text('{"text": "x"}\n')
        cfg = build_config(
            {
                "model": {"config": MODEL, "tokenizer": str(tmp)},
                "data": {"path": str(data), "seq_len": 32},
                "train": {"global_batch_size": 1, "micro_batch_size": 1},
                "strategy": "single",
                "precision": "fp32",
                "run": {"dir": str(tmp / "run"), "keep_checkpoints": 1},
            }
        )
        device = torch.device("cpu")
        ctx = BackendContext(cfg, device, 0, 0, 1, "fp32", "none", 1, 1)
        backend = build_backend("single", ctx)
        optim = OptimizerSpec(1e-4, (0.9, 0.95), 1e-8, 0.0, 1.0)
        model = backend.setup(HFModelFactory(cfg.model, seed=0), optim)
        num_params = count_parameters(model)
        ids = torch.randint(0, MODEL["vocab_size"], (1, 32))
        batch = {
            "input_ids": ids,
            "labels": ids,
            "position_ids": torch.arange(32)[None],
            "doc_ids": torch.zeros_like(ids),
        }
        train_step(model, backend, [batch], device)  # AdamW state exists now
        checkpointer = Checkpointer(tmp / "run", cfg, None, rank=0)
        sync_s, async_s, async_bg_s = [], [], []
        step = 0
        for _ in range(args.rounds):
            for asynchronous in (False, True):
                step += 1
                start = time.perf_counter()
                state = backend.state_dict()
                checkpointer.save(step, state, {}, asynchronous=asynchronous)
                blocked = time.perf_counter() - start
                del state
                if asynchronous:
                    async_s.append(blocked)
                    start = time.perf_counter()
                    checkpointer.finish()
                    async_bg_s.append(time.perf_counter() - start)
                else:
                    sync_s.append(blocked)
        size_bytes = sum(
            f.stat().st_size for f in (tmp / "run" / "checkpoints").rglob("*") if f.is_file()
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "num_params": num_params,
        "checkpoint_bytes": size_bytes,
        "sync_blocked_s": sync_s,
        "async_blocked_s": async_s,
        "async_background_wait_s": async_bg_s,
        "sync_median_s": statistics.median(sync_s),
        "async_median_s": statistics.median(async_s),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    sync_med, async_med = result["sync_median_s"], result["async_median_s"]
    print(
        f"{num_params / 1e6:.0f}M params, checkpoint {size_bytes / GIB:.2f} GiB: training "
        f"blocked {sync_med:.2f} s per sync save, {async_med:.2f} s per async save "
        f"(median of {args.rounds})"
    )


if __name__ == "__main__":
    main()
