"""A full disk says so (issue 28, item 5): a checkpoint save refused before it writes where the
filesystem is short (NOTE [ Checkpoint commit rules ] rule 8), one whose disk fills during the
write naming ENOSPC, the file and the sizes, an NVMe tier write (DiskFullError) and a profile
cache write (a warning, NOTE [ Profile cache ] rule 5) alike; nothing partial is left and the
previous checkpoint loads and trains on bitwise.

Real small filesystems are tmpfs mounts (root; skipped with the reason where mounting is not
permitted); a fault injected where the disk fills mid-write runs anywhere.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pathlib
import re
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch

import tiermem
import tiermem.checkpoint
from tests.test_checkpoint import assert_bitwise, config, manage, snapshot, train
from tests.test_faults_fs import _mounted
from tests.test_planner import synthetic
from tiermem.checkpoint import room
from tiermem.errors import CheckpointError, DiskFullError, TiermemWarning, describe_os_error
from tiermem.planner import cache
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.base import ALIGNMENT
from tiermem.tiers.nvme import NvmeTier

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

MiB = 1 << 20
NO_SPACE = "ENOSPC (No space left on device)"


def _bytes(message: str, pattern: str) -> int:
    found = re.search(pattern, message)
    assert found, (pattern, message)
    return int(found.group(1))


def _expected(tmp_path: pathlib.Path) -> tuple[list[float], Any]:
    """Two steps, a save, two more: the run without the failed save (losses after the save, states)."""
    with tiermem.Runtime(config(tmp_path, host="1MiB")) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        rt.save(tmp_path / "reference")
        return train(model, optimizer, schedule, range(2, 4)), snapshot(model, optimizer)


def _resumed(tmp_path: pathlib.Path, path: pathlib.Path) -> tuple[list[float], Any]:
    """A fresh runtime and model (another seed) that loads ``path`` and trains the two steps after it."""
    with tiermem.Runtime(config(tmp_path, host="1MiB")) as rt:
        model, optimizer, schedule = manage(rt, seed=1)
        torch.manual_seed(1234)  # the load restores the RNG the dropout draws from
        schedule.load_state_dict(rt.load(path)["schedule"])
        return train(model, optimizer, schedule, range(2, 4)), snapshot(model, optimizer)


def _leftovers(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tiermem-" in p.name)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_save_to_a_filesystem_too_small_is_refused_before_writing_and_training_goes_on(tmp_path):
    small = tmp_path / "small"
    with _mounted(small, "size=1m"), tiermem.Runtime(config(tmp_path, host="1MiB")) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        good = tmp_path / "good"
        rt.save(good, extra={"schedule": schedule.state_dict()})  # where it fits
        for blocking in (True, False):  # an asynchronous save is refused at the call too
            with pytest.raises(CheckpointError) as info:
                rt.save(small / "ckpt", blocking=blocking)
            message = str(info.value)
            assert message.startswith(f"tiermem checkpoint: not enough free space to save {small / 'ckpt'}: ")
            assert info.value.errno == errno.ENOSPC and "No space left on device" in message
            needed = _bytes(message, r"writes at least (\d+) bytes")
            free = _bytes(message, rf"the filesystem holding {re.escape(str(small))} has (\d+) bytes")
            assert free <= MiB < needed
            assert "Nothing was written" in message and "another one" in message
            assert os.listdir(small) == []  # no temporary directory, nothing partial
        losses, states = train(model, optimizer, schedule, range(2, 4)), snapshot(model, optimizer)
    expected_losses, expected = _expected(tmp_path)
    assert losses == expected_losses
    assert_bitwise(states, expected)
    resumed_losses, resumed = _resumed(tmp_path, good)  # the previous checkpoint loads and trains on
    assert resumed_losses == expected_losses
    assert_bitwise(resumed, expected)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("fmt", ["dcp", "zarr"])
def test_a_disk_that_fills_during_the_save_names_enospc_the_file_and_the_sizes(tmp_path, monkeypatch, fmt):
    """The check passes, then another writer takes the room: torch's serializer (DCP) or
    tensorstore (zarr) fails half-way, and the error says the disk filled."""
    small = tmp_path / "small"
    check = room.Room.check

    def then_filled(self: room.Room, path: pathlib.Path) -> None:
        check(self, path)
        with open(small / "other-writer", "wb") as f:  # leaves half of what the save needs
            f.truncate(0)
            f.write(b"\0" * max(room.free_bytes(small) - self.needed // 2, 0))

    path = small / "ckpt"
    with _mounted(small, "size=3m"):
        with tiermem.Runtime(config(tmp_path, host="1MiB")) as rt:
            model, optimizer, schedule = manage(rt)
            train(model, optimizer, schedule, range(2))
            rt.save(path, extra={"schedule": schedule.state_dict()}, format=fmt)  # the previous one, where it fit
            with monkeypatch.context() as patch:
                patch.setattr(room.Room, "check", then_filled)
                with pytest.raises(CheckpointError) as info:
                    rt.save(path, extra={"schedule": "not this one"}, format=fmt)
            message = str(info.value)
            assert message.startswith(f"tiermem checkpoint: saving {path} failed: the disk filled during the write: ")
            assert info.value.errno == errno.ENOSPC
            needed = _bytes(message, rf"{re.escape(NO_SPACE)} writing {re.escape(str(small))}/\S+: (\d+) bytes")
            assert info.value.filename.startswith(str(small / ".ckpt.tiermem-tmp-"))  # the file it was writing
            assert _bytes(message, r"needed, free: (\d+) bytes") < needed // 2
            assert _bytes(message, r"; (\d+) bytes \(\S+\) were free when it began") >= needed
            assert "What it wrote is removed" in message and "another one" in message
            assert sorted(os.listdir(small)) == ["ckpt", "other-writer"]  # staging removed
            os.unlink(small / "other-writer")
            losses, states = train(model, optimizer, schedule, range(2, 4)), snapshot(model, optimizer)
        resumed_losses, resumed = _resumed(tmp_path, path)  # the previous checkpoint is intact
    expected_losses, expected = _expected(tmp_path)
    assert losses == expected_losses == resumed_losses
    assert_bitwise(states, expected)
    assert_bitwise(resumed, expected)


def test_an_enospc_injected_mid_write_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Anywhere (no mount): the state file's write fails with ENOSPC after DCP wrote its files."""
    path = tmp_path / "ckpt"

    def full(directory: pathlib.Path, state: dict[str, Any]) -> None:
        with open(directory / "tiermem-state.pkl", "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "tiermem-state.pkl"))

    with tiermem.Runtime(config(tmp_path, host="1MiB")) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        rt.save(path, extra={"schedule": schedule.state_dict()})
        with monkeypatch.context() as patch, pytest.raises(CheckpointError) as info:
            patch.setattr(tiermem.checkpoint, "_write_state", full)
            rt.save(path, extra={"schedule": "not this one"})
        message = str(info.value)
        assert f"{NO_SPACE} writing {tmp_path}/.ckpt.tiermem-tmp-" in message and "/tiermem-state.pkl: " in message
        assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, OSError)
        assert _bytes(message, r"tiermem-state.pkl: (\d+) bytes") > 4 * 64 * 64  # at least the weights' bytes
        assert _bytes(message, r"free: (\d+) bytes") > 0
        assert _leftovers(tmp_path) == []
        losses = train(model, optimizer, schedule, range(2, 4))
    expected_losses, _ = _expected(tmp_path)
    assert losses == expected_losses
    assert _resumed(tmp_path, path)[0] == expected_losses


