"""NvmeTier: round trips, striping, alignment paths, accounting, faults, lifecycle."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiermem.errors import (
    ChecksumError,
    DiskFullError,
    RuntimeClosedError,
    ShortReadError,
    StorageIOError,
    StoragePathError,
    TierCapacityError,
    TiermemWarning,
    UnverifiedReadError,
)
from tiermem.tiers.backends import aio
from tiermem.tiers.backends.aio import AioBackend
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.base import ALIGNMENT
from tiermem.tiers.fsinfo import filesystem_of
from tiermem.tiers.nvme import NvmeTier

# tmp_path may itself be on tmpfs on some CI machines; the tmpfs warning has its own test.
pytestmark = pytest.mark.filterwarnings("ignore::tiermem.errors.TiermemWarning")

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB


def aligned(n: int, *, shift: int = 0, seed: int = 0) -> torch.Tensor:
    """``n`` random bytes in a tensor starting ``shift`` bytes past a 4096 boundary."""
    raw = torch.empty(n + 2 * ALIGNMENT, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGNMENT + shift
    out = raw[start : start + n]
    gen = torch.Generator().manual_seed(seed)
    out.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
    return out


def empty_like_aligned(n: int, *, shift: int = 0) -> torch.Tensor:
    raw = torch.zeros(n + 2 * ALIGNMENT, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGNMENT + shift
    return raw[start : start + n]


@pytest.fixture(params=["posix", "aio"])
def backend_name(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Both POSIX backends: the worker pool only, and AIO's kernel queue (skipped where the
    kernel or the filesystem of tmp_path refuses AIO with O_DIRECT)."""
    if request.param == "aio":
        ok, reason = aio.probe(tmp_path)
        if not ok:
            pytest.skip(f"aio unusable here: {reason}")
    return str(request.param)


def make_backend(name: str) -> PosixBackend:
    return AioBackend() if name == "aio" else PosixBackend()


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., NvmeTier]]:
    tiers: list[NvmeTier] = []

    def make(npaths: int = 1, capacity: int = 64 * MiB, **kwargs: Any) -> NvmeTier:
        paths = []
        for i in range(npaths):
            p = tmp_path / f"p{len(tiers)}_{i}"
            p.mkdir()
            paths.append(p)
        kwargs.setdefault("block_size", BLOCK)
        kwargs.setdefault("queue_depth", 8)
        kwargs.setdefault("backend", "posix")
        tier = NvmeTier(paths, capacity, **kwargs)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def direct_supported(tier: NvmeTier) -> bool:
    return bool(tier.describe()["direct"])


def round_trip(tier: NvmeTier, n: int, *, shift: int = 0, seed: int = 0) -> None:
    allocation = tier.allocate(n)
    src = aligned(n, shift=shift, seed=seed)
    tier.write(allocation, 0, src).result()
    dst = empty_like_aligned(n, shift=shift)
    tier.read(allocation, 0, dst).result()
    assert torch.equal(src, dst), f"round trip of {n} bytes (shift {shift}) changed the data"
    tier.free(allocation)


SIZES = [1, 4095, 4096, BLOCK - 1, BLOCK, BLOCK + 1, 3 * MiB + 123]


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("direct", ["auto", False])
def test_round_trip_sizes(
    make_tier: Callable[..., NvmeTier], backend_name: str, checksum: bool, direct: bool | str
) -> None:
    tier = make_tier(checksum=checksum, direct=direct, backend=backend_name)
    for n in SIZES:
        for shift in (0, 100):
            round_trip(tier, n, shift=shift, seed=n + shift)
    stats = tier.statistics()
    assert stats.current_bytes == 0 and stats.allocations == 0
    assert stats.bytes_written == stats.bytes_read == 2 * sum(SIZES)


