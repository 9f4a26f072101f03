"""Safe on a shared machine (issue 35): the directories tiermem makes or reuses on its own are
private to the user (NOTE [ Private directories ], NOTE [ Run directory rules ] rules 6-8).

Every test points the temp dir at a private one of its own: the real default directory of the
user running the suite is never touched. Planting a directory owned by another user needs root.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import tiermem
from tiermem.checkpoint import files
from tiermem.errors import StoragePathError, UnsafeDirectoryError
from tiermem.planner import cache
from tiermem.planner.profile import BlockStats, Profile
from tiermem.private_dirs import open_private, open_tree
from tiermem.tiers import nvme as nvme_module
from tiermem.tiers.nvme import NvmeTier
from tiermem.tiers.rundir import RUN_PREFIX, RunDirectory, default_parent, sweep_stale

pytestmark = pytest.mark.filterwarnings("ignore::tiermem.errors.TiermemWarning")

NOBODY = 65534
MiB = 1 << 20
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's directory needs root")


@pytest.fixture
def tmpdir_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir of this test's own, world-writable and sticky like /tmp; gettempdir() returns it."""
    root = tmp_path / "tmp"
    root.mkdir()
    root.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def tree(path: Path) -> list[str]:
    """Everything under ``path`` (not following symlinks), relative."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def nvme_tier(paths: list[Path] | list[str], **kwargs: object) -> NvmeTier:
    kwargs.setdefault("backend", "posix")
    kwargs.setdefault("block_size", 64 << 10)
    kwargs.setdefault("queue_depth", 2)
    return NvmeTier(paths, 8 * MiB, **kwargs)  # type: ignore[arg-type]


# -- the default directory ----------------------------------------------------------------------


def test_the_default_is_per_user_and_made_private_when_free(tmpdir_root: Path) -> None:
    default = Path(default_parent())
    assert default == tmpdir_root / f"tiermem-nvme-{os.geteuid()}"
    tier = nvme_tier([])
    try:
        assert default.is_dir() and not default.is_symlink()
        assert oct(default.stat().st_mode & 0o777) == oct(0o700)
        (run,) = tier.run_directories
        assert Path(run).parent == default and oct(Path(run).stat().st_mode & 0o777) == oct(0o700)
        assert oct(Path(tier.data_files[0]).stat().st_mode & 0o777) == oct(0o600)
        allocation = tier.allocate(4096)
        src = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
        tier.write(allocation, 0, src).result()
        dst = torch.zeros(4096, dtype=torch.uint8)
        tier.read(allocation, 0, dst).result()
        assert torch.equal(src, dst)
        tier.free(allocation)
    finally:
        tier.close()
    assert not default.exists(), "the default directory tiermem made is removed once empty"


def test_the_last_runtime_to_leave_the_default_directory_removes_it(tmpdir_root: Path) -> None:
    """Two runs on the default path, the one that made it leaving first: the other, which found
    it, removes it as it leaves (it was left behind, empty)."""
    default = Path(default_parent())
    first = nvme_tier([])
    second = nvme_tier([])
    first.close()
    assert default.is_dir()  # the second run's directory is in it
    second.close()
    assert not default.exists()


@pytest.mark.parametrize("backend", ["posix", "auto"])
def test_a_symlink_planted_at_the_default_path_is_refused(
    tmpdir_root: Path, tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    target.chmod(0o777)
    Path(default_parent()).symlink_to(target)
    probed: list[str] = []
    select = nvme_module.select_backend
    monkeypatch.setattr(nvme_module, "select_backend", lambda name, where: probed.append(where) or select(name, where))
    with pytest.raises(UnsafeDirectoryError) as info:
        nvme_tier([], backend=backend)
    assert probed == [], "refused before a backend probe writes its test file there"
    assert isinstance(info.value, StoragePathError)
    message = str(info.value)
    assert repr(default_parent()) in message and "symbolic link" in message
    assert "owner uid" in message and "mode 0777 (lrwxrwxrwx)" in message and "[nvme] paths" in message
    assert tree(target) == [], "nothing is written through the planted link"
    with pytest.raises(UnsafeDirectoryError):
        RunDirectory.create(default_parent(), create_parent=True)
    assert tree(target) == []


@needs_root
def test_a_default_directory_owned_by_another_user_is_refused(tmpdir_root: Path) -> None:
    default = Path(default_parent())
    default.mkdir(mode=0o700)
    os.chown(default, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectoryError) as info:
        nvme_tier([])
    message = str(info.value)
    assert "owned by another user" in message and f"owner uid {NOBODY}" in message and "mode 0700" in message
    assert "remove it if you did not make it" in message
    assert tree(default) == [] and default.stat().st_uid == NOBODY, "neither used nor repaired"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_group_or_world_writable_default_directory_is_refused(tmpdir_root: Path, mode: int) -> None:
    default = Path(default_parent())
    default.mkdir()
    default.chmod(mode)
    with pytest.raises(UnsafeDirectoryError, match=r"it is writable by (group and others|its group|others)"):
        nvme_tier([])
    assert tree(default) == [] and default.stat().st_mode & 0o777 == mode, "neither used nor repaired (chmod)"


def test_a_runtime_with_the_default_directory_refuses_a_planted_one(tmpdir_root: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    Path(default_parent()).symlink_to(target)
    config = {"device": {"capacity": "64MiB"}, "host": {"capacity": "64MiB"}}
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"), tiermem.Runtime(config):
        pass
    assert tree(target) == []


@needs_root
def test_a_rank_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "nvme"  # configured by the user: trusted as given
    (base / "rank0").mkdir(parents=True)
    os.chown(base / "rank0", NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectoryError, match="rank's directory"):
        nvme_tier([base], subdirectory="rank0")
    assert tree(base / "rank0") == []
    tier = nvme_tier([base], subdirectory="rank1")  # a free rank directory is made, private
    try:
        assert oct((base / "rank1").stat().st_mode & 0o777) == oct(0o700)
    finally:
        tier.close()


def test_a_configured_path_is_trusted_as_given(tmp_path: Path) -> None:
    real = tmp_path / "disk"
    real.mkdir()
    real.chmod(0o1777)  # a shared scratch directory: the user chose it
    link = tmp_path / "link"
    link.symlink_to(real)
    tier = nvme_tier([link])
    try:
        (run,) = tier.run_directories
        assert Path(run).parent == link and Path(run).resolve().parent == real
        assert oct(Path(run).stat().st_mode & 0o777) == oct(0o700)
    finally:
        tier.close()
    assert tree(real) == []


def test_missing_parents_are_made_private_and_a_symlink_is_never_opened_as_one(tmp_path: Path) -> None:
    fd, made = open_tree(str(tmp_path / "a" / "b"), {}, create=True)
    os.close(fd)
    assert made == [str(tmp_path / "a" / "b"), str(tmp_path / "a")]
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o700) for p in (tmp_path / "a", tmp_path / "a" / "b"))
    (tmp_path / "c").symlink_to(tmp_path / "a")
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        open_private(str(tmp_path / "c"), "advice", create=True)


# -- descriptors held for the run's life (rule 7) -----------------------------------------------


def test_a_parent_renamed_mid_run_does_not_change_what_a_later_read_returns(tmp_path: Path) -> None:
    parent = tmp_path / "nvme"
    parent.mkdir()
    tier = nvme_tier([parent])
    allocation = tier.allocate(8192)
    written = torch.full((8192,), 7, dtype=torch.uint8)
    tier.write(allocation, 0, written).result()
    (run,) = tier.run_directories
    name = Path(run).name
    # Someone with write access to the parent's parent moves it away and puts a look-alike in its
    # place, a run directory of the same name with other bytes in its data file.
    moved = tmp_path / "moved"
    parent.rename(moved)
    (parent / name).mkdir(parents=True)
    (parent / name / "data").write_bytes(bytes([9]) * (1 << 20))
    try:
        read = torch.zeros(8192, dtype=torch.uint8)
        tier.read(allocation, 0, read).result()
        assert torch.equal(read, written), "the read followed the renamed path"
        second = tier.allocate(4096)  # a later write too lands in the real file
        tier.write(second, 0, torch.full((4096,), 5, dtype=torch.uint8)).result()
        back = torch.zeros(4096, dtype=torch.uint8)
        tier.read(second, 0, back).result()
        assert torch.equal(back, torch.full((4096,), 5, dtype=torch.uint8))
        assert (parent / name / "data").read_bytes() == bytes([9]) * (1 << 20)
        tier.free(allocation)
        tier.free(second)
    finally:
        tier.close()
    assert tree(moved) == [], "cleanup removed the real run directory, where it is now"
    assert (parent / name / "data").exists(), "and left the look-alike alone"


def test_files_opened_through_the_held_run_directory_follow_it(tmp_path: Path) -> None:
    parent = tmp_path / "nvme"
    parent.mkdir()
    run = RunDirectory.create(parent)
    try:
        name = Path(run.path).name
        parent.rename(tmp_path / "moved")
        (parent / name).mkdir(parents=True)  # a look-alike at the old path
        fd = run.open("state", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(fd, b"mine")
        os.close(fd)
        with open(os.path.join(run.held_path, "state"), "rb") as f:  # the path form, for path-only libraries
            assert f.read() == b"mine"
        assert (tmp_path / "moved" / name / "state").read_bytes() == b"mine"
        assert tree(parent / name) == []
    finally:
        run.cleanup()
    assert tree(tmp_path / "moved") == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_rt_init_backs_parameters_with_files_in_the_held_run_directory(tmp_path: Path) -> None:
    parent = tmp_path / "nvme"
    parent.mkdir()
    config = {
        "device": {"capacity": "64MiB", "device": "cpu"},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [str(parent)], "capacity": "64MiB", "block_size": "64KiB"},
    }
    with tiermem.Runtime(config) as rt:
        before = {p.name for p in parent.iterdir()}
        with rt.init(min_bytes=4096):
            names = {p.name for p in parent.iterdir()} - before
            assert len(names) == 1  # rt.init's own run directory
            moved = tmp_path / "moved"
            parent.rename(moved)
            for name in {*before, *names}:
                (parent / name).mkdir(parents=True)  # look-alikes at the old paths
            weight = torch.ones(1 << 14)  # 64 KiB: on a file-backed page
            with open("/proc/self/maps") as maps:
                backing = [line.split(None, 5)[-1] for line in maps if "init-" in line]
        assert weight.sum().item() == 1 << 14
        assert backing and all(line.startswith(str(moved)) for line in backing), backing
        assert all(tree(parent / name) == [] for name in {*before, *names}), "nothing in the look-alikes"
        del weight


# -- the stale-run sweep (rule 8) -----------------------------------------------------------------


def _dead_run_in(parent: Path) -> Path:
    """A run directory under ``parent`` whose owner died by SIGKILL."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (Python 3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            run = RunDirectory.create(parent, create_parent=True)
            os.write(write_end, run.path.encode())
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        dead = Path(pipe.read().decode())
    os.waitpid(pid, 0)
    assert dead.is_dir() and dead.name.startswith(RUN_PREFIX)
    return dead


