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
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from tiermem.errors import (
    ChecksumError,
    DiskFullError,
    ShortReadError,
    StorageError,
    StorageIOError,
    StoragePathError,
    TierCapacityError,
    TiermemWarning,
    UnverifiedReadError,
    internal_error,
)
from tiermem.tiers.backends.base import IoOp, IoQueue, StorageBackend, open_queue, select_backend
from tiermem.tiers.base import ALIGNMENT, Allocation, Tier
from tiermem.tiers.extents import ExtentAllocator
from tiermem.tiers.fsinfo import filesystem_of, free_bytes
from tiermem.tiers.nvme_checksums import ChecksumIndex, ChecksumRecord, digest_of
from tiermem.tiers.rundir import RunDirectory, default_parent
from tiermem.tiers.staging import BounceBuffer, BouncePool, is_aligned, memview
from tiermem.units import round_up

__all__ = ["NvmeTier"]

logger = logging.getLogger("tiermem.nvme")

_DATA_NAME = "data"
#: Files grow in steps of at least this (or one stripe row), so fallocate stays rare.
_GROWTH_STEP = 64 << 20

# This process's PID, refreshed in a forked child: the per-request owner check (TRAPS 12)
# without a getpid system call per request (TRAPS 15).
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


class _Segment(NamedTuple):
    """The part of a request inside one stripe unit (so inside one file)."""

    file: int
    file_offset: int
    logical: int
    buf_offset: int
    length: int


class _WritePlan(NamedTuple):
    """A staged write: records it merges, the byte range it records and the range it does I/O on."""

    partial: list[ChecksumRecord]
    rec_lo: int
    rec_hi: int
    io_lo: int
    io_hi: int
    need_read: bool


class _Request:
    """One read or write in flight. Holds the caller's tensor only until it completes (TRAPS 14).

    A plain class with slots, not a dataclass: one is made per request, and small requests
    are counted in tens of thousands a second (TRAPS 15)."""

    __slots__ = (
        "address", "allocation_id", "cuda", "data_end", "error", "future", "lock", "op", "queued", "remaining", "tensor"
    )  # fmt: skip

    def __init__(
        self,
        op: str,
        allocation_id: int,
        data_end: int,
        tensor: torch.Tensor | None,
        address: int,
        cuda: bool,
        future: Future[None] | None,
        remaining: int,
    ) -> None:
        self.op = op
        self.allocation_id = allocation_id
        self.data_end = data_end  # logical end of the allocation's meaningful bytes (location + nbytes)
        self.tensor = tensor
        self.address = address  # host address of the buffer, 0 for CUDA tensors
        self.cuda = cuda
        self.future = future
        self.remaining = remaining
        self.error: BaseException | None = None
        self.queued = 0  # segments the submission queue completed (counted as zero-copy at the end)
        self.lock = threading.Lock()


def _gather(futures: list[Future[None]]) -> Future[None]:
    """One future for many: done when all are, failing with the first error."""
    out: Future[None] = Future()
    out.set_running_or_notify_cancel()
    lock = threading.Lock()
    state: dict[str, Any] = {"left": len(futures), "error": None}

    def one_done(f: Future[None]) -> None:
        with lock:
            if state["error"] is None and f.exception() is not None:
                state["error"] = f.exception()
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            if state["error"] is not None:
                out.set_exception(state["error"])
            else:
                out.set_result(None)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(one_done)
    return out


def _close_handles(backend: StorageBackend, handles: list[Any], owner_pid: int, queues: list[IoQueue]) -> None:
    # A forked child shares the parent's descriptors and must not touch kvikio/CUDA state
    # (TRAPS 12); it simply leaves them to its own exit.
    if os.getpid() != owner_pid:
        return
    while queues:  # first: its requests in flight still use the descriptors
        try:
            queues.pop().close()
        except OSError as exc:
            logger.warning("tiermem nvme: closing the submission queue failed: %s", exc)
    while handles:
        handle = handles.pop()
        try:
            backend.close(handle)
        except OSError as exc:
            logger.warning("tiermem nvme: closing a data file failed: %s", exc)


