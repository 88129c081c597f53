"""A rank's C heap: host tensors it frees go back to the OS, so its resident set follows them.

glibc serves an allocation below its mmap threshold from the heap and keeps the pages when it is
freed; the threshold starts at 128 KiB and rises to the size of each mapped block freed (up to
32 MiB). Once setup has freed a few multi-MiB tensors, every later tensor up to 32 MiB comes from
the heap, and what setup frees (the initial weights, DeepSpeed's flattening and defragmenting
copies) stays resident for the whole run: for a 113M-parameter Llama on `zero3_offload`, 12.5N
bytes of a 37.7N resident set after setup, where its live tensors held 25.2N (docs/memory.md
"Host memory"). A fixed threshold maps every block of 1 MiB or more on its own and unmaps it
when freed: the resident set is then the live tensors, which the host estimate counts. Smaller
blocks stay on the heap, where reuse is quick.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc malloc.h)
HEAP_BLOCK_MAX_BYTES = 1 << 20


def bound_heap_retention() -> bool:
    """Map host blocks of HEAP_BLOCK_MAX_BYTES or more on their own (glibc); False where the C
    library has no `mallopt` or refuses it (musl, macOS), which changes nothing there."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_MAX_BYTES))
    except (OSError, AttributeError):
        return False
