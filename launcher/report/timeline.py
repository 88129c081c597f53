"""`memory_timeline.png`: live bytes over one profiled step, by phase, with the estimate's
prediction per phase laid over the measured curve.

Measured: the memory events of rank 0's profiler trace (`debug.profile`) over the last profiled
step; on CPU the profiler counts only what was allocated after it started, so the state alive
then (parameters, buffers, optimizer state; recorded in the trace's metadata) is added. Phases:
the markers `trainer/observe/phases.py` put into the trace. Predicted: the same step traced under
FakeTensorMode (`launcher/estimate/trace.py`, what `oomless estimate --trace` runs) at the
micro-batch, accumulation and checkpointing the profiled step ran with, marked by the same phase
markers. The plotted numbers are written beside the picture (`memory_timeline.json`).
"""

from __future__ import annotations

import io
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.core.contract import CONFIG_FILE, trace_path
from trainer.core.files import umask_mode, write_atomic
from trainer.core.units import MIB
from trainer.observe.phases import MARKER, OPTIMIZER

log = logging.getLogger(__name__)

_STEP_RANGE = re.compile(r"^oomless: optimizer step (\d+)$")
_DEVICE_TYPES = {"cpu": 0, "cuda": 1}  # "Device Type" of the trace's [memory] events


@dataclass
class Phase:
    label: str
    start_ms: float
    end_ms: float
    measured_peak_bytes: int
    predicted_peak_bytes: int | None = None


@dataclass
class Timeline:
    device: str
    step: int
    t_ms: list[float]
    live_bytes: list[int]
    phases: list[Phase]


def measured_timeline(trace_path: Path) -> Timeline:
    """Live bytes and phases over the last profiled step of one rank's trace."""
    trace = json.loads(trace_path.read_text())
    meta = trace.get("oomless") or {}  # ProfileWindow's add_metadata_json
    if isinstance(meta, str):
        meta = json.loads(meta)
    device = meta.get("device", "cpu")
    events = trace["traceEvents"]
    steps = [
        (int(m.group(1)), e)
        for e in events
        if e.get("ph") == "X" and (m := _STEP_RANGE.match(e.get("name", "")))
    ]
    if not steps:
        raise ValueError(f"{trace_path} has no profiled optimizer step")
    step, span = max(steps, key=lambda s: s[0])
    t0, t1 = float(span["ts"]), float(span["ts"]) + float(span["dur"])
    base = int(meta.get("state_bytes_at_start", 0)) if device == "cpu" else 0
    device_type = _DEVICE_TYPES.get(device, 0)
    memory = sorted(
        (float(e["ts"]), base + int(e["args"]["Total Allocated"]))
        for e in events
        if e.get("name") == "[memory]"
        and e.get("args", {}).get("Device Type") == device_type
        and t0 <= float(e["ts"]) <= t1
    )
    marks = sorted(
        (float(e["ts"]), e["name"][len(MARKER) :])
        for e in events
        if e.get("name", "").startswith(MARKER) and t0 <= float(e["ts"]) <= t1
    )
    phases = []
    for i, (start, label) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else t1
        inside = [b for t, b in memory if start <= t < end]
        before = [b for t, b in memory if t < start]
        peak = max(inside + before[-1:], default=0)
        phases.append(Phase(label, (start - t0) / 1e3, (end - t0) / 1e3, peak))
    return Timeline(
        device=device,
        step=step,
        t_ms=[(t - t0) / 1e3 for t, _ in memory],
        live_bytes=[b for _, b in memory],
        phases=phases,
    )


