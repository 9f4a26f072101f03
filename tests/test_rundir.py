"""Run directories: private per runtime, swept when their owner died, never touched by forks."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from tiermem.tiers import rundir as rundir_module
from tiermem.tiers.rundir import RUN_PREFIX, RunDirectory, sweep_stale


def fork(child: Callable[[], int]) -> int:
    """Run ``child`` in a forked process that always leaves through ``os._exit``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (Python 3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    return pid


def exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def lock_is_held(path: str) -> bool:
    fd = os.open(os.path.join(path, "lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_create_and_cleanup(tmp_path: Path) -> None:
    run = RunDirectory.create(tmp_path)
    name = os.path.basename(run.path)
    assert name.startswith(f"{RUN_PREFIX}{os.getpid()}-")
    assert os.path.isdir(run.path) and run.owner
    assert oct(os.stat(run.path).st_mode & 0o777) == oct(0o700)
    assert lock_is_held(run.path)
    Path(run.path, "data").write_bytes(b"x" * 100)
    run.cleanup()
    run.cleanup()  # idempotent
    assert os.listdir(tmp_path) == []
    assert not run.owner


def test_two_run_directories_on_one_parent(tmp_path: Path) -> None:
    a = RunDirectory.create(tmp_path)
    b = RunDirectory.create(tmp_path)  # its sweep must not take a's (held) directory
    assert a.path != b.path and os.path.isdir(a.path) and os.path.isdir(b.path)
    assert sweep_stale(tmp_path) == []
    a.cleanup()
    assert os.path.isdir(b.path)
    b.cleanup()
    assert os.listdir(tmp_path) == []


def test_sigkilled_owner_is_swept(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()

    def child() -> int:
        os.close(read_end)
        run = RunDirectory.create(tmp_path)
        os.write(write_end, run.path.encode())
        os.kill(os.getpid(), signal.SIGKILL)
        return 3  # not reached

    pid = fork(child)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        dead_path = pipe.read().decode()
    assert exit_code(pid) == -signal.SIGKILL
    assert os.path.isdir(dead_path), "SIGKILL skips every cleanup: the directory is left behind"
    assert not lock_is_held(dead_path), "the kernel released the dead owner's flock"
    run = RunDirectory.create(tmp_path)
    try:
        assert not os.path.exists(dead_path), "the next create's sweep removes a dead owner's directory"
        assert os.listdir(tmp_path) == [os.path.basename(run.path)]
    finally:
        run.cleanup()


def test_live_directory_of_another_process_is_kept(tmp_path: Path) -> None:
    path_r, path_w = os.pipe()
    go_r, go_w = os.pipe()

    def child() -> int:
        os.close(path_r)
        os.close(go_w)
        run = RunDirectory.create(tmp_path)
        os.write(path_w, run.path.encode())
        os.close(path_w)
        os.read(go_r, 1)  # wait until the parent has swept
        alive = os.path.isdir(run.path)
        run.cleanup()
        return 0 if alive else 4

    pid = fork(child)
    os.close(path_w)
    os.close(go_r)
    try:
        with os.fdopen(path_r, "rb") as pipe:
            live_path = pipe.read().decode()
        mine = RunDirectory.create(tmp_path)
        assert os.path.isdir(live_path), "a live owner's directory was swept"
        assert sweep_stale(tmp_path) == []
        mine.cleanup()
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
    assert exit_code(pid) == 0
    assert not os.path.exists(live_path)


def test_forked_child_cleanup_leaves_parent_directory(tmp_path: Path) -> None:
    # TRAPS 12: DataLoader workers fork; their cleanup must be a no-op.
    run = RunDirectory.create(tmp_path)

    def child() -> int:
        if run.owner:
            return 5
        run.cleanup()
        return 0

    assert exit_code(fork(child)) == 0
    assert os.path.isdir(run.path)
    assert lock_is_held(run.path), "the child closing its copy of the lock fd must not unlock the parent"
    run.cleanup()
    assert not os.path.exists(run.path)


def test_forked_child_exiting_normally_keeps_parent_directory(tmp_path: Path) -> None:
    # A child that leaves through the normal interpreter exit runs atexit finalizers; those must
    # not remove the parent's directory either. Run in a fresh interpreter: a forked pytest would
    # run pytest's own exit handlers.
    script = textwrap.dedent(
        f"""
        import os, sys
        from tiermem.tiers.rundir import RunDirectory
        run = RunDirectory.create({str(tmp_path)!r})
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # normal exit: atexit handlers run in the child
        os.waitpid(pid, 0)
        print("alive" if os.path.isdir(run.path) else "gone", run.path)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    state, path = done.stdout.split()
    assert state == "alive", "a forked child's exit removed the parent's run directory"
    assert not os.path.exists(path), "normal interpreter exit removes the run directory"
    assert os.listdir(tmp_path) == []


def test_garbage_collected_directory_is_removed(tmp_path: Path) -> None:
    gc.disable()  # no reference cycle may be needed to free it
    try:
        run = RunDirectory.create(tmp_path)
        path = run.path
        del run
        assert not os.path.exists(path)
    finally:
        gc.enable()


def test_stale_temporary_directories(tmp_path: Path) -> None:
    old_new = tmp_path / ".tiermem-new-abc"
    old_dead = tmp_path / ".tiermem-dead-abc"
    young_new = tmp_path / ".tiermem-new-young"
    unrelated = tmp_path / "user-data"
    for d in (old_new, old_dead, young_new, unrelated):
        d.mkdir()
        (d / "file").write_bytes(b"x")
    past = time.time() - rundir_module.STALE_TEMP_AGE_S - 60
    for d in (old_new, old_dead, unrelated):
        os.utime(d, (past, past))
    removed = sweep_stale(tmp_path)
    assert sorted(removed) == sorted([str(old_new), str(old_dead)])
    assert young_new.is_dir() and unrelated.is_dir()


def test_parent_created_on_demand_is_removed_when_empty(tmp_path: Path) -> None:
    parent = tmp_path / "tiermem"
    run = RunDirectory.create(parent, create_parent=True)
    assert parent.is_dir()
    run.cleanup()
    assert not parent.exists(), "the parent tiermem created is removed once empty"

    existing = tmp_path / "mine"
    existing.mkdir()
    run = RunDirectory.create(existing, create_parent=True)
    run.cleanup()
    assert existing.is_dir(), "a directory the user made is never removed"

    with pytest.raises(FileNotFoundError):
        RunDirectory.create(tmp_path / "absent")


def test_parent_kept_while_another_run_uses_it(tmp_path: Path) -> None:
    parent = tmp_path / "tiermem"
    first = RunDirectory.create(parent, create_parent=True)
    second = RunDirectory.create(parent, create_parent=True)
    first.cleanup()
    assert Path(second.path).is_dir()
    second.cleanup()
    with contextlib.suppress(OSError):
        parent.rmdir()
    assert not parent.exists() or list(parent.iterdir()) == []


# -- rank directories (NOTE [ Run directory rules ] rule 5) ----------------------------------------


def _dead_run_in(parent: Path) -> str:
    """A run directory under ``parent`` whose owner died by SIGKILL."""
    read_end, write_end = os.pipe()

    def child() -> int:
        os.close(read_end)
        run = RunDirectory.create(parent, create_parent=True)
        os.write(write_end, run.path.encode())
        os.kill(os.getpid(), signal.SIGKILL)
        return 3  # not reached

    pid = fork(child)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        dead = pipe.read().decode()
    assert exit_code(pid) == -signal.SIGKILL and os.path.isdir(dead)
    return dead


def test_rank_directory_names() -> None:
    assert rundir_module.rank_directory_name(0) == "rank0"
    assert rundir_module.rank_directory_name(12) == "rank12"
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError, match="a rank is a non-negative integer"):
            rundir_module.rank_directory_name(bad)  # type: ignore[arg-type]


def test_sweeping_a_parent_reclaims_dead_ranks_and_keeps_the_rest(tmp_path: Path) -> None:
    live = RunDirectory.create(tmp_path / "rank1", create_parent=True)
    dead = _dead_run_in(tmp_path / "rank3")
    (tmp_path / "rank2").mkdir()  # empty, with no dead run in it: not the sweep's to remove
    (tmp_path / "rank07").mkdir()  # not a rank directory's name
    dead_in_other = _dead_run_in(tmp_path / "rank07")
    try:
        assert sweep_stale(tmp_path) == [dead]
        assert not (tmp_path / "rank3").exists(), "the dead rank's emptied directory is removed"
        assert os.path.isdir(live.path) and (tmp_path / "rank2").is_dir() and os.path.isdir(dead_in_other)
    finally:
        live.cleanup()
    assert not (tmp_path / "rank1").exists(), "the rank directory its run made is removed when empty"


def test_a_run_in_a_rank_directory_sweeps_its_sibling_ranks(tmp_path: Path) -> None:
    dead_rank1 = _dead_run_in(tmp_path / "rank1")
    dead_top = _dead_run_in(tmp_path)
    run = RunDirectory.create(tmp_path / "rank0", create_parent=True)
    try:
        assert not os.path.exists(dead_rank1) and not (tmp_path / "rank1").exists()
        assert not os.path.exists(dead_top), "a dead one-process run on the same path is reclaimed too"
    finally:
        run.cleanup()
    assert list(tmp_path.iterdir()) == []


def test_parents_made_on_demand_are_removed_innermost_first(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    run = RunDirectory.create(tmp_path / "a" / "b" / "rank0", create_parent=True)
    assert (tmp_path / "a" / "b" / "rank0").is_dir()
    run.cleanup()
    assert (tmp_path / "a").is_dir() and list((tmp_path / "a").iterdir()) == [], "only what tiermem made goes"
