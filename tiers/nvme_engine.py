"""The NVMe tier's request engine: splitting reads and writes into segments, running them on
the worker pool or the backend's submission queue, and completing each request's future (one
:class:`_Request` per read or write in flight, counted down as its segments complete).

NOTE [ NVMe tier layout and I/O ] (in :mod:`tiermem.tiers.nvme`) rules 2, 3, 5 and 6 are
kept here; where the bytes are (files, extents, checksum records) is
:class:`~tiermem.tiers.nvme_store.NvmeStore`'s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from tiermem.errors import ShortReadError, internal_error
from tiermem.tiers.backends.base import IoOp, IoQueue, open_queue
from tiermem.tiers.base import ALIGNMENT, Allocation
from tiermem.tiers.nvme_checksums import ChecksumRecord, digest_of
from tiermem.tiers.nvme_store import NvmeStore, Segment
from tiermem.tiers.staging import BounceBuffer, BouncePool, is_aligned, memview
from tiermem.units import round_up

__all__ = ["NvmeEngine", "gather"]

logger = logging.getLogger("tiermem.nvme")

# This process's PID, refreshed in a forked child: the per-request owner check (TRAPS 12)
# without a getpid system call per request (TRAPS 15).
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


class _Request:
    """One read or write in flight. Holds the caller's tensor only until it completes (TRAPS 14).

    A plain class with slots, not a dataclass: one is made per request, and small requests
    are counted in tens of thousands a second (TRAPS 15)."""

    __slots__ = (
        "address", "allocation_id", "cuda", "data_end", "error", "fence", "future", "lock", "op", "queued",
        "remaining", "tensor",
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
        self.fence: Any = None  # rule 7: the CUDA event a worker waits for before touching the tensor

    def wait_fence(self) -> None:
        """Rule 7: block until the device work queued before this request's fence has run."""
        if self.fence is not None:
            self.fence.synchronize()


class _WritePlan(NamedTuple):
    """A staged write: records it merges, the byte range it records and the range it does I/O on."""

    partial: list[ChecksumRecord]
    rec_lo: int
    rec_hi: int
    io_lo: int
    io_hi: int
    need_read: bool


def gather(futures: list[Future[None]]) -> Future[None]:
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


