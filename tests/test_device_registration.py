"""NOTE [ Registered device pool ]: the device tier's pool of chunk storage registered with kvikio,
the bookkeeping only, with a fake kvikio module and a fake private pool.

What these tests can and cannot show: when the device tier routes a chunk storage's ``resize_`` to
its pool, which of the pool's segments it registers through the NVMe tier and kvikio (once each),
that every one is deregistered at close *before* the pool is dropped, and that nothing of this
happens where it would register nothing (compatibility mode, posix, a host home) or cannot be made
safely (no CUDA, no MemPool, the allocator settings of rule 5). They never touch CUDA, a MemPool or
cuFile: the fake pool hands out addresses and the "storages" only record them. Real registration in
training is tests/test_cuda.py's job.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiermem.tiers import device_pool
from tiermem.tiers.backends import PosixBackend, kvikio_backend
from tiermem.tiers.backends.kvikio_backend import Segment
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.nvme import NvmeTier

MiB = 1 << 20
SEGMENT = 20 * MiB  # what the caching allocator cuts 1-10 MiB blocks from


class FakeCuFile:
    """Enough of ``kvikio.CuFile`` for the NVMe tier to open, grow and close its data files."""

    def __init__(self, path: str, mode: str) -> None:
        self._fd = os.open(path, os.O_RDWR)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        os.close(self._fd)


class FakeKvikio(types.ModuleType):
    """Records memory_register / memory_deregister into a shared event log."""

    def __init__(self, events: list[tuple[str, int]], *, compat: bool = False) -> None:
        super().__init__("kvikio")
        self.events = events
        self.CuFile = FakeCuFile
        self.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat)

    def memory_register(self, buf: Any) -> None:
        self.events.append(("register", buf.__cuda_array_interface__["data"][0]))

    def memory_deregister(self, buf: Any) -> None:
        self.events.append(("deregister", buf.__cuda_array_interface__["data"][0]))


class FakePool:
    """Stands for ``TorchMemPool``: routed allocations are bump-allocated from 20 MiB segments of
    the pool (a new one when none has room), unrouted ones come from elsewhere."""

    def __init__(self, events: list[tuple[str, int]], *, expandable: bool = False) -> None:
        self.events = events
        self.expandable = expandable
        self.routed = False
        self.segments_made: list[Segment] = []
        self._used: dict[int, int] = {}
        self.snapshots = 0
        self._outside = 0x70000000

    @contextlib.contextmanager
    def route(self) -> Iterator[None]:
        assert not self.routed, "rule 3: one routing at a time"
        self.routed = True
        try:
            yield
        finally:
            self.routed = False

    def allocate(self, nbytes: int) -> int:
        if not self.routed:
            self._outside += nbytes
            return self._outside - nbytes
        for segment in self.segments_made:
            if self._used[segment.base] + nbytes <= segment.size:
                self._used[segment.base] += nbytes
                return segment.base + self._used[segment.base] - nbytes
        segment = Segment(0x10000000 * (len(self.segments_made) + 1), max(SEGMENT, nbytes), self.expandable)
        self.segments_made.append(segment)
        self._used[segment.base] = nbytes
        return segment.base

    def segments(self) -> list[Segment]:
        self.snapshots += 1
        return list(self.segments_made)

    def segment_of(self, address: int) -> Segment | None:
        return next((s for s in self.segments_made if s.base <= address < s.base + s.size), None)

    def release(self) -> None:
        self.events.append(("release pool", 0))


class FakeStorage:
    """Stands for a chunk's ``UntypedStorage``: where ``resize_`` put its bytes."""

    def __init__(self, pool: FakePool) -> None:
        self._pool = pool
        self.address = 0
        self.routed = False

    def resize_(self, nbytes: int) -> None:
        self.routed = self._pool.routed
        self.address = self._pool.allocate(nbytes) if nbytes else 0

    def data_ptr(self) -> int:
        return self.address


@pytest.fixture
def events() -> list[tuple[str, int]]:
    return []


