"""The launch probe: every rank's first optimizer step measured against the plan's estimate.

After the first step of a launch each rank measures what it held: on CUDA the allocator's peak
allocated and reserved bytes and the CUDA context (what the driver says is used beyond the
reserved pool); on CPU processes the resident set's high-water mark (reset before the step, so
loading does not hide it). Every rank also measures its host memory (the same mark less the pages
other processes share with it: pinned buffers are in the resident set already), summed per node.
Rank 0 writes run.dir/probe.json (docs/probe.md).

Within the plan's budget (device and host memory less `plan.headroom`) the run goes on. A device
over it stops the run before the second step (`EXIT_REPLAN`): `oomless train` plans again with
the measured figure and starts from the state before the first step, so the run learns what a
run planned right from the start would (launcher/run/probe.py). It does so once a run, and not
for a plan the config forced whole (plan.json's `probe.may_replan`); then, and for the host, the
line says so and the run goes on, guarded by the back-off and the escalation.
`debug.probe_scale` multiplies what is measured (tests: the re-plan on any machine).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.backends import Backend
from trainer.core import host_memory
from trainer.core.contract import EXIT_REPLAN, PLAN_FILE, PROBE_FILE
from trainer.core.files import write_json
from trainer.core.units import GIB
from trainer.runtime.dist import all_reduce_sum

log = logging.getLogger(__name__)

# per rank: device measured, peak allocated, peak reserved, context, host, first rank of its node
_FIGURES = 6


def _device_figures(backend: Backend, device: torch.device) -> tuple[int, int, int, int]:
    """(measured total, peak allocated, peak reserved, context) since the step's reset."""
    stats = backend.memory_stats()
    if device.type != "cuda":
        return int(stats["peak_device_bytes"]), 0, 0, 0
    allocated = int(stats["peak_device_bytes"])
    reserved = int(stats.get("peak_reserved_bytes", allocated))
    free, total = torch.cuda.mem_get_info(device)
    context = max(0, total - free - torch.cuda.memory_reserved(device))
    return reserved + context, allocated, reserved, context


def probe_first_step(run: Any, backend: Backend) -> int | None:
    """Measure this launch's first step on every rank (a collective), write probe.json (rank 0);
    what ends the run here: EXIT_REPLAN when it went over the device budget and the plan may
    change, 0 for `plan --probe` (plan.json's `probe.only`); None: train on."""
    ctx, cfg = run.ctx, run.cfg
    plan_path = Path(run.run_dir) / PLAN_FILE
    plan = json.loads(plan_path.read_text()) if plan_path.is_file() else {}
    estimate, budget = plan.get("estimate") or {}, plan.get("budget") or {}
    scale = cfg.debug.probe_scale or 1.0
    measured, allocated, reserved, context = _device_figures(backend, ctx.device)
    host = max(0, host_memory.rss_peak_bytes() - host_memory.shared_bytes())
    mine = [0.0] * (_FIGURES * ctx.world_size)
    mine[_FIGURES * ctx.rank : _FIGURES * (ctx.rank + 1)] = [
        measured * scale, allocated * scale, reserved * scale, context, host * scale,
        ctx.rank - ctx.local_rank,
    ]  # fmt: skip
    every = [int(v) for v in all_reduce_sum(mine, ctx.device)]
    if not estimate.get("device") or not budget:  # no estimate to hold it against
        return None
    report = _report(run, plan, every, scale)
    over_device = any(
        r["device"]["measured_bytes"] > budget["device_bytes"] for r in report["ranks"]
    )
    asked = plan.get("probe") or {}
    may_replan = bool(asked.get("may_replan"))
    report["action"] = "replan" if over_device and may_replan else "continue"
    report["line"] = _line(report, over_device, may_replan)
    report["replanned"] = asked.get("replanned")  # the earlier launch's probe, when it re-planned
    if ctx.rank == 0:
        write_json(Path(run.run_dir) / PROBE_FILE, report)
        if report["over_budget"] and report["action"] != "replan":  # a re-plan: said by train
            log.warning(report["line"])
        else:
            log.info(report["line"])
    if report["action"] == "replan":
        return EXIT_REPLAN
    return 0 if asked.get("only") else None


def _report(run: Any, plan: dict[str, Any], every: list[int], scale: float) -> dict[str, Any]:
    est, budget = plan["estimate"], plan["budget"]
    device_est = est["device"]
    parts = device_est.get("breakdown") or {}
    transient = int(parts.get("activations", 0)) + int(parts.get("temporary", 0))
    ranks, nodes = [], {}
    for rank in range(run.ctx.world_size):
        measured, allocated, reserved, context, host, first = every[
            _FIGURES * rank : _FIGURES * (rank + 1)
        ]
        ranks.append({
            "rank": rank,
            "device": {
                "measured_bytes": measured,
                "peak_allocated_bytes": allocated or None,
                "peak_reserved_bytes": reserved or None,
                "context_bytes": context or None,
                "estimated_bytes": device_est["total_bytes"],
                "estimated_peak_tensor_bytes": device_est["peak_tensor_bytes"],
                "estimated_transient_bytes": transient,
                "ratio": round(measured / max(1, device_est["total_bytes"]), 4),
            },
            "host": {"measured_bytes": host},
        })  # fmt: skip
        nodes[first] = nodes.get(first, 0) + host
    host_est = int((est.get("host") or {}).get("total_bytes") or 0)
    node_rows = [
        {"first_rank": first, "host": {"measured_bytes": b, "estimated_bytes": host_est,
                                       "ratio": round(b / max(1, host_est), 4)}}
        for first, b in sorted(nodes.items())
    ]  # fmt: skip
    over_host = any(n["host"]["measured_bytes"] > budget["host_bytes"] for n in node_rows)
    over_device = any(r["device"]["measured_bytes"] > budget["device_bytes"] for r in ranks)
    return {
        "step": run.start_step + 1,
        "strategy": plan.get("strategy"),
        "family": run.factory.hf_config.model_type,
        "device": run.ctx.device.type,
        "hardware": plan.get("hardware") or {},
        "probe_scale": scale,
        "budget": budget,
        "ranks": ranks,
        "nodes": node_rows,
        "over_budget": over_device or over_host,
        "over_host_budget": over_host,
    }


def _line(report: dict[str, Any], over_device: bool, may_replan: bool) -> str:
    """One line: measured against estimated, and what follows."""
    top = max(report["ranks"], key=lambda r: r["device"]["measured_bytes"])["device"]
    host = max(report["nodes"], key=lambda n: n["host"]["measured_bytes"])["host"]
    scaled = (
        f" (x{report['probe_scale']:g}, debug.probe_scale)" if report["probe_scale"] != 1 else ""
    )
    said = (
        f"launch probe: step {report['step']} measured {top['measured_bytes'] / GIB:.2f} GiB per "
        f"device{scaled} against {top['estimated_bytes'] / GIB:.2f} GiB estimated "
        f"({top['ratio']:.2f}x; budget {report['budget']['device_bytes'] / GIB:.2f} GiB), host "
        f"{host['measured_bytes'] / GIB:.2f} GiB a node against {host['estimated_bytes'] / GIB:.2f}"
    )
    if over_device and may_replan:
        return said + "; over the device budget: planning again with the measured figure"
    if over_device:
        return said + "; over the device budget, and the plan stays (forced, or re-planned once)"
    if report["over_host_budget"]:
        return (
            said + "; over the host budget: the run goes on (plan.headroom, hardware.host_memory)"
        )
    return said + "; within the budget"
