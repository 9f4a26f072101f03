"""Private run directories for the NVMe tier, and the sweeping of ones whose owner died.

Layout under a parent directory (one of ``[nvme] paths``)::

    parent/
      tiermem-run-<pid>-<random>/    a live or dead run directory
        lock                         flock(LOCK_EX) held by the owner for its lifetime
        data                         the tier's striped data file (made by the tier)
      .tiermem-new-<random>/         being created (lock taken, not yet renamed)
      .tiermem-dead-<random>/        being removed by its owner or a sweeper

# NOTE [ Run directory rules ]
1. Liveness is the ``flock`` on ``lock``, never the PID in the name: PIDs are reused, and
   the kernel drops the lock however the owner dies, SIGKILL included (TRAPS 5).
2. A final-named directory always has a held lock: it is made under a temporary name, the
   lock taken inside, and only then renamed. A sweeper therefore never sees a final name
   without a lock it would wrongly take.
3. Whoever removes a directory (owner or sweeper) first renames it to ``.tiermem-dead-*``
   while holding the lock, so no second sweeper can start on it.
4. A forked child (DataLoader workers fork) is never an owner: its ``cleanup()`` and the
   exit-time finalizer do nothing there, and it never unlocks (TRAPS 12). ``flock`` locks
   belong to the open file description the child shares with the parent, so an unlock in
   the child would free the parent's lock; closing the child's copy of the descriptor
   does not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass

__all__ = ["RUN_PREFIX", "RunDirectory", "default_parent", "sweep_stale"]

logger = logging.getLogger("tiermem.nvme")

#: Final name prefix of a run directory.
RUN_PREFIX = "tiermem-run-"
_NEW_PREFIX = ".tiermem-new-"
_DEAD_PREFIX = ".tiermem-dead-"
_LOCK_NAME = "lock"
#: Temporary (new/dead) directories older than this are leftovers of a crash mid-create or
#: mid-remove; nothing legitimate keeps one that long.
STALE_TEMP_AGE_S = 600.0


#: The default NVMe parent's name under the temp dir (the config resolves to the same).
DEFAULT_DIR_NAME = "tiermem-nvme"


def default_parent() -> str:
    """The default NVMe parent: ``$TMPDIR/tiermem-nvme`` (created on demand, removed when empty).

    Not ``tiermem``: run from ``$TMPDIR``, ``python -m tiermem`` would import that directory
    as a namespace package instead of tiermem itself."""
    return os.path.join(tempfile.gettempdir(), DEFAULT_DIR_NAME)


@dataclass(eq=False)
class _RunState:
    """What cleanup needs, kept apart from :class:`RunDirectory` so that the finalizer does
    not keep the directory object alive (a finalizer holding its referent never fires)."""

    path: str
    parent: str
    lock_fd: int
    owner_pid: int
    created_parent: bool
    owner: bool = True
    done: bool = False


# States of live run directories, for the fork handler. Weak: the finalizer holds the only
# strong reference, and it lets go once the directory is cleaned up.
_STATES: weakref.WeakSet[_RunState] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # See rule 4: the child is not an owner. Close its copy of the lock descriptor (the
    # parent's lock stays held through the parent's copy) so that the child neither keeps a
    # dead parent's directory locked forever nor could ever unlock it.
    for state in list(_STATES):
        state.owner = False
        if state.lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(state.lock_fd)
            state.lock_fd = -1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _cleanup_state(state: _RunState) -> None:
    """Remove a run directory if this process owns it; a no-op anywhere else (rule 4)."""
    if state.done or not state.owner or state.owner_pid != os.getpid():
        return
    state.done = True
    _STATES.discard(state)
    _remove_locked_dir(state.path, state.parent)
    if state.lock_fd >= 0:
        with contextlib.suppress(OSError):
            os.close(state.lock_fd)
        state.lock_fd = -1
    if state.created_parent:
        # Only a parent this process created, and only when empty: another runtime may be
        # using it, and a user's own directory is never removed.
        with contextlib.suppress(OSError):
            os.rmdir(state.parent)


def _remove_locked_dir(path: str, parent: str) -> bool:
    """Remove ``path`` (whose lock the caller holds): rename out of the final namespace, then
    delete (rule 3). Returns False when it was already gone."""
    dead = os.path.join(parent, _DEAD_PREFIX + secrets.token_hex(6))
    try:
        os.rename(path, dead)
    except FileNotFoundError:
        return False
    except OSError:
        dead = path  # e.g. a parent that refuses renames: delete in place
    shutil.rmtree(dead, ignore_errors=True)
    return True


def _try_lock(lock_path: str) -> int | None:
    """An fd holding ``lock_path`` exclusively, or None when someone holds it (or it is gone)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_stale(parent: str | os.PathLike[str]) -> list[str]:
    """Remove run directories under ``parent`` whose owner is gone; return the removed paths.

    A run directory is stale when its lock can be taken (its owner died, rule 1). Temporary
    ``.tiermem-new-*`` / ``.tiermem-dead-*`` directories are removed once older than
    :data:`STALE_TEMP_AGE_S` (and, for new ones, when no one holds their lock). Live
    directories of other runtimes are never touched.
    """
    parent = os.fspath(parent)
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(parent, name)
        if name.startswith(RUN_PREFIX):
            fd = _try_lock(os.path.join(path, _LOCK_NAME))
            if fd is None:
                # Held (owner alive), or no lock file: a sweeper mid-remove, or a leftover of
                # a crash during removal, which only age tells apart.
                if not os.path.exists(os.path.join(path, _LOCK_NAME)) and _older_than(path, now):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                continue
            try:
                if _remove_locked_dir(path, parent):
                    removed.append(path)
            finally:
                os.close(fd)
        elif name.startswith((_NEW_PREFIX, _DEAD_PREFIX)) and _older_than(path, now):
            fd = _try_lock(os.path.join(path, _LOCK_NAME))
            if fd is None and os.path.exists(os.path.join(path, _LOCK_NAME)):
                continue  # a creator is (very slowly) alive
            try:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            finally:
                if fd is not None:
                    os.close(fd)
    if removed:
        logger.info(
            "tiermem: removed %d stale run director%s under %s: %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            parent,
            ", ".join(removed),
        )
    return removed


