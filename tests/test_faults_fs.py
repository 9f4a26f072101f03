"""Faults on real, really small or read-only filesystems (tmpfs and loop-mounted ext4; needs root).

The AIO backend needs O_DIRECT, which tmpfs accepts only since Linux 6.6: it is tested on
tmpfs where the kernel allows it (and asking for it is refused, with the reason, where not),
and on a small ext4 image mounted through a loop device (skipped where none can be made).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import torch

import tiermem
from tiermem.errors import BackendUnavailableError, DiskFullError, StoragePathError, TiermemWarning
from tiermem.tiers.backends import aio


@contextlib.contextmanager
def _mounted(path, options: str) -> Iterator[None]:
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def _mounted_ext4(path, size_mib: int, *, read_only: bool = False) -> Iterator[None]:
    """A fresh ext4 of ``size_mib`` (no journal, so nearly all of it is free) on a loop device."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    image = path.parent / f"{path.name}.img"
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(image)], capture_output=True)
    if made.returncode != 0:
        image.unlink()
        pytest.skip(f"cannot make an ext4 image: {made.stderr.decode().strip()}")
    path.mkdir()
    options = "loop,ro" if read_only else "loop"
    result = subprocess.run(["mount", "-o", options, str(image), str(path)], capture_output=True)
    if result.returncode != 0:
        image.unlink()
        pytest.skip(f"cannot loop-mount an ext4 image here: {result.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)
        image.unlink()


def _config(path, capacity: str, backend: str = "auto") -> dict:
    return {
        "device": {"capacity": "64MiB", "device": "cpu"},
        "host": {"capacity": "16MiB"},
        "nvme": {"paths": [str(path)], "capacity": capacity, "block_size": "64KiB", "backend": backend},
        "scheduler": {"loop": "asyncio"},
    }


def _aio_or_refused(path, backend: str) -> bool:
    """False (after checking that asking for it fails, naming why) where aio cannot run at ``path``."""
    if backend != "aio":
        return True
    ok, reason = aio.probe(path)
    if not ok:
        with pytest.raises(BackendUnavailableError, match="aio") as info:
            tiermem.Runtime(_config(path, "8MiB", backend)).start()
        assert reason in str(info.value) and str(path) in str(info.value)
    return ok


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
@pytest.mark.filterwarnings("ignore::tiermem.errors.TiermemWarning")
@pytest.mark.parametrize("backend", ["auto", "aio", "posix"])
def test_disk_full_keeps_the_source_and_names_the_path(tmp_path, backend):
    small = tmp_path / "small"
    with _mounted(small, "size=2m"):
        if not _aio_or_refused(small, backend):
            return
        with pytest.warns(TiermemWarning, match="tmpfs"), tiermem.Runtime(_config(small, "32MiB", backend)) as rt:
            t = torch.randn(1 << 20)  # 4 MiB: more than the filesystem holds
            handle = rt.register(t.clone())
            # Caught when the tier preallocates room for the move, before any byte is written.
            with pytest.raises(DiskFullError, match=str(small)) as info:
                handle.move_to("nvme")
            assert info.value.errno == 28
            assert rt.stats().as_dict()["tiers"]["nvme"]["current_bytes"] == 0
            assert handle.tier == "device"
            assert torch.equal(handle.tensor(), t)  # nothing lost
            small_handle = rt.store(torch.arange(1000), "nvme")  # what fits still works
            small_handle.wait()
            assert torch.equal(small_handle.tensor(), torch.arange(1000))
        assert os.listdir(small) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
@pytest.mark.filterwarnings("ignore::tiermem.errors.TiermemWarning")
def test_read_only_filesystem_is_refused_at_start(tmp_path):
    ro = tmp_path / "ro"
    with _mounted(ro, "size=1m,ro"), pytest.raises(StoragePathError, match=str(ro)):
        tiermem.Runtime(_config(ro, "8MiB")).start()


def test_missing_path_is_refused_with_the_path_named(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(StoragePathError, match="does-not-exist"):
        tiermem.Runtime(_config(missing, "8MiB")).start()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
@pytest.mark.parametrize("backend", ["aio", "posix"])
def test_disk_full_on_ext4_keeps_the_source_and_names_the_path(tmp_path, backend):
    small = tmp_path / "small"
    with _mounted_ext4(small, 8):
        if not _aio_or_refused(small, backend):
            return
        with tiermem.Runtime(_config(small, "64MiB", backend)) as rt:
            assert rt.stats().as_dict()  # started
            t = torch.randn(4 << 20)  # 16 MiB: more than the filesystem holds
            handle = rt.register(t.clone())
            with pytest.raises(DiskFullError, match=str(small)) as info:
                handle.move_to("nvme")
            assert info.value.errno == 28
            assert rt.stats().as_dict()["tiers"]["nvme"]["current_bytes"] == 0
            assert handle.tier == "device"
            assert torch.equal(handle.tensor(), t)  # nothing lost
            # What fits still works, through the backend asked for.
            data = torch.randn(300_000)
            small_handle = rt.store(data.clone(), "nvme")
            small_handle.wait()
            assert torch.equal(small_handle.tensor(), data)
        assert sorted(os.listdir(small)) == ["lost+found"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
@pytest.mark.parametrize("backend", ["aio", "posix"])
def test_read_only_ext4_is_refused_at_start(tmp_path, backend):
    ro = tmp_path / "ro"
    with _mounted_ext4(ro, 4, read_only=True), pytest.raises((StoragePathError, BackendUnavailableError)) as info:
        tiermem.Runtime(_config(ro, "8MiB", backend)).start()
    assert str(ro) in str(info.value)
