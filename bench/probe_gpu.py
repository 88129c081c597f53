"""The launch probe on docs/gpu.md's jobs: `oomless plan --probe` measured against the estimate,
the calibrated plan that follows, and a run capped at the calibrated estimate against an uncapped
one (docs/probe.md).

    python -m bench.probe_gpu [--only NAME,...] [--cpu-smoke]

Each job runs through the CLI as a user runs it, with `OOMLESS_CALIBRATION` in `$OUT` (or a
temporary directory): first `plan --probe` (measured against estimated, per rank and node), then
`plan --json` reading the calibration it left, then, for jobs marked `capped`, three steps of
`train` uncapped and three capped (`debug.device_memory_fraction`) at the calibrated estimate less
its fixed bytes: whether a plan that the calibrated estimate says fits runs, and how much slower.
Prints a table last and writes `probe_gpu.json`. `--cpu-smoke`: tiny jobs on CPU processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import MODELS

REPO = Path(__file__).resolve().parents[1]
LLAMA_8B_2_LAYERS = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 2,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}  # fmt: skip
TINY = {**MODELS["llama-1b"], "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
# name: (model config, overrides, capped run?)
GPU_JOBS = {
    "llama-1b-fsdp-mb4-s2048-full": (MODELS["llama-1b"], {
        "strategy": "fsdp", "train.micro_batch_size": 4, "train.global_batch_size": 8,
        "data.seq_len": 2048, "memory.activation_checkpointing": "full"}, True),
    "llama-1b-fsdp-mb1-s4096-none": (MODELS["llama-1b"], {
        "strategy": "fsdp", "train.micro_batch_size": 1, "train.global_batch_size": 2,
        "data.seq_len": 4096, "memory.activation_checkpointing": "none"}, True),
    "llama8b-2-layers-single-s32768-full": (LLAMA_8B_2_LAYERS, {
        "strategy": "single", "train.micro_batch_size": 1, "train.global_batch_size": 1,
        "data.seq_len": 32768, "memory.activation_checkpointing": "full",
        "memory.chunked_loss": True}, False),
}  # fmt: skip
CPU_JOBS = {
    "tiny-single-mb4-s256": (TINY, {"strategy": "single", "train.micro_batch_size": 4,
                                    "train.global_batch_size": 8, "data.seq_len": 256}, True),
}  # fmt: skip


def _config(model: dict[str, Any], overrides: dict[str, Any], device: str, path: Path) -> Path:
    job: dict[str, Any] = {
        "model": {"config": model, "tokenizer": str(REPO / "configs" / "demo" / "tokenizer")},
        "data": {"path": str(REPO / "configs" / "demo" / "train.jsonl"),
                 "format": "prompt_completion"},
        "train": {"steps": 3, "warmup_steps": 0, "log_every": 1},
        "precision": "bf16" if device == "cuda" else "fp32",
        "hardware": {"device": device, "devices_per_node": 1},
    }  # fmt: skip
    for key, value in overrides.items():
        node = job
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(job))
    return path


def _cli(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)  # fmt: skip


def _step_time(run_dir: Path) -> float | None:
    """The median step time of the steps after the first."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 1)
    return times[len(times) // 2] if times else None


def one_job(name: str, spec: tuple, device: str, work: Path, env: dict[str, str]) -> dict:
    model, overrides, capped = spec
    config = str(_config(model, overrides, device, work / f"{name}.yaml"))
    row: dict[str, Any] = {"job": name}
    started = time.time()
    probe = _cli("plan", config, "--probe", env=env, timeout=240)
    row["probe_s"] = round(time.time() - started, 1)
    row["probe_rc"] = probe.returncode
    row["probe_table"] = probe.stdout.strip().splitlines()
    ranks = [x.split() for x in row["probe_table"] if x.startswith("rank ")]
    if probe.returncode not in (0, 3) or not ranks:
        row["error"] = (probe.stderr or probe.stdout)[-1500:]
        return row
    row["measured_gib"], row["estimated_gib"], row["ratio"] = (
        float(ranks[0][2]), float(ranks[0][4]), float(ranks[0][6]))  # fmt: skip
    plan = json.loads(_cli("plan", config, "--json", env=env, timeout=240).stdout)
    device_est = plan["estimate"]["device"]
    row["calibrated_total_gib"] = round(device_est["total_bytes"] / 2**30, 3)
    row["calibrated_reason"] = next(
        (r for r in plan["reasons"] if r.startswith("calibrated")), None
    )
    if not capped:
        return row
    memory = plan["hardware"]["device_memory_bytes"]
    # the allocator may hold the calibrated estimate less its fixed bytes (the CUDA context)
    kept = json.loads(Path(env["OOMLESS_CALIBRATION"]).read_text())
    fixed = next(v["fixed_bytes"] for k, v in kept.items() if k.split("|")[3] == plan["strategy"])
    cap = (device_est["total_bytes"] - fixed) / memory if device == "cuda" else None
    for label, extra in (("uncapped", []), ("capped", [f"debug.device_memory_fraction={cap}"])):
        if label == "capped" and cap is None:
            continue
        run_dir = work / f"{name}-{label}"
        r = _cli("train", config, f"run.dir={run_dir}", "run.max_restarts=0", *extra, env=env,
                 timeout=240)  # fmt: skip
        row[f"{label}_rc"] = r.returncode
        row[f"{label}_step_s"] = _step_time(run_dir) if r.returncode == 0 else None
        if r.returncode:
            row[f"{label}_error"] = r.stderr[-800:]
    row["cap_fraction"] = cap
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe_gpu", description=__doc__)
    p.add_argument("--only", default="", help="comma-separated job names")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu_smoke else "cuda"
    jobs = CPU_JOBS if args.cpu_smoke else GPU_JOBS
    picked = [n for n in args.only.split(",") if n] or list(jobs)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="probe-gpu-"))
    work = Path(tempfile.mkdtemp(prefix="probe-gpu-work-"))
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OOMLESS_CALIBRATION": str(out / "calibration.json"), "PYTHONPATH": path}
    rows = []
    for name in picked:
        rows.append(one_job(name, jobs[name], device, work, env))
        (out / "probe_gpu.json").write_text(json.dumps(rows, indent=2))
        print(json.dumps(rows[-1]), flush=True)
    print("| job | measured | estimated | ratio | calibrated total | uncapped step | capped step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            r["job"],
            f"{r.get('measured_gib')} GiB",
            f"{r.get('estimated_gib')} GiB",
            r.get("ratio"),
            f"{r.get('calibrated_total_gib')} GiB",
            f"{r.get('uncapped_step_s')} s",
            f"{r.get('capped_step_s')} s (rc {r.get('capped_rc')})",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