def test_zero_copy_for_aligned_buffers_and_bounce_for_unaligned(
    make_tier: Callable[..., NvmeTier], backend_name: str
) -> None:
    tier = make_tier(direct="auto", backend=backend_name)
    if not direct_supported(tier):
        pytest.skip(f"no O_DIRECT here: {tier.describe()['direct_reason']}")
    assert tier.describe()["direct_reason"] == "O_DIRECT"
    allocation = tier.allocate(2 * BLOCK)
    src = aligned(2 * BLOCK)
    tier.write(allocation, 0, src).result()
    dst = empty_like_aligned(2 * BLOCK)
    tier.read(allocation, 0, dst).result()
    assert torch.equal(src, dst)
    assert tier.segment_counts() == {"zero_copy": 4, "staged": 0, "read_modify_write": 0}

    # An unaligned slice (torch tensors are only 64-byte aligned) goes through a bounce buffer.
    src2 = aligned(BLOCK + 10, shift=64)
    tier.write(allocation, 0, src2).result()
    dst2 = empty_like_aligned(BLOCK + 10, shift=64)
    tier.read(allocation, 0, dst2).result()
    assert torch.equal(src2, dst2)
    counts = tier.segment_counts()
    assert counts["zero_copy"] == 4 and counts["staged"] == 4
    # The partial page after BLOCK+10 holds live bytes (nbytes is 2*BLOCK): it is read and
    # patched (read-modify-write), not clobbered with padding.
    assert counts["read_modify_write"] == 1
    tail = empty_like_aligned(BLOCK - 10)
    tier.read(allocation, BLOCK + 10, tail).result()
    assert torch.equal(tail, src[BLOCK + 10 :]), "read-modify-write clobbered bytes after the write"


def test_buffered_mode_is_zero_copy_even_unaligned(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(direct=False)
    assert tier.describe()["direct"] is False
    round_trip(tier, BLOCK + 7, shift=3)
    assert tier.segment_counts()["staged"] == 0


def test_striping_over_two_paths(make_tier: Callable[..., NvmeTier], backend_name: str) -> None:
    tier = make_tier(npaths=2, direct="auto", backend=backend_name)
    n = 5 * BLOCK + 1000
    allocation = tier.allocate(n)
    assert allocation.location == 0
    src = aligned(n)
    tier.write(allocation, 0, src).result()
    tier.sync().result()
    files = [Path(p).read_bytes() for p in tier.data_files]
    assert len(files) == 2
    for unit in range(6):
        start = unit * BLOCK
        length = min(BLOCK, n - start)
        file, file_offset = unit % 2, (unit // 2) * BLOCK
        expect = src[start : start + length].numpy().tobytes()
        assert files[file][file_offset : file_offset + length] == expect, f"stripe unit {unit} misplaced"
    dst = empty_like_aligned(n)
    tier.read(allocation, 0, dst).result()
    assert torch.equal(src, dst)


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("direct", ["auto", False])
def test_write_and_read_at_offsets(
    make_tier: Callable[..., NvmeTier], backend_name: str, checksum: bool, direct: bool | str
) -> None:
    tier = make_tier(checksum=checksum, direct=direct, backend=backend_name)
    n = 3 * BLOCK + 500
    allocation = tier.allocate(n)
    expect = aligned(n, seed=1)
    tier.write(allocation, 0, expect).result()
    for offset, length, seed in [(12345, 70000, 2), (4096, 4096, 3), (BLOCK - 3, 6, 4), (n - 17, 17, 5)]:
        patch = aligned(length, shift=offset % 64, seed=seed)
        tier.write(allocation, offset, patch).result()
        expect[offset : offset + length] = patch
    whole = empty_like_aligned(n)
    tier.read(allocation, 0, whole).result()
    assert torch.equal(whole, expect)
    for offset, length in [(1, 1), (BLOCK - 100, 300), (2 * BLOCK, BLOCK + 500), (12345, 70000)]:
        part = empty_like_aligned(length, shift=7)
        tier.read(allocation, offset, part).result()
        assert torch.equal(part, expect[offset : offset + length]), f"read [{offset}, +{length})"


def test_many_concurrent_requests(make_tier: Callable[..., NvmeTier], backend_name: str) -> None:
    tier = make_tier(npaths=2, queue_depth=8, checksum=True, backend=backend_name)
    gen = torch.Generator().manual_seed(7)
    sizes = [int(s) for s in torch.randint(1, 3 * BLOCK, (48,), generator=gen)]
    allocations = [tier.allocate(s) for s in sizes]
    sources = [aligned(s, shift=(i % 3) * 64, seed=i) for i, s in enumerate(sizes)]
    futures = [tier.write(a, 0, s) for a, s in zip(allocations, sources, strict=True)]
    for f in futures:
        f.result()
    targets = [empty_like_aligned(s) for s in sizes]
    futures = [tier.read(a, 0, t) for a, t in zip(allocations, targets, strict=True)]
    for f in futures:
        f.result()
    for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
        assert torch.equal(s, t), f"request {i} of {sizes[i]} bytes"
    for a in allocations:
        tier.free(a)
    assert tier.statistics().current_bytes == 0


@pytest.mark.parametrize("direct", ["auto", False])
def test_concurrent_disjoint_writes_and_reads_in_one_allocation(
    make_tier: Callable[..., NvmeTier], direct: bool | str
) -> None:
    # Disjoint, unaligned pieces of one allocation written and read at the same time: they
    # share pages (read-modify-write) and checksum records (merged), and neither may clobber
    # the other nor verify against the other's stale sum.
    tier = make_tier(checksum=True, direct=direct, block_size=16 * KiB)
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        n = 200_000 + seed
        allocation = tier.allocate(n)
        model = aligned(n, seed=100 + seed)
        tier.write(allocation, 0, model.clone()).result()
        cuts = sorted(set(int(c) for c in torch.randint(1, n, (40,), generator=gen)))
        futures, reads = [], []
        for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, n], strict=True)):
            if i % 2:
                src = aligned(hi - lo, shift=64 * (i % 3), seed=1000 * seed + i)
                model[lo:hi] = src
                futures.append(tier.write(allocation, lo, src))
            else:
                dst = empty_like_aligned(hi - lo, shift=64 * (i % 3))
                reads.append((lo, hi, dst, model[lo:hi].clone()))
                futures.append(tier.read(allocation, lo, dst))
        for f in futures:
            f.result()
        for lo, hi, dst, expect in reads:
            assert torch.equal(dst, expect), f"concurrent read [{lo}, {hi})"
        whole = empty_like_aligned(n)
        tier.read(allocation, 0, whole).result()
        assert torch.equal(whole, model)
        tier.free(allocation)


