"""Freed host memory goes back to the system (glibc only; TRAPS 8).

# NOTE [ Returning freed memory ]
1. Why: glibc raises its mmap threshold each time a large block (up to 32 MiB) is freed, so
   later large allocations (staging buffers, gradient copies, activations) come from the heap
   and stay in the process after they are freed: a process that moved a few GiB through host
   buffers keeps them resident, and the host capacity the user set is broken in RSS, the
   meter users read. Measured: a GPT of 840 MB streamed through 400 MB of device and host
   capacity held 950 MB of anonymous memory after two steps; with the threshold fixed, 344 MB.
2. What: when the first runtime starts, ``mallopt`` fixes the mmap threshold at
   :data:`MMAP_THRESHOLD` (blocks from that size are mapped, and unmapped when freed) and the
   trim threshold at :data:`TRIM_THRESHOLD`. Smaller allocations keep glibc's heap.
3. The user decides first: when ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` is in
   the environment (glibc read it at start), or ``TIERMEM_KEEP_MALLOC=1``, nothing changes. On
   another C library nothing changes either.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger("tiermem")

MMAP_THRESHOLD = 1 << 20
"""Rule 2: blocks of 1 MiB and more are mapped on their own (below, page-fault churn outweighs)."""
TRIM_THRESHOLD = 16 << 20
"""Rule 2: free heap above this at the top of the heap is returned."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_done: bool | None = None


def return_freed_memory() -> bool:
    """Rule 2, once per process; True when glibc now returns freed large blocks."""
    global _done
    if _done is None:
        _done = _configure()
    return _done


def _configure() -> bool:
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False  # rule 3: the user's own settings
    if os.environ.get("TIERMEM_KEEP_MALLOC") == "1" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("tiermem: glibc refused mallopt; freed host buffers may stay in the process (TRAPS 8)")
    return ok
