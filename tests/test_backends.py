"""Storage backends: POSIX system calls, selection and probing, the fault injector, kvikio."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiermem.errors import BackendUnavailableError
from tiermem.tiers.backends import StorageBackend, kvikio_backend, select_backend
from tiermem.tiers.backends import posix as posix_module
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend

pytestmark = pytest.mark.filterwarnings("ignore::tiermem.errors.TiermemWarning")


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    backend = PosixBackend()
    handle = backend.open(str(tmp_path / "f"), direct=False)
    yield handle
    backend.close(handle)


def test_posix_round_trip_and_short_read_at_eof(fd: int) -> None:
    backend = PosixBackend()
    data = bytes(range(256)) * 40
    assert backend.pwrite(fd, data, 100) == len(data)
    back = bytearray(len(data))
    assert backend.pread(fd, back, 100) == len(data)
    assert bytes(back) == data
    tail = bytearray(1000)
    assert backend.pread(fd, tail, 100 + len(data) - 10) == 10, "a read past the end returns what exists"


def test_posix_fallocate_and_fdatasync(fd: int) -> None:
    backend = PosixBackend()
    backend.fallocate(fd, 0, 1 << 20)
    assert os.fstat(fd).st_size == 1 << 20
    backend.fallocate(fd, 0, 0)  # no-op
    backend.fdatasync(fd)


def test_posix_loops_on_partial_transfers(fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def small_pwritev(handle: int, buffers: list[Any], offset: int) -> int:
        return real_pwritev(handle, [memoryview(buffers[0])[:7]], offset)

    def small_preadv(handle: int, buffers: list[Any], offset: int) -> int:
        return real_preadv(handle, [memoryview(buffers[0])[:5]], offset)

    monkeypatch.setattr(posix_module.os, "pwritev", small_pwritev)
    monkeypatch.setattr(posix_module.os, "preadv", small_preadv)
    backend = PosixBackend()
    data = os.urandom(1000)
    assert backend.pwrite(fd, data, 0) == 1000
    back = bytearray(1000)
    assert backend.pread(fd, back, 0) == 1000
    assert bytes(back) == data


def test_posix_write_without_progress_is_an_error(fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(posix_module.os, "pwritev", lambda *args: 0)
    with pytest.raises(OSError) as info:
        PosixBackend().pwrite(fd, b"abc", 0)
    assert info.value.errno == errno.EIO


def test_posix_accepts_torch_memory(fd: int) -> None:
    backend = PosixBackend()
    src = torch.arange(100, dtype=torch.uint8)
    backend.pwrite(fd, src.numpy(), 0)
    dst = torch.zeros(100, dtype=torch.uint8)
    backend.pread(fd, dst.numpy(), 0)
    assert torch.equal(src, dst)


def test_backends_satisfy_the_protocol() -> None:
    assert isinstance(PosixBackend(), StorageBackend)
    assert isinstance(FaultyBackend(PosixBackend()), StorageBackend)


def test_select_posix_and_unknown(tmp_path: Path) -> None:
    backend, reason = select_backend("posix", tmp_path)
    assert backend.name == "posix" and "requested" in reason
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("nfs", tmp_path)


def test_select_auto_logs_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ok, probe_reason = kvikio_backend.probe(tmp_path)
    with caplog.at_level(logging.INFO, logger="tiermem.nvme"):
        backend, reason = select_backend("auto", tmp_path)
    assert backend.name == ("kvikio" if ok else "posix")
    assert probe_reason in reason
    assert any(reason in record.getMessage() for record in caplog.records)


def test_select_kvikio_when_unusable_names_the_reason(tmp_path: Path) -> None:
    ok, reason = kvikio_backend.probe(tmp_path)
    if ok:
        pytest.skip("kvikio works here")
    with pytest.raises(BackendUnavailableError, match="kvikio") as info:
        select_backend("kvikio", tmp_path)
    assert reason in str(info.value)


def test_kvikio_probe_without_kvikio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvikio_backend.importlib.util, "find_spec", lambda name: None)
    assert kvikio_backend.probe(tmp_path) == (False, "kvikio is not installed")


# -- fault injector -------------------------------------------------------------------------------
def test_faulty_injects_each_fault(tmp_path: Path) -> None:
    faulty = FaultyBackend(PosixBackend(), enospc_after=100, eio_on_read=2, short_read_on=3,
                           flip_bit_on_read=4, fallocate_limit=4096, refuse_direct=True)
    assert faulty.name == "faulty(posix)"
    with pytest.raises(OSError) as info:
        faulty.open(str(tmp_path / "f"), direct=True)
    assert info.value.errno == errno.EINVAL
    handle = faulty.open(str(tmp_path / "f"), direct=False)
    try:
        with pytest.raises(OSError) as info:
            faulty.fallocate(handle, 0, 8192)
        assert info.value.errno == errno.ENOSPC
        faulty.fallocate(handle, 0, 4096)
        data = bytes(range(64))
        assert faulty.pwrite(handle, data, 0) == 64
        with pytest.raises(OSError) as info:
            faulty.pwrite(handle, data, 64)  # 128 > 100 bytes
        assert info.value.errno == errno.ENOSPC
        buf = bytearray(64)
        assert faulty.pread(handle, buf, 0) == 64 and bytes(buf) == data  # read 1: clean
        with pytest.raises(OSError) as info:
            faulty.pread(handle, buf, 0)  # read 2: EIO
        assert info.value.errno == errno.EIO
        assert faulty.pread(handle, buf, 0) == 32  # read 3: short
        assert faulty.pread(handle, buf, 0) == 64  # read 4: silently flipped
        assert bytes(buf) != data and sum(a != b for a, b in zip(buf, data, strict=True)) == 1
        assert faulty.faults_injected == 6
    finally:
        faulty.close(handle)


# -- kvikio (only where it can really run) ------------------------------------------------------------
@pytest.fixture
def kvikio_ok(tmp_path: Path) -> None:
    ok, reason = kvikio_backend.probe(tmp_path)
    if not ok:
        pytest.skip(f"kvikio unusable: {reason}")


@pytest.mark.usefixtures("kvikio_ok")
def test_kvikio_backend_round_trip(tmp_path: Path) -> None:
    backend = kvikio_backend.KvikioBackend()
    handle = backend.open(str(tmp_path / "k"), direct=True)
    try:
        backend.fallocate(handle, 0, 1 << 20)
        src = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
        assert backend.pwrite(handle, src.numpy(), 4096) == 10_000
        dst = torch.zeros(10_000, dtype=torch.uint8)
        assert backend.pread(handle, dst.numpy(), 4096) == 10_000
        assert torch.equal(src, dst)
        backend.fdatasync(handle)
    finally:
        backend.close(handle)


@pytest.mark.usefixtures("kvikio_ok")
def test_nvme_tier_on_kvikio(tmp_path: Path) -> None:
    from tiermem.tiers.nvme import NvmeTier

    tier = NvmeTier([tmp_path], 16 << 20, backend="kvikio", block_size=1 << 16, queue_depth=4, checksum=True)
    try:
        assert tier.describe()["backend"] == "kvikio"
        allocation = tier.allocate(200_001)
        src = torch.randint(0, 256, (200_001,), dtype=torch.uint8)
        tier.write(allocation, 0, src).result()
        dst = torch.zeros_like(src)
        tier.read(allocation, 0, dst).result()
        assert torch.equal(src, dst)
    finally:
        tier.close()
