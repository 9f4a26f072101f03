"""What the scheduler adds to one request's latency, measured on the NVMe tier.

One block at a time (queue depth 1), alternating two ways of moving the same block
between a device-tier allocation and the NVMe tier:

- ``raw``: ``NvmeTier.read``/``write`` called directly, waited on with ``result()``;
- ``scheduler``: ``AsyncioScheduler.submit(...)`` of a one-block move, waited on with
  ``Transfer.wait()`` — the path a demand fetch or a store of a managed tensor takes.

Alternating sample by sample keeps drift (throttling, other tenants) out of the
difference. The added latency is the difference of the medians: the event-loop hop,
dispatch and completion bookkeeping, not the disk. Writes are not synced per request
(latency of a request, as fio reports it, not of durability).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tiermem.app.benchio.passes import CaseEnv
from tiermem.app.benchio.pattern import fill_pattern
from tiermem.schedulers.base import Priority

__all__ = ["added_latency"]


def added_latency(
    paths: list[str], *, backend: Any = "auto", block_size: int = 64 << 10, samples: int = 200, blocks: int = 256
) -> dict[str, Any]:
    """Median per-request latency raw vs through the scheduler, for reads and writes.

    Returns ``{"block_size", "samples", "read": {"raw_s", "scheduler_s", "added_s"},
    "write": {...}}``. Offsets cycle over ``blocks`` blocks, so reads are not all one block.
    """
    size = block_size * blocks
    out: dict[str, Any] = {"block_size": block_size, "samples": samples}
    with CaseEnv(
        "nvme", size=size, block_size=block_size, queue_depth=1, through="scheduler", paths=paths, backend=backend
    ) as env:
        scheduler, peer_alloc = env.scheduler, env.peer_alloc
        assert scheduler is not None and peer_alloc is not None
        fill_pattern(env.buffer)
        env.tier.write(env.alloc, 0, env.buffer).result()
        for op in ("read", "write"):
            raw: list[float] = []
            sched: list[float] = []
            for i in range(samples):
                offset = (i % blocks) * block_size
                view = peer_alloc.view(offset, block_size)
                start = time.perf_counter()
                if op == "read":
                    env.tier.read(env.alloc, offset, view).result()
                else:
                    env.tier.write(env.alloc, offset, view).result()
                raw.append(time.perf_counter() - start)
                start = time.perf_counter()
                if op == "read":
                    src, dst, priority = env.alloc, peer_alloc, Priority.DEMAND
                else:
                    src, dst, priority = peer_alloc, env.alloc, Priority.WRITEBACK
                scheduler.submit(
                    src, dst, nbytes=block_size, src_offset=offset, dst_offset=offset, priority=priority
                ).wait()  # as the registry waits on a move
                sched.append(time.perf_counter() - start)
            raw_s, sched_s = statistics.median(raw), statistics.median(sched)
            out[op] = {"raw_s": raw_s, "scheduler_s": sched_s, "added_s": sched_s - raw_s}
    return out
