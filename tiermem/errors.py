"""Every exception tiermem raises on purpose, one class per failure.

Each class subclasses the builtin a caller would naturally catch (``MemoryError``
for exhausted capacity, ``OSError`` for storage faults, ``ValueError`` for bad
configuration), so generic handlers keep working. Messages name the subsystem,
the tier, the path and the sizes involved, and what to do about it.

This module is a leaf: it imports nothing from tiermem but :mod:`tiermem.units`, so tiers
and schedulers can raise these without pulling in the core. :func:`describe_os_error` words an
``OSError`` the same way wherever tiermem writes files (checkpoints, NVMe tier files, the
profile cache).
"""

from __future__ import annotations

import errno as _errno
import os as _os

from tiermem.units import format_size

#: the errnos that mean a filesystem has no room left for a write (a full disk, a quota)
NO_SPACE_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT})


def sized(nbytes: int) -> str:
    """Bytes for a message, exact and readable: ``1258291 bytes (1.2MiB)``."""
    return f"{nbytes} bytes" if abs(nbytes) < 1024 else f"{nbytes} bytes ({format_size(nbytes)})"


def describe_os_error(
    exc: OSError,
    path: str | _os.PathLike[str],
    *,
    op: str = "writing",
    nbytes: int | None = None,
    free: int | None = None,
) -> str:
    """``exc``, met ``op`` ``path``, in words for a message: its errno's name and the system's
    text for it, the path, and for a full filesystem (:data:`NO_SPACE_ERRNOS`) the bytes needed
    against the bytes free there, where the caller knows them (this measures nothing). E.g.
    ``ENOSPC (No space left on device) writing /ckpt/x: 1258291 bytes (1.2MiB) needed, free: 0 bytes``.
    """
    code = exc.errno
    if code is None:
        return f"{type(exc).__name__} ({exc}) {op} {_os.fspath(path)}"
    words = f"{_errno.errorcode.get(code, f'errno {code}')} ({_os.strerror(code)}) {op} {_os.fspath(path)}"
    if code in NO_SPACE_ERRNOS:
        sizes = [f"{sized(nbytes)} needed"] if nbytes is not None else []
        sizes += [f"free: {'unknown' if free is None else sized(free)}"]
        words += ": " + ", ".join(sizes)
    return words


class TiermemError(Exception):
    """Base class of every error tiermem raises on purpose."""


class ConfigError(TiermemError, ValueError):
    """Raised when a tier configuration has one or more problems.

    ``problems`` lists every problem found, each as ``"section.key: what is wrong"``.
    """

    def __init__(self, problems: list[str], source: str = "configuration") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"tiermem config: {len(self.problems)} problem(s) in {source}:\n{lines}")


class TierCapacityError(TiermemError, MemoryError):
    """Raised when an allocation does not fit in what is left of a tier's capacity."""

    def __init__(self, tier: str, requested: int, used: int, capacity: int) -> None:
        self.tier, self.requested, self.used, self.capacity = tier, requested, used, capacity
        super().__init__(
            f"tiermem {tier} tier: cannot allocate {requested} bytes; {used} of {capacity} bytes "
            f"already in use ({capacity - used} free). Free objects in this tier, move them to "
            f"another tier, or raise [{tier}] capacity in the tier configuration."
        )


class StorageError(TiermemError, OSError):
    """Raised when the NVMe tier cannot read or write its files (base of the I/O errors)."""

    def __init__(self, message: str, errno: int | None = None, path: str | None = None) -> None:
        # OSError(errno, strerror, filename) keeps .errno/.filename useful to callers.
        if errno is not None:
            super().__init__(errno, message, path)
        else:
            super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class DiskFullError(StorageError):
    """Raised when a write to the NVMe tier runs out of space (ENOSPC, or EDQUOT: a quota)."""

    def __init__(
        self, path: str, nbytes: int, free_bytes: int | None = None, *, op: str = "writing", errno: int | None = None
    ) -> None:
        code = _errno.ENOSPC if errno is None else errno
        what = describe_os_error(OSError(code, _os.strerror(code)), path, op=op, nbytes=nbytes, free=free_bytes)
        super().__init__(
            f"tiermem nvme tier: disk full: {what}. Free space on that filesystem, lower [nvme] capacity, or "
            "point [nvme] paths at another filesystem (or add one).",
            code,
            path,
        )


class StoragePathError(StorageError):
    """Raised when an NVMe path is missing, not a directory, or not writable."""

    def __init__(self, path: str, reason: str, errno: int | None = None) -> None:
        super().__init__(
            f"tiermem nvme tier: cannot use path {path!r}: {reason}. "
            "Point [nvme] paths at an existing, writable directory.",
            errno,
            path,
        )


class UnsafeDirectoryError(StoragePathError):
    """Raised when a directory tiermem makes or reuses on its own initiative (the default NVMe
    directory, a rank directory, a checkpoint's temporary sibling, the profile cache) is not
    private to this user: a symlink or not a directory, owned by another user, or writable by
    group or others (NOTE [ Private directories ] in :mod:`tiermem.private_dirs`). Another local
    user could read, replace or redirect what tiermem writes there, so it is refused, never
    used, repaired or removed. ``owner`` and ``mode`` say what was found."""

    def __init__(self, path: str, problem: str, owner: str, mode: str, me: str, advice: str) -> None:
        self.owner, self.mode = owner, mode
        StorageError.__init__(
            self,
            f"tiermem: refusing to use {path!r}: {problem} (owner {owner}, mode {mode}). tiermem keeps its "
            f"files only in directories private to this user ({me}): a real directory it owns, not writable "
            f"by group or others. {advice}.",
            _errno.EPERM,
            path,
        )