def _chown_tree(path: Path, uid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, uid, uid, follow_symlinks=False)


@needs_root
def test_the_sweep_leaves_another_users_stale_run_directory_alone(tmp_path: Path) -> None:
    theirs = _dead_run_in(tmp_path)
    _chown_tree(theirs, NOBODY)
    their_rank = _dead_run_in(tmp_path / "rank1")
    _chown_tree(tmp_path / "rank1", NOBODY)
    mine = _dead_run_in(tmp_path / "rank2")
    assert sweep_stale(tmp_path) == [str(mine)], "only this user's dead run is reclaimed"
    assert theirs.is_dir() and their_rank.is_dir() and (theirs / "lock").exists()
    run = RunDirectory.create(tmp_path / "rank0", create_parent=True)  # a new run's sweep too
    run.cleanup()
    assert theirs.is_dir() and their_rank.is_dir()


def test_the_sweep_never_follows_a_symlink(tmp_path: Path) -> None:
    victim = _dead_run_in(tmp_path / "victim")
    parent = tmp_path / "nvme"
    parent.mkdir()
    (parent / f"{RUN_PREFIX}1-abc").symlink_to(victim)
    (parent / "rank3").symlink_to(tmp_path / "victim")
    assert sweep_stale(parent) == []
    assert victim.is_dir() and (victim / "lock").exists()


