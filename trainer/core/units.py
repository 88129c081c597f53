"""Byte units and sizes as users write them ('80GiB', '512GB'). Torch-free."""

from __future__ import annotations

import math
import re

MIB = 2**20
GIB = 2**30

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """'80GiB' -> 85899345920. Bare numbers are bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 80GiB")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a size; write it like 80GiB, 512GB or 24GiB")
        if value <= 0:
            raise ValueError("must be positive")
        return int(value)
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"'{value}' is not a size; write it like 80GiB, 512GB or 24GiB")
    number = float(m.group(1))
    if not math.isfinite(number):
        raise ValueError(f"'{value}' is not a size; write it like 80GiB, 512GB or 24GiB")
    size = int(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError("must be positive")
    return size


def size_words(num_bytes: float, up: bool = False) -> str:
    """A size as a person reads it: '512 MiB' under 1 GiB, '3.4 GiB' under 10, '80 GiB' above.
    With `up`, rounded up at the precision printed, so that a size said to be enough is."""
    rounded = math.ceil if up else round
    if num_bytes < GIB:
        return f"{rounded(num_bytes / MIB)} MiB"
    if num_bytes < 10 * GIB:
        tenths = rounded(num_bytes * 10 / GIB)
        return f"{tenths // 10} GiB" if tenths % 10 == 0 else f"{tenths / 10:.1f} GiB"
    return f"{rounded(num_bytes / GIB)} GiB"
