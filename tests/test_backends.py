"""Storage backends: POSIX system calls, Linux AIO, selection and probing, the fault injector, kvikio."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiermem.errors import BackendUnavailableError
from tiermem.tiers.backends import StorageBackend, aio, kvikio_backend, select_backend
from tiermem.tiers.backends import posix as posix_module
from tiermem.tiers.backends.aio import AioBackend, AioQueue
from tiermem.tiers.backends.base import IoOp, IoQueue
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
    assert isinstance(AioBackend(), StorageBackend)
    assert isinstance(FaultyBackend(PosixBackend()), StorageBackend)


def test_select_posix_and_unknown(tmp_path: Path) -> None:
    backend, reason = select_backend("posix", tmp_path)
    assert backend.name == "posix" and "requested" in reason
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("nfs", tmp_path)


def test_select_auto_logs_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ok, probe_reason = kvikio_backend.probe(tmp_path)
    aio_ok, aio_reason = aio.probe(tmp_path)
    with caplog.at_level(logging.INFO, logger="tiermem.nvme"):
        backend, reason = select_backend("auto", tmp_path)
    assert backend.name == ("kvikio" if ok else "aio" if aio_ok else "posix")
    assert probe_reason in reason
    if not ok:
        assert aio_reason in reason
    assert any(reason in record.getMessage() for record in caplog.records)


def test_select_auto_without_aio_falls_back_to_posix_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvikio_backend, "probe", lambda directory: (False, "kvikio is not installed"))
    monkeypatch.setattr(aio, "probe", lambda directory: (False, "tmpfs at /x refuses O_DIRECT"))
    backend, reason = select_backend("auto", tmp_path)
    assert backend.name == "posix"
    assert "kvikio is not installed" in reason and "tmpfs at /x refuses O_DIRECT" in reason


def test_select_aio_when_unusable_names_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio, "probe", lambda directory: (False, "the kernel refuses AIO: Function not implemented"))
    with pytest.raises(BackendUnavailableError, match="aio") as info:
        select_backend("aio", tmp_path)
    message = str(info.value)
    assert "Function not implemented" in message and str(tmp_path) in message and "posix" in message


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
    faulty = FaultyBackend(
        PosixBackend(),
        enospc_after=100,
        eio_on_read=2,
        short_read_on=3,
        flip_bit_on_read=4,
        fallocate_limit=4096,
        refuse_direct=True,
    )
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


# -- Linux AIO ----------------------------------------------------------------------------------------
@pytest.fixture
def aio_ok(tmp_path: Path) -> None:
    ok, reason = aio.probe(tmp_path)
    if not ok:
        pytest.skip(f"aio unusable here: {reason}")


class _Done:
    """Collects ``IoOp.done`` calls; ``wait(n)`` until n have come."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, OSError | None]] = []
        self._cond = threading.Condition()

    def __call__(self, nbytes: int, error: OSError | None) -> None:
        with self._cond:
            self.calls.append((nbytes, error))
            self._cond.notify_all()

    def wait(self, count: int) -> list[tuple[int, OSError | None]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= count, timeout=30), self.calls
            return list(self.calls)