# -- the profile cache (NOTE [ Profile cache ] rule 4) -------------------------------------------------


def _profile(key: str) -> Profile:
    return Profile(
        blocks=(),
        outside=BlockStats("outside", 0.001, 0.002, MiB),
        params=(),
        order=(),
        modules=(),
        shared=(),
        links={"device->host": 1e9},
        optimizer_s_per_byte=1e-10,
        key=key,
    )


def test_the_profile_cache_is_made_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cache.load("k" * 32) is None and cache.clear() == 0  # nothing yet, nothing made
    assert not (tmp_path / "cache").exists()
    stored = cache.store(_profile("k" * 32))
    assert stored is not None and cache.load("k" * 32) == _profile("k" * 32)
    for directory in (tmp_path / "cache" / "tiermem", tmp_path / "cache" / "tiermem" / "profiles"):
        assert oct(directory.stat().st_mode & 0o777) == oct(0o700)


def test_a_planted_profile_cache_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target = tmp_path / "elsewhere"
    (target / "profiles").mkdir(parents=True)
    (target / "profiles" / f"{'k' * 32}.json").write_text(_profile("k" * 32).to_json())
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tiermem").symlink_to(target)
    for use in (lambda: cache.load("k" * 32), lambda: cache.store(_profile("j" * 32)), cache.clear):
        with pytest.raises(UnsafeDirectoryError, match="profile cache"):
            use()
    assert tree(target) == ["profiles", f"profiles/{'k' * 32}.json"], "nothing written or removed there"


