"""Loading a ~1B pretrained model under fsdp x 2 on the CPU: time and host peak, per-rank reads
against the broadcast from rank 0 (the path before per-rank loading).

    python -m bench.load_pretrained [--cache DIR] [--json out.json]

The model (a 1.01B Llama: hidden 2048, 20 layers, 32000 vocabulary, untied; random weights) is
saved once with `save_pretrained` in bf16, as Hub checkpoints are, into `--cache` (default
`~/.cache/oomless/bench/llama-1b`). Each mode is one torchrun launch of two CPU ranks that run the
FSDP backend's setup (meta build, `fully_shard`, `to_empty`, the initial weights) on it:
`per_rank` reads each rank's shard from the safetensors files (trainer/model/pretrained.py);
`broadcast` is the old path: rank 0 loads the whole model with `from_pretrained`, copies its
state dict, and sends every rank its shard (`set_model_state_dict(broadcast_from_rank0)`).
Reported per rank: the setup's wall time and the process's peak resident set (`ru_maxrss`) over
its resident set before the setup. Needs ~12 GB of free host memory for the broadcast mode.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine

CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 20,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
MODES = ("broadcast", "per_rank")


def save_model(directory: Path) -> None:
    """The model saved once (bf16 safetensors); later runs reuse it."""
    if (directory / "config.json").is_file():
        return
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    params = {k: v for k, v in CONFIG.items() if k != "model_type"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**params), dtype=torch.bfloat16)
    model.save_pretrained(directory)


def worker(model_dir: Path, mode: str, out: Path) -> None:
    """One rank: the FSDP backend's setup on the saved model, timed, its host peak measured."""
    import torch
    import torch.distributed as dist

    from trainer.backends import BackendContext, OptimizerSpec, build_backend
    from trainer.core.config import build_config
    from trainer.model.build import HFModelFactory

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "d.jsonl"
        data.write_text('{"text": "x"}\n')
        cfg = build_config(
            {
                "model": {"name_or_path": str(model_dir), "tokenizer": tmp},
                "data": {"path": str(data), "seq_len": 128},
                "train": {"global_batch_size": 2, "micro_batch_size": 1},
                "strategy": "fsdp",
                "run": {"dir": str(Path(tmp) / "run")},
            }
        )
        ctx = BackendContext(cfg, torch.device("cpu"), rank, rank, world, "fp32", "none", 1, 1)
        factory = HFModelFactory(cfg.model, seed=0)
        if mode == "broadcast":  # no safetensors seen: rank 0 loads and broadcasts
            factory.pretrained_checkpoint = lambda: None
        optim = OptimizerSpec(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=1)
        dist.barrier()
        before = _rss_bytes()
        start = time.perf_counter()
        build_backend("fsdp", ctx).setup(factory, optim)
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"rank": rank, "setup_s": seconds, "rss_before_bytes": before, "rss_peak_bytes": peak}
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def run_mode(model_dir: Path, mode: str, out: Path) -> list[dict]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv += ["-m", "bench.load_pretrained", "--worker", str(model_dir), mode, str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: torchrun exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache/oomless/bench/llama-1b")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    start = time.perf_counter()
    save_model(args.cache)
    print(f"model in {args.cache} ({time.perf_counter() - start:.0f} s)")
    result: dict = {"machine": machine(), "model": CONFIG, "modes": {}}
    with tempfile.TemporaryDirectory() as out:
        for mode in MODES:
            ranks = run_mode(args.cache, mode, Path(out))
            result["modes"][mode] = ranks
            growth = [(r["rss_peak_bytes"] - r["rss_before_bytes"]) / 2**30 for r in ranks]
            print(
                f"{mode:>9}: setup {max(r['setup_s'] for r in ranks):.1f} s, host peak over the "
                f"process baseline: rank 0 +{growth[0]:.2f} GiB, rank 1 +{growth[1]:.2f} GiB"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
