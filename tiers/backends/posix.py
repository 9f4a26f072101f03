"""POSIX backend: ``os.preadv``/``os.pwritev`` with optional ``O_DIRECT``.

Plain system calls release the GIL, so the tier's worker threads overlap I/O. With
``O_DIRECT`` the page cache is bypassed: bandwidth is the device's, and the RAM saved by
offloading is not quietly taken back by cached pages (TRAPS 8).
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = ["PosixBackend"]

# O_DIRECT is Linux-only; elsewhere the tier sees EINVAL and falls back to buffered I/O.
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _bytes_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class PosixBackend:
    """Synchronous file I/O through the operating system. Handles are plain fds."""

    name = "posix"
    handles_alignment = False
    #: Host memory only: the NVMe tier stages CUDA tensors for it (NOTE [ NVMe tier layout and I/O ] rule 7).
    takes_device_memory = False

    def open(self, path: str, *, direct: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        if direct:
            if not _O_DIRECT:
                raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform", path)
            flags |= _O_DIRECT
        return os.open(path, flags, 0o600)

    def pread(self, handle: int, buffer: Any, offset: int) -> int:
        view = _bytes_view(buffer)
        total, size = 0, len(view)
        while total < size:
            got = os.preadv(handle, [view[total:]], offset + total)
            if got == 0:
                break  # end of file: the caller decides whether that is a short read
            total += got
        return total

    def pwrite(self, handle: int, buffer: Any, offset: int) -> int:
        view = _bytes_view(buffer)
        total, size = 0, len(view)
        while total < size:
            done = os.pwritev(handle, [view[total:]], offset + total)
            if done <= 0:
                # write(2) returning 0 for a non-empty buffer would loop forever.
                raise OSError(errno.EIO, f"pwrite made no progress at offset {offset + total}")
            total += done
        return total

    def fallocate(self, handle: int, offset: int, length: int) -> None:
        if length > 0:
            os.posix_fallocate(handle, offset, length)

    def fdatasync(self, handle: int) -> None:
        os.fdatasync(handle)

    def close(self, handle: int) -> None:
        os.close(handle)

    def __repr__(self) -> str:
        return "PosixBackend()"
