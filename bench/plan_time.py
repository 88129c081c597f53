"""Wall time of the planner on the 70B preset (8 x 80 GiB, 2 TiB host): CLI and `make_plan`.

    python -m bench.plan_time [--repeats 5] [--no-moe] [--json out.json]

The CLI time is what a user waits for (`oomless plan ... --json`: Python start-up, imports, config,
estimate of every rung, plan); the in-process time is `make_plan` alone on the same config and
hardware (model shape read once, as the CLI does), median of many calls. The cold-start time is
the CLI on a shape no preset ships and no cache holds (the 70B config with 79 layers, a fresh
`XDG_CACHE_HOME` per run): the shape is counted by arithmetic, without torch. The traced cold
start is the CLI on a block type the analytic model does not know (a 1.0B gpt_neox: 16 layers,
hidden 2048, seq 4096, bf16) with an empty cache: its activations are measured by tracing
(launcher/estimate/activations.py), on a copy of 3 layers. With `--moe` (the default) it
also plans bench/cold_plan's shapes cold, once each (DeepSeek-V3, traced whole, ~100 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import machine
from trainer.core.hf_config import PRESETS

PRESET = "configs/models/llama-3.1-70b.yaml"
OVERRIDES = [
    "hardware.devices_per_node=8",
    "hardware.device_memory=80GiB",
    "hardware.host_memory=2TiB",  # as the preset says; no GPU here to detect it from
]


def cli_seconds(repeats: int) -> tuple[list[float], dict[str, Any]]:
    """CLI wall times and the last answer: the plan JSON, or {"exit": 3, "message": ...}."""
    oomless = Path(sys.executable).with_name("oomless")
    argv = [str(oomless), "plan", PRESET, *OVERRIDES, "--json"]
    times, answer = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode == 0:
            answer = json.loads(proc.stdout)
        elif proc.returncode == 3:  # planned, nothing fits: still a full planner run
            answer = {"exit": 3, "message": proc.stderr.strip().splitlines()[-1]}
        else:
            raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}")
    return times, answer


def cold_cli_seconds(repeats: int) -> list[float]:
    """CLI wall times on a config never seen: inline 70B-like shape, empty shape cache."""
    job = yaml.safe_load(Path(PRESET).read_text())
    config = json.loads((PRESETS / "llama-3.1-70b.json").read_text())
    job["model"] = {"config": {**config, "num_hidden_layers": 79}}
    return _empty_cache_seconds(job, repeats)


NEOX_1B = {
    "model_type": "gpt_neox",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "intermediate_size": 8192,
    "vocab_size": 50304,
    "max_position_embeddings": 4096,
}


def traced_cold_cli_seconds(repeats: int) -> list[float]:
    """CLI wall times on the 1.0B gpt_neox (a traced block type, seq 4096, bf16), empty caches."""
    job = yaml.safe_load(Path(PRESET).read_text())
    job["model"] = {"config": NEOX_1B}
    job["data"]["seq_len"] = 4096
    job["precision"] = "bf16"
    return _empty_cache_seconds(job, repeats)


COLD_PLANS = Path("bench/cold_plan")  # shapes no preset ships: docs/planner.md's table


def moe_cold_cli_seconds() -> dict[str, float]:
    """Per config under bench/cold_plan (gpt-oss-20b, Qwen3-235B-A22B, gemma-3-27b, DeepSeek-V3):
    one cold CLI plan, on its own hardware, with an empty cache."""
    out = {}
    for path in sorted(COLD_PLANS.glob("*.yaml")):
        job = yaml.safe_load(path.read_text())
        job["data"]["path"] = str((path.parent / job["data"]["path"]).resolve())
        (seconds,) = _empty_cache_seconds(job, 1, overrides=[])
        out[path.stem] = seconds
    return out


def _empty_cache_seconds(
    job: dict[str, Any], repeats: int, overrides: list[str] = OVERRIDES
) -> list[float]:
    oomless = Path(sys.executable).with_name("oomless")
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "job.yaml"
            path.write_text(yaml.safe_dump(job))
            env = {**os.environ, "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
            start = time.perf_counter()
            proc = subprocess.run(
                [str(oomless), "plan", str(path), *overrides, "--json"],
                capture_output=True,
                text=True,
                env=env,
            )
            times.append(time.perf_counter() - start)
            if proc.returncode not in (0, 3):
                raise SystemExit(f"cold plan exited {proc.returncode}:\n{proc.stderr}")
    return times


def in_process_seconds(num_calls: int) -> list[float]:
    from launcher.estimate.shape import model_shape
    from launcher.plan.hardware import detect_hardware
    from launcher.plan.planner import NoFitError, make_plan
    from trainer.core.config import load_config

    cfg = load_config(PRESET, OVERRIDES)
    hw = detect_hardware(cfg.hardware)
    shape = model_shape(cfg.model)
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        try:
            make_plan(cfg, hw, shape)
        except NoFitError:
            pass
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="CLI runs")
    p.add_argument("--calls", type=int, default=50, help="in-process make_plan calls")
    p.add_argument("--traced-repeats", type=int, default=1, help="traced cold CLI runs")
    p.add_argument("--moe", action=argparse.BooleanOptionalAction, default=True,
                   help="cold plans of bench/cold_plan's shapes (~2 min)")  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cli, plan = cli_seconds(args.repeats)
    cold = cold_cli_seconds(args.repeats)
    calls = in_process_seconds(args.calls)
    traced = traced_cold_cli_seconds(args.traced_repeats)
    moe = moe_cold_cli_seconds() if args.moe else {}
    result = {
        "machine": machine(),
        "command": f"oomless plan {PRESET} {' '.join(OVERRIDES)} --json",
        "cli_s": cli,
        "cli_median_s": statistics.median(cli),
        "cold_cli_s": cold,
        "cold_cli_median_s": statistics.median(cold),
        "traced_cold_cli_s": traced,
        "traced_cold_cli_median_s": statistics.median(traced),
        "moe_cold_cli_s": moe,
        "make_plan_median_s": statistics.median(calls),
        "make_plan_calls": args.calls,
        "strategy": plan.get("strategy"),
        "micro_batch_size": plan.get("micro_batch_size"),
        "activation_checkpointing": plan.get("activation_checkpointing"),
        "no_fit": plan.get("message"),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"plan 70B on 8 x 80GiB: CLI {result['cli_median_s']:.2f} s (median of {args.repeats}), "
        f"cold start {result['cold_cli_median_s']:.2f} s, "
        f"traced cold start (1.0B gpt_neox) {result['traced_cold_cli_median_s']:.1f} s, "
        + "".join(f"{name} cold {t:.1f} s, " for name, t in moe.items())
        + f"make_plan {result['make_plan_median_s'] * 1e3:.1f} ms (median of {args.calls}); "
        + (f"chose {result['strategy']}" if result["strategy"] else f"no fit: {result['no_fit']}")
    )


if __name__ == "__main__":
    main()
