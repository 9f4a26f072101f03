"""A fault-injecting wrapper around a backend, for tests of the NVMe tier's error paths.

Every fault a disk can produce, on demand and deterministically: a full disk, I/O errors,
short reads, silent bit flips, and filesystems that refuse ``O_DIRECT``. When the inner
backend has a submission queue (``aio``), its requests get the same faults, counted with
the blocking calls' (one read counter, one write counter), delivered the way the kernel
would deliver them: in the completion.
"""

from __future__ import annotations

import ctypes
import errno
import threading
from collections.abc import Sequence
from typing import Any

from tiermem.tiers.backends.base import IoOp, IoQueue, StorageBackend, open_queue

__all__ = ["FaultyBackend"]


class FaultyBackend:
    """Wraps ``inner`` and injects faults. Counts are 1-based and per operation kind.

    - ``enospc_after``: a write that would take the bytes written through this wrapper
      past this many raises ``ENOSPC``.
    - ``fallocate_limit``: an ``fallocate`` reaching past this file size raises ``ENOSPC``.
    - ``eio_on_read`` / ``eio_on_write``: the k-th read / write raises ``EIO``.
    - ``short_read_on``: the k-th read returns only half of what was asked.
    - ``flip_bit_on_read``: the k-th read flips one bit of the returned data and reports
      success (silent corruption); ``flip_all_reads`` does it on every read.
    - ``refuse_direct``: ``open(direct=True)`` raises ``EINVAL``, as tmpfs and some network
      filesystems do.
    """

    def __init__(
        self,
        inner: StorageBackend,
        *,
        enospc_after: int | None = None,
        fallocate_limit: int | None = None,
        eio_on_read: int | None = None,
        eio_on_write: int | None = None,
        short_read_on: int | None = None,
        flip_bit_on_read: int | None = None,
        flip_all_reads: bool = False,
        refuse_direct: bool = False,
    ) -> None:
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.handles_alignment = inner.handles_alignment
        self.takes_device_memory = bool(getattr(inner, "takes_device_memory", False))
        self.enospc_after = enospc_after
        self.fallocate_limit = fallocate_limit
        self.eio_on_read = eio_on_read
        self.eio_on_write = eio_on_write
        self.short_read_on = short_read_on
        self.flip_bit_on_read = flip_bit_on_read
        self.flip_all_reads = flip_all_reads
        self.refuse_direct = refuse_direct
        self._lock = threading.Lock()
        self.reads = 0
        self.writes = 0
        self.bytes_written = 0
        self.faults_injected = 0

    def open(self, path: str, *, direct: bool) -> Any:
        if direct and self.refuse_direct:
            self._fault()
            raise OSError(errno.EINVAL, "Invalid argument (injected: O_DIRECT refused)", path)
        return self.inner.open(path, direct=direct)

    def _read_fault(self) -> str | None:
        """Count one read; the fault to inject into it: "eio", "short", "flip" or None."""
        with self._lock:
            self.reads += 1
            k = self.reads
        fault = None
        if k == self.eio_on_read:
            fault = "eio"
        elif k == self.short_read_on:
            fault = "short"
        elif self.flip_all_reads or k == self.flip_bit_on_read:
            fault = "flip"
        return fault

    def _write_error(self, size: int) -> OSError | None:
        """Count one write of ``size`` bytes; the error to inject into it, or None."""
        with self._lock:
            self.writes += 1
            k = self.writes
            full = self.enospc_after is not None and self.bytes_written + size > self.enospc_after
            if not full and k != self.eio_on_write:
                self.bytes_written += size
        if full:
            self._fault()
            return OSError(errno.ENOSPC, "No space left on device (injected)")
        if k == self.eio_on_write:
            self._fault()
            return OSError(errno.EIO, "Input/output error (injected)")
        return None

    def pread(self, handle: Any, buffer: Any, offset: int) -> int:
        fault = self._read_fault()
        if fault == "eio":
            self._fault()
            raise OSError(errno.EIO, "Input/output error (injected)")
        view = memoryview(buffer).cast("B")
        if fault == "short":
            self._fault()
            return self.inner.pread(handle, view[: len(view) // 2], offset)
        got = self.inner.pread(handle, view, offset)
        if got and fault == "flip":
            self._fault()
            view[got // 2] ^= 0x10
        return got

    def pwrite(self, handle: Any, buffer: Any, offset: int) -> int:
        error = self._write_error(memoryview(buffer).nbytes)
        if error is not None:
            raise error
        return self.inner.pwrite(handle, buffer, offset)

    def open_queue(self, depth: int) -> IoQueue | None:
        """The inner backend's submission queue with faults injected, or None if it has none."""
        inner = open_queue(self.inner, depth)
        return None if inner is None else _FaultyQueue(self, inner)

    def fallocate(self, handle: Any, offset: int, length: int) -> None:
        if self.fallocate_limit is not None and offset + length > self.fallocate_limit:
            self._fault()
            raise OSError(errno.ENOSPC, "No space left on device (injected at fallocate)")
        self.inner.fallocate(handle, offset, length)

    def fdatasync(self, handle: Any) -> None:
        self.inner.fdatasync(handle)

    def close(self, handle: Any) -> None:
        self.inner.close(handle)

    def _fault(self) -> None:
        with self._lock:
            self.faults_injected += 1

    def __repr__(self) -> str:
        return f"FaultyBackend({self.inner!r})"


class _FaultyQueue:
    """An :class:`IoQueue` whose ops get ``FaultyBackend``'s faults in their completions."""

    def __init__(self, faulty: FaultyBackend, inner: IoQueue) -> None:
        self._faulty = faulty
        self._inner = inner
        self.depth = inner.depth

    def submit(self, ops: Sequence[IoOp]) -> None:
        self._inner.submit([self._wrap(op) for op in ops])

    def _wrap(self, op: IoOp) -> IoOp:
        faulty, done = self._faulty, op.done
        if op.write:
            error = faulty._write_error(op.nbytes)
            if error is None:
                return op

            def failed_write(nbytes: int, real: OSError | None) -> None:
                done(0, real or error)

            # The write is not sent: a full disk or a failed device stores nothing.
            return op._replace(nbytes=0, done=failed_write)
        fault = faulty._read_fault()
        if fault is None:
            return op

        def faulty_read(nbytes: int, real: OSError | None) -> None:
            if real is not None:
                done(nbytes, real)
            elif fault == "eio":
                faulty._fault()
                done(0, OSError(errno.EIO, "Input/output error (injected)"))
            elif fault == "short":
                faulty._fault()
                done(nbytes // 2, None)  # as if the device returned only half
            else:
                if nbytes:
                    faulty._fault()
                    cell = ctypes.c_ubyte.from_address(op.address + nbytes // 2)
                    cell.value ^= 0x10
                done(nbytes, None)

        return op._replace(done=faulty_read)

    def close(self) -> None:
        self._inner.close()