class ShortReadError(StorageError):
    """Raised when a read from the NVMe tier returns fewer bytes than were written there."""

    def __init__(self, path: str, offset: int, expected: int, got: int) -> None:
        super().__init__(
            f"tiermem nvme tier: short read from {path} at offset {offset}: expected {expected} bytes, "
            f"got {got}. The file was truncated or the device failed; the data is not returned.",
            _errno.EIO,
            path,
        )


class StorageIOError(StorageError):
    """Raised when the operating system reports an I/O error on an NVMe tier file."""

    def __init__(self, path: str, op: str, offset: int, nbytes: int, cause: OSError) -> None:
        self.cause = cause
        super().__init__(
            f"tiermem nvme tier: {op} of {nbytes} bytes at offset {offset} in {path} failed: "
            f"{cause.strerror or cause}. Check the device (dmesg) and the filesystem.",
            cause.errno,
            path,
        )


class ChecksumError(StorageError):
    """Raised when bytes read back from the NVMe tier do not match the checksum taken at write."""

    def __init__(self, path: str, offset: int, nbytes: int, expected: str, got: str) -> None:
        super().__init__(
            f"tiermem nvme tier: checksum mismatch reading {nbytes} bytes at offset {offset} in {path} "
            f"(expected {expected}, got {got}). The stored bytes are corrupt; they are not returned.",
            _errno.EIO,
            path,
        )


class UnverifiedReadError(StorageError):
    """Raised when ``checksum=True`` and a read covers stored bytes that no checksum vouches for.

    That happens when the bytes were never written, or when the record that covered them
    was lost (e.g. a failed write). tiermem refuses to return bytes it cannot verify.
    """

    def __init__(self, path: str, offset: int, nbytes: int, reason: str) -> None:
        super().__init__(
            f"tiermem nvme tier: cannot verify {nbytes} bytes at offset {offset} in {path}: {reason}. "
            "With [nvme] checksum on, only bytes written through the tier can be read back.",
            _errno.EIO,
            path,
        )


class RuntimeClosedError(TiermemError, RuntimeError):
    """Raised when a request reaches a Runtime, scheduler or tier that is closed."""

    def __init__(self, what: str) -> None:
        super().__init__(f"tiermem: {what} is closed; requests are only accepted inside `with tiermem.Runtime(...)`.")


class TransferCancelledError(TiermemError, RuntimeError):
    """Raised to whoever waits on a move that was cancelled before it completed."""


class ObjectFreedError(TiermemError, RuntimeError):
    """Raised when a managed object is used after it was freed."""


class BackendUnavailableError(TiermemError, RuntimeError):
    """Raised when a requested storage backend (e.g. kvikio) cannot run on this machine."""


def internal_error(message: str) -> AssertionError:
    """An invariant of tiermem itself broke: a bug to report, not bad input."""
    return AssertionError(f"tiermem internal error (please report): {message}")


class TiermemWarning(UserWarning):
    """Warned when tiermem can run but something about the setup defeats its purpose.

    For example an NVMe path on tmpfs: its bytes stay in RAM, so offloading there saves none.
    """


class PlanError(TiermemError, ValueError):
    """Raised when a hand-written placement plan is malformed or contradicts the model."""


class StatesMemoryError(TiermemError, MemoryError):
    """Raised when model states do not fit the budgets: at ``rt.manage`` when the plan cannot
    fit, or during a step when every device buffer is pinned."""

    @classmethod
    def tier_full(
        cls, exc: TierCapacityError, what: str, remedy: str = "", *, sharded: bool = False
    ) -> StatesMemoryError:
        """The error of a model-state move a full tier refused: ``what`` needed room in
        ``exc.tier``; the tier's use, the capacity to raise and ``remedy`` (what else helps)."""
        subject = "tiermem sharded model states" if sharded else "tiermem model states"
        per_rank = " (per rank)" if sharded else ""
        return cls(
            f"{subject}: {what} needs {format_size(exc.requested)} in the {exc.tier} tier, but "
            f"{format_size(exc.used)} of {format_size(exc.capacity)} are in use; raise [{exc.tier}] capacity"
            f"{per_rank}{remedy}"
        )


class CheckpointError(TiermemError, OSError):
    """Raised when a checkpoint cannot be saved or loaded: damaged or partial files, a missing
    checkpoint, or one that does not match the managed model. ``path`` names the file or
    directory at fault; the message says what to do."""

    def __init__(self, message: str, path: str | None = None, errno: int | None = None) -> None:
        # with an errno (ENOSPC for a save without room), OSError's .errno and .filename say it too
        if errno is not None:
            super().__init__(errno, message, path)
        else:
            super().__init__(message)
        self.path = path
        self.message = message

    def __str__(self) -> str:
        return self.message
