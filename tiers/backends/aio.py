"""Linux AIO backend: O_DIRECT reads and writes queued to the kernel, no thread per request.

The posix backend runs every segment on a pool thread: a submit wakes a worker, the worker
takes the GIL, makes one system call and completes a future that wakes someone again. On a
small machine those hand-offs, not the disk, cap small requests (bench/README.md, I/O
section: ~5 context switches and ~80 µs of CPU per 64 KiB request). Here the submitting
thread hands segments straight to the kernel with ``io_submit(2)`` (several in one call
when it has several), and one reaper thread per queue collects completions with
``io_getevents(2)``, many per wake-up: fio's libaio engine, in Python.

The system calls go through ctypes and libc's ``syscall()`` (the GIL is released while
they run), so nothing needs compiling or installing. The AIO bindings on PyPI do not fit:
``caio`` writes only from ``bytes`` and reads into buffers it allocates, ``liburing``
takes only ``bytes``/``bytearray`` — neither does I/O on the caller's 4096-aligned memory,
which O_DIRECT requires (TRAPS 5, TRAPS 15).

Linux AIO is only asynchronous with O_DIRECT: on a buffered file ``io_submit`` does the
copy (or the disk read) itself, blocking the submitter. So :class:`AioQueue` is for
O_DIRECT files only; the NVMe tier sends everything else — buffered files, staging,
checksums — through the blocking methods this backend inherits from
:class:`~tiermem.tiers.backends.posix.PosixBackend`, on its worker pool
(NOTE [ NVMe tier layout and I/O ] rule 6).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import logging
import os
import platform
import struct
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from tiermem.tiers.backends.base import IoOp
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.fsinfo import filesystem_of

__all__ = ["AioBackend", "AioQueue", "probe"]

logger = logging.getLogger("tiermem.nvme")

# Linux system call numbers: x86-64 has its own table; arm64 (and other new ports) use
# asm-generic's. Anything else is reported unavailable rather than guessed.
_SYSCALLS = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4},
}
# struct iocb and struct io_event (linux/aio_abi.h), little-endian: aio_data, aio_key,
# aio_rw_flags, aio_lio_opcode, aio_reqprio, aio_fildes, aio_buf, aio_nbytes, aio_offset,
# aio_reserved2, aio_flags, aio_resfd  /  data, obj, res, res2.
_IOCB = struct.Struct("<QIIHhIQQqQII")
_EVENT = struct.Struct("<QQqq")
_IOCB_CMD_PREAD, _IOCB_CMD_PWRITE = 0, 1
#: How long the reaper blocks in io_getevents before it looks at the queue's state again.
#: Only matters when a batch was rejected by io_submit or at close; completions wake it.
_REAP_TIMEOUT_NS = 100_000_000
#: O_DIRECT transfers are multiples of the logical block size (512 at least): a short read
#: whose remainder is not can only be the end of the file.
_SECTOR = 512

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _unavailable_reason() -> str | None:
    """Why this platform cannot run Linux AIO through raw system calls, or None."""
    if not sys.platform.startswith("linux"):
        return f"Linux AIO needs Linux (this is {sys.platform})"
    if platform.machine() not in _SYSCALLS:
        return f"no AIO system call table for {platform.machine()} (known: {', '.join(_SYSCALLS)})"
    if not _O_DIRECT:
        return "os.O_DIRECT is not available"
    return None


class _Kernel:
    """The four AIO system calls through libc's ``syscall()``; errors come back as errno.

    Each call gets its own typed function object (fixed ``argtypes``), so ctypes converts
    plain ints itself instead of Python building ``c_long`` objects per request. Fixed
    argument types are safe for the variadic ``syscall`` on the two ABIs listed in
    ``_SYSCALLS``: both pass variadic integer arguments in the same registers as fixed ones.
    """

    def __init__(self) -> None:
        reason = _unavailable_reason()
        if reason is not None:
            raise OSError(errno.ENOSYS, reason)
        numbers = _SYSCALLS[platform.machine()]
        libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released during each call

        def call(name: str, *argtypes: Any) -> Any:
            function = libc["syscall"]  # a new function object each time: its own argtypes
            function.restype = ctypes.c_long
            function.argtypes = [ctypes.c_long, *argtypes]
            return functools.partial(function, numbers[name])

        ulong, long, pointer = ctypes.c_ulong, ctypes.c_long, ctypes.c_void_p
        self._setup = call("io_setup", long, pointer)
        self._destroy = call("io_destroy", ulong)
        self._submit = call("io_submit", ulong, long, pointer)
        self._getevents = call("io_getevents", ulong, long, long, pointer, pointer)

    def setup(self, depth: int) -> int:
        context = ctypes.c_ulong(0)
        if self._setup(depth, ctypes.byref(context)) < 0:
            code = ctypes.get_errno()
            hint = " (the system-wide limit fs.aio-max-nr is reached)" if code == errno.EAGAIN else ""
            raise OSError(code, f"io_setup({depth}) failed: {os.strerror(code)}{hint}")
        return context.value

    def destroy(self, context: int) -> None:
        if self._destroy(context) < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_destroy failed: {os.strerror(code)}")

    def submit(self, context: int, count: int, iocbpp: int) -> int:
        """Returns how many were accepted, or ``-errno`` when the first one was refused."""
        done: int = self._submit(context, count, iocbpp)
        return done if done >= 0 else -ctypes.get_errno()

    def getevents(self, context: int, max_nr: int, events: int, timeout: int) -> int:
        """Waits for at least one completion (or the timeout); returns the count or ``-errno``."""
        got: int = self._getevents(context, 1, max_nr, events, timeout)
        return got if got >= 0 else -ctypes.get_errno()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Slot:
    """One kernel request slot: the op it carries and how many bytes are done so far."""

    __slots__ = ("done", "op")

    def __init__(self, op: IoOp) -> None:
        self.op = op
        self.done = 0


class AioQueue:
    """Up to ``depth`` O_DIRECT requests in flight in one kernel AIO context; more wait, FIFO.

    :meth:`submit` never waits for I/O (only for ``io_submit`` to hand the requests to the
    block layer). Each op's ``done(nbytes, error)`` runs exactly once, on the reaper thread
    (or on the submitter, when ``io_submit`` refuses it): ``nbytes`` is the whole length on
    success, less only for a read that met the end of the file; ``error`` an ``OSError``.
    A partial transfer is continued for the rest, never reported as success (TRAPS 15).

    Buffers, lengths and offsets must be 4096-aligned and stay valid until ``done`` runs.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"tiermem aio: queue depth must be >= 1, got {depth}")
        self._kernel = _Kernel()
        self._depth = depth
        self._context = self._kernel.setup(depth)
        self._iocbs = ctypes.create_string_buffer(_IOCB.size * depth)
        self._iocb_base = ctypes.addressof(self._iocbs)
        self._pointers = (ctypes.c_void_p * depth)(*(self._iocb_base + _IOCB.size * i for i in range(depth)))
        self._pointer_base = ctypes.addressof(self._pointers)
        self._events = ctypes.create_string_buffer(_EVENT.size * depth)
        self._timeout = _Timespec(0, _REAP_TIMEOUT_NS)
        self._slots: list[_Slot | None] = [None] * depth
        self._free = list(range(depth - 1, -1, -1))
        self._pending: collections.deque[IoOp] = collections.deque()
        self._busy = 0  # slots holding an op (in the kernel, or about to be submitted)
        self._cond = threading.Condition(threading.Lock())
        self._closing = False
        self._closed = False
        self._owner_pid = os.getpid()
        self._reaper = threading.Thread(target=self._reap, name="tiermem-aio", daemon=True)
        self._reaper.start()

    @property
    def depth(self) -> int:
        return self._depth

    # -- submission (any thread) -------------------------------------------------------------
    def submit(self, ops: Sequence[IoOp]) -> None:
        """Queue ``ops``; as many as there are free slots go to the kernel in one call."""
        with self._cond:
            if self._closing:
                raise RuntimeError("tiermem aio: submit after close")
            was_idle = self._busy == 0
            self._pending.extend(ops)
            batch = self._take()
            if was_idle and batch:
                self._cond.notify()  # the reaper parks while nothing is in flight
        if batch:
            self._submit(batch)

    def _take(self) -> list[int]:
        """Move pending ops into free slots (under the lock); returns the slots to submit."""
        batch: list[int] = []
        pending, free = self._pending, self._free
        while pending and free:
            op = pending.popleft()
            slot = free.pop()
            self._slots[slot] = _Slot(op)
            self._pack(slot, op, 0)
            batch.append(slot)
        self._busy += len(batch)
        return batch

    def _pack(self, slot: int, op: IoOp, done: int) -> None:
        _IOCB.pack_into(
            self._iocbs, _IOCB.size * slot,
            slot, 0, 0, _IOCB_CMD_PWRITE if op.write else _IOCB_CMD_PREAD, 0, op.handle,
            op.address + done, op.nbytes - done, op.offset + done, 0, 0, 0,
        )  # fmt: skip

    def _submit(self, batch: list[int]) -> None:
        """io_submit the slots' iocbs (outside the lock: the slots are this caller's until then)."""
        if len(batch) == 1:
            pointers, base = None, self._pointer_base + 8 * batch[0]
        else:
            pointers = (ctypes.c_void_p * len(batch))(*(self._iocb_base + _IOCB.size * s for s in batch))
            base = ctypes.addressof(pointers)
        sent = 0
        while sent < len(batch):
            got = self._kernel.submit(self._context, len(batch) - sent, base + 8 * sent)
            if got > 0:
                sent += got
                continue
            if got == -errno.EINTR:
                continue
            # The kernel refused the first one not yet sent (a bad descriptor, EAGAIN when
            # out of resources...): fail that op alone and go on with the rest.
            code = -got if got < 0 else errno.EIO
            slot = batch[sent]
            sent += 1
            op = self._op(slot)
            self._finished(
                [
                    (
                        slot,
                        OSError(
                            code,
                            f"io_submit refused a {op.nbytes}-byte "
                            f"{'write' if op.write else 'read'}: {os.strerror(code)}",
                        ),
                    )
                ]
            )
        del pointers

    def _op(self, slot: int) -> IoOp:
        state = self._slots[slot]
        if state is None:
            raise AssertionError(f"tiermem internal error (please report): aio slot {slot} is empty")
        return state.op

    # -- completion (reaper thread) -------------------------------------------------------------
    def _reap(self) -> None:
        events = ctypes.addressof(self._events)
        timeout = ctypes.addressof(self._timeout)
        while True:
            with self._cond:
                while self._busy == 0 and not self._closing:
                    self._cond.wait()
                if self._busy == 0:
                    return  # closing, and nothing in flight
            got = self._kernel.getevents(self._context, self._depth, events, timeout)
            if got == -errno.EINTR or got == 0:
                continue
            if got < 0:
                # The context itself is broken: nothing will complete. Fail what is in flight
                # rather than leave its waiters hanging forever.
                logger.error("tiermem aio: io_getevents failed: %s", os.strerror(-got))
                with self._cond:
                    stuck = [s for s, state in enumerate(self._slots) if state is not None]
                self._finished([(s, OSError(-got, f"io_getevents failed: {os.strerror(-got)}")) for s in stuck])
                continue
            raw = self._events.raw
            self._finished([(data, res) for data, _obj, res, _res2 in _EVENT.iter_unpack(raw[: _EVENT.size * got])])

    def _finished(self, results: list[tuple[int, int | OSError]]) -> None:
        """Account completed slots: continue partial transfers, free the rest, start what
        waits, then run the callbacks (outside the lock, after the next batch is submitted)."""
        calls: list[tuple[IoOp, int, OSError | None]] = []
        again: list[int] = []
        with self._cond:
            freed = 0
            for slot, res in results:
                state = self._slots[slot]
                if state is None:
                    continue  # failed by a broken context and then completed after all
                op = state.op
                error: OSError | None = None
                if isinstance(res, OSError):
                    error = res
                elif res < 0:
                    error = OSError(-res, os.strerror(-res))
                else:
                    state.done += res
                    left = op.nbytes - state.done
                    if left and res > 0 and (op.write or left % _SECTOR == 0):
                        self._pack(slot, op, state.done)  # TRAPS 15: go on with the rest
                        again.append(slot)
                        continue
                    if left and op.write:
                        error = OSError(errno.EIO, f"write made no progress at offset {op.offset + state.done}")
                calls.append((op, state.done, error))
                self._slots[slot] = None
                self._free.append(slot)
                freed += 1
            self._busy -= freed
            again += self._take()
            if self._busy == 0 and self._closing:
                self._cond.notify_all()
        if again:
            self._submit(again)
        for op, nbytes, error in calls:
            try:
                op.done(nbytes, error)
            except BaseException:  # the reaper must survive a faulty callback
                logger.exception("tiermem aio: a completion callback raised")

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every queued and in-flight op to complete, then release the context.
        Idempotent. In a forked child it does nothing: the context belongs to the parent."""
        if os.getpid() != self._owner_pid:
            return
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
            while self._busy or self._pending:
                self._cond.wait()
            self._closed = True
        if self._reaper is not threading.current_thread():
            self._reaper.join()
        self._kernel.destroy(self._context)

    def __repr__(self) -> str:
        return f"AioQueue(depth={self._depth})"


class AioBackend(PosixBackend):
    """Linux AIO for O_DIRECT files (:meth:`open_queue`); blocking POSIX calls otherwise."""

    name = "aio"

    def open_queue(self, depth: int) -> AioQueue:
        """A submission queue of ``depth`` requests. Raises ``OSError`` when the kernel refuses."""
        return AioQueue(depth)

    def __repr__(self) -> str:
        return "AioBackend()"


_probe_cache: dict[tuple[int, str], tuple[bool, str]] = {}
_probe_lock = threading.Lock()


def probe(directory: str | os.PathLike[str]) -> tuple[bool, str]:
    """Whether AIO with O_DIRECT really works for files in ``directory``, and why (not).

    One 4 KiB write and read through an :class:`AioQueue` on a temporary O_DIRECT file
    (removed again), checked byte for byte; cached for the process per directory and
    device (a device number alone is reused by the next tmpfs mounted after an unmount).
    """
    directory = os.fspath(directory)
    reason = _unavailable_reason()
    if reason is not None:
        return False, reason
    try:
        key = (os.stat(directory).st_dev, os.path.realpath(directory))
    except OSError as exc:
        return False, f"cannot stat {directory}: {exc.strerror}"
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _run_probe(directory)
        return _probe_cache[key]


def _run_probe(directory: str) -> tuple[bool, str]:
    fs = filesystem_of(directory)
    try:
        queue = AioQueue(2)
    except OSError as exc:
        return False, f"the kernel refuses AIO: {exc.strerror or exc}"
    try:
        fd, path = tempfile.mkstemp(prefix=".tiermem-aio-probe-", dir=directory)
        os.close(fd)
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:
                return False, (
                    f"{fs.fstype} at {fs.mountpoint} refuses O_DIRECT ({exc.strerror}); "
                    "without it AIO runs synchronously"
                )
            try:
                return _probe_io(queue, fd, fs.fstype)
            finally:
                os.close(fd)
        finally:
            os.unlink(path)
    except OSError as exc:
        return False, f"probe I/O in {directory} failed: {exc.strerror or exc}"
    finally:
        queue.close()


def _probe_io(queue: AioQueue, fd: int, fstype: str) -> tuple[bool, str]:
    raw = ctypes.create_string_buffer(3 * 4096)
    base = ctypes.addressof(raw)
    base += (-base) % 4096
    out, back = base, base + 4096
    ctypes.memmove(out, bytes(range(256)) * 16, 4096)
    results: list[tuple[int, OSError | None]] = []
    landed = threading.Event()

    def done(nbytes: int, error: OSError | None) -> None:
        results.append((nbytes, error))
        landed.set()

    for op in (IoOp(True, fd, out, 4096, 0, done), IoOp(False, fd, back, 4096, 0, done)):
        landed.clear()
        queue.submit([op])
        if not landed.wait(10.0):
            return False, "probe I/O did not complete within 10 s"
        nbytes, error = results[-1]
        if error is not None:
            return False, f"probe {'write' if op.write else 'read'} failed: {error.strerror or error}"
        if nbytes != 4096:
            return False, f"probe {'write' if op.write else 'read'} moved {nbytes} of 4096 bytes"
    if ctypes.string_at(back, 4096) != ctypes.string_at(out, 4096):
        return False, "probe read returned other bytes than were written"
    return True, f"Linux AIO with O_DIRECT works on {fstype}"
