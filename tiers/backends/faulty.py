"""A fault-injecting wrapper around a backend, for tests of the NVMe tier's error paths.

Every fault a disk can produce, on demand and deterministically: a full disk, I/O errors,
short reads, silent bit flips, and filesystems that refuse ``O_DIRECT``.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

from tiermem.tiers.backends.base import StorageBackend

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

    def pread(self, handle: Any, buffer: Any, offset: int) -> int:
        with self._lock:
            self.reads += 1
            k = self.reads
        if k == self.eio_on_read:
            self._fault()
            raise OSError(errno.EIO, "Input/output error (injected)")
        view = memoryview(buffer).cast("B")
        if k == self.short_read_on:
            self._fault()
            return self.inner.pread(handle, view[: len(view) // 2], offset)
        got = self.inner.pread(handle, view, offset)
        if got and (self.flip_all_reads or k == self.flip_bit_on_read):
            self._fault()
            view[got // 2] ^= 0x10
        return got

    def pwrite(self, handle: Any, buffer: Any, offset: int) -> int:
        size = memoryview(buffer).nbytes
        with self._lock:
            self.writes += 1
            k = self.writes
            full = self.enospc_after is not None and self.bytes_written + size > self.enospc_after
            if not full and k != self.eio_on_write:
                self.bytes_written += size
        if full:
            self._fault()
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if k == self.eio_on_write:
            self._fault()
            raise OSError(errno.EIO, "Input/output error (injected)")
        return self.inner.pwrite(handle, buffer, offset)

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
