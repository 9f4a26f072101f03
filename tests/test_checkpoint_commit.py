"""NOTE [ Checkpoint commit rules ] rules 2, 3 and 6, each observable (issue 31): a kill test keeps the
page cache (no missing ``fsync`` shows) and almost never lands between two steps of a commit, so
these tests look at the steps themselves through a layer over the filesystem calls of
``tiermem/checkpoint/files.py`` (``os.fsync``, ``os.rename``, the exchange, ``shutil.rmtree``):
the order of syncs and renames is checked against rule 2; the disk as a crash would leave it is
copied before and after every rename, exchange and removal of a commit, and each copy must hold
the previous or the new checkpoint (rule 3); a user's directory made at the path while an
asynchronous save waits to commit is never swapped out (rule 6). docs/ARCHITECTURE.md, "Testing
crash safety", says how."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import tiermem
from tests.test_checkpoint import config, manage, train
from tiermem.checkpoint import files
from tiermem.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def _digests(checkpoint: pathlib.Path) -> dict[str, Any]:
    return json.loads((checkpoint / files.MANIFEST).read_text())["files"]


class CrashImages:
    """Before and after each rename, exchange and removal under ``parent``, a copy of ``parent``:
    what a crash at that instant leaves on disk (rule 2 made it durable; a lock dies with its
    process, and a copy holds none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, parent: pathlib.Path, images: pathlib.Path) -> None:
        self.parent, self.images = parent, images
        self.taken: list[tuple[str, pathlib.Path]] = []
        self._copytree = shutil.copytree
        rename, rmtree, exchange = os.rename, shutil.rmtree, files._exchange
        monkeypatch.setattr(os, "rename", self._around("rename", rename))
        monkeypatch.setattr(shutil, "rmtree", self._around("rmtree", rmtree))
        monkeypatch.setattr(files, "_exchange", self._around("exchange", exchange))

    def _around(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def layer(*args: Any, **kwargs: Any) -> Any:
            ours = pathlib.Path(args[0]).parent == self.parent
            if ours:
                self._take(f"before {name} of {pathlib.Path(args[0]).name}")
            try:
                return call(*args, **kwargs)
            finally:
                if ours:
                    self._take(f"after {name} of {pathlib.Path(args[0]).name}")

        return layer

    def _take(self, label: str) -> None:
        image = self.images / str(len(self.taken))
        self._copytree(self.parent, image, symlinks=True)
        self.taken.append((label, image))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-fallback"])
def test_a_crash_at_any_step_of_a_commit_leaves_the_previous_or_the_new_checkpoint(tmp_path, monkeypatch, exchange):
    """Rule 3: at every step of a commit that replaces a checkpoint (an atomic exchange, or the
    fallback's two renames), the disk holds the previous or the new checkpoint at ``path`` once a
    load or save recovers it: complete, every digest right. Removing the previous one before the
    new one is in place (the gap a random SIGKILL almost never hits) leaves neither."""
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    parent = tmp_path / "checkpoints"
    path = parent / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        rt.save(path, extra="previous")
        previous = _digests(path)
        train(model, optimizer, schedule, range(1))
        images = CrashImages(monkeypatch, parent, tmp_path / "images")
        rt.save(path, extra="new")
        monkeypatch.undo()
        new = _digests(path)
    assert previous != new
    found = []
    for label, image in images.taken:
        at = image / "ckpt"
        files.recover(at)  # what the next load or save of the path does first
        try:
            assert files.verify(at), label
        except CheckpointError as exc:
            pytest.fail(f"a crash {label} leaves no checkpoint at the path: {exc}")
        which = {json.dumps(previous): "previous", json.dumps(new): "new"}.get(json.dumps(_digests(at)))
        assert which is not None, f"a crash {label} leaves another checkpoint at the path"
        found.append(which)
    assert found[0] == "previous" and found[-1] == "new"  # the copies span the whole commit
    assert len(found) >= 4


class SyncLog:
    """Every ``os.fsync`` (by the path of its descriptor), rename and exchange, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str, str]] = []
        fsync, rename, exchange = os.fsync, os.rename, files._exchange

        def logged_fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
            fsync(fd)

        def logged_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            rename(src, dst, *args, **kwargs)
            self.events.append(("rename", os.fspath(src), os.fspath(dst)))

        def logged_exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
            done = exchange(a, b)
            if done:
                self.events.append(("exchange", os.fspath(a), os.fspath(b)))
            return done

        monkeypatch.setattr(os, "fsync", logged_fsync)
        monkeypatch.setattr(os, "rename", logged_rename)
        monkeypatch.setattr(files, "_exchange", logged_exchange)

    def synced(self, path: pathlib.Path, before: int) -> int:
        """The index of ``path``'s last sync before event ``before``, under the name it was
        synced with (DCP syncs ``.metadata.tmp``, then renames it within the directory, whose
        own sync comes later)."""
        names = {str(path)} | {src for op, src, dst in self.events[:before] if op == "rename" and dst == str(path)}
        hits = [i for i, (op, where, _) in enumerate(self.events[:before]) if op == "fsync" and where in names]
        assert hits, f"{path} was not synced before the commit"
        return hits[-1]


@pytest.mark.parametrize("fmt", ["dcp", "zarr"])
def test_every_byte_is_synced_before_the_commit_and_the_rename_after(tmp_path, monkeypatch, fmt):
    """Rule 2, as a recorded order of syncs and renames, for a first save (a rename) and a save
    over it (an exchange): every file (DCP's and ours; tensorstore syncs the zarr arrays'
    itself, out of Python's sight) and every folder synced, the manifest after all of them, the
    directory itself after the manifest, all before the commit; the parent after it."""
    path = pathlib.Path(os.path.realpath(tmp_path)) / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        for extra in ("first", "second"):
            log = SyncLog(monkeypatch)
            rt.save(path, extra=extra, format=fmt)
            monkeypatch.undo()
            commits = [
                i for i, (op, _, dst) in enumerate(log.events) if op in ("rename", "exchange") and dst == str(path)
            ]
            assert len(commits) == 1, log.events
            commit = commits[0]
            staged = pathlib.Path(log.events[commit][1])
            names = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
            ours = {files.MANIFEST, files.STATE_FILE}
            checked = [n for n in names if fmt == "dcp" or str(n) in ours]
            synced = {n: log.synced(staged / n, commit) for n in checked}
            folders = [log.synced(staged / p.relative_to(path), commit) for p in path.rglob("*") if p.is_dir()]
            manifest = synced.pop(pathlib.Path(files.MANIFEST))
            assert all(i < manifest for i in [*synced.values(), *folders]), "the manifest is not synced last"
            assert manifest < log.synced(staged, commit), "the directory is not synced after its manifest"
            after = [i for i, (op, where, _) in enumerate(log.events) if op == "fsync" and where == str(path.parent)]
            assert any(i > commit for i in after), "the parent directory is not synced after the commit"
            train(model, optimizer, schedule, range(1))


@pytest.mark.parametrize("before", ["nothing", "a checkpoint"])
def test_a_directory_made_at_the_path_while_an_async_save_waits_to_commit_is_kept(tmp_path, monkeypatch, before):
    """Rule 6's second check: the path was a checkpoint (or nothing) when ``rt.save(blocking=False)``
    checked it, and a user's directory is there by the time the writer commits: the save is
    refused naming it, the user's files are untouched, and nothing of the save is left."""
    path = tmp_path / "ckpt"
    arrived, go = threading.Event(), threading.Event()
    commit = files.Staging.commit

    def waiting_commit(self: files.Staging) -> None:
        arrived.set()
        go.wait(30)  # a failing test must not hang
        commit(self)

    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        if before == "a checkpoint":
            rt.save(path)
        train(model, optimizer, schedule, range(1))
        monkeypatch.setattr(files.Staging, "commit", waiting_commit)
        pending = rt.save(path, blocking=False)
        deadline = time.monotonic() + 30  # a bound on a hang, not a timing assert
        while not arrived.is_set() and time.monotonic() < deadline:
            pending.done()  # copies what the writer waits for
            time.sleep(0.005)
        assert arrived.is_set(), "the writer never reached its commit"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir()
        (path / "notes.txt").write_text("the user's")
        go.set()
        with pytest.raises(CheckpointError, match="not a tiermem checkpoint"):
            pending.wait()
    assert [p.name for p in path.iterdir()] == ["notes.txt"]
    assert (path / "notes.txt").read_text() == "the user's"
    assert not [p.name for p in tmp_path.iterdir() if ".tiermem-" in p.name]