def _aligned_buffer(nbytes: int) -> torch.Tensor:
    raw = torch.zeros(nbytes + 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    return raw[start : start + nbytes]


@pytest.fixture
def direct_fd(tmp_path: Path) -> Iterator[int]:
    handle = AioBackend().open(str(tmp_path / "d"), direct=True)
    yield handle
    os.close(handle)


@pytest.mark.usefixtures("aio_ok")
def test_aio_probe_is_cached_and_leaves_no_files(tmp_path: Path) -> None:
    ok, reason = aio.probe(tmp_path)
    assert ok and "O_DIRECT" in reason
    assert aio.probe(tmp_path) == (ok, reason)
    assert list(tmp_path.iterdir()) == []


def test_aio_probe_off_linux(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio.sys, "platform", "darwin")
    ok, reason = aio.probe(tmp_path)
    assert not ok and "needs Linux" in reason


@pytest.mark.usefixtures("aio_ok")
def test_aio_queue_round_trip_with_more_ops_than_slots(direct_fd: int) -> None:
    block, count = 16 << 10, 40
    AioBackend().fallocate(direct_fd, 0, block * count)
    src = _aligned_buffer(block * count)
    src.copy_(torch.randint(0, 256, (block * count,), dtype=torch.uint8))
    dst = _aligned_buffer(block * count)
    queue = AioQueue(4)
    assert isinstance(queue, IoQueue)
    try:
        writes = _Done()
        base = src.data_ptr()
        queue.submit([IoOp(True, direct_fd, base + i * block, block, i * block, writes) for i in range(count)])
        assert writes.wait(count) == [(block, None)] * count
        reads = _Done()
        for i in range(count):  # one at a time too
            queue.submit([IoOp(False, direct_fd, dst.data_ptr() + i * block, block, i * block, reads)])
        assert reads.wait(count) == [(block, None)] * count
        assert torch.equal(src, dst)
    finally:
        queue.close()
    queue.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        queue.submit([IoOp(False, direct_fd, dst.data_ptr(), block, 0, reads)])


@pytest.mark.usefixtures("aio_ok")
def test_aio_queue_read_past_end_of_file_reports_what_exists(direct_fd: int) -> None:
    AioBackend().pwrite(direct_fd, _aligned_buffer(4096).numpy(), 0)
    dst = _aligned_buffer(16384)
    queue = AioQueue(2)
    try:
        done = _Done()
        queue.submit([IoOp(False, direct_fd, dst.data_ptr(), 16384, 0, done)])
        assert done.wait(1) == [(4096, None)], "a short read is reported short, for the tier to refuse"
    finally:
        queue.close()


@pytest.mark.usefixtures("aio_ok")
def test_aio_queue_partial_write_is_continued_then_fails(direct_fd: int) -> None:
    # RLIMIT_FSIZE makes the kernel really cut a write short; the queue goes on with the rest,
    # which the kernel refuses (EFBIG): the op fails, it never reports a partial success.
    import resource
    import signal

    src = _aligned_buffer(65536)
    queue = AioQueue(2)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, old_limit[1]))
        done = _Done()
        queue.submit([IoOp(True, direct_fd, src.data_ptr(), 65536, 0, done)])
        ((nbytes, error),) = done.wait(1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
        queue.close()
    assert nbytes == 16384 and error is not None and error.errno == errno.EFBIG
    assert os.fstat(direct_fd).st_size == 16384


@pytest.mark.usefixtures("aio_ok")
def test_aio_queue_reports_refusals_and_kernel_errors(direct_fd: int, tmp_path: Path) -> None:
    buf = _aligned_buffer(8192)
    queue = AioQueue(2)
    try:
        done = _Done()
        closed = AioBackend().open(str(tmp_path / "c"), direct=True)
        os.close(closed)
        queue.submit([IoOp(True, closed, buf.data_ptr(), 4096, 0, done)])  # io_submit refuses: EBADF
        queue.submit([IoOp(True, direct_fd, buf.data_ptr() + 1, 4096, 0, done)])  # O_DIRECT misaligned: EINVAL
        queue.submit([IoOp(True, direct_fd, buf.data_ptr(), 4096, 0, done)])  # and the queue still works
        calls = done.wait(3)
    finally:
        queue.close()
    errors = sorted((c[1].errno if c[1] is not None else 0) for c in calls)
    assert errors == [0, errno.EBADF, errno.EINVAL]


def test_aio_queue_callbacks_that_raise_do_not_stop_it(
    direct_fd: int, aio_ok: None, caplog: pytest.LogCaptureFixture
) -> None:
    buf = _aligned_buffer(4096)
    queue = AioQueue(1)
    done = _Done()

    def bad(nbytes: int, error: OSError | None) -> None:
        raise ValueError("callback bug")

    try:
        with caplog.at_level(logging.ERROR, logger="tiermem.nvme"):
            queue.submit([IoOp(True, direct_fd, buf.data_ptr(), 4096, 0, bad)])
            queue.submit([IoOp(False, direct_fd, buf.data_ptr(), 4096, 0, done)])
            assert done.wait(1) == [(4096, None)]
    finally:
        queue.close()
    assert any("callback raised" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("aio_ok")
def test_faulty_queue_injects_each_fault(direct_fd: int) -> None:
    faulty = FaultyBackend(AioBackend(), enospc_after=3 * 4096, eio_on_read=2, short_read_on=3, flip_bit_on_read=4)
    pattern = bytes(range(256)) * 16
    src = _aligned_buffer(4096)
    src.copy_(torch.frombuffer(bytearray(pattern), dtype=torch.uint8))
    dst = _aligned_buffer(4096)
    queue = faulty.open_queue(2)
    assert queue is not None
    try:
        writes = _Done()
        for i in range(4):  # the 4th write would pass 3 pages: ENOSPC
            queue.submit([IoOp(True, direct_fd, src.data_ptr(), 4096, 4096 * i, writes)])
            writes.wait(i + 1)
        assert [c[0] for c in writes.calls] == [4096, 4096, 4096, 0]
        error = writes.calls[3][1]
        assert error is not None and error.errno == errno.ENOSPC
        reads = _Done()
        for i in range(4):
            queue.submit([IoOp(False, direct_fd, dst.data_ptr(), 4096, 0, reads)])
            reads.wait(i + 1)
            if i == 0:
                assert bytes(dst.numpy()) == pattern
        (ok, eio, short, flipped) = reads.calls
        assert ok == (4096, None) and short == (2048, None) and flipped == (4096, None)
        assert eio[1] is not None and eio[1].errno == errno.EIO
        assert sum(a != b for a, b in zip(bytes(dst.numpy()), pattern, strict=True)) == 1
        assert faulty.faults_injected == 4
    finally:
        queue.close()
    assert FaultyBackend(PosixBackend()).open_queue(2) is None, "no queue to wrap: the tier uses its pool"
