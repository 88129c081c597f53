"""What the benchmarks share: model shapes, batches, the alternation, medians, the machine.

Every comparison alternates its contenders round by round with the order shuffled every round,
so that a busy neighbour slows both sides alike; only medians and their ratios are reported. The
one-process comparisons run each contender in a process of its own, in sessions of fresh
processes (bench/contenders.py); the 2-rank ones alternate inside one torchrun launch. Run the
scripts as modules from the repository root (`python -m bench.NAME`, `torchrun ... -m
bench.NAME`).
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from trainer.core.flops import training_flops_per_token

# Llama shapes built from an inline HF config (random init; nothing is downloaded).
MODELS: dict[str, dict[str, Any]] = {
    "llama-20m": {  # 20.0M parameters: the CPU benchmarks
        "model_type": "llama",
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "llama-tiny": {  # 0.6M parameters: smoke runs of the GPU scripts on a CPU
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "llama-1b": {  # 1.1B parameters, TinyLlama's shape: the GPU throughput runs
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "llama3-1b": {  # 1.2B parameters, Llama-3.2-1B's shape (128k vocabulary, tied): the levers
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "llama-3b": {  # 3.2B parameters, Llama-3.2-3B's shape with a 32k vocabulary
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "llama-8b": {  # 7.5B parameters, Llama-3.1-8B's shape with a 32k vocabulary
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}


def hf_config(model: str) -> Any:
    """The transformers config of a shape, as the engine builds it (sdpa, no KV cache)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in MODELS[model].items() if k != "model_type"})
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    return cfg


def build_hf_model(model: str, seed: int = 0) -> torch.nn.Module:
    """The plain HF model, fp32, seeded, on the CPU (what a hand-written script starts from)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(model), dtype=torch.float32)


def make_batches(model: str, num_micro: int, micro: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """Random-token micro-batches in the engine's batch format (labels aligned with inputs)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(num_micro):
        ids = torch.randint(0, MODELS[model]["vocab_size"], (micro, seq), generator=g)
        out.append(
            {
                "input_ids": ids,
                "labels": ids.clone(),
                "position_ids": torch.arange(seq).repeat(micro, 1),
                "doc_ids": torch.zeros_like(ids),
            }
        )
    return out


def demo_job_file(
    tmp: Path, model_config: dict, seq_len: int, train: dict, **sections: Any
) -> Path:
    """A job file in `tmp`: `model_config` on the demo tokenizer and data (configs/demo/), the
    data's cache in tmp, no final save, no checkpoints, no escalation (a comparison measures the
    rungs it names); `sections` beside them (precision, memory, hardware)."""
    import yaml

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo"
    job = {
        "model": {"config": model_config, "tokenizer": str(demo / "tokenizer")},
        "data": {"path": str(demo / "train.jsonl"), "format": "prompt_completion",
                 "seq_len": seq_len, "cache_dir": str(tmp / "cache")},
        "train": train,
        "run": {"save_final": False, "checkpoint_every": 0},
        "escalation": {"enabled": False},
        **sections,
    }  # fmt: skip
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def job_config(
    tmp: Path,
    model: str,
    strategy: str,
    precision: str,
    micro: int,
    accum: int,
    seq: int,
    device: torch.device,
    world_size: int = 1,
    activation_checkpointing: str = "none",
    compile: bool = False,
) -> Any:
    """A resolved JobConfig for the engine's side of a comparison (data is never read)."""
    from trainer.core.config import build_config

    data = tmp / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    return build_config(
        {
            "model": {"config": MODELS[model], "tokenizer": str(tmp)},
            "data": {"path": str(data), "seq_len": seq},
            "train": {
                "global_batch_size": micro * accum * world_size,
                "micro_batch_size": micro,
                "compile": compile,
            },
            "precision": precision,
            "memory": {"activation_checkpointing": activation_checkpointing},
            "strategy": strategy,
            "hardware": {"device": device.type, "devices_per_node": world_size},
        }
    )