@needs_root
def test_a_profile_cache_owned_by_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    profiles = tmp_path / "cache" / "tiermem" / "profiles"
    profiles.mkdir(parents=True, mode=0o700)
    os.chown(profiles, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectoryError, match=f"owner uid {NOBODY}"):
        cache.store(_profile("k" * 32))
    assert tree(profiles) == []


# -- checkpoint temporaries (NOTE [ Checkpoint commit rules ] rule 1) ----------------------------------


def test_a_checkpoints_temporary_sibling_is_private(tmp_path: Path) -> None:
    staging = files.Staging(tmp_path / "ckpt")
    try:
        assert staging.dir.parent == tmp_path and not staging.dir.is_symlink()
        assert oct(staging.dir.stat().st_mode & 0o777) == oct(0o700)
    finally:
        staging.discard()
    assert tree(tmp_path) == []


def test_a_checkpoints_temporary_sibling_is_never_made_through_a_planted_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    fixed = uuid.UUID(int=35)
    monkeypatch.setattr(files.uuid, "uuid4", lambda: fixed)
    (tmp_path / f".ckpt.tiermem-tmp-{fixed.hex}").symlink_to(target)  # its name guessed in advance
    with pytest.raises(FileExistsError):
        files.Staging(tmp_path / "ckpt")
    assert tree(target) == []


# -- the layering: a leaf every layer may import ---------------------------------------------------


def test_private_dirs_is_a_leaf() -> None:
    code = (
        "import sys, json, tiermem.private_dirs; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tiermem'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert set(json.loads(out.stdout.strip().splitlines()[-1])) <= {
        "tiermem",
        "tiermem.errors",
        "tiermem.units",
        "tiermem.private_dirs",
    }
