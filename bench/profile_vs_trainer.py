"""Where the time of one eager step goes: oomless `single`, the plain loop and the transformers
Trainer on `make bench`'s job, each profiled with the engine's profiler window
(`trainer/observe/profile.py`: the same trace, memory events and phase markers a `debug.profile` run
writes), and the load-insensitive differences printed side by side: operator counts,
allocations, threads, and the share of the step in each phase.

Built and run as `bench.engine_vs_plain` builds and runs them (each in a thread of its own, the
Trainer parked between steps by a callback), after warm-up steps.

    python -m bench.profile_vs_trainer [--steps 2] [--out bench-profile] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch

from bench.common import make_batches, resolve_device
from bench.engine_vs_plain import HFTrainerStepper, OomlessSingle, PlainLoop
from trainer.core.contract import trace_path
from trainer.observe.phases import MARKER
from trainer.observe.profile import ProfileWindow

_STEP = "oomless: optimizer step "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--steps", type=int, default=2, help="profiled steps per contender")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", type=Path, default=Path("bench-profile"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.rounds = 2  # what HFTrainerStepper sizes its dataset by: warm-up + profiled steps
    device = resolve_device(args.device)
    batches = make_batches(args.model, args.accum, args.micro, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "o").mkdir()
        pools = {name: ThreadPoolExecutor(1) for name in ("oomless", "plain")}
        sides: dict[str, Any] = {  # one after the other: transformers' lazy imports race
            "oomless": pools["oomless"]
            .submit(OomlessSingle, Path(tmp) / "o", args, device)
            .result()
        }
        sides["plain"] = pools["plain"].submit(PlainLoop, args, device).result()
        sides["hf_trainer"] = HFTrainerStepper(args, device, Path(tmp) / "hf")

        for name in pools:
            pools[name].submit(sides[name].run, batches, 1).result()  # warm-up
        sides["hf_trainer"].run(1)
        summary = {}
        for name, side in sides.items():
            # the profiler records the thread it starts in: each side's own
            model = side.trainer.model if name == "hf_trainer" else side.model
            spec = types.SimpleNamespace(start=1, steps=args.steps)
            window = ProfileWindow(spec, args.out / name, 0, device, model)
            for i in range(args.steps):
                before = _thread_cpu_s()
                if name in pools:
                    pools[name].submit(_profiled_step, window, i, side, batches).result()
                else:  # the Trainer's thread: begins when it resumes, ends when it parks
                    side.num_threads_seen = None

                    def resume(
                        i: int = i, window: ProfileWindow = window, side: Any = side
                    ) -> None:
                        side.num_threads_seen = torch.get_num_threads()
                        window.begin(i)

                    side.on_resume = resume
                    side.on_park = lambda i=i, window=window: window.end(i)
                    side.run(1)
                cpu_s = {t: s - before.get(t, 0.0) for t, s in _thread_cpu_s().items()}
            sides["hf_trainer"].on_resume = sides["hf_trainer"].on_park = lambda: None
            summary[name] = summarize(trace_path(args.out / name, 0))
            busy = sorted((s for s in cpu_s.values() if s > 0.01), reverse=True)
            summary[name]["os_threads_cpu_s"] = [round(s, 3) for s in busy]
            summary[name]["torch_num_threads"] = (
                pools[name].submit(torch.get_num_threads).result()
                if name in pools
                else side.num_threads_seen
            )
        sides["hf_trainer"].close()
        for pool in pools.values():
            pool.shutdown()
    print(render(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of every OS thread of this process."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def _profiled_step(window: ProfileWindow, i: int, side: Any, batches: Any) -> None:
    window.begin(i)
    side.run(batches, 1)
    window.end(i)


def summarize(path: Path) -> dict[str, Any]:
    """Counts and times over the last profiled step of one trace."""
    events = json.loads(path.read_text())["traceEvents"]
    step = max(
        (e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(_STEP)),
        key=lambda e: int(e["name"][len(_STEP) :]),
    )
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    ops = [
        e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1
    ]
    self_us = _self_times(ops)
    by_op_us: collections.Counter[str] = collections.Counter()
    for e, us in zip(ops, self_us, strict=True):
        by_op_us[e["name"]] += us
    counts = collections.Counter(e["name"] for e in ops)
    allocs = [
        e["args"]["Bytes"]
        for e in events
        if e.get("name") == "[memory]" and t0 <= e["ts"] <= t1 and e["args"]["Bytes"] > 0
    ]
    threads = collections.Counter()
    for e, us in zip(ops, self_us, strict=True):
        threads[e["tid"]] += us
    marks = sorted(
        (e["ts"], e["name"][len(MARKER) :])
        for e in events
        if e.get("name", "").startswith(MARKER) and t0 <= e["ts"] <= t1
    )
    phases: collections.Counter[str] = collections.Counter()
    edges = [(t0, "before forward")] + marks + [(t1, "end")]
    for (start, label), (end, _) in zip(edges, edges[1:], strict=False):
        kind = _kind(label)
        phases[kind] += (end - start) / 1e3
    return {
        "step_ms": step["dur"] / 1e3,
        "num_ops": len(ops),
        "self_cpu_ms": sum(self_us) / 1e3,
        "op_counts": dict(counts.most_common()),
        "op_self_ms": {k: v / 1e3 for k, v in by_op_us.most_common()},
        "num_allocations": len(allocs),
        "allocated_mib": sum(allocs) / 2**20,
        "threads_self_ms": {str(k): v / 1e3 for k, v in threads.most_common()},
        "phase_ms": dict(phases),
    }


def _kind(label: str) -> str:
    if label.startswith("forward"):
        return "forward (layers)"
    if label.startswith("backward"):
        return "backward (layers)"
    if label in ("head and loss",):
        return "head, loss and their backward"
    if label in ("embeddings backward", "optimizer"):
        return "embeddings backward, clip, optimizer, bookkeeping"
    return "before the first layer (data, embeddings)"


def _self_times(ops: list[dict[str, Any]]) -> list[float]:
    """Each op's duration less its children's, per thread (ops nest by time on a thread)."""
    out = [0.0] * len(ops)
    by_tid: dict[Any, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(ops):
        by_tid[e["tid"]].append(i)
    for idx in by_tid.values():
        idx.sort(key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
        stack: list[int] = []
        for i in idx:
            e = ops[i]
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            out[i] = e["dur"]
            if stack:
                out[stack[-1]] -= e["dur"]
            stack.append(i)
    return out


def render(summary: dict[str, dict[str, Any]]) -> str:
    names = list(summary)
    lines = [f"{'':<44}" + "".join(f"{n:>14}" for n in names)]

    def row(label: str, values: list[Any], fmt: str = "{:>14,.1f}") -> None:
        lines.append(f"{label:<44}" + "".join(fmt.format(v) for v in values))

    row("step (ms, profiled)", [summary[n]["step_ms"] for n in names])
    row("self CPU of all ops (ms)", [summary[n]["self_cpu_ms"] for n in names])
    row("ops", [summary[n]["num_ops"] for n in names], "{:>14,}")
    row("allocations", [summary[n]["num_allocations"] for n in names], "{:>14,}")
    row("allocated (MiB)", [summary[n]["allocated_mib"] for n in names])
    row("threads running ops", [len(summary[n]["threads_self_ms"]) for n in names], "{:>14,}")
    row("torch.get_num_threads() there", [summary[n]["torch_num_threads"] for n in names], "{:>14}")
    row(
        "OS threads busy in the step",
        [len(summary[n]["os_threads_cpu_s"]) for n in names],
        "{:>14}",
    )
    lines.append(
        f"{'  their CPU s':<44}"
        + "".join(f"{str(summary[n]['os_threads_cpu_s']):>24}" for n in names)
    )
    kinds = sorted({k for n in names for k in summary[n]["phase_ms"]})
    for k in kinds:
        row(f"  {k} (ms)", [summary[n]["phase_ms"].get(k, 0.0) for n in names])
    top = collections.Counter()
    for n in names:
        top.update(summary[n]["op_self_ms"])
    lines.append("ops by self CPU (ms) / count:")
    for op, _ in top.most_common(25):
        lines.append(
            f"  {op[:42]:<42}"
            + "".join(
                f"{s['op_self_ms'].get(op, 0.0):>8.1f}/{s['op_counts'].get(op, 0):<5}"
                for s in summary.values()
            )
        )
    counts = {op for n in names for op in summary[n]["op_counts"]}
    differ = [
        op for op in sorted(counts) if len({summary[n]["op_counts"].get(op, 0) for n in names}) > 1
    ]
    lines.append("ops whose counts differ:")
    for op in differ:
        lines.append(
            f"  {op[:42]:<42}" + "".join(f"{summary[n]['op_counts'].get(op, 0):>14}" for n in names)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
