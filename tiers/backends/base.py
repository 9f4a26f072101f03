"""The storage backend protocol of the NVMe tier, and how a backend is chosen.

A backend moves bytes between a host buffer and a file at an offset, synchronously; the
tier runs it on its own worker pool and does striping, alignment, staging and checksums.
Keeping backends this small lets tests wrap one (:mod:`.faulty`) to inject faults.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol, runtime_checkable

from tiermem.errors import BackendUnavailableError

__all__ = ["BACKEND_NAMES", "StorageBackend", "select_backend"]

logger = logging.getLogger("tiermem.nvme")

BACKEND_NAMES = ("auto", "kvikio", "posix")


@runtime_checkable
class StorageBackend(Protocol):
    """Synchronous file I/O on host buffers. Every method may raise ``OSError``.

    ``buffer`` arguments are writable (``pread``) or readable (``pwrite``) byte buffers:
    anything that ``memoryview`` accepts, C-contiguous. With ``direct=True`` the caller
    passes 4096-aligned buffers, lengths and offsets (TRAPS 5), unless
    ``handles_alignment`` says the backend copes with any (kvikio does its own staging).
    """

    #: Short name for headers and logs ("posix", "kvikio", ...).
    name: str
    #: True when the backend accepts unaligned buffers/offsets even for direct I/O.
    handles_alignment: bool

    def open(self, path: str, *, direct: bool) -> Any:
        """Open (creating if missing, mode 0600) ``path`` for reading and writing; returns a
        handle. Raises ``OSError(EINVAL)`` when ``direct`` and the filesystem refuses O_DIRECT."""
        ...

    def pread(self, handle: Any, buffer: Any, offset: int) -> int:
        """Fill ``buffer`` from ``offset``; return the bytes read (fewer only at end of file)."""
        ...

    def pwrite(self, handle: Any, buffer: Any, offset: int) -> int:
        """Write all of ``buffer`` at ``offset`` (looping on partial writes); return its length."""
        ...

    def fallocate(self, handle: Any, offset: int, length: int) -> None:
        """Reserve disk blocks for ``[offset, offset + length)``, growing the file if needed."""
        ...

    def fdatasync(self, handle: Any) -> None:
        """Make written data durable (TRAPS 5: O_DIRECT alone does not flush device caches)."""
        ...

    def close(self, handle: Any) -> None:
        """Close the handle. Called once per handle."""
        ...


def select_backend(name: str, probe_dir: str | os.PathLike[str]) -> tuple[StorageBackend, str]:
    """The backend for ``name`` ("auto" | "kvikio" | "posix") and why it was chosen.

    "kvikio" raises :class:`BackendUnavailableError` with the probe's reason when kvikio
    cannot actually do I/O here. "auto" picks kvikio only when its probe — a real small
    write and read under ``probe_dir`` — succeeded (TRAPS 13: importing kvikio proves
    nothing, it loads the CUDA driver at first I/O), and otherwise POSIX, logging why.
    """
    from tiermem.tiers.backends.posix import PosixBackend

    if name == "posix":
        return PosixBackend(), "posix requested"
    if name not in ("auto", "kvikio"):
        raise ValueError(f"tiermem nvme tier: unknown backend {name!r}; expected one of {BACKEND_NAMES}")
    from tiermem.tiers.backends import kvikio_backend

    ok, reason = kvikio_backend.probe(probe_dir)
    if ok:
        why = f"kvikio {'requested' if name == 'kvikio' else 'chosen by auto'}: {reason}"
        logger.info("tiermem nvme: %s", why)
        return kvikio_backend.KvikioBackend(), why
    if name == "kvikio":
        raise BackendUnavailableError(
            f"tiermem nvme tier: backend 'kvikio' cannot run here: {reason}. "
            "Install kvikio (pip install tiermem[gds]) on a machine with the CUDA driver, "
            "or set [nvme] backend = 'posix' or 'auto'."
        )
    why = f"posix chosen by auto: kvikio unusable ({reason})"
    logger.info("tiermem nvme: %s", why)
    return PosixBackend(), why