def _older_than(path: str, now: float, age: float = STALE_TEMP_AGE_S) -> bool:
    try:
        return now - os.stat(path).st_mtime > age
    except OSError:
        return False


class RunDirectory:
    """A private directory of one runtime under ``parent``, removed by :meth:`cleanup`.

    Also removed at normal interpreter exit, or when the object is garbage collected,
    whichever comes first; never by a forked child (rule 4).
    """

    def __init__(self, state: _RunState) -> None:
        self._state = state
        self._finalizer = weakref.finalize(self, _cleanup_state, state)

    @classmethod
    def create(cls, parent: str | os.PathLike[str], *, create_parent: bool = False) -> RunDirectory:
        """Sweep ``parent`` of stale run directories, then make a fresh one there.

        ``create_parent`` makes ``parent`` when missing (for the default ``$TMPDIR/tiermem-nvme``);
        :meth:`cleanup` then removes it again once empty. Otherwise a missing parent raises
        ``FileNotFoundError``.
        """
        parent = os.path.abspath(os.fspath(parent))
        created_parent = False
        for _attempt in range(5):
            if create_parent and not os.path.isdir(parent):
                try:
                    os.makedirs(parent, mode=0o700)
                    created_parent = True
                except FileExistsError:
                    pass
            sweep_stale(parent)
            try:
                return cls(cls._make(parent, created_parent))
            except FileNotFoundError:
                # Another runtime removed the (empty) default parent between our makedirs
                # and mkdtemp: make it again.
                if not create_parent:
                    raise
        raise OSError(errno.ENOENT, "tiermem: the run directory parent keeps disappearing", parent)

    @staticmethod
    def _make(parent: str, created_parent: bool) -> _RunState:
        # Rule 2: lock under a temporary name, then rename to the final name.
        temp = tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=parent)
        fd = -1
        try:
            fd = os.open(os.path.join(temp, _LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            pid = os.getpid()
            final = os.path.join(parent, f"{RUN_PREFIX}{pid}-{secrets.token_hex(6)}")
            os.rename(temp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            shutil.rmtree(temp, ignore_errors=True)
            raise
        state = _RunState(path=final, parent=parent, lock_fd=fd, owner_pid=pid, created_parent=created_parent)
        _STATES.add(state)
        return state

    @property
    def path(self) -> str:
        return self._state.path

    @property
    def parent(self) -> str:
        return self._state.parent

    @property
    def owner(self) -> bool:
        """True in the process that created it (and not yet cleaned up); False in forked children."""
        state = self._state
        return state.owner and not state.done and state.owner_pid == os.getpid()

    def cleanup(self) -> None:
        """Remove the directory and everything in it. Idempotent; a no-op in a forked child."""
        if self._state.owner_pid != os.getpid() or not self._state.owner:
            return  # rule 4: leave the finalizer armed in the owner's memory, untouched here
        self._finalizer()

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"RunDirectory({self.path!r}, owner={self.owner})"
