"""What launch probes measured, kept for later plans (docs/probe.md "Calibration").

A probe (`oomless train`'s first step, `oomless plan --probe`; trainer/observe/probe.py) measures
what the estimate can only assume: on CUDA the context and the caching allocator's reserve, on CPU
processes the interpreter's and libraries' resident set. Those figures are kept in one file in the
user's cache (`$XDG_CACHE_HOME/oomless/calibration.json`; `OOMLESS_CALIBRATION` names another
file, or `off`), keyed by the hardware the plan is for (device name and memory, torch version),
the rung and the model family: not by the machine that plans, so `submit` on a login node reads
what a probe measured on the GPU nodes. Later plans put them in place of the estimate's runtime
overhead; the tensor peak stays the traced one. Delete the file and plans fall back to the
estimate. Torch-free."""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from trainer.core.files import write_json

log = logging.getLogger(__name__)

ENV = "OOMLESS_CALIBRATION"
UNKNOWN_DEVICE_NAMES = ("cuda", "unknown")  # planning for GPUs from a machine without one


@dataclass(frozen=True)
class RuntimeFigures:
    """Device bytes outside the step's tensors, as a probe measured them for one rung."""

    fixed_bytes: int  # CUDA: the context and libraries; CPU: the process without its tensors
    reserve_ratio: float | None  # CUDA: the allocator's reserve per byte that comes and goes
    measured_on: str  # the date
    measured_bytes: int  # the probe's measured total, and what the estimate said
    estimated_bytes: int


def calibration_path() -> Path | None:
    """The calibration file; None when `OOMLESS_CALIBRATION=off`."""
    named = os.environ.get(ENV)
    if named == "off":
        return None
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "oomless" / "calibration.json"


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def _key(device_name: str, device_memory: int, rung: str, family: str) -> str:
    return f"{device_name}|{device_memory}|torch {torch_version()}|{rung}|{family}"


def _read(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("calibration: %s is unreadable; planning without it", path)
        return {}
    return found if isinstance(found, dict) else {}


def memory_key(hardware: dict[str, Any]) -> int:
    """The memory a calibration is keyed by: the device's; for CPU processes the host's (their
    runtime overhead does not change with the share of it a config gives each rank)."""
    if hardware.get("device") == "cpu":
        return int(hardware["host_memory_bytes"])
    return int(hardware["device_memory_bytes"])


def figures_for(hw: Any, family: str) -> tuple[tuple[str, RuntimeFigures], ...]:
    """(rung, figures) of every rung a probe calibrated for this hardware (launcher/plan/
    hardware.py's Hardware) and model family."""
    device_name = hw.device_name
    device_memory = memory_key({"device": hw.device, "host_memory_bytes": hw.host_memory_bytes,
                                "device_memory_bytes": hw.device_memory_bytes})  # fmt: skip
    found = []
    for key, value in _read(calibration_path()).items():
        parts = key.split("|")
        if len(parts) != 5 or not isinstance(value, dict):
            continue
        name, memory, torch, rung, fam = parts
        same_name = name == device_name or device_name in UNKNOWN_DEVICE_NAMES
        if (same_name and memory == str(device_memory) and torch == f"torch {torch_version()}"
                and fam == family):  # fmt: skip
            try:
                found.append((rung, RuntimeFigures(**value)))
            except TypeError:
                continue
    return tuple(sorted(found, key=lambda pair: pair[0]))


def figures_from_probe(probe: dict[str, Any]) -> RuntimeFigures | None:
    """What one probe says of the runtime overhead: the largest rank's measured bytes above the
    estimate's tensor peak (never below it). On CUDA, split as the estimate splits it: the
    context, and the reserve over the bytes that come and go in a step."""
    ranks = [r.get("device") or {} for r in probe.get("ranks", [])]
    ranks = [d for d in ranks if d.get("measured_bytes") and d.get("estimated_peak_tensor_bytes")]
    if not ranks:
        return None
    top = max(ranks, key=lambda d: d["measured_bytes"])
    peak = int(top["estimated_peak_tensor_bytes"])
    above = max(0, int(top["measured_bytes"]) - peak)
    ratio = None
    if probe.get("device") == "cuda":
        context = int(top.get("context_bytes") or 0)
        transient = max(1, int(top.get("estimated_transient_bytes") or 0))
        ratio = round(max(0, above - context) / transient, 4)
        above = context
    return RuntimeFigures(
        fixed_bytes=above,
        reserve_ratio=ratio,
        measured_on=datetime.date.today().isoformat(),
        measured_bytes=int(top["measured_bytes"]),
        estimated_bytes=int(top.get("estimated_bytes") or 0),
    )


def record(probe: dict[str, Any]) -> Path | None:
    """Keep what `probe` (probe.json) measured for its hardware, rung and family; the file
    written, or None (calibration off, nothing measured, or the cache not writable)."""
    path = calibration_path()
    figures = figures_from_probe(probe)
    hardware = probe.get("hardware") or {}
    if path is None or figures is None or not hardware:
        return None
    key = _key(hardware["device_name"], memory_key(hardware), probe["strategy"], probe["family"])
    kept = _read(path)
    kept[key] = asdict(figures)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, kept)
    except OSError as err:
        log.warning(
            "calibration: could not write %s (%s); later plans stay uncalibrated", path, err
        )
        return None
    return path
