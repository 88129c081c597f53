"""The table bench/gpu_validate.sh prints last: one row per part, from what the parts left in OUT.

    python -m bench.gpu_report OUT

Reads OUT/parts.tsv (name, exit status, seconds; written by the script) and each part's JSON;
writes OUT/summary.md with the same table. A part whose JSON is missing shows its exit status and
the last line of its log instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import machine
from bench.expert_parallel import words as expert_words
from trainer.core.units import GIB

LABELS = {
    "estimate": "estimator vs max_memory_allocated",
    "single": "`single` vs plain loop",
    "fsdp": "`fsdp` (world 1) vs hand-written FSDP2",
    "zero3_offload": "`zero3_offload` vs DeepSpeed by hand",
    "escalation": "real OOM -> escalation",
    "levers": "chunked loss, activation offload vs off",
    "long_context": "long context: 8B layers, peak vs estimate",
    "stream": "`stream` vs `zero3_offload_params` (optional)",
    "expert": "`parallel.expert=2` vs `fsdp` (optional, 2+ GPUs)",
}
EXIT_MEANINGS = {"124": "timed out", "137": "killed (timeout)", "missing": "missing"}


def read_parts(out: Path) -> list[tuple[str, str, str]]:
    path = out / "parts.tsv"
    if not path.exists():
        return []
    return [tuple(line.split("\t")[:3]) for line in path.read_text().splitlines() if line.strip()]


def status(code: str) -> str:
    if code == "0":
        return "ok"
    return EXIT_MEANINGS.get(code, code if code == "skipped" else f"exit {code}")


def describe(name: str, out: Path) -> str:
    path = out / f"{name}.json"
    if path.exists():
        result = json.loads(path.read_text())
        if name in ("single", "fsdp"):
            return _throughput(result, "plain")
        if name == "zero3_offload":
            return _offload(result)
        if name == "escalation":
            return _escalation(result)
        if name == "levers":
            return _levers(result)
        if name == "long_context":
            return _long_context(result)
        if name == "stream":
            return f"{result['speedup_vs_zero3_offload_params']:.2f}x the tokens/s"
        if name == "expert":
            return expert_words(result)
    if name == "estimate" and (out / "estimate_gpu.json").exists():
        return _estimate(json.loads((out / "estimate_gpu.json").read_text())["runs"])
    if name == "estimate" and not (out / "estimate.log").exists():
        return "bench/estimate_gpu.py not found"
    return _last_line(out / f"{name}.log")


def _estimate(runs: list[dict[str, Any]]) -> str:
    """The estimate's errors over the runs measured (all of the grid, or those done in time)."""
    from bench.estimate_gpu import errors

    errs = [errors(r) for r in runs]
    peak = [e["peak"] for e in errs if e["peak"] is not None]
    total = [e["total"] for e in errs if e["total"] is not None]
    if not peak:
        return f"{len(runs)} runs, none measured"
    text = f"{len(peak)} of {len(runs)} runs: peak error {min(peak):+.1%} to {max(peak):+.1%}"
    if total:
        text += f", total (reserved + context) {min(total):+.1%} to {max(total):+.1%}"
    return text


def _throughput(r: dict[str, Any], peer: str) -> str:
    tps = r["tokens_per_s"]
    text = (
        f"{r['model']} ({_size(r['num_params'])}) {r['precision']} seq {r['seq_len']}: "
        f"{tps['oomless']:,.0f} vs {tps[peer]:,.0f} tok/s, step-time ratio "
        f"{r['oomless_over'][peer]:.3f}"
    )
    if "mfu_6n" in r:
        text += f"; MFU (6N) {r['mfu_6n']['oomless']:.1%} vs {r['mfu_6n'][peer]:.1%}"
    return text


def _levers(r: dict[str, Any]) -> str:
    """Step time and peak of each lever as a ratio to neither."""
    parts = []
    for name, label in (
        ("chunked_loss", "chunked"),
        ("offload_activations", "offload"),
        ("both", "both"),
    ):
        peak = r["over_off"]["peak"][name]
        parts.append(
            f"{label} time {r['over_off']['step_time'][name]:.3f}"
            + (f" peak {peak:.3f}" if peak is not None else "")
        )
    off = r["peak_device_bytes"]["off"]
    head = f"{r['model']} seq {r['seq_len']}" + (f", off {off / GIB:.1f} GiB" if off else "")
    return f"{head}: " + ", ".join(parts) + " (of off)"


def _offload(r: dict[str, Any]) -> str:
    tps = r["tokens_per_s"]
    text = (
        f"{r['model']} ({_size(r['num_params'])}): {tps['oomless']:,.0f} vs "
        f"{tps['deepspeed']:,.0f} tok/s, step-time ratio {r['oomless_over']['deepspeed']:.3f}"
    )
    transfer = r.get("transfer")
    if transfer:
        text += (
            f"; copies h2d {transfer['h2d_bytes_per_s'] / 1e9:.1f} / d2h "
            f"{transfer['d2h_bytes_per_s'] / 1e9:.1f} GB/s, transfer floor "
            f"{transfer['floor_tokens_per_s']:,.0f} tok/s"
        )
    return text


def _escalation(r: dict[str, Any]) -> str:
    cap = r.get("cap_bytes")
    where = f"cap {cap / GIB:.1f} GiB, " if cap else ""
    loss = "none" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
    text = (
        f"{r['oom']} OOM, {r['model']}, {where}rungs {' -> '.join(r['rungs']) or 'none'}, "
        f"{r['steps_done']} steps, final loss {loss}, exit {r['exit_code']}"
    )
    if r.get("error"):
        text += f"; stopped by: {r['error'][:160]}".replace("|", "/")
    return text


def _long_context(rows: list[dict[str, Any]]) -> str:
    """Per sequence length: the estimate over the measured peak, and tokens/s."""
    parts = []
    for r in rows:
        ratio = r["estimated_peak"] / r["measured_peak"] if r["measured_peak"] else None
        parts.append(
            f"{r['seq']:,} tokens{' offloaded' if r.get('offload') else ''}: "
            f"{r['measured_peak'] / GIB:.1f} GiB, estimate x"
            + ("n/a" if ratio is None else f"{ratio:.3f}")
            + f", {r['tokens_per_s']:,.0f} tok/s"
        )
    return "; ".join(parts)


def _size(num_params: int) -> str:
    return f"{num_params / 1e9:.2f}B" if num_params >= 1e9 else f"{num_params / 1e6:.1f}M"


def _last_line(path: Path) -> str:
    if not path.exists():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    return lines[-1][:200].replace("|", "/") if lines else ""


def table(out: Path) -> str:
    rows = ["| part | status | s | result |", "|---|---|---|---|"]
    for name, code, seconds in read_parts(out):
        rows.append(
            f"| {LABELS.get(name, name)} | {status(code)} | {seconds} | {describe(name, out)} |"
        )
    return "\n".join(rows)


def header(m: dict[str, Any], wall_s: float | None) -> str:
    """Device and versions, the line above the table."""
    where = m.get("gpu") or f"{m['cpu']} (CPU smoke)"
    took = f"; {wall_s:.0f} s" if wall_s is not None else ""
    return (
        f"{where}; torch {m['torch']}, transformers {m['transformers']}, deepspeed "
        f"{m['deepspeed']}; {m['date_utc']} UTC{took}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--wall-s", type=float, help="how long the whole script took")
    args = p.parse_args()
    m = machine()
    (args.out / "machine.json").write_text(json.dumps(m, indent=2) + "\n")
    text = header(m, args.wall_s) + "\n\n" + table(args.out)
    (args.out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
