"""The device tier's registered pool: chunk buffers that do NVMe I/O, in segments cuFile knows.

# NOTE [ Registered device pool ]
kvikio documents registering device memory with cuFile as a gain for buffers reused across many
GPUDirect Storage I/Os and a loss for one-off ones. A streamed chunk's storage is emptied
(``resize_(0)``) and refilled on every fetch (TRAPS 2), so on CUDA each fetch gets a block from
the caching allocator: registering per fetch would be the loss. What lives long is the *segment*
the allocator keeps behind those blocks. So:

1. Only when the device is CUDA, the NVMe tier's backend registers device memory (kvikio with
   GDS active: ``registers_device_memory``) and this torch allows it (rule 5), the device tier
   allocates streamed chunk storage (:meth:`DeviceTier.resize_for_io
   <tiermem.tiers.device.DeviceTier.resize_for_io>`) from its own ``torch.cuda.MemPool``, and
   declares each segment of that pool to the backend once, when a buffer first lands in it
   (NOTE [ Registered device buffers ] in :mod:`tiermem.tiers.backends.kvikio_backend`, rule 6).
   Everywhere else storage is resized as before and I/O goes unregistered.
2. Registered memory must never go back to the driver while registered (``cudaFree`` under a live
   cuFile registration is undefined). Read in PyTorch's main-branch source of the torch 2.13 era
   (``c10/cuda/CUDACachingAllocator.cpp``, ``DeviceCachingAllocator``: ``malloc``,
   ``release_cached_blocks``, ``release_available_cached_blocks``, ``garbage_collect_cached_blocks``,
   ``releasePool``; ``aten/src/ATen/cuda/MemPool.cpp``: ``MemPool::~MemPool``), a private pool's
   segment is ``cudaFree``'d (``release_block``) only by:
   a. ``release_cached_blocks(context, mempool_id)`` (``torch.cuda.empty_cache()``, and the last
      retry of an allocation that ran out of memory): the default pools, plus private pools in
      ``graph_pools_freeable`` only, which a pool enters when ``releasePool`` drops its
      ``use_count`` to 0. A ``MemPool`` holds one use for its life, so never while ours lives;
   b. ``release_available_cached_blocks(params, ...)``: on an allocation *into our pool* that
      ran out of memory, it frees that pool's unsplit free blocks of at least ``max_split_size``,
      but returns at once unless ``max_split_size_mb`` is configured;
   c. ``garbage_collect_cached_blocks``: the default pool's ``large_blocks`` only;
   d. ``MemPool::~MemPool``: ``releasePool`` then ``emptyCache(id)``, freeing the pool's cached
      segments at once (those still allocated later, on the next release of freeable pools).
   So: this pool is not made where ``max_split_size_mb`` is set (b), everything registered is
   deregistered before the last reference to the ``MemPool`` goes (d: :meth:`RegisteredDevicePool.close`,
   the device tier's close; a finalizer otherwise), and (a, c) need nothing.
3. ``torch.cuda.use_mem_pool`` routes the calling thread's allocations to the pool, by a filter
   in the allocator's ``captures_underway``; ``beginAllocateToPool`` refuses a second routing to
   one pool while one is active, so routings are serialised (a lock) and cover nothing but the
   ``resize_`` of one storage. While any routing is active the allocator skips ``process_events``
   and the free-everything retry for *every* thread's allocations (``malloc``: both need an empty
   ``captures_underway``), so an allocation on another thread in that window that would only
   have succeeded after freeing cached blocks raises out of memory instead: the window is one
   allocation long, and tiermem allocates streamed chunks on the thread that computes. The
   routed allocation itself loses that retry too (in the sources read; newer ones gate it on
   a capture context instead): one that runs out of memory is retried once after
   ``torch.cuda.empty_cache()`` outside the routing, then takes a plain, unregistered block.
4. Segments are found from the pool's own snapshot when a buffer lands outside the segments
   seen so far (rare: the allocator only grows a pool by ``cudaMalloc``); an expandable segment
   is never registered (NOTE [ Registered device buffers ] rule 3).
5. Made only with ``torch.cuda.MemPool`` and thread-scoped routing
   (``torch._C._cuda_beginAllocateCurrentThreadToPool``, which torch 2.13's ``use_mem_pool``
   calls; a torch without it is not known to confine routing to the calling thread, and
   pyproject allows torch>=2.2, which has no MemPool at all), the native allocator
   (``cudaMallocAsync`` has no such pools), and neither ``max_split_size_mb`` (rule 2b) nor
   ``expandable_segments`` (rule 4: nothing could be registered) in the allocator's settings.
   Changing those settings after the pool was made is not supported.
6. The cost: a private pool keeps its free blocks to itself (the allocator's out-of-memory retry
   does not free them, rule 2a), so memory a streamed chunk gave back serves only other
   streamed chunks. The plan budgets the streamed chunks' buffers on the device anyway (NOTE
   [ Spare chunk storage ] rule 2), and the pool goes at the device tier's close.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from tiermem.tiers.backends.kvikio_backend import DevicePointer, Segment

__all__ = [
    "IoRegistrar",
    "RegisteredDevicePool",
    "SegmentSource",
    "TorchMemPool",
    "open_pool",
    "pool_unavailable_reason",
]

logger = logging.getLogger("tiermem.device")


class IoRegistrar(Protocol):
    """What the pool declares its segments to: the NVMe tier (:class:`~tiermem.tiers.nvme.NvmeTier`)."""

    @property
    def registers_device_memory(self) -> bool: ...

    def register_buffer(self, buffer: Any) -> bool: ...

    def deregister_buffer(self, buffer: Any) -> None: ...


class SegmentSource(Protocol):
    """The private pool under the allocator (:class:`TorchMemPool`; tests give a fake)."""

    def route(self) -> contextlib.AbstractContextManager[None]:
        """Within it, the calling thread's allocations come from the pool."""
        ...

    def segments(self) -> list[Segment]:
        """The pool's segments now."""
        ...

    def release(self) -> None:
        """Drop the pool: from now on the allocator may ``cudaFree`` its segments (rule 2d)."""
        ...


