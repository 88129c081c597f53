"""Host memory of the offload rungs, measured on CPU processes, beside oomless's host estimate.

    python -m bench.host_memory [--json PATH] [--cpu-smoke]

For `fsdp_offload`, `zero3_offload` and `zero3_offload_params` on 1 and 2 CPU (gloo) ranks, a
Llama large enough that its states dominate (inline HF config, random init, fp32, short
sequences) trains 2 steps through the real CLI (`python -m launcher.cli train`), which saves a
checkpoint, and then resumes it for one more step. Each rank's peak resident set above its
baseline is measured, and the node's: the baseline is the rank's resident set once the
interpreter has imported torch, transformers, deepspeed and the engine, before the model is
built. Per rank, VmHWM of /proc/<pid>/status after resetting it there (writing "5" to
/proc/<pid>/clear_refs); per node, the sum of the ranks' proportional set sizes (Pss of
/proc/<pid>/smaps_rollup, sampled by this process), so that pages the ranks share count once
(pinned pages are resident pages: counted once). "step": the peak up to the end of the last
step (model build and the steps); "resume": the resumed run's, up to the end of its step (model
build, loading the checkpoint with its optimizer state, one step).

The estimate is `oomless estimate --json`'s host figure for the same job (in process), less
what the measurement's baseline holds: the per-rank process constants (`processes`, and on CPU
ranks the runtime overhead of the device side). docs/memory.md "Host memory" shows the table.

The ranks are hooked at interpreter start (a `sitecustomize` on PYTHONPATH that acts only in
`python -m trainer` processes): it imports the libraries, records the baseline, resets the
high-water mark and records it after each step and around the resume.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
HOOK_DIR_VAR = "OOMLESS_HOST_MEMORY_DIR"
RUNGS = ("fsdp_offload", "zero3_offload", "zero3_offload_params")
RANKS = (1, 2)
# A Llama whose states dominate the process: 113M parameters, nearly all in 16 decoder layers
# (the demo tokenizer's 45-token vocabulary keeps the embeddings negligible).
MODEL = {
    "model_type": "llama",
    "vocab_size": 45,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
SMOKE_MODEL = {**MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
SAMPLE_S = 0.05
DEMO = REPO / "configs" / "demo"


# ---- in the rank (via sitecustomize) ------------------------------------------------------------


def _status_bytes(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _pss_bytes(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def rank_hook() -> None:
    """In a `python -m trainer` rank: import what every rank imports, record the baseline, reset
    VmHWM, and record it after every step and around the resume."""
    out = Path(os.environ[HOOK_DIR_VAR])
    pid = os.getpid()
    events = out / f"events-{pid}.jsonl"

    def record(event: str) -> None:
        hwm = _status_bytes("self", "VmHWM:")
        with events.open("a") as f:
            f.write(json.dumps({"t": time.time(), "event": event, "hwm": hwm}) + "\n")

    import deepspeed  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import trainer.engine as engine

    step, resume, objective = engine.step_with_backoff, engine._resume, engine._objective

    def hooked_objective(*args: Any, **kwargs: Any) -> Any:  # right after the backend's setup
        record("setup")
        return objective(*args, **kwargs)

    def hooked_step(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        record("step")
        return result

    def hooked_resume(*args: Any, **kwargs: Any) -> Any:
        record("resume_start")
        result = resume(*args, **kwargs)
        record("resume_end")
        return result

    engine.step_with_backoff, engine._resume = hooked_step, hooked_resume
    engine._objective = hooked_objective
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    base = {"pid": pid, "rss": _status_bytes("self", "VmRSS:"), "pss": _pss_bytes("self")}
    (out / f"base-{pid}.json").write_text(json.dumps(base))


SITECUSTOMIZE = f"""\
import os
if os.environ.get({HOOK_DIR_VAR!r}):
    _argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    if b"-m" in _argv and _argv[_argv.index(b"-m") + 1] == b"trainer":
        from bench.host_memory import rank_hook
        rank_hook()
