"""This process's host memory as Linux keeps it (`/proc/self`): the resident set, its high-water
mark and the share of it no other process maps. Torch-free; 0 where /proc is not there.

`ru_maxrss` never resets, so a loading peak would hide a step's: the step's peak is VmHWM after
writing 5 to /proc/self/clear_refs (`reset_peak`). A node's processes share the pages of the
libraries they load; proportional set sizes (Pss) count each shared page once across them."""

from __future__ import annotations

from pathlib import Path

_PROC = Path("/proc/self")


def _kib(path: Path, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """The resident set now."""
    return _kib(_PROC / "status", "VmRSS:") * 1024


def rss_peak_bytes() -> int:
    """The resident set's high-water mark since the last `reset_peak` (or the start)."""
    return _kib(_PROC / "status", "VmHWM:") * 1024


def reset_peak() -> None:
    """Set the high-water mark to the resident set now (Linux; a no-op where it cannot)."""
    try:
        with open(_PROC / "clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def shared_bytes() -> int:
    """What the resident set counts that other processes map too (Rss - Pss): subtracted from
    each process's peak, a node's sum counts every shared page once. Pinned pages are in the
    resident set already."""
    rollup = _PROC / "smaps_rollup"
    rss, pss = _kib(rollup, "Rss:"), _kib(rollup, "Pss:")
    return max(0, rss - pss) * 1024
