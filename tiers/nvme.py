"""The NVMe tier: allocations in preallocated files, striped over one or more paths.

# NOTE [ NVMe tier layout and I/O ]
1. Each path gets a private run directory (:mod:`tiermem.tiers.rundir`) holding one data
   file. Allocations are extents of one logical space (``ExtentAllocator``, 4096-aligned);
   logical byte ``off`` lives in file ``(off // block_size) % P`` at file offset
   ``(off // (block_size * P)) * block_size + off % block_size``. Files grow by
   ``fallocate`` as the allocator's high-water mark rises: never a file per tensor (TRAPS 5).
2. A request is split at stripe-unit boundaries into segments (each inside one unit, so at
   most ``block_size`` bytes in one file), run on a worker pool of ``queue_depth`` threads.
   The request's one future completes when every segment has; on error it fails with the
   first error only after the other segments have stopped touching the caller's buffer.
3. With O_DIRECT, buffer address, length and file offset must be 4096-aligned (TRAPS 5).
   Memory-tier buffers are, so the common path is zero-copy. Otherwise a segment is staged
   through an aligned bounce buffer, padded to whole pages: a partial page is read first
   (read-modify-write) unless the bytes it would clobber are allocation padding.
4. With ``checksum=True`` every written segment's xxh3-64 is recorded by logical range.
   Every read of bytes inside the allocation's ``nbytes`` is verified against the records
   covering it, reading whole records through a bounce buffer when the read does not match
   one exactly; bytes no record covers raise :class:`UnverifiedReadError`. Nothing is
   returned unverified.
5. Futures returned here are already RUNNING, so ``cancel()`` returns False: a caller must
   not free or reuse a buffer while a worker may still be reading or writing it.
6. When the backend has a submission queue (``aio``) and a file does O_DIRECT, a segment
   that needs no CPU work — zero-copy (host memory, aligned address, length and offset),
   no checksum to compute or verify — goes from the submitting thread straight to the
   queue, and completes on the queue's thread: no worker hand-off per request, which is
   what limits small requests (TRAPS 15). Everything else (staging, read-modify-write,
   checksums, CUDA tensors, buffered files) runs on the worker pool as before, so the
   submitting thread — often the scheduler's event loop — never copies or hashes.
   Both kinds of segment of one request count down the same ``remaining``.
7. CUDA tensors: a request holds the event :meth:`NvmeTier.fence` recorded last on the
   submitting thread's stream (the scheduler fences on the thread that submits a move) and its
   workers wait for it before they read or write the tensor. Staged through page-locked bounce
   buffers; a backend that ``takes_device_memory`` (kvikio) gets the tensor's device memory
   itself, segment by segment, where no bounce is needed (no checksum, no partial page).

The tier composes two parts: :class:`~tiermem.tiers.nvme_store.NvmeStore`, what is stored
where (run directories, data files, extents, checksum records: rules 1, 3, 4), and
:class:`~tiermem.tiers.nvme_engine.NvmeEngine`, the request engine (segments, the worker
pool and submission queue, futures, frees deferred behind I/O in flight: rules 2, 3, 5, 6).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from tiermem.errors import TiermemWarning
from tiermem.tiers.backends.base import (
    StorageBackend,
    deregister_buffer,
    register_buffer,
    registers_device_memory,
    select_backend,
)
from tiermem.tiers.base import ALIGNMENT, Allocation, Tier
from tiermem.tiers.fsinfo import filesystem_of
from tiermem.tiers.nvme_engine import NvmeEngine
from tiermem.tiers.nvme_store import NvmeStore, resolve_parents
from tiermem.tiers.staging import BouncePool

__all__ = ["NvmeTier"]


def _backend_for(backend: str | StorageBackend, probe_dir: str) -> tuple[StorageBackend, str]:
    """The storage backend and why it was chosen: by name (probed in ``probe_dir``) or as given."""
    if isinstance(backend, str):
        return select_backend(backend, probe_dir)
    if isinstance(backend, StorageBackend):
        return backend, "backend instance given by the caller"
    raise TypeError(f"tiermem nvme tier: backend must be a name or a StorageBackend, got {backend!r}")


def _existing_ancestor(path: str) -> str:
    """``path`` or its nearest existing ancestor: on the same filesystem, unless a mount point
    lies in between, which a directory made on demand never has."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _check_arguments(block_size: int, queue_depth: int, direct: bool | str, capacity: int) -> None:
    if block_size <= 0 or block_size % ALIGNMENT:
        raise ValueError(f"tiermem nvme tier: block_size must be a positive multiple of {ALIGNMENT}, got {block_size}")
    if queue_depth < 1:
        raise ValueError(f"tiermem nvme tier: queue_depth must be >= 1, got {queue_depth}")
    if direct not in (True, False, "auto"):
        raise ValueError(f"tiermem nvme tier: direct must be True, False or 'auto', got {direct!r}")
    if capacity < 0:
        raise ValueError(f"tiermem nvme tier: capacity cannot be negative, got {capacity}")


