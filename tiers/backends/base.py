"""The storage backend protocol of the NVMe tier, and how a backend is chosen.

A backend moves bytes between a host buffer and a file at an offset, synchronously; the
tier runs it on its own worker pool and does striping, alignment, staging and checksums.
Keeping backends this small lets tests wrap one (:mod:`.faulty`) to inject faults.

A backend may also offer ``open_queue(depth)``: an :class:`IoQueue` that takes aligned
O_DIRECT requests without a thread per request (:mod:`.aio`). The tier uses it for the
segments that need no CPU work of their own (NOTE [ NVMe tier layout and I/O ] rule 6).

A backend that takes device memory may also offer ``register_buffer(buffer)`` /
``deregister_buffer(buffer)`` for device buffers that live across many I/Os (NOTE [ Registered
device buffers ] in :mod:`.kvikio_backend`). Callers go through :func:`register_buffer` and
:func:`deregister_buffer` here, which do nothing for backends without them (posix, aio): whether a
registration pays is the backend's policy, not the caller's; :func:`registers_device_memory` asks it
whether registering does anything at all here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from tiermem.errors import BackendUnavailableError

__all__ = [
    "BACKEND_NAMES",
    "IoOp",
    "IoQueue",
    "StorageBackend",
    "decide_backend",
    "deregister_buffer",
    "open_queue",
    "register_buffer",
    "registers_device_memory",
    "select_backend",
]

logger = logging.getLogger("tiermem.nvme")

BACKEND_NAMES = ("auto", "kvikio", "aio", "posix")


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
    # Optional, read with getattr (default False): ``takes_device_memory``, True when ``pread`` and
    # ``pwrite`` also take CUDA tensors (device memory) as ``buffer`` (kvikio).

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


class IoOp(NamedTuple):
    """One request for an :class:`IoQueue`: ``nbytes`` between host memory at ``address``
    and the file behind ``handle`` at ``offset``, all 4096-aligned (TRAPS 5).

    ``done(nbytes, error)`` is called exactly once when it ends: ``error`` is None and
    ``nbytes`` the whole length on success (less only for a read that met the end of the
    file), or ``error`` is the ``OSError``. It runs on the queue's thread: keep it short.
    """

    write: bool
    handle: Any
    address: int
    nbytes: int
    offset: int
    done: Callable[[int, OSError | None], None]


@runtime_checkable
class IoQueue(Protocol):
    """Asynchronous requests on O_DIRECT handles, at most ``depth`` in flight, FIFO beyond."""

    depth: int

    def submit(self, ops: Sequence[IoOp]) -> None:
        """Queue ``ops`` without waiting for their I/O. Raises ``RuntimeError`` after close."""
        ...

    def close(self) -> None:
        """Wait until every op submitted has called ``done``, then release the queue."""
        ...


def open_queue(backend: StorageBackend, depth: int) -> IoQueue | None:
    """``backend``'s submission queue of ``depth``, or None when it has none (it works on
    the tier's worker pool only). Raises ``OSError`` when it has one the kernel refuses."""
    opener = getattr(backend, "open_queue", None)
    return None if opener is None else opener(depth)


def register_buffer(backend: StorageBackend, buffer: Any) -> bool:
    """Tell ``backend`` that ``buffer`` (a CUDA tensor) will serve many I/Os until
    :func:`deregister_buffer`; the backend registers it where its library documents a gain (kvikio
    with GPUDirect Storage active) and does nothing otherwise. Returns whether it registered.
    The caller must deregister before it frees the buffer, and must not use it for I/O after."""
    register = getattr(backend, "register_buffer", None)
    return False if register is None else bool(register(buffer))


def registers_device_memory(backend: StorageBackend) -> bool:
    """Whether :func:`register_buffer` can register anything with ``backend`` here (kvikio with
    GPUDirect Storage active); False for backends without registration."""
    return bool(getattr(backend, "registers_device_memory", False))


def deregister_buffer(backend: StorageBackend, buffer: Any) -> None:
    """End what :func:`register_buffer` began for ``buffer`` (nothing when it registered nothing)."""
    deregister = getattr(backend, "deregister_buffer", None)
    if deregister is not None:
        deregister(buffer)


def select_backend(name: str, probe_dir: str | os.PathLike[str]) -> tuple[StorageBackend, str]:
    """The backend for ``name`` ("auto" | "kvikio" | "aio" | "posix") and why it was chosen:
    :func:`decide_backend`'s choice, constructed. It logs why."""
    chosen, why = decide_backend(name, probe_dir)
    if name != "posix":
        logger.info("tiermem nvme: %s", why)
    if chosen == "posix":
        from tiermem.tiers.backends.posix import PosixBackend

        return PosixBackend(), why
    if chosen == "aio":
        from tiermem.tiers.backends import aio

        return aio.AioBackend(), why
    from tiermem.tiers.backends import kvikio_backend

    return kvikio_backend.KvikioBackend(), why


def decide_backend(name: str, probe_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """Which backend ``name`` ("auto" | "kvikio" | "aio" | "posix") means here, and why, without
    making one (``tiermem config show`` asks this too).

    "kvikio" and "aio" raise :class:`BackendUnavailableError` with the probe's reason when
    they cannot actually do I/O here. "auto" tries, in order: kvikio, when its probe — a real
    small write and read under ``probe_dir`` — succeeded (TRAPS 13: importing kvikio proves
    nothing, it loads the CUDA driver at first I/O); aio, when Linux AIO with O_DIRECT did a
    real write and read under ``probe_dir``; otherwise posix.
    """
    if name == "posix":
        return "posix", "posix requested"
    if name not in BACKEND_NAMES:
        raise ValueError(f"tiermem nvme tier: unknown backend {name!r}; expected one of {BACKEND_NAMES}")
    from tiermem.tiers.backends import aio, kvikio_backend

    if name == "aio":
        ok, reason = aio.probe(probe_dir)
        if not ok:
            raise BackendUnavailableError(
                f"tiermem nvme tier: backend 'aio' cannot run for {os.fspath(probe_dir)}: {reason}. "
                "Point [nvme] paths at a filesystem with O_DIRECT (ext4, xfs, ...), "
                "or set [nvme] backend = 'posix' or 'auto'."
            )
        return "aio", f"aio requested: {reason}"
    kvikio_ok, kvikio_reason = kvikio_backend.probe(probe_dir)
    if kvikio_ok:
        return "kvikio", f"kvikio {'requested' if name == 'kvikio' else 'chosen by auto'}: {kvikio_reason}"
    if name == "kvikio":
        raise BackendUnavailableError(
            f"tiermem nvme tier: backend 'kvikio' cannot run here: {kvikio_reason}. "
            "Install kvikio (pip install tiermem[gds]) on a machine with the CUDA driver, "
            "or set [nvme] backend = 'posix', 'aio' or 'auto'."
        )
    aio_ok, aio_reason = aio.probe(probe_dir)
    if aio_ok:
        return "aio", f"aio chosen by auto: {aio_reason} (kvikio unusable: {kvikio_reason})"
    return "posix", f"posix chosen by auto: kvikio unusable ({kvikio_reason}); aio unusable ({aio_reason})"
