"""How the scheduler shares a tier's in-flight bound between priorities.

The scheduler enforces it (NOTE [ Scheduling rules ] rule 4 in
:mod:`tiermem.schedulers.asyncio_scheduler`) and the cost model predicts with it
(NOTE [ Cost model ] rule 6), so it lives here, in the vocabulary both import.
"""

from __future__ import annotations

PREFETCH_SHARE = 0.75
"""The most of a tier's in-flight bound (and of its backend's queue) prefetches may hold, so
write-backs and demand fetches always find room beside them."""
