"""Faults on real, really small or read-only filesystems (tmpfs mounts; needs root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest
import torch

import tiermem
from tiermem.errors import DiskFullError, StoragePathError, TiermemWarning


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


def _config(path, capacity: str) -> dict:
    return {
        "device": {"capacity": "64MiB", "device": "cpu"},
        "host": {"capacity": "16MiB"},
        "nvme": {"paths": [str(path)], "capacity": capacity, "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_disk_full_keeps_the_source_and_names_the_path(tmp_path):
    small = tmp_path / "small"
    with _mounted(small, "size=2m"):
        with pytest.warns(TiermemWarning, match="tmpfs"), tiermem.Runtime(_config(small, "32MiB")) as rt:
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