def largest_model_that_fits(
    candidates: list[str],
    strategy: str,
    device: torch.device,
    micro: int,
    accum: int,
    seq: int,
    precision: str,
    num_copies: int = 1,
) -> str | None:
    """The largest shape the planner says fits this machine on `strategy` (one process).

    `num_copies` contenders live in one process side by side (the alternation), so each gets that
    share of the device and of the host memory. None when not even the smallest fits.
    """
    import psutil

    from launcher.plan.hardware import Hardware
    from launcher.plan.planner import NoFitError, make_plan
    from trainer.core import strategies

    if device.type == "cuda":
        device_bytes = torch.cuda.get_device_properties(device).total_memory
    else:
        device_bytes = psutil.virtual_memory().total
    hw = Hardware(
        device.type, 1, 1, device_bytes // num_copies, psutil.virtual_memory().total // num_copies
    )
    others = [name for name in strategies.names() if name != strategy]
    fits = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in candidates:
            cfg = job_config(Path(tmp), name, "auto", precision, micro, accum, seq, device)
            try:
                make_plan(cfg, hw, exclude=others)
            except NoFitError:
                continue
            fits.append(name)
    return max(fits, key=num_parameters, default=None)


def num_parameters(model: str) -> int:
    """Parameters of a shape, counted on the meta device (nothing allocated or initialised)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(hf_config(model)))


def copy_bandwidth(device: torch.device, num_bytes: int = 2**30, repeats: int = 5) -> dict:
    """Median bytes/s of copies between pinned host memory and `device`, both ways.

    The floor of any offload rung's step time: what it moves over PCIe divided by this. On a CPU
    "device" it is a host memcpy (no pinning), which keeps the code path runnable in smoke tests.
    """
    pin = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    result = {}
    for direction, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        copy = functools.partial(dst.copy_, src, non_blocking=pin)
        times = [timed(copy, device) for _ in range(repeats)]
        result[f"{direction}_bytes_per_s"] = num_bytes / statistics.median(times)
    result["bytes_per_copy"] = num_bytes
    result["pinned"] = pin
    return result


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def add_step_args(parser: Any, rounds: int, precisions: tuple[str, ...] = ("bf16", "fp32")) -> None:
    """The options every timed-step bench takes: rounds, batch geometry, precision, device and
    where its JSON goes."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", default="bf16", choices=list(precisions))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", type=Path, help="write the raw numbers here")


def step_run_result(
    args: Any, device: torch.device, world: int, num_params: int, times: dict[str, list[float]]
) -> dict[str, Any]:
    """The head of a timed-step bench's JSON (`add_step_args`' options): the machine, the job,
    every round's step times and each contender's median and tokens per second."""
    med = medians(times)
    tokens = args.micro * args.accum * args.seq * world
    return {
        "machine": machine(),
        "model": args.model,
        "num_params": num_params,
        "world_size": world,
        "device": device.type,
        "precision": args.precision,
        "micro_batch_size": args.micro,
        "grad_accum": args.accum,
        "seq_len": args.seq,
        "rounds": args.rounds,
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "step_s": times,
        "median_step_s": med,
        "tokens_per_s": {name: tokens / s for name, s in med.items()},
    }


def init_torchrun_rank(device_name: str, cuda_backend: str) -> tuple[torch.device, int, int]:
    """(device, rank, world size) of a torchrun worker, its process group initialised
    (`cuda_backend` on GPUs, gloo on CPU)."""
    import torch.distributed as dist

    device = resolve_device(device_name)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(cuda_backend if device.type == "cuda" else "gloo")
    return device, rank, world


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(
    contenders: dict[str, Callable[[], float]], num_rounds: int, first_round: int = 0
) -> dict[str, list[float]]:
    """Call every contender once per round, in an order shuffled each round; each returns
    seconds.

    Shuffled, not rotated: a rotation keeps the cyclic order, so every contender would always
    follow the same predecessor and inherit what it leaves behind (caches, another thread
    pool's spinning workers) every round. The shuffle is seeded by the round, so all ranks of a
    launch run the same order; `first_round` numbers the rounds of a later session on from the
    earlier ones'.
    """
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(first_round, first_round + num_rounds):
        order = list(names)
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(contenders[name]())
    return times