class NvmeTier(Tier):
    """Storage tier on files under ``paths`` (striped), through a POSIX or kvikio backend.

    ``capacity`` bytes of logical space, handed out in 4096-byte multiples. ``block_size``
    (a multiple of 4096) is the stripe unit and the largest single I/O; ``queue_depth`` the
    number of concurrent I/Os (worker threads). ``direct``: True requires O_DIRECT, "auto"
    uses it where the filesystem accepts it, False never. ``checksum`` verifies every read
    (see NOTE [ NVMe tier layout and I/O ] rule 4). An empty ``paths`` uses the default
    ``$TMPDIR/tiermem-nvme`` (created on demand and removed again when empty).
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
    ) -> None:
        if isinstance(paths, (str, bytes, os.PathLike)):
            raise TypeError("tiermem nvme tier: paths must be a list of directories, not one path")
        if block_size <= 0 or block_size % ALIGNMENT:
            raise ValueError(
                f"tiermem nvme tier: block_size must be a positive multiple of {ALIGNMENT}, got {block_size}"
            )
        if queue_depth < 1:
            raise ValueError(f"tiermem nvme tier: queue_depth must be >= 1, got {queue_depth}")
        if direct not in (True, False, "auto"):
            raise ValueError(f"tiermem nvme tier: direct must be True, False or 'auto', got {direct!r}")
        if capacity < 0:
            raise ValueError(f"tiermem nvme tier: capacity cannot be negative, got {capacity}")
        super().__init__("nvme", capacity, queue_depth=queue_depth)
        self.block_size = int(block_size)
        self.checksum = bool(checksum)
        self._direct_arg = direct
        self._owner_pid = os.getpid()

        parents, create = self._resolve_parents(paths)
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

        if isinstance(backend, str):
            self._backend, self._backend_reason = select_backend(backend, parents[0])
        elif isinstance(backend, StorageBackend):
            self._backend, self._backend_reason = backend, "backend instance given by the caller"
        else:
            raise TypeError(f"tiermem nvme tier: backend must be a name or a StorageBackend, got {backend!r}")

        self._space = ExtentAllocator(self.capacity, ALIGNMENT)
        self._alloc_lock = threading.Lock()  # allocator + file growth
        self._state_lock = threading.Lock()  # in-flight counts, deferred frees, counters
        self._rmw_lock = threading.Lock()  # serialises read-modify-write of partial pages
        self._inflight: dict[int, int] = {}
        self._deferred: dict[int, tuple[int, int]] = {}
        self._counts = {"zero_copy": 0, "staged": 0, "read_modify_write": 0}
        self._sums = ChecksumIndex(self.block_size) if self.checksum else None
        # One per worker is all that can be in use at once (each segment holds at most one).
        self._bounces = BouncePool(self.block_size, self.queue_depth)
        self._rundirs: list[RunDirectory] = []
        self._handles: list[Any] = []
        self._data_paths: list[str] = []
        self._aligned: list[bool] = []  # per file: buffer/offset/length must be 4096-aligned
        self._direct: list[bool] = []
        self._direct_reasons: list[str] = []
        self._file_sizes: list[int] = []
        self._prealloc = 0  # logical bytes covered by the files' fallocated sizes
        # The submission queue (rule 6), when the backend has one and some file does O_DIRECT.
        self._queues: list[IoQueue] = []
        self._queue: IoQueue | None = None
        self._queueable: list[bool] = []
        self._finalizer = weakref.finalize(
            self, _close_handles, self._backend, self._handles, self._owner_pid, self._queues
        )
        try:
            for parent, make in zip(parents, create, strict=True):
                self._open_path(parent, make)
            self._open_queue()
        except BaseException:
            self._finalizer()
            for rundir in self._rundirs:
                rundir.cleanup()
            raise
        self._pool = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="tiermem-nvme")

    # -- construction ----------------------------------------------------------------------
    @staticmethod
    def _resolve_parents(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[str], list[bool]]:
        default = default_parent()
        parents = [os.path.abspath(os.fspath(p)) for p in paths] or [default]
        seen: set[str] = set()
        create: list[bool] = []
        for parent in parents:
            real = os.path.realpath(parent)
            if real in seen:
                raise StoragePathError(parent, "listed twice in [nvme] paths (striping over one directory)")
            seen.add(real)
            make = parent == default  # only tiermem's own default directory is made on demand
            create.append(make)
            if make and not os.path.exists(parent):
                continue
            if not os.path.exists(parent):
                raise StoragePathError(parent, "no such directory", errno.ENOENT)
            if not os.path.isdir(parent):
                raise StoragePathError(parent, "not a directory", errno.ENOTDIR)
            if not os.access(parent, os.W_OK | os.X_OK):
                raise StoragePathError(parent, "not writable by this process", errno.EACCES)
        return parents, create

    def _open_path(self, parent: str, create_parent: bool) -> None:
        try:
            rundir = RunDirectory.create(parent, create_parent=create_parent)
        except OSError as exc:
            raise StoragePathError(parent, f"cannot create a run directory: {exc.strerror or exc}", exc.errno) from exc
        self._rundirs.append(rundir)
        path = os.path.join(rundir.path, _DATA_NAME)
        handle, direct, reason = self._open_data_file(path)
        self._handles.append(handle)
        self._data_paths.append(path)
        self._direct.append(direct)
        self._direct_reasons.append(reason)
        self._aligned.append(direct and not self._backend.handles_alignment)
        self._file_sizes.append(ALIGNMENT if direct and not self._backend.handles_alignment else 0)

    def _open_data_file(self, path: str) -> tuple[Any, bool, str]:
        """Open one data file, with O_DIRECT where possible; returns (handle, direct, why)."""
        backend = self._backend
        if self._direct_arg is False:
            return self._open(path, direct=False), False, "buffered I/O requested (direct=False)"
        try:
            handle = backend.open(path, direct=True)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise StoragePathError(path, f"cannot open: {exc.strerror or exc}", exc.errno) from exc
            return self._refuse_direct(path, exc)
        if backend.handles_alignment:
            return handle, True, f"{backend.name} manages O_DIRECT itself"
        # Some filesystems accept O_DIRECT at open and refuse it at the first I/O: probe with
        # one aligned page (the file is new and empty, so nothing is overwritten).
        try:
            backend.fallocate(handle, 0, ALIGNMENT)
            with self._bounces.get() as bounce:
                ctypes.memset(bounce.address, 0, ALIGNMENT)
                backend.pwrite(handle, bounce.view(ALIGNMENT), 0)
                backend.pread(handle, bounce.view(ALIGNMENT), 0)
        except OSError as exc:
            backend.close(handle)
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(path, ALIGNMENT, free_bytes(path)) from exc
            if exc.errno != errno.EINVAL:
                raise StorageIOError(path, "O_DIRECT probe", 0, ALIGNMENT, exc) from exc
            return self._refuse_direct(path, exc)
        return handle, True, "O_DIRECT"

    def _open_queue(self) -> None:
        """Open the backend's submission queue if it has one and it can serve some file."""
        if not any(self._aligned):
            if hasattr(self._backend, "open_queue"):
                self._backend_reason += "; no file does O_DIRECT, so requests run on the worker pool"
            return
        try:
            queue = open_queue(self._backend, self.queue_depth)
        except OSError as exc:
            # Kernel resources (fs.aio-max-nr) can run out with many tiers: the worker pool
            # still does the job, only with more overhead per request.
            self._backend_reason += f"; submission queue unavailable ({exc.strerror or exc}), worker pool used"
            logger.warning("tiermem nvme: %s submission queue unavailable, using the worker pool: %s",
                           self._backend.name, exc)
            return
        if queue is not None:
            self._queues.append(queue)
            self._queue = queue
            # Per file: may its zero-copy segments go to the queue? Not with checksums (rule 6).
            self._queueable = [aligned and self._sums is None for aligned in self._aligned]

    def _refuse_direct(self, path: str, exc: OSError) -> tuple[Any, bool, str]:
        fs = filesystem_of(path)
        why = f"{fs.fstype} at {fs.mountpoint} refuses O_DIRECT ({exc.strerror or exc})"
        if self._direct_arg is True:
            raise StoragePathError(
                os.path.dirname(os.path.dirname(path)),
                f"direct=True but {why}; use direct='auto' to fall back to buffered I/O",
                errno.EINVAL,
            ) from exc
        logger.info("tiermem nvme: buffered I/O for %s: %s", path, why)
        return self._open(path, direct=False), False, f"buffered fallback: {why}"

    def _open(self, path: str, *, direct: bool) -> Any:
        try:
            return self._backend.open(path, direct=direct)
        except OSError as exc:
            raise StoragePathError(path, f"cannot open: {exc.strerror or exc}", exc.errno) from exc

    # -- allocation ------------------------------------------------------------------------
    def _allocate(self, nbytes: int, reserved: int) -> Allocation:
        with self._alloc_lock:
            start = self._space.allocate(reserved)
            if start is None:
                # The base class checked the byte budget; what failed is a contiguous extent
                # (fragmentation, or frees deferred behind in-flight I/O).
                raise TierCapacityError(self.name, reserved, self._space.used_bytes, self.capacity)
            try:
                self._grow(self._space.high_water)
            except BaseException:
                self._space.free(start)
                raise
        return Allocation(self, nbytes, reserved, location=start)

    def _free(self, allocation: Allocation) -> None:
        extent = (allocation.location, allocation.reserved)
        with self._state_lock:
            if self._inflight.get(allocation.id):
                # I/O still touches this extent: hand it back when the last request ends, so
                # no new allocation gets bytes a stale write is still landing on.
                self._deferred[allocation.id] = extent
                return
        self._release_extent(*extent)

    def _release_extent(self, start: int, reserved: int) -> None:
        if self._sums is not None:
            self._sums.discard(start, start + reserved)
        with self._alloc_lock:
            self._space.free(start)

    def _file_bytes(self, file: int, logical: int) -> int:
        """Size file ``file`` needs so the logical range ``[0, logical)`` is backed."""
        row = self.block_size * len(self._handles)
        rows, rest = divmod(logical, row)
        return rows * self.block_size + min(max(rest - file * self.block_size, 0), self.block_size)

    def _grow(self, high_water: int) -> None:
        """Fallocate the files up to ``high_water`` (in big steps; called under _alloc_lock)."""
        if high_water <= self._prealloc:
            return
        step = max(_GROWTH_STEP, self.block_size * len(self._handles))
        target = min(round_up(high_water, step), self._space.size)
        try:
            self._fallocate_to(target)
        except DiskFullError:
            if target <= high_water:
                raise
            self._fallocate_to(high_water)  # the big step did not fit; what is needed may

    def _fallocate_to(self, logical: int) -> None:
        for file, handle in enumerate(self._handles):
            have, need = self._file_sizes[file], self._file_bytes(file, logical)
            if need <= have:
                continue
            try:
                self._backend.fallocate(handle, have, need - have)
            except OSError as exc:
                raise self._storage_error(file, "fallocate", have, need - have, exc) from exc
            self._file_sizes[file] = need
        self._prealloc = max(self._prealloc, logical)

    # -- requests ----------------------------------------------------------------------------
    def _write(self, allocation: Allocation, offset: int, src: torch.Tensor) -> Future[None]:
        return self._submit("write", allocation, offset, src)

    def _read(self, allocation: Allocation, offset: int, dst: torch.Tensor) -> Future[None]:
        return self._submit("read", allocation, offset, dst)

    def sync(self) -> Future[None]:
        """fdatasync every data file: the writes completed so far become durable (TRAPS 5)."""
        self._check_open()
        self._check_owner()
        return _gather([self._pool.submit(self._fdatasync, file) for file in range(len(self._handles))])

    def _fdatasync(self, file: int) -> None:
        try:
            self._backend.fdatasync(self._handles[file])
        except OSError as exc:
            raise self._storage_error(file, "fdatasync", 0, self._file_sizes[file], exc) from exc

    def _check_owner(self) -> None:
        if _pid[0] != self._owner_pid:
            # A forked child has the pool object but none of its threads: a submit would
            # hang forever (TRAPS 12).
            raise RuntimeError(
                "tiermem nvme tier: used in a forked child process (e.g. a DataLoader worker); "
                "tiers belong to the process that made them"
            )

    def _submit(self, op: str, allocation: Allocation, offset: int, buffer: torch.Tensor) -> Future[None]:
        # The path every request takes: kept lean, small requests are CPU-bound (TRAPS 15).
        self._check_owner()
        cuda = buffer.is_cuda
        if not cuda and not buffer.is_cpu:
            raise internal_error(f"nvme tier I/O from a {buffer.device.type} tensor")
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()  # rule 5: not cancellable once handed over
        nbytes = buffer.numel()
        if nbytes == 0:
            future.set_result(None)
            return future
        segments = self._segments(allocation.location + offset, nbytes)
        request = _Request(
            op,
            allocation.id,
            allocation.location + allocation.nbytes,
            buffer,
            0 if cuda else buffer.data_ptr(),
            cuda,
            future,
            len(segments),
        )
        with self._state_lock:
            self._inflight[allocation.id] = self._inflight.get(allocation.id, 0) + 1
        queued: list[IoOp] = []
        queue = self._queue
        for segment in segments:
            io = None if queue is None or cuda else self._queued_op(request, segment)
            if io is None:
                self._pool.submit(self._run_segment, request, segment)
            else:
                queued.append(io)
        if queued:
            assert queue is not None  # _queued_op is only asked when there is one
            queue.submit(queued)
        return future

    def _queued_op(self, request: _Request, seg: _Segment) -> IoOp | None:
        """The queue op for a host-memory ``seg`` when it needs no CPU work (rule 6), else None."""
        address = request.address + seg.buf_offset
        if not self._queueable[seg.file] or (address | seg.length | seg.file_offset) % ALIGNMENT:
            return None
        # _make, not IoOp(...): a NamedTuple's generated __new__ costs a Python call (TRAPS 15).
        return IoOp._make(
            (
                request.op == "write",
                self._handles[seg.file],
                address,
                seg.length,
                seg.file_offset,
                functools.partial(self._queued_done, request, seg),
            )
        )

    def _queued_done(self, request: _Request, seg: _Segment, nbytes: int, error: OSError | None) -> None:
        # Runs on the queue's thread. The same checks as _pwrite/_pread_exact make on the pool.
        failure: BaseException | None = None
        if error is not None:
            failure = self._storage_error(seg.file, request.op, seg.file_offset, seg.length, error)
        elif nbytes < seg.length:
            failure = ShortReadError(self._data_paths[seg.file], seg.file_offset, seg.length, nbytes)
        self._segment_ended(request, failure, queued=failure is None)

    def _segments(self, logical: int, nbytes: int) -> list[_Segment]:
        """Split ``[logical, logical + nbytes)`` at stripe-unit boundaries (rule 1)."""
        block, stripes = self.block_size, len(self._handles)
        unit, within = divmod(logical, block)
        if within + nbytes <= block:  # the common case: inside one stripe unit
            return [_Segment(unit % stripes, (unit // stripes) * block + within, logical, 0, nbytes)]
        out = []
        position, end = logical, logical + nbytes
        while position < end:
            unit, within = divmod(position, block)
            length = min(block - within, end - position)
            file_offset = (unit // stripes) * block + within
            out.append(_Segment(unit % stripes, file_offset, position, position - logical, length))
            position += length
        return out

    def _run_segment(self, request: _Request, segment: _Segment) -> None:
        # Runs on a worker. Never raises: the first error is kept for the request's future.
        failure: BaseException | None = None
        try:
            if request.error is None:  # after a failure, skip what has not started
                if request.op == "write":
                    self._write_segment(request, segment)
                else:
                    self._read_segment(request, segment)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            failure = exc
        finally:
            self._segment_ended(request, failure)

    def _segment_ended(self, request: _Request, failure: BaseException | None, *, queued: bool = False) -> None:
        """Count one segment down; the last one completes the request (rule 2)."""
        with request.lock:
            if failure is not None and request.error is None:
                request.error = failure
            request.queued += queued
            request.remaining -= 1
            last = request.remaining == 0
        if last:
            self._finish(request)

    def _finish(self, request: _Request) -> None:
        # TRAPS 14: drop every reference to the caller's buffer before anyone is woken, and
        # break the request <-> future <-> traceback cycle, so nothing waits for the GC.
        request.tensor = None
        future, error = request.future, request.error
        request.future = request.error = None
        with self._state_lock:
            self._counts["zero_copy"] += request.queued
            left = self._inflight.get(request.allocation_id, 1) - 1
            release = None
            if left:
                self._inflight[request.allocation_id] = left
            else:
                self._inflight.pop(request.allocation_id, None)
                release = self._deferred.pop(request.allocation_id, None)
        if release is not None:
            self._release_extent(*release)
        if future is None:
            raise internal_error("nvme request finished twice")
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)

    def _bump(self, key: str) -> None:
        with self._state_lock:
            self._counts[key] += 1

    # -- one segment ---------------------------------------------------------------------
    def _write_segment(self, request: _Request, seg: _Segment) -> None:
        lo, hi = seg.logical, seg.logical + seg.length
        sums = self._sums
        address = request.address + seg.buf_offset
        fast = not request.cuda and (not self._aligned[seg.file] or is_aligned(address, seg.length, seg.file_offset))
        try:
            if fast and not (sums is not None and self._plan_write(request, seg).partial):
                # Zero-copy: straight from the caller's memory. Records inside [lo, hi) are
                # simply replaced; any other writer of those bytes would be racing this one.
                view = memview(address, seg.length)
                digest = digest_of(view) if sums is not None else 0
                self._pwrite(seg.file, view, seg.file_offset)
                if sums is not None:
                    sums.record(lo, seg.length, digest)
                self._bump("zero_copy")
            else:
                self._write_staged(request, seg)
        except BaseException:
            if sums is not None:
                sums.discard(lo, hi)  # the stored bytes are now unknown: never verify stale sums
            raise

    def _plan_write(self, request: _Request, seg: _Segment) -> _WritePlan:
        """What a staged write of ``seg`` must read, verify, write and record (rules 3, 4)."""
        lo, hi = seg.logical, seg.logical + seg.length
        sums = self._sums
        # Records only partly overwritten are verified and merged with this write into one.
        partial: list[ChecksumRecord] = []
        if sums is not None:
            partial = [r for r in sums.overlapping(lo, hi) if r.start < lo or r.end > hi]
        rec_lo = min([lo, *(r.start for r in partial)])
        rec_hi = max([hi, *(r.end for r in partial)])
        io_lo, io_hi = rec_lo, rec_hi
        if self._aligned[seg.file]:
            io_lo, io_hi = io_lo - io_lo % ALIGNMENT, round_up(io_hi, ALIGNMENT)  # stays in the unit
        # Bytes of [io_lo, io_hi) outside [lo, hi) must survive unless they are allocation
        # padding (past nbytes) that no record vouches for.
        need_read = (
            bool(partial)
            or io_lo < lo
            or (io_hi > hi and (hi < request.data_end or bool(sums is not None and sums.overlapping(hi, io_hi))))
        )
        return _WritePlan(partial, rec_lo, rec_hi, io_lo, io_hi, need_read)

    def _write_staged(self, request: _Request, seg: _Segment) -> None:
        with self._bounces.get() as bounce:
            plan = self._plan_write(request, seg)
            if not plan.need_read:
                self._write_through(request, seg, plan, bounce)
                return
            # Read-modify-write: serialised, and re-planned under the lock, so that two writes
            # sharing a page or a record never work from each other's stale bytes or sums.
            with self._rmw_lock:
                self._write_through(request, seg, self._plan_write(request, seg), bounce)

    def _write_through(self, request: _Request, seg: _Segment, plan: _WritePlan, bounce: BounceBuffer) -> None:
        lo, hi = seg.logical, seg.logical + seg.length
        io_len, io_file_offset = plan.io_hi - plan.io_lo, seg.file_offset - (lo - plan.io_lo)
        if plan.need_read:
            self._pread_exact(seg.file, bounce.view(io_len), io_file_offset)
            for r in plan.partial:
                self._verify(
                    seg.file, r, bounce.view(r.length, r.start - plan.io_lo), io_file_offset + (r.start - plan.io_lo)
                )
            self._bump("read_modify_write")
        else:
            ctypes.memset(bounce.address, 0, lo - plan.io_lo)
            ctypes.memset(bounce.address + (hi - plan.io_lo), 0, plan.io_hi - hi)
        at = lo - plan.io_lo
        if request.cuda:
            source = request.tensor
            if source is None:
                raise internal_error("nvme write segment ran after its request finished")
            bounce.tensor[at : at + seg.length].copy_(source[seg.buf_offset : seg.buf_offset + seg.length])
            del source
        else:
            ctypes.memmove(bounce.address + at, request.address + seg.buf_offset, seg.length)
        sums = self._sums
        digest = 0
        if sums is not None:
            digest = digest_of(bounce.view(plan.rec_hi - plan.rec_lo, plan.rec_lo - plan.io_lo))
        self._pwrite(seg.file, bounce.view(io_len), io_file_offset)
        if sums is not None:
            sums.record(plan.rec_lo, plan.rec_hi - plan.rec_lo, digest)
        self._bump("staged")

    def _read_segment(self, request: _Request, seg: _Segment) -> None:
        lo, hi = seg.logical, seg.logical + seg.length
        address = request.address + seg.buf_offset
        sums = self._sums
        if sums is None:
            records: list[ChecksumRecord] = []
        else:
            records = sums.overlapping(lo, hi)
            if any(r.start < lo or r.end > hi for r in records):
                # Verifying a record that reaches past this read means reading bytes a
                # concurrent (disjoint, legitimate) write may be merging into that record:
                # do it under the read-modify-write lock, with the records as they are then.
                # Lock order everywhere: bounce buffer, then the lock.
                with self._bounces.get() as bounce, self._rmw_lock:
                    records = sums.overlapping(lo, hi)
                    self._check_covered(seg, records, min(hi, request.data_end))
                    self._read_staged(request, seg, records, bounce)
                return
            self._check_covered(seg, records, min(hi, request.data_end))
        exact = len(records) == 1 and records[0].start == lo and records[0].length == seg.length
        if (
            not request.cuda
            and (exact or not records)
            and (not self._aligned[seg.file] or is_aligned(address, seg.length, seg.file_offset))
        ):
            view = memview(address, seg.length)
            self._pread_exact(seg.file, view, seg.file_offset)
            if exact:
                self._verify(seg.file, records[0], view, seg.file_offset)
            self._bump("zero_copy")
            return
        with self._bounces.get() as bounce:
            self._read_staged(request, seg, records, bounce)

    def _read_staged(
        self, request: _Request, seg: _Segment, records: list[ChecksumRecord], bounce: BounceBuffer
    ) -> None:
        """Read the segment and every record touching it whole, verify, copy out."""
        lo, hi = seg.logical, seg.logical + seg.length
        io_lo = min([lo, *(r.start for r in records)])
        io_hi = max([hi, *(r.end for r in records)])
        if self._aligned[seg.file]:
            io_lo, io_hi = io_lo - io_lo % ALIGNMENT, round_up(io_hi, ALIGNMENT)
        io_len, io_file_offset = io_hi - io_lo, seg.file_offset - (lo - io_lo)
        self._pread_exact(seg.file, bounce.view(io_len), io_file_offset)
        for r in records:
            at_record = r.start - io_lo
            self._verify(seg.file, r, bounce.view(r.length, at_record), io_file_offset + at_record)
        at = lo - io_lo
        if request.cuda:
            target = request.tensor
            if target is None:
                raise internal_error("nvme read segment ran after its request finished")
            target = target[seg.buf_offset : seg.buf_offset + seg.length]
            target.copy_(bounce.tensor[at : at + seg.length])
            # The bounce is reused as soon as this returns: wait for the copy to land.
            torch.cuda.current_stream(target.device).synchronize()
            del target
        else:
            ctypes.memmove(request.address + seg.buf_offset, bounce.address + at, seg.length)
        self._bump("staged")

    def _check_covered(self, seg: _Segment, records: list[ChecksumRecord], limit: int) -> None:
        """Raise unless records cover ``[seg.logical, limit)`` (the bytes that carry data)."""
        cursor = seg.logical
        for r in records:
            if cursor >= limit or r.start > cursor:
                break
            cursor = max(cursor, r.end)
        if cursor < limit:
            offset = seg.file_offset + (cursor - seg.logical)
            raise UnverifiedReadError(
                self._data_paths[seg.file],
                offset,
                limit - cursor,
                "no checksum covers these bytes (never written through the tier, or a write failed)",
            )

    # -- system calls, with errors named -------------------------------------------------------
    def _pwrite(self, file: int, view: memoryview, offset: int) -> None:
        try:
            self._backend.pwrite(self._handles[file], view, offset)
        except OSError as exc:
            raise self._storage_error(file, "write", offset, len(view), exc) from exc

    def _pread_exact(self, file: int, view: memoryview, offset: int) -> None:
        try:
            got = self._backend.pread(self._handles[file], view, offset)
        except OSError as exc:
            raise self._storage_error(file, "read", offset, len(view), exc) from exc
        if got < len(view):
            raise ShortReadError(self._data_paths[file], offset, len(view), got)

    def _verify(self, file: int, record: ChecksumRecord, view: memoryview, file_offset: int) -> None:
        got = digest_of(view)
        if got != record.digest:
            raise ChecksumError(
                self._data_paths[file], file_offset, record.length, f"xxh3:{record.digest:016x}", f"xxh3:{got:016x}"
            )

    def _storage_error(self, file: int, op: str, offset: int, nbytes: int, exc: OSError) -> StorageError:
        if isinstance(exc, StorageError):
            return exc
        path = self._data_paths[file]
        if exc.errno == errno.ENOSPC:
            return DiskFullError(path, nbytes, free_bytes(path))
        return StorageIOError(path, op, offset, nbytes, exc)

    # -- lifecycle and facts ---------------------------------------------------------------
    def _close(self) -> None:
        if os.getpid() != self._owner_pid:
            # Forked child: the pool's threads do not exist here and the files belong to the
            # parent. Remove nothing (TRAPS 12).
            self._pool.shutdown(wait=False, cancel_futures=True)
            return
        self._pool.shutdown(wait=True)
        self._finalizer()  # waits for the submission queue, then closes the files
        for rundir in self._rundirs:
            rundir.cleanup()
        self._bounces.clear()

    def segment_counts(self) -> dict[str, int]:
        """How segments were served so far: ``zero_copy``, ``staged`` (bounce buffer) and
        ``read_modify_write`` (staged writes that first read a partial page or record)."""
        with self._state_lock:
            return dict(self._counts)

    @property
    def paths(self) -> list[str]:
        """The parent directories (one per stripe)."""
        return list(self._parents)

    @property
    def run_directories(self) -> list[str]:
        return [r.path for r in self._rundirs]

    @property
    def data_files(self) -> list[str]:
        return list(self._data_paths)

    @property
    def direct(self) -> bool:
        """True when every data file does direct I/O."""
        return all(self._direct)

    def describe(self) -> dict[str, Any]:
        reasons = sorted(set(self._direct_reasons))
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
            "preallocated": sum(self._file_sizes),  # int bytes, like every size in tiermem
        }

    def __repr__(self) -> str:
        return (
            f"NvmeTier({self._parents!r}, capacity={self.capacity}, backend={self._backend.name!r}, "
            f"direct={self.direct})"
        )
