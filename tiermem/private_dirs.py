"""Directories tiermem makes or reuses on its own initiative, checked private to this user.

A leaf every layer may import (the NVMe tier's run directories, checkpoints, the profile cache):
it imports nothing of tiermem but :mod:`tiermem.errors`, and is the one leaf that touches the
filesystem.

# NOTE [ Private directories ]
1. A directory tiermem makes or reuses on its own initiative (the default NVMe directory, a
   rank's ``rank<N>``, missing parents it makes on demand, a checkpoint's temporary sibling,
   the profile cache's ``tiermem/profiles``) is used only when ``lstat`` shows a real directory
   (never a symlink), owned by this process's effective uid and not writable by group or
   others. Anything else raises :class:`~tiermem.errors.UnsafeDirectoryError` naming the path,
   its owner and mode, and what to do. tiermem never repairs (``chmod``), uses or removes such
   a directory: it may be another local user's, planted where tiermem would look.
2. Made with mode 0700 by ``mkdir`` relative to its parent's descriptor (``mkdir`` never
   follows a symlink and fails on any existing entry), then opened ``O_DIRECTORY|O_NOFOLLOW``
   relative to the same descriptor and checked again on what was opened (``fstat``: the same
   device and inode as the ``lstat``): a swap between the check and the open is caught.
3. A directory the user configures explicitly is trusted as given (symlinks in its path are
   followed: it is the user's path); what tiermem makes inside it follows rules 1 and 2.
4. Files that hold training state are opened relative to a directory descriptor held for the
   run's life (``dir_fd``, or :func:`held_path` for libraries that only take a path), so
   renaming entries of a parent mid-run cannot redirect a read or a write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Mapping

from tiermem.errors import UnsafeDirectoryError

__all__ = [
    "MADE_ADVICE",
    "PRIVATE_MODE",
    "check_private",
    "held_path",
    "open_private",
    "open_tree",
    "owner_text",
    "private_existing",
]

#: The mode tiermem makes its own directories with (rule 2).
PRIVATE_MODE = 0o700
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_PROC_FD = "/proc/self/fd"

#: What to do when a directory tiermem made on demand is not private (rule 1).
MADE_ADVICE = (
    "tiermem made it moments ago with mode 0700, so something else replaced it: remove it if you "
    "did not make it, and look at who can write to its parent"
)


def owner_text(uid: int) -> str:
    """``uid 1000 (alice)``, or ``uid 1000`` where the user database has no name for it."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _mode_text(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o} ({stat.filemode(st.st_mode)})"


def check_private(path: str, st: os.stat_result, advice: str) -> None:
    """Rule 1: raise :class:`UnsafeDirectoryError` unless ``st`` (``lstat`` or ``fstat`` of
    ``path``) is a directory owned by this process's effective uid, not group/other writable."""
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        problem = "it is a symbolic link, not a directory"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    elif st.st_uid != me:
        problem = f"it is owned by another user, not by {owner_text(me)}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = "it is writable by " + (
            "group and others"
            if st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IWOTH
            else "its group"
            if st.st_mode & stat.S_IWGRP
            else "others"
        )
    else:
        return
    raise UnsafeDirectoryError(path, problem, owner_text(st.st_uid), _mode_text(st), owner_text(me), advice)


def private_existing(path: str, advice: str) -> bool:
    """Rule 1 for a directory that may exist: False when nothing is at ``path``, True when a
    private directory is; raises :class:`UnsafeDirectoryError` for anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    check_private(path, st, advice)
    return True


def open_private(
    name: str, advice: str, *, dir_fd: int | None = None, create: bool = False, path: str | None = None
) -> tuple[int, bool]:
    """Rules 1 and 2: a descriptor of the private directory ``name`` (relative to ``dir_fd``
    when given), made with mode 0700 first when ``create`` and missing; and whether this call
    made it. ``path`` names it in errors (default ``name``). Raises ``FileNotFoundError`` when
    it is missing and not ``create``, :class:`UnsafeDirectoryError` when it is not private."""
    shown = name if path is None else path
    made = False
    if create:
        try:
            os.mkdir(name, PRIVATE_MODE, dir_fd=dir_fd)
            made = True
        except FileExistsError:
            pass  # checked below like any directory found there
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    check_private(shown, before, MADE_ADVICE if made else advice)
    try:
        fd = os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a symlink or a file since the lstat
            check_private(shown, os.stat(name, dir_fd=dir_fd, follow_symlinks=False), advice)
        raise
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafeDirectoryError(
                shown,
                "it was replaced between its check and its opening",
                owner_text(after.st_uid),
                _mode_text(after),
                owner_text(os.geteuid()),
                advice,
            )
        check_private(shown, after, advice)
    except BaseException:
        os.close(fd)
        raise
    return fd, made


def open_tree(path: str, own: Mapping[str, str], *, create: bool) -> tuple[int, list[str]]:
    """A descriptor of the directory ``path``, and the directories this call made (innermost
    first). Components of ``path`` in ``own`` (tiermem's own directories, each with the advice
    its error gives) and missing ones (made when ``create``) are opened one by one with
    :func:`open_private`, each relative to the one above (rules 1, 2); the nearest existing
    ancestor that is neither is the user's, opened as given (rule 3). Raises
    ``FileNotFoundError`` when a component is missing and not ``create``."""
    path = os.path.abspath(path)
    chain: list[str] = []
    anchor = path
    while (anchor in own or not os.path.lexists(anchor)) and os.path.dirname(anchor) != anchor:
        chain.append(anchor)
        anchor = os.path.dirname(anchor)
    fd = os.open(anchor, _DIR_FLAGS)
    made: list[str] = []
    try:
        for component in reversed(chain):
            advice = own.get(component, MADE_ADVICE)
            child, new = open_private(os.path.basename(component), advice, dir_fd=fd, create=create, path=component)
            os.close(fd)
            fd = child
            if new:
                made.append(component)
    except BaseException:
        os.close(fd)
        for directory in reversed(made):  # what this call made, innermost first, only when empty
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return fd, made[::-1]


def held_path(dir_fd: int, name: str = "") -> str | None:
    """Rule 4 for libraries that take a path: ``name`` inside the directory ``dir_fd`` holds,
    reached through the descriptor (``/proc/self/fd/<fd>/<name>``), so it stays the held
    directory's whatever is renamed above it; None where ``/proc`` is not mounted."""
    if not os.path.isdir(_PROC_FD):
        return None
    base = os.path.join(_PROC_FD, str(dir_fd))
    return os.path.join(base, name) if name else base
