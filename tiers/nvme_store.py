"""What the NVMe tier stores where: its run directories and data files, the extents of its
logical space, the checksums of its bytes, and the system calls on its files.

:class:`NvmeStore` keeps NOTE [ NVMe tier layout and I/O ] (in :mod:`tiermem.tiers.nvme`)
rule 1 (files, stripes, growth), the alignment facts of rule 3 and the records of rule 4;
it does no request bookkeeping (that is :mod:`tiermem.tiers.nvme_engine`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from tiermem.errors import (
    NO_SPACE_ERRNOS,
    ChecksumError,
    DiskFullError,
    ShortReadError,
    StorageError,
    StorageIOError,
    StoragePathError,
    TierCapacityError,
    UnverifiedReadError,
)
from tiermem.tiers.backends.base import IoQueue, StorageBackend
from tiermem.tiers.base import ALIGNMENT
from tiermem.tiers.extents import ExtentAllocator
from tiermem.tiers.fsinfo import filesystem_of, free_bytes
from tiermem.tiers.nvme_checksums import ChecksumIndex, ChecksumRecord, digest_of
from tiermem.tiers.rundir import RunDirectory, check_own_directories, default_parent
from tiermem.tiers.staging import BouncePool
from tiermem.units import round_up

__all__ = ["NvmeStore", "Segment", "resolve_parents"]

logger = logging.getLogger("tiermem.nvme")

_DATA_NAME = "data"
#: Files grow in steps of at least this (or one stripe row), so fallocate stays rare.
_GROWTH_STEP = 64 << 20


class Segment(NamedTuple):
    """The part of a request inside one stripe unit (so inside one file)."""

    file: int
    file_offset: int
    logical: int
    buf_offset: int
    length: int


def resolve_parents(
    paths: Sequence[str | os.PathLike[str]], subdirectory: str | None = None
) -> tuple[list[str], list[bool]]:
    """The absolute parent directories (the default one when ``paths`` is empty), checked,
    and per parent whether it may be created (only tiermem's own default directory).

    With ``subdirectory`` (a rank's ``rank<N>``) each path is checked as above and the parent
    is ``<path>/<subdirectory>``, always created on demand and removed again when empty."""
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
        create.append(make or subdirectory is not None)
        if make and not os.path.exists(parent):
            continue
        if not os.path.exists(parent):
            raise StoragePathError(parent, "no such directory", errno.ENOENT)
        if not os.path.isdir(parent):
            raise StoragePathError(parent, "not a directory", errno.ENOTDIR)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise StoragePathError(parent, "not writable by this process", errno.EACCES)
    if subdirectory is not None:
        parents = [os.path.join(parent, subdirectory) for parent in parents]
    for parent, make in zip(parents, create, strict=True):
        check_own_directories(parent, make)  # NOTE [ Run directory rules ] rule 6, before the backend's probe
    return parents, create


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


class NvmeStore:
    """The data files under ``parents`` (one per stripe) and the logical space striped over
    them: extents, file growth, checksum records, and reads and writes with errors named.

    ``direct``: True requires O_DIRECT, "auto" uses it where the filesystem accepts it, False
    never. ``bounces`` lends the page used to probe O_DIRECT. Opening fails as a whole: what
    was made is removed again.
    """

    def __init__(
        self,
        parents: list[str],
        create: list[bool],
        backend: StorageBackend,
        *,
        capacity: int,
        block_size: int,
        checksum: bool,
        direct: bool | str,
        bounces: BouncePool,
    ) -> None:
        self.backend = backend
        self.block_size = block_size
        self._direct_arg = direct
        self._bounces = bounces
        self.owner_pid = os.getpid()
        self._capacity = capacity
        self._space = ExtentAllocator(capacity, ALIGNMENT)
        self._alloc_lock = threading.Lock()  # allocator + file growth
        self.sums = ChecksumIndex(block_size) if checksum else None
        self._rundirs: list[RunDirectory] = []
        #: data file path -> the path the backend opens it by (through its run directory's descriptor)
        self._opening: dict[str, str] = {}
        self.handles: list[Any] = []
        self.data_paths: list[str] = []
        self.aligned: list[bool] = []  # per file: buffer/offset/length must be 4096-aligned
        self.direct: list[bool] = []
        self.direct_reasons: list[str] = []
        self.file_sizes: list[int] = []
        self._prealloc = 0  # logical bytes covered by the files' fallocated sizes
        #: Submission queues over these files (rule 6), closed before the files are.
        self.queues: list[IoQueue] = []
        self._finalizer = weakref.finalize(
            self, _close_handles, self.backend, self.handles, self.owner_pid, self.queues
        )
        try:
            for parent, make in zip(parents, create, strict=True):
                self._open_path(parent, make)
        except BaseException:
            self.close()
            raise

    # -- opening -----------------------------------------------------------------------------
    def _open_path(self, parent: str, create_parent: bool) -> None:
        try:
            rundir = RunDirectory.create(parent, create_parent=create_parent)
            self._rundirs.append(rundir)
            # NOTE [ Run directory rules ] rule 7: opened through the run directory's held descriptor
            self._opening[os.path.join(rundir.path, _DATA_NAME)] = rundir.new_file(_DATA_NAME)
        except StoragePathError:
            raise  # a directory that is not private to the user (rule 6) says so itself
        except OSError as exc:
            raise StoragePathError(parent, f"cannot create a run directory: {exc.strerror or exc}", exc.errno) from exc
        path = os.path.join(rundir.path, _DATA_NAME)
        handle, direct, reason = self._open_data_file(path)
        self.handles.append(handle)
        self.data_paths.append(path)
        self.direct.append(direct)
        self.direct_reasons.append(reason)
        self.aligned.append(direct and not self.backend.handles_alignment)
        self.file_sizes.append(ALIGNMENT if direct and not self.backend.handles_alignment else 0)

    def _open_data_file(self, path: str) -> tuple[Any, bool, str]:
        """Open one data file, with O_DIRECT where possible; returns (handle, direct, why)."""
        backend = self.backend
        if self._direct_arg is False:
            return self._open(path, direct=False), False, "buffered I/O requested (direct=False)"
        try:
            handle = backend.open(self._opening.get(path, path), direct=True)
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
            if exc.errno in NO_SPACE_ERRNOS:
                raise DiskFullError(path, ALIGNMENT, free_bytes(path), errno=exc.errno) from exc
            if exc.errno != errno.EINVAL:
                raise StorageIOError(path, "O_DIRECT probe", 0, ALIGNMENT, exc) from exc
            return self._refuse_direct(path, exc)
        return handle, True, "O_DIRECT"

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
            return self.backend.open(self._opening.get(path, path), direct=direct)
        except OSError as exc:
            raise StoragePathError(path, f"cannot open: {exc.strerror or exc}", exc.errno) from exc

    # -- extents -----------------------------------------------------------------------------
    def allocate(self, reserved: int) -> int:
        """The logical start of a new extent of ``reserved`` bytes, its files grown to back it."""
        with self._alloc_lock:
            start = self._space.allocate(reserved)
            if start is None:
                # The tier checked the byte budget; what failed is a contiguous extent
                # (fragmentation, or frees deferred behind in-flight I/O).
                raise TierCapacityError("nvme", reserved, self._space.used_bytes, self._capacity)
            try:
                self._grow(self._space.high_water)
            except BaseException:
                self._space.free(start)
                raise
        return start

    def release(self, start: int, reserved: int) -> None:
        """Give the extent back, and forget the checksums of its bytes."""
        if self.sums is not None:
            self.sums.discard(start, start + reserved)
        with self._alloc_lock:
            self._space.free(start)

    def _file_bytes(self, file: int, logical: int) -> int:
        """Size file ``file`` needs so the logical range ``[0, logical)`` is backed."""
        row = self.block_size * len(self.handles)
        rows, rest = divmod(logical, row)
        return rows * self.block_size + min(max(rest - file * self.block_size, 0), self.block_size)

    def _grow(self, high_water: int) -> None:
        """Fallocate the files up to ``high_water`` (in big steps; called under _alloc_lock)."""
        if high_water <= self._prealloc:
            return
        step = max(_GROWTH_STEP, self.block_size * len(self.handles))
        target = min(round_up(high_water, step), self._space.size)
        try:
            self._fallocate_to(target)
        except DiskFullError:
            if target <= high_water:
                raise
            self._fallocate_to(high_water)  # the big step did not fit; what is needed may

    def _fallocate_to(self, logical: int) -> None:
        for file, handle in enumerate(self.handles):
            have, need = self.file_sizes[file], self._file_bytes(file, logical)
            if need <= have:
                continue
            try:
                self.backend.fallocate(handle, have, need - have)
            except OSError as exc:
                raise self.storage_error(file, "fallocate", have, need - have, exc) from exc
            self.file_sizes[file] = need
        self._prealloc = max(self._prealloc, logical)

    def segments(self, logical: int, nbytes: int) -> list[Segment]:
        """Split ``[logical, logical + nbytes)`` at stripe-unit boundaries (rule 1)."""
        block, stripes = self.block_size, len(self.handles)
        unit, within = divmod(logical, block)
        if within + nbytes <= block:  # the common case: inside one stripe unit
            return [Segment(unit % stripes, (unit // stripes) * block + within, logical, 0, nbytes)]
        out = []
        position, end = logical, logical + nbytes
        while position < end:
            unit, within = divmod(position, block)
            length = min(block - within, end - position)
            file_offset = (unit // stripes) * block + within
            out.append(Segment(unit % stripes, file_offset, position, position - logical, length))
            position += length
        return out

    # -- system calls and checksums, with errors named -------------------------------------
    def pwrite(self, file: int, view: memoryview, offset: int) -> None:
        try:
            self.backend.pwrite(self.handles[file], view, offset)
        except OSError as exc:
            raise self.storage_error(file, "write", offset, len(view), exc) from exc

    def pread_exact(self, file: int, view: memoryview, offset: int) -> None:
        try:
            got = self.backend.pread(self.handles[file], view, offset)
        except OSError as exc:
            raise self.storage_error(file, "read", offset, len(view), exc) from exc
        if got < len(view):
            raise ShortReadError(self.data_paths[file], offset, len(view), got)

    def fdatasync(self, file: int) -> None:
        try:
            self.backend.fdatasync(self.handles[file])
        except OSError as exc:
            raise self.storage_error(file, "fdatasync", 0, self.file_sizes[file], exc) from exc

    def verify(self, file: int, record: ChecksumRecord, view: memoryview, file_offset: int) -> None:
        got = digest_of(view)
        if got != record.digest:
            raise ChecksumError(
                self.data_paths[file], file_offset, record.length, f"xxh3:{record.digest:016x}", f"xxh3:{got:016x}"
            )

    def check_covered(self, seg: Segment, records: list[ChecksumRecord], limit: int) -> None:
        """Raise unless records cover ``[seg.logical, limit)`` (the bytes that carry data)."""
        cursor = seg.logical
        for r in records:
            if cursor >= limit or r.start > cursor:
                break
            cursor = max(cursor, r.end)
        if cursor < limit:
            offset = seg.file_offset + (cursor - seg.logical)
            raise UnverifiedReadError(
                self.data_paths[seg.file],
                offset,
                limit - cursor,
                "no checksum covers these bytes (never written through the tier, or a write failed)",
            )

    def storage_error(self, file: int, op: str, offset: int, nbytes: int, exc: OSError) -> StorageError:
        if isinstance(exc, StorageError):
            return exc
        path = self.data_paths[file]
        if exc.errno in NO_SPACE_ERRNOS:
            verb = {"write": "writing", "fallocate": "reserving space in"}.get(op, op)
            return DiskFullError(path, nbytes, free_bytes(path), op=verb, errno=exc.errno)
        return StorageIOError(path, op, offset, nbytes, exc)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the submission queues, then the files, and remove the run directories."""
        self._finalizer()
        for rundir in self._rundirs:
            rundir.cleanup()

    @property
    def run_directories(self) -> list[str]:
        return [r.path for r in self._rundirs]