@pytest.fixture
def pool(events: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch) -> FakePool:
    """The fake pool, made where the device tier would make a ``TorchMemPool``, on a machine where
    rule 5 allows one (the device is the CPU here: the availability check is what is faked)."""
    fake = FakePool(events)
    made: list[torch.device] = []

    def make(device: torch.device) -> FakePool:
        made.append(device)
        return fake

    monkeypatch.setattr(device_pool, "TorchMemPool", make)
    monkeypatch.setattr(device_pool, "pool_unavailable_reason", lambda device: None)
    monkeypatch.setattr(kvikio_backend, "cuda_segment_of", fake.segment_of)
    fake.made = made  # type: ignore[attr-defined]
    return fake


def kvikio_nvme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: list, *, compat: bool = False) -> NvmeTier:
    monkeypatch.setitem(sys.modules, "kvikio", FakeKvikio(events, compat=compat))
    return NvmeTier([str(tmp_path)], 64 * MiB, backend=kvikio_backend.KvikioBackend(), block_size=MiB)


def test_each_segment_of_the_pool_is_registered_once_and_all_are_deregistered_before_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: list, pool: FakePool
) -> None:
    nvme = kvikio_nvme(tmp_path, monkeypatch, events)
    device = DeviceTier(256 * MiB, "cpu")
    try:
        assert nvme.registers_device_memory
        storages = [FakeStorage(pool) for _ in range(3)]
        for storage in storages:  # 8 MiB each: two in the first 20 MiB segment, the third in a second
            device.resize_for_io(storage, 8 * MiB, nvme)
        assert all(s.routed for s in storages)
        first, second = (s.base for s in pool.segments_made)
        assert events == [("register", first), ("register", second)]
        assert device.io_pool is not None and device.io_pool.registered_segments == [first, second]
        assert pool.snapshots == 2  # only when a buffer landed outside the segments seen so far
        # A chunk released and fetched again lands in a known segment: nothing to register.
        storages[0].resize_(0)
        device.resize_for_io(storages[0], 2 * MiB, nvme)
        assert storages[0].routed and events == [("register", first), ("register", second)]
        assert pool.snapshots == 2
    finally:
        device.close()
        nvme.close()
    # Rule 2d: every segment deregistered, and only then the pool dropped.
    assert sorted(events[2:4]) == sorted([("deregister", first), ("deregister", second)])
    assert events[4:] == [("release pool", 0)]
    assert pool.made == [torch.device("cpu")]  # type: ignore[attr-defined]


def test_after_close_storage_is_resized_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: list, pool: FakePool
) -> None:
    nvme = kvikio_nvme(tmp_path, monkeypatch, events)
    device = DeviceTier(64 * MiB, "cpu")
    device.resize_for_io(FakeStorage(pool), MiB, nvme)
    device.close()
    late = FakeStorage(pool)
    device.resize_for_io(late, MiB, nvme)
    assert not late.routed and device.io_pool is None
    nvme.close()
    assert [e for e, _ in events] == ["register", "deregister", "release pool"]


def test_compatibility_mode_makes_no_pool_and_registers_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: list, pool: FakePool
) -> None:
    nvme = kvikio_nvme(tmp_path, monkeypatch, events, compat=True)
    device = DeviceTier(64 * MiB, "cpu")
    try:
        assert not nvme.registers_device_memory
        storage = FakeStorage(pool)
        device.resize_for_io(storage, 4 * MiB, nvme)
        assert not storage.routed and storage.address and device.io_pool is None
    finally:
        device.close()
        nvme.close()
    assert events == [] and pool.made == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("home", ["posix", "host"])
def test_homes_that_register_nothing_make_no_pool(tmp_path: Path, pool: FakePool, home: str) -> None:
    io = NvmeTier([str(tmp_path)], 64 * MiB, backend=PosixBackend()) if home == "posix" else HostTier(64 * MiB)
    device = DeviceTier(64 * MiB, "cpu")
    try:
        storage = FakeStorage(pool)
        device.resize_for_io(storage, 4 * MiB, io)
        assert not storage.routed and device.io_pool is None
    finally:
        device.close()
        io.close()
    assert pool.made == []  # type: ignore[attr-defined]