"""


# ---- in this process -----------------------------------------------------------------------------


class NodeSampler(threading.Thread):
    """Samples the hooked ranks' Pss above their baselines every SAMPLE_S: (time, sum) pairs."""

    def __init__(self, hook_dir: Path) -> None:
        super().__init__(daemon=True)
        self.hook_dir, self.samples, self.stop = hook_dir, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            total, alive = 0, False
            for path in self.hook_dir.glob("base-*.json"):
                base = json.loads(path.read_text())
                try:
                    total += _pss_bytes(base["pid"]) - base["pss"]
                    alive = True
                except (FileNotFoundError, ProcessLookupError, ValueError):
                    pass
            if alive:
                self.samples.append((time.time(), total))
            time.sleep(SAMPLE_S)


def job_tree(model: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    return {
        "model": {"config": model, "tokenizer": str(DEMO / "tokenizer")},
        "data": {
            "path": str(DEMO / "train.jsonl"),
            "format": "prompt_completion",
            "seq_len": 32,
            "cache_dir": str(run_dir.parent / "cache"),
        },  # fmt: skip
        "train": {"lr": 1e-4, "micro_batch_size": 1, "log_every": 1},
        "precision": "fp32",
        "memory": {"activation_checkpointing": "none"},
        "hardware": {"device": "cpu", "nodes": 1},
        "run": {"dir": str(run_dir), "save_final": False, "checkpoint_every": 2},
    }


def overrides(rung: str, ranks: int, steps: int) -> list[str]:
    # `stream` recomputes every layer: it refuses the job's checkpointing `none`
    full = ["memory.activation_checkpointing=full"] if rung == "stream" else []
    return [f"strategy={rung}", f"hardware.devices_per_node={ranks}",
            f"train.global_batch_size={ranks}", f"train.steps={steps}", *full]  # fmt: skip


def train(config: Path, args: list[str], hook_dir: Path, timeout_s: float) -> dict[str, int]:
    """One `oomless train` with hooked ranks: peak bytes above baseline per rank (max over the
    ranks) and per node, up to the last step and, when the run resumed, up to the load's end."""
    hook_dir.mkdir(parents=True)
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(hook_dir), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), HOOK_DIR_VAR: str(hook_dir)}
    sampler = NodeSampler(hook_dir)
    sampler.start()
    try:
        done = subprocess.run([sys.executable, "-m", "launcher.cli", "train", str(config), *args],
                              env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
    finally:
        sampler.stop.set()
        sampler.join()
    if done.returncode != 0:
        raise RuntimeError(f"oomless train {' '.join(args)} exited {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")  # fmt: skip
    ranks = []
    for path in hook_dir.glob("base-*.json"):
        base = json.loads(path.read_text())
        lines = (hook_dir / f"events-{base['pid']}.jsonl").read_text().splitlines()
        ranks.append((base, [json.loads(line) for line in lines]))
    return phase_peaks(ranks, sampler.samples)


def phase_peaks(ranks: list[tuple[dict, list[dict]]], samples: list[tuple[float, int]]):
    """Peak bytes above baseline in each phase a run went through (setup: building and sharding
    the model and the optimizer; load: reading the checkpoint into it; step: the steps after),
    per rank (the largest rank's VmHWM at the phase's end: the peak up to there) and per node
    (the ranks' summed Pss within the phase), and up to the end of the last step ("run")."""

    def end(event: str, last: bool = False) -> float | None:
        times = [[e["t"] for e in ev if e["event"] == event] for _, ev in ranks]
        if not all(times):
            return None
        return min(t[-1] if last else t[0] for t in times)

    def hwm(event: str) -> int:
        return max(max(e["hwm"] for e in ev if e["event"] == event) - b["rss"] for b, ev in ranks)

    def node(start: float, stop: float) -> int:
        return max((s for t, s in samples if start < t <= stop), default=0)

    bounds = {"setup": end("setup"), "load": end("resume_end"), "step": end("step", last=True)}
    out, start = {}, 0.0
    for phase, stop in bounds.items():
        if stop is None:
            continue
        out[f"rank_{phase}_bytes"] = hwm({"load": "resume_end"}.get(phase, phase))
        out[f"node_{phase}_bytes"] = node(start, stop)
        start = stop
    out["rank_run_bytes"] = out["rank_step_bytes"]
    out["baseline_rss_bytes"] = [b["rss"] for b, _ in ranks]
    out["node_run_bytes"] = node(0.0, bounds["step"])
    return out


def estimated(config: Path, args: list[str]) -> dict[str, Any]:
    """`oomless estimate --json`'s host figure for the job, and the part of it above the
    measurement's baseline (the per-rank process constants taken out). The estimate's modules
    are imported here, not at the top: every rank imports this module at start (the hook)."""
    from launcher.estimate.activations import with_activations
    from launcher.estimate.shape import model_shape
    from launcher.plan.hardware import detect_hardware
    from launcher.report.estimate_report import estimates_for
    from trainer.core.config import load_config

    cfg = load_config(config, args)
    hw = detect_hardware(cfg.hardware)
    (est,) = estimates_for(cfg, hw, with_activations(model_shape(cfg.model), cfg))
    host = dict(est.host_breakdown)
    ranks = cfg.hardware.devices_per_node
    constants = host.pop("processes") + ranks * est.device_breakdown["runtime_overhead"]
    above = est.host_total_bytes - constants
    return {
        "params": model_shape(cfg.model).num_params,
        "host_bytes": est.host_total_bytes,
        # a checkpoint's save or load is a peak of its own: the steps are the rest
        "step_bytes": above - host.get("checkpoint", 0),
        "resume_bytes": above,
        "breakdown": host,
    }


def measure_case(model: dict[str, Any], rung: str, ranks: int, work: Path, timeout_s: float):
    """Train 2 steps (saving a checkpoint), resume for a third; both measured, and estimated."""
    run_dir = work / f"{rung}-{ranks}"
    config = work / f"{rung}-{ranks}.yaml"
    config.write_text(yaml.safe_dump(job_tree(model, run_dir)))
    step = train(config, overrides(rung, ranks, 2), run_dir.with_suffix(".hook1"), timeout_s)
    resume = train(config, overrides(rung, ranks, 3), run_dir.with_suffix(".hook2"), timeout_s)
    est = estimated(config, overrides(rung, ranks, 3))
    measured_step, measured_resume = step["node_run_bytes"], resume["node_run_bytes"]
    return {
        "rung": rung,
        "ranks": ranks,
        "params": est["params"],
        "measured_step_bytes": measured_step,
        "measured_resume_bytes": measured_resume,
        "estimate_step_bytes": est["step_bytes"],
        "estimate_resume_bytes": est["resume_bytes"],
        "ratio_step": round(est["step_bytes"] / measured_step, 3),
        "ratio_resume": round(est["resume_bytes"] / measured_resume, 3),
        "first_run": step,
        "resumed_run": resume,
        "estimate_breakdown": est["breakdown"],
    }


def render(rows: list[dict[str, Any]]) -> str:
    """The table of docs/memory.md "Host memory": MiB above the ranks' baselines, per node."""
    mib = 2**20
    lines = ["| rung | ranks | params | measured step | measured resume | estimate step / resume "
             "| ratio step / resume |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['rung']} | {r['ranks']} | {r['params'] / 1e6:.0f}M | "
            f"{r['measured_step_bytes'] / mib:,.0f} MiB | "
            f"{r['measured_resume_bytes'] / mib:,.0f} MiB | "
            f"{r['estimate_step_bytes'] / mib:,.0f} / {r['estimate_resume_bytes'] / mib:,.0f} MiB"
            f" | {r['ratio_step']:.2f} / {r['ratio_resume']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_memory", description=__doc__)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a 0.1M-parameter model, zero3_offload on one rank only")  # fmt: skip
    p.add_argument("--rungs", default=",".join(RUNGS))
    p.add_argument("--ranks", default=",".join(map(str, RANKS)))
    args = p.parse_args(argv)
    model = SMOKE_MODEL if args.cpu_smoke else MODEL
    cases = [(r, 1) for r in ("zero3_offload",)] if args.cpu_smoke else [
        (rung, int(n)) for rung in args.rungs.split(",") for n in args.ranks.split(",")
    ]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="oomless-host-memory-") as tmp:
        for rung, ranks in cases:
            rows.append(measure_case(model, rung, ranks, Path(tmp), timeout_s=900))
            print(render(rows[-1:]).splitlines()[-1], flush=True)
            if args.json:  # after every case: a cut-short run keeps what it measured
                result = {"date": datetime.date.today().isoformat(), "rows": rows}
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
