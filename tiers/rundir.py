"""Private run directories for the NVMe tier, and the sweeping of ones whose owner died.

Layout under a parent directory (one of ``[nvme] paths``)::

    parent/
      tiermem-run-<pid>-<random>/    a live or dead run directory
        lock                         flock(LOCK_EX) held by the owner for its lifetime
        data                         the tier's striped data file (made by the tier)
      .tiermem-new-<random>/         being created (lock taken, not yet renamed)
      .tiermem-dead-<random>/        being removed by its owner or a sweeper
      rank<N>/                       rank N's parent in a multi-process job (tiermem.distributed):
        tiermem-run-<pid>-<random>/  the same layout again, one level down

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
5. A ``rank<N>`` directory is one rank's parent. Sweeping a parent sweeps its ``rank<N>``
   directories too, and sweeping a rank directory sweeps its siblings (through the parent),
   so a dead rank's run directory is reclaimed by the next run on the same path whatever its
   world size. A rank directory the sweep emptied is removed; one a live run is about to use
   may vanish under it, which creating with ``create_parent`` retries (rule 2 still holds).
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

__all__ = ["RANK_PREFIX", "RUN_PREFIX", "RunDirectory", "default_parent", "rank_directory_name", "sweep_stale"]

logger = logging.getLogger("tiermem.nvme")

#: Final name prefix of a run directory.
RUN_PREFIX = "tiermem-run-"
_NEW_PREFIX = ".tiermem-new-"
_DEAD_PREFIX = ".tiermem-dead-"
_LOCK_NAME = "lock"
#: Temporary (new/dead) directories older than this are leftovers of a crash mid-create or
#: mid-remove; nothing legitimate keeps one that long.
STALE_TEMP_AGE_S = 600.0


#: Prefix of one rank's directory under a parent (rule 5): ``rank0``, ``rank1``, ...
RANK_PREFIX = "rank"


def rank_directory_name(rank: int) -> str:
    """The directory under each NVMe path that rank ``rank`` of a multi-process job uses."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"tiermem run directory: a rank is a non-negative integer, got {rank!r}")
    return f"{RANK_PREFIX}{rank}"


def _is_rank_directory(name: str) -> bool:
    digits = name[len(RANK_PREFIX) :]
    return name.startswith(RANK_PREFIX) and digits.isdigit() and digits == str(int(digits))


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
    #: Directories this process made for ``parent`` (``parent`` first, then its missing
    #: ancestors), removed at cleanup once empty.
    created: tuple[str, ...]
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
    # Only directories this process created, and only when empty: another runtime may be
    # using them, and a user's own directory is never removed.
    for directory in state.created:
        try:
            os.rmdir(directory)
        except OSError:
            break  # not empty (or gone): its ancestors are not empty either


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
    """Remove run directories under ``parent`` and its ``rank<N>`` directories whose owner is
    gone; return the removed paths.

    A run directory is stale when its lock can be taken (its owner died, rule 1). Temporary
    ``.tiermem-new-*`` / ``.tiermem-dead-*`` directories are removed once older than
    :data:`STALE_TEMP_AGE_S` (and, for new ones, when no one holds their lock). Live
    directories of other runtimes are never touched. A rank directory left empty by the
    sweep (a dead rank's) is removed too (rule 5).
    """
    parent = os.fspath(parent)
    removed = _sweep_one(parent)
    try:
        ranks = [name for name in os.listdir(parent) if _is_rank_directory(name)]
    except OSError:
        ranks = []
    for name in ranks:
        rank_dir = os.path.join(parent, name)
        swept = _sweep_one(rank_dir)
        if swept:
            removed += swept
            with contextlib.suppress(OSError):
                os.rmdir(rank_dir)  # only when empty: a live rank's directory stays
    if removed:
        logger.info(
            "tiermem: removed %d stale run director%s under %s: %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            parent,
            ", ".join(removed),
        )
    return removed


def _sweep_one(parent: str) -> list[str]:
    """:func:`sweep_stale` for the entries of ``parent`` itself (not its rank directories)."""
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
    return removed


def _make_missing(parent: str) -> list[str]:
    """Make ``parent`` and its missing ancestors; the ones this call made, innermost first."""
    missing: list[str] = []
    probe = parent
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        missing.append(probe)
        probe = os.path.dirname(probe)
    made: list[str] = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode=0o700)
            made.append(directory)
        except FileExistsError:
            pass  # another runtime made it: it is not ours to remove
    return made[::-1]


def _removable(parent: str, created: list[str]) -> tuple[str, ...]:
    """What cleanup may remove once empty, innermost first: what this process made, and
    tiermem's own default parent above a rank directory whoever made it (the last rank to
    leave removes it)."""
    directories = sorted(set(created), key=len, reverse=True)
    default = default_parent()
    if os.path.dirname(parent) == default and default not in directories:
        directories.append(default)
    return tuple(directories)


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

        ``create_parent`` makes ``parent`` (and its missing ancestors) when missing: the default
        ``$TMPDIR/tiermem-nvme`` and rank directories; :meth:`cleanup` removes what it made once
        empty. Otherwise a missing parent raises ``FileNotFoundError``. In a rank directory
        (``rank<N>``) the sweep covers the sibling ranks too (rule 5).
        """
        parent = os.path.abspath(os.fspath(parent))
        base = os.path.dirname(parent)
        sweep_root = base if _is_rank_directory(os.path.basename(parent)) else parent
        created: list[str] = []
        for _attempt in range(5):
            if create_parent:
                created += _make_missing(parent)
            sweep_stale(sweep_root)
            try:
                return cls(cls._make(parent, _removable(parent, created) if create_parent else ()))
            except FileNotFoundError:
                # Another runtime (or a sweeper, rule 5) removed the empty parent between our
                # makedirs and mkdtemp: make it again.
                if not create_parent:
                    raise
        raise OSError(errno.ENOENT, "tiermem: the run directory parent keeps disappearing", parent)

    @staticmethod
    def _make(parent: str, created: tuple[str, ...]) -> _RunState:
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
        state = _RunState(path=final, parent=parent, lock_fd=fd, owner_pid=pid, created=created)
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