def test_a_failure_that_is_not_the_disk_keeps_its_own_words(tmp_path, monkeypatch):
    """Rule 8 names ENOSPC only where the disk filled: torch's "unexpected pos" with room left is
    reported as it was."""
    staged = room.Room(needed=1 << 20)
    directory = tmp_path / "staging"
    directory.mkdir()
    assert staged.error(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                        directory, tmp_path / "ckpt") is None  # fmt: skip
    assert staged.error(KeyboardInterrupt(), directory, tmp_path / "ckpt") is None
    monkeypatch.setattr(room, "free_bytes", lambda path, **kwargs: 4096)  # now the disk is full
    error = staged.error(RuntimeError("unexpected pos 704 vs 598"), directory, tmp_path / "ckpt")
    assert error is not None and NO_SPACE in str(error) and error.errno == errno.ENOSPC


# -- the NVMe tier ---------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.filterwarnings("ignore::tiermem.errors.TiermemWarning")  # an NVMe path on tmpfs
def test_an_nvme_tier_on_a_tiny_filesystem_names_enospc_the_file_and_what_to_do(tmp_path):
    small = tmp_path / "small"
    settings = {
        "device": {"capacity": "64MiB", "device": "cpu"},
        "host": {"capacity": "16MiB"},
        "nvme": {"paths": [str(small)], "capacity": "32MiB", "block_size": "64KiB", "backend": "posix"},
        "scheduler": {"loop": "asyncio"},
    }
    with _mounted(small, "size=1m"):
        with tiermem.Runtime(settings) as rt:
            t = torch.randn(1 << 20)  # 4 MiB
            handle = rt.register(t.clone())
            with pytest.raises(DiskFullError) as info:
                handle.move_to("nvme")
            message = str(info.value)
            assert info.value.errno == errno.ENOSPC and info.value.filename.startswith(str(small))
            assert f"disk full: {NO_SPACE} reserving space in {info.value.filename}: " in message
            assert _bytes(message, r"(\d+) bytes \(\S+\) needed") >= 4 * MiB - 64 * 1024
            assert _bytes(message, r"free: (\d+) bytes") <= MiB
            assert "lower [nvme] capacity" in message and "another filesystem" in message
            assert torch.equal(handle.tensor(), t)  # nothing lost
        assert os.listdir(small) == []  # nothing left behind


