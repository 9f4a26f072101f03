"""A checkpoint directory on disk: written beside its destination, committed by one atomic
rename, with a digest per file verified before anything is loaded.

# NOTE [ Checkpoint commit rules ]
1. A save writes into a temporary sibling of ``path`` (``.<name>.tiermem-tmp-<id>``, same
   directory, so the same filesystem and a rename can commit it). The writer holds an
   ``flock`` on that directory for its whole life; a sibling whose lock is free belongs to a
   save that died (SIGKILL, power loss) and the next save of ``path`` removes it. Never judged
   by a PID, which the system reuses (TRAPS 5). Making the sibling and locking it, removing
   dead siblings and recovering (rule 3) happen under an ``flock`` on the parent directory,
   taken first: no save ever sees another's sibling unlocked, and a failure in between removes
   the sibling it made. The sibling is made with mode 0700 and opened never through a symlink,
   checked private to the user (NOTE [ Private directories ]), so a save's files are only its own.
2. Durability before visibility: every file is written and ``fsync``-ed (DCP's data and
   ``.metadata`` with ``sync_files``, tensorstore's with ``file_io_sync``, ours explicitly),
   every folder below the checkpoint, the manifest last, then the directory itself; only then
   is it renamed into place, and the parent directory is ``fsync``-ed after.
3. The commit is one atomic step: with no checkpoint at ``path``, ``rename``; with one,
   ``renameat2(RENAME_EXCHANGE)`` swaps the two directories, so ``path`` is at every instant
   either the previous complete checkpoint or the new complete one; the previous one (now at
   the temporary name) is removed afterwards. Where the filesystem cannot exchange, the old
   one is first renamed to ``.<name>.tiermem-old-<id>`` and the new one into place; a crash
   between the two leaves ``path`` missing and the old sibling, which the next load or save
   of ``path`` renames back (:func:`recover`).
4. The manifest (``tiermem-manifest.json``) records every other file's size and xxh3-128
   digest, files in folders too (the zarr format's arrays, by relative path), and the storage
   format (``"dcp"`` or ``"zarr"``). A load verifies all of them first, streaming (a few MiB
   in memory), and refuses a missing, truncated or corrupted file with a
   :class:`CheckpointError` naming it: never wrong weights. A directory with DCP's
   ``.metadata``, neither manifest nor tiermem state file, and no ``tiermem`` entry in its
   metadata (every tiermem save writes one, :data:`MARKER`) is a plain DCP checkpoint (written
   by PyTorch itself): loaded without digests. A tiermem checkpoint that lost its manifest (a
   copy that left files out) is refused, naming what is missing: never loaded unverified.
5. A save that fails removes its temporary directory and leaves ``path`` as it was.
6. Only a checkpoint is replaced: ``path`` must be missing, an empty directory, or a tiermem
   checkpoint (its manifest names our format). Anything else (a directory of other files, a
   file, a symlink) is refused before anything is written, and checked again just before the
   commit: a save must never swap out and remove a user's directory.
7. One checkpoint per read: a load (and ``tiermem checkpoint inspect``) holds a shared ``flock``
   on the checkpoint directory from its verification to its last read (:func:`reading`); a
   commit takes the exclusive one on the checkpoint it replaces before swapping it out (and
   holds it until that one is removed), so it waits for those reads; a read that locked a
   directory no longer at ``path`` locks the new one instead. Every file a load reads is the
   verified checkpoint's, never a mix with a concurrent save's.
8. Room (:mod:`~tiermem.checkpoint.room`): before it makes its temporary sibling (after removing
   dead ones, which frees theirs), a save compares the bytes it writes at least with the free
   bytes of the filesystem and, short, refuses naming the lack of space, the path, both sizes
   and what to do, having written nothing (a lower bound: a save that fits is never refused). A
   disk that fills during the write anyway (ENOSPC in an ``OSError`` or a storage library's
   message, or torch's serializer failing with less free than the rest needs) is named as such:
   ENOSPC, the file, the bytes needed and free, measured before rule 5 removes what was written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path

import xxhash

from tiermem.checkpoint.room import Room
from tiermem.errors import CheckpointError
from tiermem.private_dirs import MADE_ADVICE, PRIVATE_MODE, open_private

MANIFEST = "tiermem-manifest.json"
#: extra, RNG states and loop positions (pickled)
STATE_FILE = "tiermem-state.pkl"
DCP_METADATA = ".metadata"
#: the root of a checkpoint in the zarr format (a zarr v3 group)
ZARR_ROOT = "zarr.json"
FORMAT = "tiermem-dcp"
FORMAT_VERSION = 1
#: the state-dict entry every tiermem save writes beside ``model``/``optimizer`` (rule 4): it
#: tells a tiermem checkpoint that lost its manifest from a plain DCP one
MARKER = "tiermem"
_TMP = ".tiermem-tmp-"
_OLD = ".tiermem-old-"
_BLOCK = 4 << 20
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _siblings(path: Path, tag: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}{tag}*"))


def fsync_path(path: Path) -> None:
    """``fsync`` a file or a directory (rule 2)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_dir(path: Path) -> int | None:
    """A descriptor of the directory at ``path``, or None where there is none."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _try_lock(fd: int) -> bool:
    """An exclusive ``flock`` on ``fd`` if nobody holds one (rule 1's test of a dead save)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _parent_locked(path: Path) -> Iterator[None]:
    """Rule 1: the siblings of ``path`` are made, locked, removed or renamed back under an
    exclusive ``flock`` on its parent directory (held for milliseconds)."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _locked_at(path: Path, operation: int) -> int | None:
    """Rule 7: a descriptor of the directory at ``path`` holding ``flock(operation)``, re-opened
    until the locked directory is still the one at ``path`` (a commit may swap it meanwhile);
    None where ``path`` is no directory."""
    while True:
        fd = _open_dir(path)
        if fd is None:
            return None
        fcntl.flock(fd, operation)
        try:
            now = os.stat(path)
        except OSError:
            now = None
        held = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Rule 7: a shared lock on the checkpoint at ``path`` for a whole read (verification and
    load); no commit swaps it out meanwhile. A ``path`` that is no directory is not locked (the
    read itself reports it)."""
    fd = _locked_at(path, fcntl.LOCK_SH)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _recover(path: Path) -> None:
    """:func:`recover`, under the parent's lock; a sibling a commit still holds is its own."""
    for old in _siblings(path, _OLD):
        fd = _open_dir(old)
        if fd is None:
            continue
        try:
            if not _try_lock(fd):
                continue  # a commit is between its renames right now
            if path.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(old, path)
                fsync_path(path.parent)
        finally:
            os.close(fd)


def recover(path: Path) -> None:
    """Rule 3: a fallback commit killed between its two renames left ``path`` missing and the
    previous checkpoint at an ``-old-`` sibling: put it back. With ``path`` present, an old
    sibling is a committed save's leftover: remove it."""
    if path.parent.is_dir():
        with _parent_locked(path):
            _recover(path)


def _remove_stale(path: Path) -> None:
    """Rule 1 (under the parent's lock): remove temporary siblings whose writer is gone."""
    for stale in _siblings(path, _TMP):
        fd = _open_dir(stale)
        if fd is None:
            continue
        try:
            if _try_lock(fd):
                shutil.rmtree(stale, ignore_errors=True)
        finally:
            os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically; False where the system or filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _is_checkpoint(path: Path) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def check_replaceable(path: Path) -> None:
    """Rule 6: refuse a ``path`` that holds something other than a tiermem checkpoint."""
    if path.is_symlink():
        what = "is a symbolic link"
    elif not path.exists():
        return
    elif not path.is_dir():
        what = "is a file"
    elif not any(path.iterdir()) or _is_checkpoint(path):
        return
    else:
        what = f"is a directory that is not a tiermem checkpoint (no {MANIFEST} of format {FORMAT!r})"
    raise CheckpointError(
        f"tiermem checkpoint: cannot save to {path}: it {what}, and a save replaces its destination. Nothing was "
        "written; choose a new or empty directory.",
        str(path),
    )


class Staging:
    """The temporary sibling a save writes into (rules 1, 3, 5, 6, 7)."""

    def __init__(self, path: Path, needed: int = 0) -> None:
        self.path = path
        #: the storage format written (recorded in the manifest)
        self.storage = "dcp"
        #: rule 8: the bytes this save writes at least (0: unknown, not checked)
        self.room = Room(needed)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _parent_locked(path):  # rule 1: first, so no other save sees ours unlocked
            _recover(path)
            check_replaceable(path)
            _remove_stale(path)
            self.room.check(path)  # rule 8: before anything is written
            self.dir = path.parent / f".{path.name}{_TMP}{uuid.uuid4().hex}"
            self.dir.mkdir(mode=PRIVATE_MODE)  # rule 1: nobody else writes into it
            self._fd: int | None = None
            try:
                self._fd, _ = open_private(str(self.dir), MADE_ADVICE)  # never through a symlink, checked
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocking: an inspect may test it this instant
            except BaseException:
                self.discard()  # rule 5: nothing left behind
                raise

    def _unlock(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def no_room(self, exc: BaseException) -> CheckpointError | None:
        """Rule 8: the error naming ENOSPC where ``exc`` is the disk filling (before :meth:`discard`)."""
        return self.room.error(exc, self.dir, self.path)

    def discard(self) -> None:
        """Rule 5: remove everything this save wrote."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self._unlock()

    def commit(self) -> None:
        """Rules 2, 3 and 7: make the written checkpoint ``path``, atomically, once the reads of
        the one it replaces are done."""
        write_manifest(self.dir, self.storage)
        fsync_path(self.dir)
        while True:
            current = _locked_at(self.path, fcntl.LOCK_EX)  # rule 7: waits for its readers
            try:
                check_replaceable(self.path)
                if self._swap(current is not None):
                    break
            finally:
                if current is not None:
                    os.close(current)  # after the replaced checkpoint is removed
        fsync_path(self.path.parent)
        self._unlock()

    def _swap(self, replacing: bool) -> bool:
        """Rule 3's renames; False where another save committed to ``path`` first (try again)."""
        path, parent = self.path, self.path.parent
        if not replacing:
            try:
                os.rename(self.dir, path)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return False  # a checkpoint appeared there since: replace it instead
                raise
        elif _exchange(self.dir, path):
            fsync_path(parent)
            shutil.rmtree(self.dir, ignore_errors=True)  # the previous checkpoint, swapped out
        else:
            old = parent / f".{path.name}{_OLD}{uuid.uuid4().hex}"
            os.rename(path, old)
            try:
                os.rename(self.dir, path)
            except BaseException:
                os.rename(old, path)  # the previous checkpoint back in place
                raise
            fsync_path(parent)
            shutil.rmtree(old, ignore_errors=True)
        return True


def digest_file(path: Path) -> tuple[int, str]:
    """Size and xxh3-128 digest of ``path``, read in blocks (bounded memory)."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def _tree(directory: Path) -> tuple[list[str], list[Path]]:
    """Every file under ``directory`` (relative, ``/``-separated, sorted) and every folder below it."""
    names: list[str] = []
    folders: list[Path] = []
    for root, dirs, found in os.walk(directory):
        dirs.sort()
        here = Path(root)
        if here != directory:
            folders.append(here)
        names += [(here / name).relative_to(directory).as_posix() for name in found]
    return sorted(names), folders


def write_manifest(directory: Path, storage: str = "dcp") -> None:
    """Rule 4: every file's size and digest (files in folders too: the zarr format's arrays),
    written and synced last, after every folder below ``directory`` (rule 2)."""
    names, folders = _tree(directory)
    files = {}
    for name in names:
        if name != MANIFEST:
            size, digest = digest_file(directory / name)
            files[name] = {"bytes": size, "xxh3_128": digest}
    for folder in folders:
        fsync_path(folder)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "storage": storage, "files": files}
    with open(directory / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def storage_of(directory: Path) -> str:
    """Which storage format the checkpoint at ``directory`` is in, from what is on disk:
    ``"zarr"`` where it is a zarr group (its root ``zarr.json``), else ``"dcp"``."""
    return "zarr" if (directory / ZARR_ROOT).is_file() else "dcp"


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"tiermem checkpoint: {path} {what}. The checkpoint is damaged or incomplete and was not loaded (no weights "
        "were changed); load an earlier checkpoint, or save again from a run that still has its states.",
        str(path),
    )


def _written_by_tiermem(directory: Path) -> str | None:
    """Rule 4: why a directory without a manifest is a tiermem checkpoint (its state file, or
    :data:`MARKER` in its DCP metadata), or None for a plain DCP checkpoint."""
    if (directory / STATE_FILE).exists():
        return f"it holds {STATE_FILE}"
    from torch.distributed.checkpoint import FileSystemReader  # torch only once needed

    try:
        metadata = FileSystemReader(os.fspath(directory)).read_metadata()
    except Exception as exc:  # whatever unpickling a damaged file raises
        raise _damaged(directory / DCP_METADATA, f"cannot be read ({exc!r})") from exc
    if any(key.split(".", 1)[0] == MARKER for key in metadata.state_dict_metadata):
        return f"its {DCP_METADATA} has the {MARKER!r} entry every tiermem save writes"
    return None


def _unverifiable(directory: Path, why: str) -> CheckpointError:
    missing = [name for name in (MANIFEST, STATE_FILE) if not (directory / name).exists()]
    verb = "is" if len(missing) == 1 else "are"
    return CheckpointError(
        f"tiermem checkpoint: {directory} was written by tiermem ({why}), but {' and '.join(missing)} {verb} "
        "missing: tiermem's own files, which hold every file's digest (and the RNG states, loop position and "
        "extra). Without them its files cannot be verified, so it was not loaded (no weights were changed). "
        "Copy the whole checkpoint directory again, every file (hidden ones such as .metadata too: cp -a, "
        "rsync -a), or load an earlier checkpoint.",
        str(directory / MANIFEST),
    )


def verify(directory: Path, only: Collection[str] | None = None) -> bool:
    """Rule 4: check every file (or the files in ``only``) against the manifest; True for a
    tiermem checkpoint, False for a plain DCP one. Raises :class:`CheckpointError` naming the
    first bad file, or what a tiermem checkpoint lacks where its manifest is gone."""
    if not directory.is_dir():
        raise CheckpointError(
            f"tiermem checkpoint: no checkpoint at {directory} (not a directory). Give the path rt.save() wrote.",
            str(directory),
        )
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        if (directory / ZARR_ROOT).is_file():
            raise _unverifiable(directory, f"its {ZARR_ROOT} is the zarr format tiermem writes")
        if not (directory / DCP_METADATA).exists():
            raise _damaged(manifest_path, "is missing")
        why = _written_by_tiermem(directory)
        if why is None:
            return False
        raise _unverifiable(directory, why)
    for name in only or ():
        if not (directory / name).exists():
            raise _damaged(directory / name, "is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _damaged(manifest_path, f"cannot be read ({exc})") from exc
    for name, record in files.items():
        if only is not None and name not in only:
            continue
        file = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise _damaged(manifest_path, f"names {name!r}, outside the checkpoint")
        if not file.exists():
            raise _damaged(file, "is missing")
        size, digest = digest_file(file)
        if size != record["bytes"]:
            raise _damaged(file, f"is {size} bytes but was written with {record['bytes']} (truncated or extended)")
        if digest != record["xxh3_128"]:
            raise _damaged(file, f"does not match its digest (xxh3-128 {digest}, written {record['xxh3_128']})")
    return True


@contextlib.contextmanager
def staged(path: Path, needed: int = 0) -> Iterator[Staging]:
    """A :class:`Staging` (of a save writing at least ``needed`` bytes, rule 8) committed when the
    block succeeds, discarded when it raises, a disk that filled named as such (rule 8)."""
    staging = Staging(path, needed)
    try:
        yield staging
    except BaseException as exc:
        _discard(staging, exc)
        raise
    try:
        staging.commit()
    except BaseException as exc:
        _discard(staging, exc)
        raise


def _discard(staging: Staging, exc: BaseException) -> None:
    """Rules 5 and 8: remove what the save wrote; raise the disk-full error where ``exc`` is one."""
    full = staging.no_room(exc)
    staging.discard()
    if full is not None:
        raise full from exc