def _allocator_settings() -> str:
    """The caching allocator's settings as configured: the environment, and what was set at run time."""
    parts = [os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")]
    current = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if current is not None:
        with contextlib.suppress(Exception):
            parts.append(str(current()))
    return ",".join(parts).replace(" ", "").lower()


def pool_unavailable_reason(device: torch.device) -> str | None:
    """Why the registered pool cannot be made for ``device`` (rule 5), or None when it can."""
    if device.type != "cuda":
        return f"the device tier is on {device}, not CUDA"
    if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")) or not hasattr(
        torch._C, "_cuda_beginAllocateCurrentThreadToPool"
    ):
        return f"torch {torch.__version__} has no torch.cuda.MemPool with thread-scoped use_mem_pool"
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        return f"the CUDA allocator backend is {backend!r}, which has no private pools"
    settings = _allocator_settings()
    if "max_split_size_mb" in settings:
        return "max_split_size_mb is set: the allocator could cudaFree a registered segment on an out-of-memory retry"
    if "expandable_segments:true" in settings:
        return "expandable_segments is on: kvikio cannot register an expandable segment"
    return None


class TorchMemPool:
    """A ``torch.cuda.MemPool`` on one device (rules 2, 3, 5)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        with torch.cuda.device(device):
            self._pool: Any = torch.cuda.MemPool()
        self._id = tuple(self._pool.id)

    @contextlib.contextmanager
    def route(self) -> Iterator[None]:
        with torch.cuda.use_mem_pool(self._pool, self._device):
            yield

    def segments(self) -> list[Segment]:
        try:
            raw = self._pool.snapshot(include_traces=False)
        except TypeError:  # torch before include_traces
            raw = self._pool.snapshot()
        return [
            Segment(int(s["address"]), int(s["total_size"]), bool(s.get("is_expandable", False)))
            for s in raw
            if tuple(s.get("segment_pool_id", self._id)) == self._id  # only this pool's, whatever the torch
        ]

    def release(self) -> None:
        self._pool = None  # the last reference: MemPool's destructor releases the pool (rule 2d)


def _release(io: IoRegistrar, registered: list[int], source: SegmentSource) -> None:
    """Rule 2d: deregister every segment, then drop the pool. A module function: a finalizer must
    not hold the pool object it finalizes."""
    while registered:
        io.deregister_buffer(DevicePointer(registered.pop()))
    source.release()


class RegisteredDevicePool:
    """Streamed chunk storage from a private pool whose segments are registered with ``io`` once
    each (NOTE [ Registered device pool ]). Thread-safe."""

    def __init__(self, io: IoRegistrar, source: SegmentSource) -> None:
        self._io = io
        self._source = source
        self._lock = threading.Lock()  # rule 3: one routing to the pool at a time
        #: every segment of the pool seen so far (registered or not), so a buffer in one is found without a snapshot
        self._known: dict[int, Segment] = {}
        #: the bases of the segments registered with ``io``
        self._registered: list[int] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, io, self._registered, source)

    @property
    def registered_segments(self) -> list[int]:
        """The bases of the segments registered now (a copy)."""
        with self._lock:
            return list(self._registered)

    def resize(self, storage: Any, nbytes: int) -> None:
        """``storage.resize_(nbytes)`` with the bytes from the pool (rule 1), its segment registered
        if it is new (rule 4). After :meth:`close`, a plain ``resize_``."""
        with self._lock:
            if self._closed or nbytes == 0:
                storage.resize_(nbytes)
                return
            try:
                with self._source.route():
                    storage.resize_(nbytes)
            except torch.cuda.OutOfMemoryError:
                # Routed, the allocator skips its free-the-cache retry (rule 3): retry once after
                # emptying the cache outside the routing, then fall back to a plain block.
                torch.cuda.empty_cache()
                try:
                    with self._source.route():
                        storage.resize_(nbytes)
                except torch.cuda.OutOfMemoryError:
                    storage.resize_(nbytes)  # unregistered: its I/O still works (rule 1)
                    return
            address = int(storage.data_ptr())
            if not any(s.base <= address < s.base + s.size for s in self._known.values()):
                self._register_new_segments()

    def _register_new_segments(self) -> None:
        for segment in self._source.segments():
            if segment.base in self._known:
                continue
            self._known[segment.base] = segment
            if not segment.expandable and self._io.register_buffer(DevicePointer(segment.base)):
                self._registered.append(segment.base)

    def close(self) -> None:
        """Deregister every segment, then drop the pool (rule 2d). Idempotent."""
        with self._lock:
            self._closed = True
            self._finalizer()


def open_pool(device: torch.device, io: Any) -> RegisteredDevicePool | None:
    """The registered pool for chunk storage on ``device`` doing I/O with ``io``, or None where
    it would register nothing or cannot be made safely (rules 1, 5); logs which and why."""
    reason = pool_unavailable_reason(device)
    if reason is not None and device.type != "cuda":
        return None  # the CPU device: nothing to say, nothing to ask the backend
    if not getattr(io, "registers_device_memory", False):
        return None  # posix, aio, host tiers, kvikio in compatibility mode: nothing to register
    if reason is not None:
        logger.info("tiermem device tier: chunk buffers do NVMe I/O unregistered: %s", reason)
        return None
    logger.info("tiermem device tier: chunk buffers come from a private pool registered with cuFile")
    return RegisteredDevicePool(io, TorchMemPool(device))
