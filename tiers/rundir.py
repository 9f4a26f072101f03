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
6. The default parent is private to the user: ``<tempdir>/tiermem-nvme-<uid>``, made with mode
   0700. It, a ``rank<N>`` directory and any missing parent tiermem makes are used only when
   they are real directories of this user, not writable by group or others, and refused with
   ``UnsafeDirectoryError`` otherwise (NOTE [ Private directories ] in
   :mod:`tiermem.private_dirs`); a path the user configured is trusted as given. Every level
   is opened relative to the one above it, never through a symlink.
7. A run directory is made, locked, renamed and removed relative to a descriptor of its parent,
   and holds a descriptor of itself, both kept for its life: files in it are opened relative to
   that (:meth:`RunDirectory.open`, :meth:`RunDirectory.new_file`, :attr:`RunDirectory.held_path`),
   so renaming the parent's entries mid-run cannot redirect a read, a write or the removal.
8. A sweep only reclaims run, temporary and rank directories that are real directories owned
   by this user: never another user's (their locks are not ours to judge), never a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import tempfile
import time
import weakref
from dataclasses import dataclass

from tiermem.private_dirs import MADE_ADVICE, held_path, open_private, open_tree, private_existing

__all__ = [
    "DEFAULT_DIR_PREFIX",
    "RANK_PREFIX",
    "RUN_PREFIX",
    "RunDirectory",
    "check_own_directories",
    "default_parent",
    "rank_directory_name",
    "sweep_stale",
]

logger = logging.getLogger("tiermem.nvme")

#: Final name prefix of a run directory.
RUN_PREFIX = "tiermem-run-"
_NEW_PREFIX = ".tiermem-new-"
_DEAD_PREFIX = ".tiermem-dead-"
_LOCK_NAME = "lock"
#: Temporary (new/dead) directories older than this are leftovers of a crash mid-create or
#: mid-remove; nothing legitimate keeps one that long.
STALE_TEMP_AGE_S = 600.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


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


#: The default NVMe parent's name under the temp dir, before the user's uid (rule 6).
DEFAULT_DIR_PREFIX = "tiermem-nvme-"
_DEFAULT_ADVICE = (
    "It is tiermem's default NVMe directory: remove it if you did not make it (another local user may "
    "have planted it; look at what it holds first), or set [nvme] paths to a directory of your own"
)
_RANK_ADVICE = (
    "It is a rank's directory tiermem makes under an NVMe path: remove it if you did not make it, or set "
    "[nvme] paths to a directory of your own"
)


def default_parent() -> str:
    """The default NVMe parent: ``$TMPDIR/tiermem-nvme-<uid>``, private to the user (rule 6;
    created on demand with mode 0700, removed by the last runtime to leave it).

    Per user: a fixed name in a world-writable directory is another local user's to take first.
    Not under ``$XDG_RUNTIME_DIR``: that is a tmpfs, where offloaded bytes would stay in RAM.
    Not ``tiermem``: run from ``$TMPDIR``, ``python -m tiermem`` would import that directory
    as a namespace package instead of tiermem itself."""
    return os.path.join(tempfile.gettempdir(), f"{DEFAULT_DIR_PREFIX}{os.geteuid()}")


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
    #: Descriptors of ``parent`` and of the run directory itself, held for its life (rule 7).
    parent_fd: int = -1
    dir_fd: int = -1
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


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _cleanup_state(state: _RunState) -> None:
    """Remove a run directory if this process owns it; a no-op anywhere else (rule 4)."""
    if state.done or not state.owner or state.owner_pid != os.getpid():
        return
    state.done = True
    _STATES.discard(state)
    _remove_locked_dir(state.parent_fd, os.path.basename(state.path), state.parent)
    for fd in (state.lock_fd, state.dir_fd, state.parent_fd):
        _close(fd)
    state.lock_fd = state.dir_fd = state.parent_fd = -1
    # Only directories this process created, and only when empty: another runtime may be
    # using them, and a user's own directory is never removed.
    for directory in state.created:
        try:
            os.rmdir(directory)
        except OSError:
            break  # not empty (or gone): its ancestors are not empty either


def _rmtree_at(parent_fd: int, name: str, parent: str) -> None:
    """Remove ``name`` in the directory ``parent_fd`` holds, and everything in it (rule 7)."""
    try:
        shutil.rmtree(name, dir_fd=parent_fd, ignore_errors=True)  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # Python 3.10: no dir_fd; through the held descriptor where /proc has it
        shutil.rmtree(held_path(parent_fd, name) or os.path.join(parent, name), ignore_errors=True)