def test_without_cuda_no_pool_is_made_and_the_backend_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real availability check on this CPU machine: the CPU device is refused before anything
    asks kvikio whether GDS is active."""

    class Io:
        @property
        def registers_device_memory(self) -> bool:
            raise AssertionError("asked the backend on the CPU device")

    made: list[Any] = []
    monkeypatch.setattr(device_pool, "TorchMemPool", made.append)
    assert device_pool.open_pool(torch.device("cpu"), Io()) is None and made == []
    assert "not CUDA" in str(device_pool.pool_unavailable_reason(torch.device("cpu")))


def _cuda_like_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """What rule 5 reads, as a CUDA build of a recent torch would answer it."""
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("no MemPool", "no torch.cuda.MemPool"),
        ("no thread routing", "no torch.cuda.MemPool with thread-scoped"),
        ("cudaMallocAsync", "'cudaMallocAsync'"),
        ("max_split_size_mb", "max_split_size_mb"),
        ("expandable_segments", "expandable_segments"),
        ("set at run time", "max_split_size_mb"),
    ],
)
def test_rule_5_refuses_the_pool_where_it_cannot_be_made_safely(
    monkeypatch: pytest.MonkeyPatch, change: str, why: str
) -> None:
    _cuda_like_torch(monkeypatch)
    cuda = torch.device("cuda", 0)
    assert device_pool.pool_unavailable_reason(cuda) is None
    if change == "no MemPool":
        monkeypatch.delattr(torch.cuda, "MemPool")
    elif change == "no thread routing":  # torch 2.5-2.6 routed every thread's allocations
        monkeypatch.delattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool")
    elif change == "cudaMallocAsync":
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    elif change == "max_split_size_mb":
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    elif change == "expandable_segments":
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    else:
        monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "max_split_size_mb:64")
    assert why in str(device_pool.pool_unavailable_reason(cuda))

    class Io:
        registers_device_memory = True

    made: list[Any] = []
    monkeypatch.setattr(device_pool, "TorchMemPool", made.append)
    assert device_pool.open_pool(cuda, Io()) is None and made == []


def test_expandable_segments_of_the_pool_are_never_registered(events: list) -> None:
    fake = FakePool(events, expandable=True)

    class Io:
        registers_device_memory = True

        def register_buffer(self, buffer: Any) -> bool:
            raise AssertionError("registered an expandable segment")

        def deregister_buffer(self, buffer: Any) -> None:
            raise AssertionError("nothing was registered")

    pool = device_pool.RegisteredDevicePool(Io(), fake)
    storage = FakeStorage(fake)
    pool.resize(storage, MiB)
    pool.resize(FakeStorage(fake), MiB)
    assert storage.routed and pool.registered_segments == [] and fake.snapshots == 1
    pool.close()
    assert events == [("release pool", 0)]


def test_a_pool_dropped_without_close_deregisters_before_it_releases(events: list) -> None:
    fake = FakePool(events)

    class Io:
        registers_device_memory = True

        def register_buffer(self, buffer: Any) -> bool:
            events.append(("register", buffer.__cuda_array_interface__["data"][0]))
            return True

        def deregister_buffer(self, buffer: Any) -> None:
            events.append(("deregister", buffer.__cuda_array_interface__["data"][0]))

    pool = device_pool.RegisteredDevicePool(Io(), fake)
    pool.resize(FakeStorage(fake), 30 * MiB)
    base = fake.segments_made[0].base
    del pool
    gc.collect()
    assert events == [("register", base), ("deregister", base), ("release pool", 0)]


def test_a_host_home_asked_first_does_not_keep_nvme_chunks_from_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: list, pool: FakePool
) -> None:
    """Mixed homes (the default placement): the first streamed chunk fetched is often host-homed;
    the pool is still made for the NVMe tier that registers device memory, when it first asks."""
    nvme = kvikio_nvme(tmp_path, monkeypatch, events)
    host = HostTier(64 * MiB)
    device = DeviceTier(64 * MiB, "cpu")
    try:
        from_host = FakeStorage(pool)
        device.resize_for_io(from_host, MiB, host)
        assert not from_host.routed and device.io_pool is None
        from_nvme = FakeStorage(pool)
        device.resize_for_io(from_nvme, MiB, nvme)
        assert from_nvme.routed and device.io_pool is not None
        again = FakeStorage(pool)
        device.resize_for_io(again, MiB, host)
        assert not again.routed  # host-homed chunks never draw from the registered pool
    finally:
        device.close()
        host.close()
        nvme.close()
    assert [e for e, _ in events] == ["register", "deregister", "release pool"]