def predicted_phases(run_dir: Path, record: dict[str, Any]) -> list[tuple[str, int]] | None:
    """The estimate's live bytes per phase for the profiled step's shape, from a FakeTensor
    trace of one step; None for strategies the trace does not cover."""
    from launcher.estimate.trace import TRACEABLE, trace_step
    from trainer.core.config import load_config
    from trainer.core.hf_config import hf_config_dict
    from trainer.core.step_spec import StepSpec

    strategy = record["strategy"]
    if strategy not in TRACEABLE:
        return None
    cfg = load_config(run_dir / CONFIG_FILE)
    every = cfg.fsdp.reduce_every_micro_batch
    spec = StepSpec(
        strategy=strategy,
        world_size=int(record["world_size"]),
        micro_batch_size=int(record["micro_batch_size"]),
        seq_len=cfg.data.seq_len,
        activation_checkpointing=record.get("activation_checkpointing", "none"),
        precision=cfg.precision,
        grad_accum=int(record["grad_accum"]),
        fsdp_reduce_every_micro_batch=every is True,
    )
    traced = trace_step(
        hf_config_dict(cfg.model.config, cfg.model.name_or_path), spec,
        attn_implementation=cfg.model.attn_implementation,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
    )  # fmt: skip
    return list(traced.phases)


def attach_prediction(timeline: Timeline, predicted: list[tuple[str, int]]) -> None:
    """Give each measured phase the predicted peak of the same phase: the n-th occurrence of a
    label in the measured step takes the n-th occurrence in the prediction."""
    by_label: dict[str, list[int]] = {}
    for label, value in predicted:
        by_label.setdefault(label, []).append(value)
    seen: dict[str, int] = {}
    for phase in timeline.phases:
        n = seen.get(phase.label, 0)
        seen[phase.label] = n + 1
        values = by_label.get(phase.label, [])
        phase.predicted_peak_bytes = values[n] if n < len(values) else None


def plot_memory_timeline(run_dir: Path, records: list[dict[str, Any]], out: Path) -> Path:
    """memory_timeline.png (and .json with the plotted numbers) from rank 0's trace."""
    import matplotlib.pyplot as plt

    timeline = measured_timeline(trace_path(run_dir, 0))
    record = next((r for r in records if r["step"] == timeline.step), records[-1])
    predicted = predicted_phases(run_dir, record)
    if predicted is not None:
        attach_prediction(timeline, predicted)

    fig, ax = plt.subplots(figsize=(11, 4.5))
    colors = {"forward": "tab:blue", "head": "tab:orange", "backward": "tab:green"}
    for phase in timeline.phases:
        kind = phase.label.split(" ")[0]
        color = colors.get(kind, "tab:red" if phase.label == OPTIMIZER else "tab:gray")
        ax.axvspan(phase.start_ms, phase.end_ms, color=color, alpha=0.10, linewidth=0)
    ax.plot(
        timeline.t_ms,
        [b / MIB for b in timeline.live_bytes],
        drawstyle="steps-post",
        color="black",
        linewidth=1.0,
        label="measured live tensor bytes",
    )
    first = True
    for phase in timeline.phases:
        if phase.predicted_peak_bytes is None:
            continue
        ax.hlines(
            phase.predicted_peak_bytes / MIB,
            phase.start_ms,
            phase.end_ms,
            colors="tab:red",
            linewidth=2.0,
            label="estimate (traced step): peak per phase" if first else None,
        )
        first = False
    measured_peak = max(timeline.phases, key=lambda p: p.measured_peak_bytes)
    title = (
        f"{record['strategy']} x {record['world_size']}, step {timeline.step} "
        f"(micro-batch {record['micro_batch_size']} x {record['grad_accum']}): measured peak "
        f"{measured_peak.measured_peak_bytes / MIB:,.1f} MiB in {measured_peak.label}"
    )
    with_prediction = [p for p in timeline.phases if p.predicted_peak_bytes is not None]
    if with_prediction:
        top = max(with_prediction, key=lambda p: p.predicted_peak_bytes or 0)
        title += f"; estimate {top.predicted_peak_bytes / MIB:,.1f} MiB in {top.label}"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("time in the step (ms); bands: forward (blue), head and loss (orange), "
                  "backward (green), optimizer (red)", fontsize=8)  # fmt: skip
    ax.set_ylabel(f"MiB on {timeline.device} (rank 0)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()  # rendered in memory, written atomically: a link at `out` is replaced
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_atomic(out, png.getvalue(), mode=umask_mode(0o666))
    data = asdict(timeline)
    data["strategy"] = record["strategy"]
    write_atomic(out.with_suffix(".json"), json.dumps(data) + "\n", mode=umask_mode(0o666))
    return out