def timed(fn: Callable[[], Any], device: torch.device, barrier: bool = False) -> float:
    """Wall seconds of fn(), device work included (and all ranks in step when barrier)."""
    if barrier:
        torch.distributed.barrier()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    if barrier:
        torch.distributed.barrier()
    return time.perf_counter() - start


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in times.items()}


def paired_ratio(first: list[float], second: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of first[i] / second[i]: the times of one round, taken back to back.

    Under a load that drifts over minutes, the ratio within a round moves less than either side,
    so its spread says how far the medians' ratio can be trusted.
    """
    ratios = [a / b for a, b in zip(first, second, strict=True)]
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return median, q1, q3


def ratio_interval(
    first: list[float],
    second: list[float],
    level: float = 0.9,
    num_resamples: int = 4000,
    groups: list[int] | None = None,
) -> tuple[float, float]:
    """A bootstrap interval of median(first) / median(second): rounds resampled with
    replacement, the two times of a round kept together (they ran back to back).

    With `groups` (the session of each round, bench/contenders.py), the sessions are resampled
    first and then the rounds within each drawn session: rounds of one session share its
    processes' speed, so they are not independent draws, and the interval has to show how far a
    different set of processes could move the ratio.

    The bench's headline is the ratio of medians; this says how far it moves when the same
    machine's noise is drawn again, so a ratio of 1.01 with an interval of [0.97, 1.04] reads as
    "not told apart", not as "1% slower".
    """
    rng = random.Random(0)
    n = len(first)
    clusters: dict[int, list[int]] = {}
    for i, group in enumerate(groups or []):
        clusters.setdefault(group, []).append(i)
    members = list(clusters.values())
    ratios = []
    for _ in range(num_resamples):
        if members:
            drawn = [rng.choice(members) for _ in members]
            idx = [rng.choice(cluster) for cluster in drawn for _ in cluster]
        else:
            idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(
            statistics.median(first[i] for i in idx) / statistics.median(second[i] for i in idx)
        )
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * num_resamples)], ratios[int((1 - tail) * num_resamples) - 1]


def flops_per_token(model: str, num_params: int, seq: int) -> float:
    """Training FLOPs per token, as the engine's MFU counts them (trainer/core/flops.py)."""
    shape = MODELS[model]
    return training_flops_per_token(num_params, shape["num_hidden_layers"], shape["hidden_size"],
                                    seq)  # fmt: skip


def mfu(
    model: str,
    num_params: int,
    seq: int,
    device: torch.device,
    tokens_per_s: dict[str, float],
    world_size: int = 1,
) -> dict[str, Any]:
    """Model FLOPs utilisation per contender on a GPU whose bf16 peak is known, else {}.

    `mfu_6n` counts 6 FLOPs per parameter and token (the usual headline figure); `mfu` adds
    attention's score and value matmuls (what the engine logs).
    """
    peak = peak_flops(device)
    if not peak:
        return {}
    total = peak * world_size
    with_attention = flops_per_token(model, num_params, seq)
    return {
        "peak_flops_per_device": peak,
        "mfu_6n": {name: 6 * num_params * tps / total for name, tps in tokens_per_s.items()},
        "mfu": {name: with_attention * tps / total for name, tps in tokens_per_s.items()},
    }


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    from trainer.core.gpus import peak_flops_for

    return peak_flops_for(torch.cuda.get_device_name(device))


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def machine() -> dict[str, Any]:
    """Where and with what the numbers were taken, including how busy the machine was."""
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for package in ("transformers", "accelerate", "deepspeed"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
