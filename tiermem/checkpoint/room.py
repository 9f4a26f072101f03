"""Room on disk for a save (NOTE [ Checkpoint commit rules ] rule 8 in :mod:`~tiermem.checkpoint.files`):
the bytes a save writes at least, the free bytes of its filesystem, the refusal before anything
is written where they do not fit, and the error naming ENOSPC where the disk fills during the
write anyway. The words for the ``OSError`` are :func:`tiermem.errors.describe_os_error`'s, as
for the NVMe tier's files and the profile cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

from tiermem.errors import NO_SPACE_ERRNOS, CheckpointError, TiermemError, describe_os_error, sized

#: what a save writes beyond a tree entry's tensor bytes, at least (DCP wrote 1.5 KiB per entry:
#: its data file's record and its metadata; zarr an array's ``zarr.json``, 0.7 KiB, a file rounded
#: up to the filesystem's block), so the estimate stays a lower bound and a save that fits is
#: never refused
ENTRY_BYTES = 1024
#: how torch's serializer reports a write the filesystem cut short (``inline_container.cc``)
_SERIALIZER_WRITE_FAILED = ("unexpected pos", "file write failed", "failed writing")
#: a write failure leaving less than this beyond what the save still needed is the disk filling
_SLACK = 64 << 10


def bytes_to_write(tree: dict[str, Any], state_bytes: int) -> int:
    """The fewest bytes a save of ``tree`` writes: every tensor's bytes (a stand-in's as its
    shape says), the state file's ``state_bytes`` and :data:`ENTRY_BYTES` per entry."""
    import torch  # only here: files.py (and ``tiermem checkpoint inspect``) imports this without torch

    total = state_bytes
    pending: list[Any] = [tree]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += value.values()
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value):
            pending += value
        else:  # a tensor, or a value DCP pickles as one entry (a list of names, a scalar)
            total += ENTRY_BYTES
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def free_bytes(path: Path, *, at_most: bool = False) -> int | None:
    """The free bytes of the filesystem of ``path`` (or of its nearest existing parent) that
    unprivileged writes may take (``df``'s "Avail"); None where unknown. ``at_most``: for root,
    every free block, those a filesystem reserves for privileged users too (ext4's reserve may be
    root's, or another user's): what a refusal judges by, so it never refuses a save that fits."""
    for candidate in (path, *path.parents):
        try:
            fs = os.statvfs(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return None
        return fs.f_frsize * (fs.f_bfree if at_most and os.geteuid() == 0 else fs.f_bavail)
    return None


def check_room(path: Path, needed: int) -> None:
    """Refuse a save of ``needed`` bytes to ``path`` where its filesystem has less free, naming both."""
    free = free_bytes(path.parent, at_most=True)
    if free is None or free >= needed:
        return
    raise CheckpointError(
        f"tiermem checkpoint: not enough free space to save {path}: the save writes at least {sized(needed)} and "
        f"the filesystem holding {path.parent} has {sized(free)} free (it would fail with ENOSPC, No space left on "
        "device). Nothing was written; free space on that filesystem (older checkpoints, other files) or save to "
        "a directory on another one.",
        str(path),
        errno.ENOSPC,
    )


def _cause(exc: BaseException, free: int | None, short_of: int) -> OSError | None:
    """The ENOSPC behind ``exc``, a failure of a save that still needed ``short_of`` bytes with
    ``free`` left; None where it is not the disk filling."""
    seen: BaseException | None = exc
    for _ in range(8):  # the exception, then what it was raised from
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in NO_SPACE_ERRNOS:
            return seen
        text = str(seen)
        full = os.strerror(errno.ENOSPC) in text or f"os_error_code='{errno.ENOSPC}'" in text  # tensorstore's
        if full or (any(m in text for m in _SERIALIZER_WRITE_FAILED) and free is not None and free < short_of + _SLACK):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        seen = seen.__cause__ or seen.__context__
    return None


def _written(directory: Path) -> tuple[int, Path]:
    """The bytes of the files under ``directory`` and the file written last (the one a failed
    write was writing; ``directory`` where there is none)."""
    total, newest, last = 0, -1, directory
    for root, _, found in os.walk(directory):
        for name in found:
            with contextlib.suppress(OSError):  # vanishing files are skipped
                stat = os.lstat(os.path.join(root, name))
                total += stat.st_size
                if stat.st_mtime_ns > newest:
                    newest, last = stat.st_mtime_ns, Path(root, name)
    return total, last


class Room:
    """A save's room: the bytes it writes at least, checked before its temporary directory is made,
    and the error it raises where the disk fills during the write."""

    def __init__(self, needed: int) -> None:
        self.needed = needed
        #: the free bytes when the save began (None: unchecked or unknown)
        self.free: int | None = None
        #: what the error says failed (the asynchronous writer says so)
        self.what = "saving"

    def check(self, path: Path) -> None:
        """Before anything is written (a save of unknown size, ``needed`` 0, is not checked)."""
        if self.needed:
            check_room(path, self.needed)
            self.free = free_bytes(path.parent)

    def error(self, exc: BaseException, directory: Path, path: Path) -> CheckpointError | None:
        """The error naming ENOSPC where ``exc`` is the disk filling during the save to ``path``
        writing into ``directory`` (measured while what was written still takes its room); else None."""
        if isinstance(exc, TiermemError) or not isinstance(exc, Exception):
            return None
        written, last = _written(directory)
        free = free_bytes(directory)
        cause = _cause(exc, free, max(self.needed - written, 0))
        if cause is None:
            return None
        where = cause.filename or last
        began = "" if self.free is None else f"{sized(self.free)} were free when it began and "
        return CheckpointError(
            f"tiermem checkpoint: {self.what} {path} failed: the disk filled during the write: "
            f"{describe_os_error(cause, where, nbytes=self.needed, free=free)}; {began}{sized(written)} had been "
            f"written when it failed. What it wrote is removed; the previous checkpoint at {path}, if any, is "
            "intact. Free space on that filesystem or save to a directory on another one.",
            str(where),
            cause.errno,
        )