class NvmeTier(Tier):
    """Storage tier on files under ``paths`` (striped), through a POSIX or kvikio backend.

    ``capacity`` bytes of logical space, handed out in 4096-byte multiples. ``block_size``
    (a multiple of 4096) is the stripe unit and the largest single I/O; ``queue_depth`` the
    number of concurrent I/Os (worker threads). ``direct``: True requires O_DIRECT, "auto"
    uses it where the filesystem accepts it, False never. ``checksum`` verifies every read
    (see NOTE [ NVMe tier layout and I/O ] rule 4). An empty ``paths`` uses the default
    ``$TMPDIR/tiermem-nvme-<uid>`` (private to the user: created on demand, mode 0700, and removed
    again when empty).
    ``subdirectory`` (one rank's ``rank<N>`` in a multi-process job) puts everything in
    ``<path>/<subdirectory>`` instead, created on demand and removed again when empty.
    """

    is_memory = False
    #: Every request is split at stripe-unit boundaries into I/Os of at most ``block_size``
    #: (rule 2), so a scheduler may hand it runs of contiguous blocks in one call.
    vectored = True

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        capacity: int,
        *,
        backend: str | StorageBackend = "auto",
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        checksum: bool = False,
        direct: bool | str = "auto",
        subdirectory: str | None = None,
    ) -> None:
        if isinstance(paths, (str, bytes, os.PathLike)):
            raise TypeError("tiermem nvme tier: paths must be a list of directories, not one path")
        _check_arguments(block_size, queue_depth, direct, capacity)
        super().__init__("nvme", capacity, queue_depth=queue_depth)
        self.block_size = int(block_size)
        self.checksum = bool(checksum)
        self._owner_pid = os.getpid()
        parents, create = resolve_parents(paths, subdirectory)
        self._parents = parents
        self._filesystems = [filesystem_of(p) for p in parents]
        for parent, fs in zip(parents, self._filesystems, strict=True):
            if fs.fstype == "tmpfs":
                warnings.warn(
                    f"tiermem nvme tier: path {parent} is on tmpfs ({fs.mountpoint}); its bytes stay in "
                    "RAM, so offloading there saves no memory. Point [nvme] paths at a disk.",
                    TiermemWarning,
                    stacklevel=2,
                )
        # Probed where the files will be: the nearest directory that exists (a rank directory and
        # the default directory are made only below, by the store).
        probe_dir = _existing_ancestor(parents[0])
        self._backend, self._backend_reason = _backend_for(backend, probe_dir)
        # One bounce buffer per worker is all that can be in use at once (each segment holds at most one).
        self._bounces = BouncePool(self.block_size, self.queue_depth)
        # CUDA tensors stage through page-locked ones (rule 3), made on a CUDA request's first need.
        self._pinned_bounces = BouncePool(self.block_size, self.queue_depth, pinned=True)
        self._store = NvmeStore(
            parents,
            create,
            self._backend,
            capacity=self.capacity,
            block_size=self.block_size,
            checksum=self.checksum,
            direct=direct,
            bounces=self._bounces,
        )
        try:
            self._requests = NvmeEngine(self._store, self.queue_depth, self._bounces, self._pinned_bounces)
        except BaseException:
            self._store.close()
            raise
        self._backend_reason += self._requests.queue_note
        # The checksum records and the submission queue, if any (describe() and tests read them).
        self._sums = self._store.sums
        self._queue = self._requests.queue

    # -- allocation ------------------------------------------------------------------------
    def _allocate(self, nbytes: int, reserved: int) -> Allocation:
        return Allocation(self, nbytes, reserved, location=self._store.allocate(reserved))

    def _free(self, allocation: Allocation) -> None:
        self._requests.release_when_idle(allocation.id, allocation.location, allocation.reserved)

    # -- requests ----------------------------------------------------------------------------
    def _write(self, allocation: Allocation, offset: int, src: torch.Tensor) -> Future[None]:
        return self._requests.submit("write", allocation, offset, src)

    def _read(self, allocation: Allocation, offset: int, dst: torch.Tensor) -> Future[None]:
        return self._requests.submit("read", allocation, offset, dst)

    def fence(self) -> None:
        """Order the CUDA tensors' I/O of requests submitted from now on after the device work the
        calling thread has queued (TRAPS 28): the bytes of a device->NVMe move may come from a
        kernel on the caller's stream, and an NVMe->device move may land where a kernel still
        reads. Workers wait on the recorded event before they touch the tensor (rule 7)."""
        self._requests.fence()

    def sync(self) -> Future[None]:
        """fdatasync every data file: the writes completed so far become durable (TRAPS 5)."""
        self._check_open()
        return self._requests.sync()

    # -- registered device memory (NOTE [ Registered device pool ] in tiermem.tiers.device_pool) ----
    @property
    def registers_device_memory(self) -> bool:
        """Whether device buffers declared with :meth:`register_buffer` get registered (kvikio, GDS active)."""
        return registers_device_memory(self._backend)

    def register_buffer(self, buffer: Any) -> bool:
        """Declare device memory that serves many I/Os until :meth:`deregister_buffer` (NOTE
        [ Registered device buffers ]); True if the backend registered it."""
        return register_buffer(self._backend, buffer)

    def deregister_buffer(self, buffer: Any) -> None:
        deregister_buffer(self._backend, buffer)

    # -- lifecycle and facts ---------------------------------------------------------------
    def _close(self) -> None:
        if os.getpid() != self._owner_pid:
            # Forked child: the pool's threads do not exist here and the files belong to the
            # parent. Remove nothing (TRAPS 12).
            self._requests.abandon()
            return
        self._requests.close()
        self._store.close()  # waits for the submission queue, then closes the files
        self._bounces.clear()
        self._pinned_bounces.clear()

    def segment_counts(self) -> dict[str, int]:
        """How segments were served so far: ``zero_copy``, ``staged`` (bounce buffer) and
        ``read_modify_write`` (staged writes that first read a partial page or record)."""
        return self._requests.counts()

    @property
    def paths(self) -> list[str]:
        """The parent directories (one per stripe)."""
        return list(self._parents)

    @property
    def run_directories(self) -> list[str]:
        return self._store.run_directories

    @property
    def data_files(self) -> list[str]:
        return list(self._store.data_paths)

    @property
    def direct(self) -> bool:
        """True when every data file does direct I/O."""
        return all(self._store.direct)

    def describe(self) -> dict[str, Any]:
        reasons = sorted(set(self._store.direct_reasons))
        return {
            "tier": self.name,
            "capacity": self.capacity,
            "backend": self._backend.name,
            "backend_reason": self._backend_reason,
            "paths": list(self._parents),
            "run_directories": self.run_directories,
            "filesystems": [
                {"path": p, "fstype": fs.fstype, "mountpoint": fs.mountpoint, "device": fs.device}
                for p, fs in zip(self._parents, self._filesystems, strict=True)
            ],
            "direct": self.direct,
            "direct_reason": "; ".join(reasons),
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            # How requests reach the disk (rule 6): the backend's kernel queue, else threads.
            "submission": (
                f"{self._backend.name} kernel queue for zero-copy O_DIRECT segments, worker pool for the rest"
                if self._queue is not None
                else f"worker pool of {self.queue_depth} threads"
            ),
            "checksum": self.checksum,
            "preallocated": sum(self._store.file_sizes),  # int bytes, like every size in tiermem
        }

    def __repr__(self) -> str:
        return (
            f"NvmeTier({self._parents!r}, capacity={self.capacity}, backend={self._backend.name!r}, "
            f"direct={self.direct})"
        )