def test_accounting_and_extent_reuse(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(capacity=1 * MiB)
    first = [tier.allocate(10_000) for _ in range(4)]
    assert tier.statistics().current_bytes == 4 * 12288
    assert [a.location for a in first] == [0, 12288, 24576, 36864]
    for a in first:
        tier.free(a)
    stats = tier.statistics()
    assert stats.current_bytes == 0 and stats.allocations == 0 and stats.peak_bytes == 4 * 12288
    again = tier.allocate(40_000)
    assert again.location == 0, "freed extents are reused (first fit)"
    tier.free(again)


def test_capacity_exhaustion(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(capacity=64 * KiB)
    a = tier.allocate(60_000)
    with pytest.raises(TierCapacityError) as info:
        tier.allocate(8192)
    assert "nvme" in str(info.value)
    tier.free(a)
    tier.free(tier.allocate(64 * KiB))
    assert tier.statistics().current_bytes == 0


def test_files_grow_lazily_and_are_removed_on_close(tmp_path: Path) -> None:
    parent = tmp_path / "nvme"
    parent.mkdir()
    tier = NvmeTier([parent], 1 << 40, backend="posix", block_size=BLOCK, queue_depth=2)
    (data,) = tier.data_files
    assert os.path.getsize(data) <= ALIGNMENT, "a 1 TiB capacity must not be preallocated up front"
    allocation = tier.allocate(100)
    grown = os.path.getsize(data)
    assert 0 < grown <= 64 * MiB
    round_trip(tier, 1000)
    tier.free(allocation)
    assert os.listdir(parent) == [os.path.basename(tier.run_directories[0])]
    tier.close()
    tier.close()  # idempotent
    assert os.listdir(parent) == []
    assert os.listdir(tmp_path) == ["nvme"]
    with pytest.raises(RuntimeClosedError):
        tier.allocate(1)


def test_close_waits_for_in_flight_and_frees_everything(make_tier: Callable[..., NvmeTier], backend_name: str) -> None:
    tier = make_tier(backend=backend_name)
    allocation = tier.allocate(2 * MiB)
    future = tier.write(allocation, 0, aligned(2 * MiB))
    tier.close()
    assert future.done() and future.exception() is None
    assert tier.statistics().current_bytes == 0


def test_zero_length_io(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(checksum=True)
    allocation = tier.allocate(0)
    empty = torch.empty(0, dtype=torch.uint8)
    tier.write(allocation, 0, empty).result()
    tier.read(allocation, 0, empty).result()


def test_buffers_released_without_gc(make_tier: Callable[..., NvmeTier], backend_name: str) -> None:
    # TRAPS 14: once a move completes the tier keeps no reference to the caller's buffer,
    # not even through a cycle only the cyclic GC would free.
    tier = make_tier(checksum=backend_name == "posix", backend=backend_name)  # aio: the queue's path
    allocation = tier.allocate(BLOCK * 3)
    gc.disable()
    try:
        for shift in (0, 64):
            src = aligned(BLOCK * 3, shift=shift)
            ref = weakref.ref(src)
            tier.write(allocation, 0, src).result()
            del src
            dst = empty_like_aligned(BLOCK * 3, shift=shift)
            dref = weakref.ref(dst)
            tier.read(allocation, 0, dst).result()
            del dst
            assert ref() is None and dref() is None
    finally:
        gc.enable()


def test_free_while_in_flight_defers_the_extent(tmp_path: Path) -> None:
    gate = threading.Event()

    class Gated(PosixBackend):
        def pwrite(self, handle: int, buffer: Any, offset: int) -> int:
            gate.wait(10)
            return super().pwrite(handle, buffer, offset)

    parent = tmp_path / "p"
    parent.mkdir()
    tier = NvmeTier([parent], 1 * MiB, backend=Gated(), direct=False, block_size=BLOCK, queue_depth=2)
    try:
        first = tier.allocate(8192)
        future = tier.write(first, 0, aligned(8192))
        assert not future.cancel(), "an in-flight request must not be cancellable (its buffer is in use)"
        tier.free(first)
        second = tier.allocate(8192)
        assert second.location != first.location, "an extent with I/O in flight was handed out again"
        gate.set()
        future.result()
        third = tier.allocate(8192)
        assert third.location == first.location, "the deferred extent was released after the I/O"
    finally:
        gate.set()
        tier.close()


def test_sync_and_describe(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(npaths=2, checksum=True)
    round_trip(tier, 1000)
    assert tier.sync().result() is None
    facts = tier.describe()
    for key in (
        "tier",
        "capacity",
        "backend",
        "backend_reason",
        "paths",
        "filesystems",
        "direct",
        "direct_reason",
        "block_size",
        "queue_depth",
        "checksum",
    ):
        assert key in facts
    assert facts["tier"] == "nvme" and facts["backend"] == "posix" and facts["checksum"] is True
    assert facts["block_size"] == BLOCK and facts["queue_depth"] == 8 == tier.queue_depth
    assert len(facts["filesystems"]) == 2 and all(fs["fstype"] for fs in facts["filesystems"])


def test_argument_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        NvmeTier([tmp_path], MiB, block_size=1000)
    with pytest.raises(ValueError, match="direct"):
        NvmeTier([tmp_path], MiB, direct="yes")
    with pytest.raises(TypeError, match="list"):
        NvmeTier(str(tmp_path), MiB)  # type: ignore[arg-type]
    with pytest.raises(StoragePathError, match="twice"):
        NvmeTier([tmp_path, tmp_path], MiB, backend="posix")


# -- paths -------------------------------------------------------------------------------------
def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(StoragePathError, match="no such directory"):
        NvmeTier([tmp_path / "absent"], MiB, backend="posix")


def test_path_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_bytes(b"x")
    with pytest.raises(StoragePathError, match="not a directory"):
        NvmeTier([file], MiB, backend="posix")


def test_read_only_path(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a 0o500 directory is still writable")
        with pytest.raises(StoragePathError, match="not writable"):
            NvmeTier([ro], MiB, backend="posix")
    finally:
        ro.chmod(0o700)


def test_unwritable_path_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same check as above, runnable as root: pretend the kernel says "not writable".
    real_access = os.access
    target = str(tmp_path)
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == target else real_access(p, mode))
    with pytest.raises(StoragePathError, match="not writable") as info:
        NvmeTier([tmp_path], MiB, backend="posix")
    assert target in str(info.value)


def test_tmpfs_path_warns() -> None:
    if not os.path.isdir("/dev/shm") or filesystem_of("/dev/shm").fstype != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not writable")
    with pytest.warns(TiermemWarning, match="tmpfs"):
        tier = NvmeTier(["/dev/shm"], MiB, backend="posix", block_size=BLOCK, queue_depth=2)
    try:
        round_trip(tier, 5000)
        assert tier.describe()["filesystems"][0]["fstype"] == "tmpfs"
        run_dir = tier.run_directories[0]
    finally:
        tier.close()
    assert not os.path.exists(run_dir)


# -- faults -------------------------------------------------------------------------------------
def faulty_tier(
    make_tier: Callable[..., NvmeTier], inner: str = "posix", **kwargs: Any
) -> tuple[NvmeTier, FaultyBackend]:
    backend = FaultyBackend(make_backend(inner))
    tier = make_tier(backend=backend, **kwargs)
    return tier, backend


def test_enospc_on_write_is_disk_full(make_tier: Callable[..., NvmeTier], backend_name: str) -> None:
    tier, backend = faulty_tier(make_tier, backend_name)
    backend.enospc_after = backend.bytes_written + 2 * BLOCK
    allocation = tier.allocate(4 * BLOCK)
    with pytest.raises(DiskFullError) as info:
        tier.write(allocation, 0, aligned(4 * BLOCK)).result()
    message = str(info.value)
    assert tier.data_files[0] in message and "free:" in message and "bytes" in message
    assert info.value.errno == 28
    assert tier.statistics().bytes_written == 0, "a failed write is not counted as written"


def test_enospc_on_fallocate_is_disk_full_and_allocation_rolls_back(
    make_tier: Callable[..., NvmeTier],
) -> None:
    tier, backend = faulty_tier(make_tier, capacity=512 * MiB)
    backend.fallocate_limit = 1 * MiB
    small = tier.allocate(100 * KiB)  # the 64 MiB growth step fails; growing to what is needed works
    with pytest.raises(DiskFullError):
        tier.allocate(2 * MiB)
    assert tier.statistics().current_bytes == small.reserved
    tier.free(small)


@pytest.mark.parametrize("op", ["read", "write"])
def test_eio_is_storage_io_error(make_tier: Callable[..., NvmeTier], op: str, backend_name: str) -> None:
    tier, backend = faulty_tier(make_tier, backend_name)
    n = 4 * BLOCK
    allocation = tier.allocate(n)
    if op == "write":
        backend.eio_on_write = backend.writes + 2
        future = tier.write(allocation, 0, aligned(n))
    else:
        tier.write(allocation, 0, aligned(n)).result()
        backend.eio_on_read = backend.reads + 2
        future = tier.read(allocation, 0, empty_like_aligned(n))
    with pytest.raises(StorageIOError) as info:
        future.result()
    assert info.value.errno == 5 and tier.data_files[0] in str(info.value) and op in str(info.value)


def test_short_read(make_tier: Callable[..., NvmeTier], backend_name: str) -> None:
    tier, backend = faulty_tier(make_tier, backend_name)
    allocation = tier.allocate(BLOCK)
    tier.write(allocation, 0, aligned(BLOCK)).result()
    backend.short_read_on = backend.reads + 1
    with pytest.raises(ShortReadError, match="short read"):
        tier.read(allocation, 0, empty_like_aligned(BLOCK)).result()


@pytest.mark.parametrize("shift", [0, 64])
def test_bit_flip_caught_by_checksum(make_tier: Callable[..., NvmeTier], shift: int, backend_name: str) -> None:
    # With checksum=False the same flip would go unnoticed; that is what the option is for.
    tier, backend = faulty_tier(make_tier, backend_name, checksum=True)
    allocation = tier.allocate(3 * BLOCK)
    tier.write(allocation, 0, aligned(3 * BLOCK)).result()
    backend.flip_bit_on_read = backend.reads + 2
    with pytest.raises(ChecksumError, match="checksum mismatch") as info:
        tier.read(allocation, 0, empty_like_aligned(3 * BLOCK, shift=shift)).result()
    assert tier.data_files[0] in str(info.value)
    # A read that does not line up with the written segments is verified too.
    backend.flip_all_reads = True
    with pytest.raises(ChecksumError):
        tier.read(allocation, 100, empty_like_aligned(50)).result()
    backend.flip_all_reads = False
    part = empty_like_aligned(50)
    tier.read(allocation, 100, part).result()


def test_checksum_refuses_unwritten_bytes(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(checksum=True)
    allocation = tier.allocate(3 * BLOCK)
    tier.write(allocation, 0, aligned(BLOCK)).result()
    tier.read(allocation, 0, empty_like_aligned(BLOCK)).result()
    with pytest.raises(UnverifiedReadError, match="no checksum covers"):
        tier.read(allocation, 0, empty_like_aligned(2 * BLOCK)).result()


def test_checksum_records_dropped_on_free(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(checksum=True)
    allocation = tier.allocate(3 * BLOCK)
    tier.write(allocation, 0, aligned(3 * BLOCK)).result()
    assert tier._sums is not None and tier._sums.count() == 3
    tier.free(allocation)
    assert tier._sums.count() == 0
    again = tier.allocate(3 * BLOCK)
    with pytest.raises(UnverifiedReadError):
        tier.read(again, 0, empty_like_aligned(BLOCK)).result()


def test_padding_past_nbytes_needs_no_checksum(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(checksum=True)
    allocation = tier.allocate(1000)  # reserved 4096: bytes past 1000 are padding
    src = aligned(1000)
    tier.write(allocation, 0, src).result()
    whole = empty_like_aligned(allocation.reserved)
    tier.read(allocation, 0, whole).result()
    assert torch.equal(whole[:1000], src)


def test_o_direct_refused_falls_back_to_buffered(make_tier: Callable[..., NvmeTier]) -> None:
    backend = FaultyBackend(PosixBackend(), refuse_direct=True)
    tier = make_tier(backend=backend, direct="auto", checksum=True)
    facts = tier.describe()
    assert facts["direct"] is False and "refuses O_DIRECT" in facts["direct_reason"]
    round_trip(tier, BLOCK + 3, shift=5)
    round_trip(tier, 3 * BLOCK)
    with pytest.raises(StoragePathError, match="refuses O_DIRECT"):
        make_tier(backend=backend, direct=True)


def test_cpu_fork_child_close_keeps_parent_files(make_tier: Callable[..., NvmeTier], backend_name: str) -> None:
    # TRAPS 12: a forked child (a DataLoader worker) closing the tier removes nothing.
    tier = make_tier(backend=backend_name)
    allocation = tier.allocate(BLOCK)
    src = aligned(BLOCK)
    tier.write(allocation, 0, src).result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        with contextlib.suppress(BaseException):
            tier.close()
            code = 0 if all(os.path.exists(p) for p in tier.data_files) else 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(os.path.exists(p) for p in tier.data_files)
    dst = empty_like_aligned(BLOCK)
    tier.read(allocation, 0, dst).result()
    assert torch.equal(src, dst)


@pytest.mark.cuda
def test_cuda_tensors_are_staged(make_tier: Callable[..., NvmeTier]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tier = make_tier(checksum=True)
    n = 2 * BLOCK + 77
    allocation = tier.allocate(n)
    src = aligned(n).cuda()
    tier.write(allocation, 0, src).result()
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    tier.read(allocation, 0, dst).result()
    assert torch.equal(src, dst)


# -- the AIO submission queue (NOTE [ NVMe tier layout and I/O ] rule 6) -------------------------------
@pytest.fixture
def aio_ok(tmp_path: Path) -> None:
    ok, reason = aio.probe(tmp_path)
    if not ok:
        pytest.skip(f"aio unusable here: {reason}")


@pytest.mark.usefixtures("aio_ok")
def test_aio_queue_takes_zero_copy_segments_and_the_pool_the_rest(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(backend="aio", queue_depth=4)
    assert tier._queue is not None and "kernel queue" in tier.describe()["submission"]
    # More requests than the queue holds at once: the rest wait in it, FIFO.
    allocations = [tier.allocate(BLOCK) for _ in range(12)]
    sources = [aligned(BLOCK, seed=i) for i in range(12)]
    for f in [tier.write(a, 0, s) for a, s in zip(allocations, sources, strict=True)]:
        f.result()
    targets = [empty_like_aligned(BLOCK) for _ in range(12)]
    for f in [tier.read(a, 0, t) for a, t in zip(allocations, targets, strict=True)]:
        f.result()
    assert all(torch.equal(s, t) for s, t in zip(sources, targets, strict=True))
    assert tier.segment_counts() == {"zero_copy": 24, "staged": 0, "read_modify_write": 0}
    # An unaligned buffer is staged on the pool; its aligned neighbours still use the queue.
    round_trip(tier, 3 * BLOCK, shift=64)
    assert tier.segment_counts()["staged"] == 6


@pytest.mark.usefixtures("aio_ok")
def test_aio_with_checksums_keeps_hashing_off_the_submitting_thread(make_tier: Callable[..., NvmeTier]) -> None:
    tier = make_tier(backend="aio", checksum=True)
    assert tier._queue is not None
    submitter = threading.get_ident()
    seen: set[int] = set()
    real = tier._backend.pwrite

    def spy(handle: Any, buffer: Any, offset: int) -> int:
        seen.add(threading.get_ident())
        return real(handle, buffer, offset)

    tier._backend.pwrite = spy  # type: ignore[method-assign]
    round_trip(tier, 2 * BLOCK)
    assert seen and submitter not in seen, "checksummed segments run on the worker pool (rule 6)"


@pytest.mark.usefixtures("aio_ok")
def test_aio_queue_unavailable_falls_back_to_the_pool(
    make_tier: Callable[..., NvmeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: AioBackend, depth: int) -> None:
        raise OSError(11, "io_setup(8) failed: Resource temporarily unavailable")

    monkeypatch.setattr(AioBackend, "open_queue", refuse)
    tier = make_tier(backend="aio")
    assert tier._queue is None
    facts = tier.describe()
    assert "worker pool" in facts["submission"] and "submission queue unavailable" in facts["backend_reason"]
    round_trip(tier, BLOCK)


@pytest.mark.usefixtures("aio_ok")
def test_aio_short_write_is_an_error_never_partial(make_tier: Callable[..., NvmeTier]) -> None:
    # A real partial write from the kernel: RLIMIT_FSIZE cuts a write that crosses it short
    # (and refuses the rest with EFBIG). The queue continues the rest, and the error surfaces.
    import resource
    import signal

    tier = make_tier(backend="aio")
    allocation = tier.allocate(4 * BLOCK)
    tier.write(allocation, 0, aligned(4 * BLOCK)).result()
    limit = allocation.location + BLOCK + 16 * KiB  # inside the second block
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
        future = tier.write(allocation, 0, aligned(4 * BLOCK, seed=9))
        with pytest.raises(StorageIOError) as info:
            future.result()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert info.value.errno == 27 and tier.data_files[0] in str(info.value) and "write" in str(info.value)
    assert tier.statistics().bytes_written == 4 * BLOCK, "the failed write is not counted"