class NvmeEngine:
    """Carries out the reads and writes of one :class:`NvmeStore` on ``queue_depth`` worker
    threads (and the backend's submission queue, rule 6), one future per request.

    It also keeps, per allocation, how many requests are in flight, so that an extent freed
    while I/O still lands on it is handed back only when that I/O ends.
    """

    def __init__(
        self, store: NvmeStore, queue_depth: int, bounces: BouncePool, pinned_bounces: BouncePool | None = None
    ) -> None:
        self._store = store
        self._owner_pid = store.owner_pid
        # The store's own lists and methods, bound once: the request path is per-request
        # Python work that small requests pay for (TRAPS 15).
        self._handles = store.handles
        self._aligned = store.aligned
        self._sums = store.sums
        self._segments = store.segments
        self._bounces = bounces
        # Rule 7: CUDA tensors stage through page-locked buffers, and reach a backend that takes
        # device memory (kvikio) directly.
        self._pinned_bounces = pinned_bounces or bounces
        self._device_direct = bool(getattr(store.backend, "takes_device_memory", False))
        self._fence_event: Any = None
        self._state_lock = threading.Lock()  # in-flight counts, deferred frees, counters
        self._rmw_lock = threading.Lock()  # serialises read-modify-write of partial pages
        self._inflight: dict[int, int] = {}
        self._deferred: dict[int, tuple[int, int]] = {}
        self._counts = {"zero_copy": 0, "staged": 0, "read_modify_write": 0}
        # The submission queue (rule 6), when the backend has one and some file does O_DIRECT.
        self.queue: IoQueue | None = None
        self._queueable: list[bool] = []
        #: Why requests reach the disk the way they do, when it is not the backend's queue.
        self.queue_note = ""
        self._open_queue(queue_depth)
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="tiermem-nvme")

    def _open_queue(self, depth: int) -> None:
        """Open the backend's submission queue if it has one and it can serve some file."""
        backend = self._store.backend
        if not any(self._aligned):
            if hasattr(backend, "open_queue"):
                self.queue_note = "; no file does O_DIRECT, so requests run on the worker pool"
            return
        try:
            queue = open_queue(backend, depth)
        except OSError as exc:
            # Kernel resources (fs.aio-max-nr) can run out with many tiers: the worker pool
            # still does the job, only with more overhead per request.
            self.queue_note = f"; submission queue unavailable ({exc.strerror or exc}), worker pool used"
            logger.warning(
                "tiermem nvme: %s submission queue unavailable, using the worker pool: %s", backend.name, exc
            )
            return
        if queue is not None:
            self._store.queues.append(queue)  # the store closes it before its files
            self.queue = queue
            # Per file: may its zero-copy segments go to the queue? Not with checksums (rule 6).
            self._queueable = [aligned and self._sums is None for aligned in self._aligned]

    # -- what the tier asks ------------------------------------------------------------------
    def release_when_idle(self, allocation_id: int, start: int, reserved: int) -> None:
        """Give the extent back to the store now, or when the last request on it ends."""
        with self._state_lock:
            if self._inflight.get(allocation_id):
                # I/O still touches this extent: hand it back when the last request ends, so
                # no new allocation gets bytes a stale write is still landing on.
                self._deferred[allocation_id] = (start, reserved)
                return
        self._store.release(start, reserved)

    def sync(self) -> Future[None]:
        """fdatasync every data file on the worker pool: one future for all of them."""
        self.check_owner()
        return gather([self._pool.submit(self._store.fdatasync, file) for file in range(len(self._handles))])

    def counts(self) -> dict[str, int]:
        with self._state_lock:
            return dict(self._counts)

    def close(self) -> None:
        """Wait for every request on the worker pool, then stop it."""
        self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """In a forked child: the pool's threads do not exist here; drop what is queued."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fence(self) -> None:
        """Rule 7: record an event on the calling thread's current CUDA stream for the CUDA requests
        submitted from now on (nothing to order before CUDA was ever used in this process)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self._fence_event = event

    # -- requests ----------------------------------------------------------------------------
    def check_owner(self) -> None:
        """Raise in a forked child: tiers belong to the process that made them."""
        if _pid[0] != self._owner_pid:
            # A forked child has the pool object but none of its threads: a submit would
            # hang forever (TRAPS 12).
            raise RuntimeError(
                "tiermem nvme tier: used in a forked child process (e.g. a DataLoader worker); "
                "tiers belong to the process that made them"
            )

    def submit(self, op: str, allocation: Allocation, offset: int, buffer: torch.Tensor) -> Future[None]:
        # The path every request takes: kept lean, small requests are CPU-bound (TRAPS 15).
        self.check_owner()
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
        if cuda:
            request.fence = self._fence_event
        with self._state_lock:
            self._inflight[allocation.id] = self._inflight.get(allocation.id, 0) + 1
        queued: list[IoOp] = []
        queue = self.queue
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

    def _queued_op(self, request: _Request, seg: Segment) -> IoOp | None:
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

    def _queued_done(self, request: _Request, seg: Segment, nbytes: int, error: OSError | None) -> None:
        # Runs on the queue's thread. The same checks as _pwrite/_pread_exact make on the pool.
        failure: BaseException | None = None
        if error is not None:
            failure = self._store.storage_error(seg.file, request.op, seg.file_offset, seg.length, error)
        elif nbytes < seg.length:
            failure = ShortReadError(self._store.data_paths[seg.file], seg.file_offset, seg.length, nbytes)
        self._segment_ended(request, failure, queued=failure is None)

    def _run_segment(self, request: _Request, segment: Segment) -> None:
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
            self._store.release(*release)
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
    def _write_segment(self, request: _Request, seg: Segment) -> None:
        lo, hi = seg.logical, seg.logical + seg.length
        sums = self._sums
        address = request.address + seg.buf_offset
        fast = not request.cuda and (not self._aligned[seg.file] or is_aligned(address, seg.length, seg.file_offset))
        try:
            if self._takes_device(request, seg):
                self._write_device(request, seg)
            elif fast and not (sums is not None and self._plan_write(request, seg).partial):
                # Zero-copy: straight from the caller's memory. Records inside [lo, hi) are
                # simply replaced; any other writer of those bytes would be racing this one.
                view = memview(address, seg.length)
                digest = digest_of(view) if sums is not None else 0
                self._store.pwrite(seg.file, view, seg.file_offset)
                if sums is not None:
                    sums.record(lo, seg.length, digest)
                self._bump("zero_copy")
            else:
                self._write_staged(request, seg)
        except BaseException:
            if sums is not None:
                sums.discard(lo, hi)  # the stored bytes are now unknown: never verify stale sums
            raise

    def _takes_device(self, request: _Request, seg: Segment) -> bool:
        """Rule 7: does ``seg`` of a CUDA request go to the backend as device memory? Only when the
        backend takes it, no checksum is kept (hashing needs the bytes on the host) and the file
        needs no page padding (a backend that takes device memory handles alignment itself)."""
        return request.cuda and self._device_direct and self._sums is None and not self._aligned[seg.file]

    def _device_slice(self, request: _Request, seg: Segment) -> torch.Tensor:
        tensor = request.tensor
        if tensor is None:
            raise internal_error("nvme segment ran after its request finished")
        return tensor[seg.buf_offset : seg.buf_offset + seg.length]

    def _write_device(self, request: _Request, seg: Segment) -> None:
        request.wait_fence()  # the bytes may come from a kernel on the submitter's stream
        self._store.pwrite(seg.file, self._device_slice(request, seg), seg.file_offset)
        self._bump("zero_copy")

    def _read_device(self, request: _Request, seg: Segment) -> None:
        request.wait_fence()  # a kernel queued before the move may still read these bytes
        self._store.pread_exact(seg.file, self._device_slice(request, seg), seg.file_offset)
        self._bump("zero_copy")

    def _bounce_pool(self, request: _Request) -> BouncePool:
        return self._pinned_bounces if request.cuda else self._bounces

    def _plan_write(self, request: _Request, seg: Segment) -> _WritePlan:
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

    def _write_staged(self, request: _Request, seg: Segment) -> None:
        with self._bounce_pool(request).get() as bounce:
            plan = self._plan_write(request, seg)
            if not plan.need_read:
                self._write_through(request, seg, plan, bounce)
                return
            # Read-modify-write: serialised, and re-planned under the lock, so that two writes
            # sharing a page or a record never work from each other's stale bytes or sums.
            with self._rmw_lock:
                self._write_through(request, seg, self._plan_write(request, seg), bounce)

    def _write_through(self, request: _Request, seg: Segment, plan: _WritePlan, bounce: BounceBuffer) -> None:
        lo, hi = seg.logical, seg.logical + seg.length
        io_len, io_file_offset = plan.io_hi - plan.io_lo, seg.file_offset - (lo - plan.io_lo)
        if plan.need_read:
            self._store.pread_exact(seg.file, bounce.view(io_len), io_file_offset)
            for r in plan.partial:
                self._store.verify(
                    seg.file, r, bounce.view(r.length, r.start - plan.io_lo), io_file_offset + (r.start - plan.io_lo)
                )
            self._bump("read_modify_write")
        else:
            ctypes.memset(bounce.address, 0, lo - plan.io_lo)
            ctypes.memset(bounce.address + (hi - plan.io_lo), 0, plan.io_hi - hi)
        at = lo - plan.io_lo
        if request.cuda:
            request.wait_fence()  # rule 7; the copy into host memory returns once it has landed
            bounce.tensor[at : at + seg.length].copy_(self._device_slice(request, seg))
        else:
            ctypes.memmove(bounce.address + at, request.address + seg.buf_offset, seg.length)
        sums = self._sums
        digest = 0
        if sums is not None:
            digest = digest_of(bounce.view(plan.rec_hi - plan.rec_lo, plan.rec_lo - plan.io_lo))
        self._store.pwrite(seg.file, bounce.view(io_len), io_file_offset)
        if sums is not None:
            sums.record(plan.rec_lo, plan.rec_hi - plan.rec_lo, digest)
        self._bump("staged")

    def _read_segment(self, request: _Request, seg: Segment) -> None:
        lo, hi = seg.logical, seg.logical + seg.length
        address = request.address + seg.buf_offset
        sums = self._sums
        if self._takes_device(request, seg):
            self._read_device(request, seg)
            return
        if sums is None:
            records: list[ChecksumRecord] = []
        else:
            records = sums.overlapping(lo, hi)
            if any(r.start < lo or r.end > hi for r in records):
                # Verifying a record that reaches past this read means reading bytes a
                # concurrent (disjoint, legitimate) write may be merging into that record:
                # do it under the read-modify-write lock, with the records as they are then.
                # Lock order everywhere: bounce buffer, then the lock.
                with self._bounce_pool(request).get() as bounce, self._rmw_lock:
                    records = sums.overlapping(lo, hi)
                    self._store.check_covered(seg, records, min(hi, request.data_end))
                    self._read_staged(request, seg, records, bounce)
                return
            self._store.check_covered(seg, records, min(hi, request.data_end))
        exact = len(records) == 1 and records[0].start == lo and records[0].length == seg.length
        if (
            not request.cuda
            and (exact or not records)
            and (not self._aligned[seg.file] or is_aligned(address, seg.length, seg.file_offset))
        ):
            view = memview(address, seg.length)
            self._store.pread_exact(seg.file, view, seg.file_offset)
            if exact:
                self._store.verify(seg.file, records[0], view, seg.file_offset)
            self._bump("zero_copy")
            return
        with self._bounce_pool(request).get() as bounce:
            self._read_staged(request, seg, records, bounce)

    def _read_staged(
        self, request: _Request, seg: Segment, records: list[ChecksumRecord], bounce: BounceBuffer
    ) -> None:
        """Read the segment and every record touching it whole, verify, copy out."""
        lo, hi = seg.logical, seg.logical + seg.length
        io_lo = min([lo, *(r.start for r in records)])
        io_hi = max([hi, *(r.end for r in records)])
        if self._aligned[seg.file]:
            io_lo, io_hi = io_lo - io_lo % ALIGNMENT, round_up(io_hi, ALIGNMENT)
        io_len, io_file_offset = io_hi - io_lo, seg.file_offset - (lo - io_lo)
        self._store.pread_exact(seg.file, bounce.view(io_len), io_file_offset)
        for r in records:
            at_record = r.start - io_lo
            self._store.verify(seg.file, r, bounce.view(r.length, at_record), io_file_offset + at_record)
        at = lo - io_lo
        if request.cuda:
            target = self._device_slice(request, seg)
            request.wait_fence()  # rule 7: a kernel queued before the move may still read these bytes
            target.copy_(bounce.tensor[at : at + seg.length])
            # The bounce is reused as soon as this returns: wait for the copy to land.
            torch.cuda.current_stream(target.device).synchronize()
            del target
        else:
            ctypes.memmove(request.address + seg.buf_offset, bounce.address + at, seg.length)
        self._bump("staged")