def test_an_enospc_from_pwrite_is_the_tiers_disk_full_error(tmp_path):
    backend = FaultyBackend(PosixBackend())
    tier = NvmeTier([str(tmp_path)], 8 * MiB, backend=backend, block_size=64 * 1024, queue_depth=2)
    run_directory = tier.run_directories[0]
    try:
        backend.enospc_after = backend.bytes_written + 64 * 1024  # the second block's write fails
        allocation = tier.allocate(4 * 64 * 1024)
        data = torch.empty(4 * 64 * 1024 + 2 * ALIGNMENT, dtype=torch.uint8)
        start = (-data.data_ptr()) % ALIGNMENT
        with pytest.raises(DiskFullError) as info:
            tier.write(allocation, 0, data[start : start + 4 * 64 * 1024]).result()
        message = str(info.value)
        assert f"{NO_SPACE} writing {tier.data_files[0]}: 65536 bytes (64KiB) needed, free: " in message
        assert _bytes(message, r"free: (\d+) bytes") > 0 and "lower [nvme] capacity" in message
        tier.free(allocation)
    finally:
        tier.close()
    assert not os.path.exists(run_directory)


# -- the profile cache -------------------------------------------------------------------------


def _profile() -> Any:
    return dataclasses.replace(synthetic(2), key="0123456789abcdef0123456789abcdef")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_profile_cache_on_a_full_filesystem_warns_naming_enospc_and_the_path(tmp_path, monkeypatch):
    small = tmp_path / "small"
    with _mounted(small, "size=64k,mode=0700"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(small))
        directory = cache.cache_dir()
        directory.mkdir(parents=True, mode=0o700)
        os.chmod(directory.parent, 0o700)
        with open(small / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:  # fill it up
                f.write(b"\0" * 4096)
        with pytest.warns(TiermemWarning) as caught:
            assert cache.store(_profile()) is None
        message = str(caught[0].message)
        path = directory / f"{_profile().key}.json"
        assert f"the profile was not cached: {NO_SPACE} writing {path}: " in message
        assert _bytes(message, r"(\d+) bytes( \(\S+\))? needed") == len(_profile().to_json().encode())
        assert _bytes(message, r"free: (\d+) bytes") < 4096
        assert "XDG_CACHE_HOME" in message
        assert os.listdir(directory) == []  # no temporary file left
        assert cache.load(_profile().key) is None  # a miss: the next run profiles again


def test_a_failed_profile_cache_write_warns_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Anywhere (no mount): the rename fails with ENOSPC."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def full(src: str, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch, pytest.warns(TiermemWarning, match=re.escape(NO_SPACE)):
        patch.setattr(os, "replace", full)
        assert cache.store(_profile()) is None
    assert os.listdir(cache.cache_dir()) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.store(_profile()) is not None  # with room, it is cached as before


def test_describe_os_error_words_every_errno_the_same_way():
    assert describe_os_error(OSError(errno.EIO, "x"), "/a/b", op="reading") == "EIO (Input/output error) reading /a/b"
    assert (
        describe_os_error(OSError(errno.ENOSPC, "x"), "/a/b", nbytes=3 << 20, free=4096)
        == "ENOSPC (No space left on device) writing /a/b: 3145728 bytes (3MiB) needed, free: 4096 bytes (4KiB)"
    )
    assert describe_os_error(OSError(errno.EDQUOT, "x"), "/q").endswith("writing /q: free: unknown")


_BUILD_ON_A_FULL_DISK = """
import sys, torch, tiermem
settings = {"device": {"capacity": "8MiB", "device": "cpu"}, "host": {"capacity": "8MiB"},
            "nvme": {"paths": [sys.argv[1]], "capacity": "1MiB"}, "scheduler": {"loop": "asyncio"}}
with tiermem.Runtime(settings) as rt:
    try:
        with rt.init():
            torch.nn.Linear(1024, 1024)  # 4 MiB of weight on file-backed pages, on a 1 MiB filesystem
    except tiermem.errors.StorageError as exc:
        print("REFUSED", exc.errno, exc)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_build_under_init_on_a_full_filesystem_is_an_error_not_sigbus(tmp_path):
    """NOTE [ Materialising under rt.init() ] rule 7: the file behind a file-backed parameter is
    reserved before it is mapped, so a full disk is a StorageError naming the bytes and the free
    space. A sparse mapping's first write to a full disk killed the process with SIGBUS (a
    child here, so that the suite survives it)."""
    small = tmp_path / "small"
    with _mounted(small, "size=1m"):
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_ON_A_FULL_DISK, str(small)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert f"REFUSED {errno.ENOSPC} tiermem init: cannot reserve 4MiB for file-backed pages" in done.stdout
        assert "free on that filesystem" in done.stdout and "rule 7" in done.stdout
        assert os.listdir(small) == []  # nothing left behind


_CLOSE_ON_A_FULL_DISK = """
import logging, os, shutil, sys, warnings, torch, tiermem
from tiermem.app.models.gpt import GPT, GPTConfig
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
warnings.simplefilter("ignore")  # the NVMe path is on tmpfs (a test filesystem)
small = sys.argv[1]
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=8, d_model=256, n_head=4, vocab_size=512, seq_len=32))
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
assert nbytes > (6 << 20) + (9 << 20)  # more than the memory tiers hold: they would come back on files
settings = {"device": {"capacity": 6 << 20, "device": "cpu"}, "host": {"capacity": 9 << 20},
            "nvme": {"paths": [small], "capacity": 5 * nbytes, "block_size": "64KiB", "backend": "posix"},
            "scheduler": {"loop": "asyncio"}}
with tiermem.Runtime(settings) as rt:
    model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3,
                                 plan={"state_home": "nvme", "persistent_chunks": 0, "buffers": 3})
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    filler = os.path.join(small, "another-tenant")  # the disk fills while the model trains
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(small).free - nbytes // 2)
os.unlink(filler)
print("UNUSABLE", all(p.device.type == "meta" for p in model.parameters()), sorted(os.listdir(small)))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_leaving_the_runtime_without_disk_for_the_parameters_says_so_and_writes_nothing(tmp_path):
    """Rule 7 at close: parameters larger than the memory tiers come back on file-backed pages
    (rule 6) only where the filesystem has room for all of them; otherwise the model is unusable
    and the warning says why, with the sizes, before a byte is written. In a child: written into
    the full disk's sparse mappings, the hand-back died of SIGBUS."""
    small = tmp_path / "small"
    with _mounted(small, f"size={200 << 20}"):
        done = subprocess.run(
            [sys.executable, "-c", _CLOSE_ON_A_FULL_DISK, str(small)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert "of parameters exceed the memory tiers' capacities" in done.stdout
        assert "free under" in done.stdout and "unusable after the Runtime closed" in done.stdout
        assert "UNUSABLE True []" in done.stdout