def _remove_locked_dir(parent_fd: int, name: str, parent: str) -> bool:
    """Remove ``name`` under ``parent_fd`` (whose lock the caller holds): rename out of the final
    namespace, then delete (rule 3). Returns False when it was already gone."""
    dead = _DEAD_PREFIX + secrets.token_hex(6)
    try:
        os.rename(name, dead, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except FileNotFoundError:
        return False
    except OSError:
        dead = name  # e.g. a parent that refuses renames: delete in place
    _rmtree_at(parent_fd, dead, parent)
    return True


def _try_lock(parent_fd: int, name: str) -> tuple[int | None, bool]:
    """An fd holding ``name``'s lock exclusively, or None when someone holds it (or it is gone);
    and whether the lock file exists. Never through a symlink (rule 8)."""
    try:
        dir_fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None, False
    try:
        fd = os.open(_LOCK_NAME, os.O_RDWR | os.O_CLOEXEC | _NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, False
    except OSError:
        return None, True
    finally:
        os.close(dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None, True
    return fd, True


def _ours(parent_fd: int, name: str) -> os.stat_result | None:
    """Rule 8: ``lstat`` of ``name`` when it is a real directory owned by this user, else None."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return None
    return st if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() else None


def sweep_stale(parent: str | os.PathLike[str]) -> list[str]:
    """Remove run directories under ``parent`` and its ``rank<N>`` directories whose owner is
    gone; return the removed paths.

    A run directory is stale when its lock can be taken (its owner died, rule 1). Temporary
    ``.tiermem-new-*`` / ``.tiermem-dead-*`` directories are removed once older than
    :data:`STALE_TEMP_AGE_S` (and, for new ones, when no one holds their lock). Live
    directories of other runtimes are never touched, nor anything of another user (rule 8).
    A rank directory left empty by the sweep (a dead rank's) is removed too (rule 5).
    """
    parent = os.fspath(parent)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        removed = _sweep_one(parent_fd, parent)
        try:
            ranks = [name for name in os.listdir(parent_fd) if _is_rank_directory(name)]
        except OSError:
            ranks = []
        for name in ranks:
            if _ours(parent_fd, name) is None:
                continue  # rule 8: never another user's, never a symlink
            try:
                rank_fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
            except OSError:
                continue
            try:
                swept = _sweep_one(rank_fd, os.path.join(parent, name))
            finally:
                os.close(rank_fd)
            if swept:
                removed += swept
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=parent_fd)  # only when empty: a live rank's directory stays
    finally:
        os.close(parent_fd)
    if removed:
        logger.info(
            "tiermem: removed %d stale run director%s under %s: %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            parent,
            ", ".join(removed),
        )
    return removed


def _sweep_one(parent_fd: int, parent: str) -> list[str]:
    """:func:`sweep_stale` for the entries of ``parent`` itself (not its rank directories)."""
    removed: list[str] = []
    try:
        names = os.listdir(parent_fd)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith((RUN_PREFIX, _NEW_PREFIX, _DEAD_PREFIX)):
            continue
        st = _ours(parent_fd, name)
        if st is None:
            continue  # rule 8: another user's, or not a directory
        path = os.path.join(parent, name)
        old = now - st.st_mtime > STALE_TEMP_AGE_S
        if not old and not name.startswith(RUN_PREFIX):
            continue  # a young temporary: its creator may be about to lock it (rule 2)
        fd, has_lock = _try_lock(parent_fd, name)
        try:
            if name.startswith(RUN_PREFIX):
                if fd is not None:
                    if _remove_locked_dir(parent_fd, name, parent):
                        removed.append(path)
                elif not has_lock and old:
                    # No lock file: a sweeper mid-remove, or a leftover of a crash during
                    # removal, which only age tells apart.
                    _rmtree_at(parent_fd, name, parent)
                    removed.append(path)
            elif old and (fd is not None or not has_lock):  # else a creator is (very slowly) alive
                _rmtree_at(parent_fd, name, parent)
                removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _own_directories(parent: str, create_parent: bool) -> dict[str, str]:
    """Rule 6: the directories on the way to ``parent`` that are tiermem's own (checked private
    even when they exist), each with what its error advises."""
    own = {default_parent(): _DEFAULT_ADVICE}
    if create_parent and _is_rank_directory(os.path.basename(parent)):
        own[parent] = _RANK_ADVICE
    return own


def check_own_directories(parent: str | os.PathLike[str], create_parent: bool) -> None:
    """Rule 6 before anything probes or writes under ``parent``: raise
    :class:`~tiermem.errors.UnsafeDirectoryError` when one of tiermem's own directories on the way
    to it (the default parent, a rank directory) exists and is not private to the user."""
    parent = os.path.abspath(os.fspath(parent))
    for directory, advice in sorted(_own_directories(parent, create_parent).items(), key=lambda item: len(item[0])):
        if parent == directory or parent.startswith(directory + os.sep):
            private_existing(directory, advice)


def _removable(parent: str, created: list[str]) -> tuple[str, ...]:
    """What cleanup may remove once empty, innermost first: what this process made, and
    tiermem's own default parent, itself or above a rank directory, whoever made it: the last
    runtime to leave removes it. Were only its maker to, a second run that outlived the first
    would leave it behind, empty. One that vanishes as another run makes its directory there is
    made again (:meth:`RunDirectory.create` retries)."""
    directories = sorted(set(created), key=len, reverse=True)
    default = default_parent()
    if default in (parent, os.path.dirname(parent)) and default not in directories:
        directories.append(default)
    return tuple(directories)


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

        ``create_parent`` makes ``parent`` (and its missing ancestors) when missing, mode 0700:
        the default ``$TMPDIR/tiermem-nvme-<uid>`` and rank directories; :meth:`cleanup` removes
        what it made once empty. Otherwise a missing parent raises ``FileNotFoundError``. The
        default parent and a rank directory are checked private to the user, and raise
        :class:`~tiermem.errors.UnsafeDirectoryError` when not (rule 6). In a rank directory
        (``rank<N>``) the sweep covers the sibling ranks too (rule 5).
        """
        parent = os.path.abspath(os.fspath(parent))
        base = os.path.dirname(parent)
        sweep_root = base if _is_rank_directory(os.path.basename(parent)) else parent
        own = _own_directories(parent, create_parent)
        created: list[str] = []
        for _attempt in range(5):
            parent_fd = -1
            try:
                parent_fd, made = open_tree(parent, own, create=create_parent)
                created += made
                sweep_stale(sweep_root)
                state = cls._make(parent, parent_fd, _removable(parent, created) if create_parent else ())
            except FileNotFoundError:
                # Another runtime (or a sweeper, rule 5) removed the empty parent between our
                # mkdir and the run directory's: make it again.
                _close(parent_fd)
                if not create_parent:
                    raise
                continue
            except BaseException:
                _close(parent_fd)
                for directory in sorted(set(created), key=len, reverse=True):  # what it made, if empty
                    with contextlib.suppress(OSError):
                        os.rmdir(directory)
                raise
            return cls(state)
        raise OSError(errno.ENOENT, "tiermem: the run directory parent keeps disappearing", parent)

    @staticmethod
    def _make(parent: str, parent_fd: int, created: tuple[str, ...]) -> _RunState:
        # Rule 2: lock under a temporary name, then rename to the final name; rule 7: all of it
        # relative to the parent's descriptor.
        temp = _NEW_PREFIX + secrets.token_hex(6)
        os.mkdir(temp, 0o700, dir_fd=parent_fd)
        dir_fd = fd = -1
        try:
            dir_fd, _ = open_private(temp, MADE_ADVICE, dir_fd=parent_fd, path=os.path.join(parent, temp))
            fd = os.open(
                _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW, 0o600, dir_fd=dir_fd
            )
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            pid = os.getpid()
            name = f"{RUN_PREFIX}{pid}-{secrets.token_hex(6)}"
            os.rename(temp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except BaseException:
            _close(fd)
            _close(dir_fd)
            _rmtree_at(parent_fd, temp, parent)
            raise
        final = os.path.join(parent, name)
        state = _RunState(
            path=final, parent=parent, lock_fd=fd, owner_pid=pid, created=created, parent_fd=parent_fd, dir_fd=dir_fd
        )
        _STATES.add(state)
        return state

    @property
    def fd(self) -> int:
        """A descriptor of the run directory, held until :meth:`cleanup` (rule 7)."""
        return self._state.dir_fd

    @property
    def held_path(self) -> str:
        """A path to the run directory through its held descriptor (``/proc/self/fd/<fd>``), for
        libraries that only take a path: renames above it cannot redirect it (rule 7). The
        plain :attr:`path` where ``/proc`` is not mounted."""
        return held_path(self._state.dir_fd) or self._state.path

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``name`` in the run directory, relative to its held descriptor and never
        through a symlink (rule 7)."""
        return os.open(name, flags | os.O_CLOEXEC | _NOFOLLOW, mode, dir_fd=self._state.dir_fd)

    def new_file(self, name: str) -> str:
        """Create the file ``name`` (mode 0600; it must not exist) and return a path that opens it
        through the held descriptor, for libraries that only take a path (rule 7)."""
        os.close(self.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL))
        return held_path(self._state.dir_fd, name) or os.path.join(self._state.path, name)

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
