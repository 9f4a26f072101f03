"""Facts about the filesystem holding a path: its mount, type and device, and free space."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass

import psutil

__all__ = ["Filesystem", "filesystem_of", "free_bytes"]


@dataclass(frozen=True)
class Filesystem:
    mountpoint: str
    fstype: str
    device: str


def filesystem_of(path: str) -> Filesystem:
    """The mount holding ``path``: the longest mount point that is a prefix of its real path."""
    real = os.path.realpath(path)
    best = Filesystem("/", "unknown", "unknown")
    best_len = -1
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        prefix = mount.rstrip("/") + "/"
        if (real == mount or real.startswith(prefix) or mount == "/") and len(mount) >= best_len:
            # >=: of two mounts on one point, the later one (listed last) is the visible one
            best, best_len = Filesystem(mount, part.fstype, part.device), len(mount)
    return best


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its parent, or grandparent); None if unknown."""
    for candidate in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(candidate).free
    return None
