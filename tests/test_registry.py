"""Managed objects through real tiers (NOTE [ Managed object rules ]) and the shared
conformance checks every tier path must pass: round trips of many dtypes, shapes and
strides, accounting back to zero, forwarding, cancellation, failure, concurrency."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

from tests.gated_tier import GatedTier
from tiermem.errors import ObjectFreedError, StorageIOError, TierCapacityError
from tiermem.registry import ObjectState, Registry
from tiermem.schedulers import AsyncioScheduler, Priority
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.nvme import NvmeTier

BLOCK = 64 << 10


class Store:
    """Tiers + scheduler + registry, closed in order at teardown."""

    def __init__(self, nvme, device_capacity: int = 256 << 20) -> None:
        self.device = DeviceTier(device_capacity, "cpu")
        self.host = HostTier(256 << 20)
        self.nvme = nvme
        self.scheduler = AsyncioScheduler(block_size=BLOCK, loop="asyncio", debug=True)
        self.registry = Registry({"device": self.device, "host": self.host, "nvme": nvme}, self.scheduler)

    def close(self) -> None:
        if isinstance(self.nvme, GatedTier):
            self.nvme.gated = False
            self.nvme.release_all()
        self.registry.free_all()
        self.scheduler.close()
        for tier in (self.device, self.host, self.nvme):
            tier.close()

    def current(self) -> dict[str, int]:
        return {t.name: t.statistics().current_bytes for t in (self.device, self.host, self.nvme)}


@pytest.fixture
def make_store(tmp_path):
    stores: list[Store] = []

    def make(*, backend=None, gated: bool = False, checksum: bool = False, **kwargs) -> Store:
        if gated:
            nvme = GatedTier(queue_depth=2)
        else:
            nvme = NvmeTier(
                [tmp_path],
                1 << 30,
                block_size=BLOCK,
                queue_depth=4,
                checksum=checksum,
                backend=backend or "posix",
            )
        store = Store(nvme, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
    assert list(tmp_path.iterdir()) == []  # no files left behind


def _views(dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        base = torch.rand(96, 40, generator=generator) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(96, 40, generator=generator, dtype=torch.float32).to(dtype)
    else:
        base = torch.randint(-100, 100, (96, 40), generator=generator).to(dtype)
    return [
        base,
        base.t(),  # transposed
        base[3:50:2, 5:],  # strided with an offset
        base[7, 3],  # a scalar view
        base.reshape(-1)[123:4000],  # 1-D slice, unaligned offset
        base[:, :1].expand(96, 9),  # stride 0
    ]


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
    torch.uint8,
]
PATHS = [("nvme", "host"), ("host", "nvme"), ("nvme",)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS, ids="->".join)
def test_round_trip_keeps_bytes_and_views(make_store, dtype, path):
    store = make_store()
    views = _views(dtype)
    expected = [(v.clone(), v.stride()) for v in views]
    handles = [store.registry.register(v.clone() if i == 0 else v, "device", dedup=False) for i, v in enumerate(views)]
    for tier in path:
        for handle in handles:
            handle.move_to(tier, Priority.WRITEBACK)
        for handle in handles:
            handle.wait()
            assert handle.tier == tier
    for handle, (want, stride) in zip(handles, expected, strict=True):
        got = handle.tensor()
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == stride
        assert torch.equal(got, want)
        assert handle.tier == "device"  # read where it was asked for

    for handle in handles:
        handle.free()
    assert store.current() == {"device": 0, "host": 0, "nvme": 0}


def test_dedup_one_copy_per_storage_and_version_with_own_views(make_store):
    store = make_store()
    t = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    a = store.registry.register(t)
    b = store.registry.register(t.t())
    c = store.registry.register(t[5:9].view(torch.int32))
    assert a.obj is b.obj is c.obj
    assert store.registry.statistics().dedup_hits == 2
    a.move_to("nvme")
    a.wait()
    assert store.current()["nvme"] == 8192  # one copy of the 8 KiB storage
    assert torch.equal(b.tensor(), t.t()) and b.tensor().stride() == (1, 32)
    assert torch.equal(c.tensor(), t[5:9].view(torch.int32))
    t.add_(1)  # a new version of the same storage is a new object
    d = store.registry.register(t)
    assert d.obj is not a.obj
    for handle in (a, b, c):
        handle.free()
    assert a.obj.state is ObjectState.FREED
    d.free()
    assert store.current() == {"device": 0, "host": 0, "nvme": 0}


def test_dedup_never_confuses_a_new_storage_at_a_reused_address(make_store):
    store = make_store()
    seen = set()
    for value in range(20):
        t = torch.full((1024,), float(value))
        handle = store.registry.register(t)
        seen.add(handle.obj.id)
        assert torch.equal(handle.tensor(), torch.full((1024,), float(value)))
        handle.free()
        del t, handle
    assert len(seen) == 20
    assert store.registry.statistics().dedup_hits == 0


def test_forwarding_serves_a_moving_object_from_memory(make_store):
    store = make_store(gated=True)
    t = torch.randn(40_000)
    handle = store.registry.register(t.clone())
    transfer = handle.move_to("nvme", Priority.WRITEBACK)
    store.nvme.wait_pending(1)
    assert handle.state is ObjectState.MOVING
    assert torch.equal(handle.tensor(), t)  # served from the source while the write is held
    assert store.registry.statistics().forwarded == 1
    store.nvme.gated = False
    store.nvme.release_all()
    transfer.wait(timeout=10)
    handle.wait()
    assert handle.tier == "nvme"
    assert store.current()["device"] == 0


def test_asking_back_cancels_the_unneeded_write(make_store):
    store = make_store(gated=True)
    t = torch.randn(8 * BLOCK // 4)
    handle = store.registry.register(t.clone())
    handle.move_to("nvme", Priority.WRITEBACK)
    store.nvme.wait_pending(1)
    assert handle.move_to("device") is None  # rule 3
    store.nvme.release(2)  # the blocks already in flight finish
    handle.wait()
    assert handle.tier == "device" and handle.state is ObjectState.RESIDENT
    assert store.registry.statistics().cancelled == 1
    assert len(store.nvme.log) < 8  # the rest of the write was never issued
    assert store.current()["nvme"] == 0
    assert torch.equal(handle.tensor(), t)


def test_freeing_a_moving_object_releases_memory_only_after_the_move_ends(make_store):
    store = make_store(gated=True)
    handle = store.registry.register(torch.randn(4 * BLOCK // 4))
    handle.move_to("nvme", Priority.WRITEBACK)
    store.nvme.wait_pending(1)
    handle.free()
    with pytest.raises(ObjectFreedError):
        handle.tensor()
    assert store.current()["nvme"] > 0  # a block may still be writing into it
    store.nvme.gated = False
    store.nvme.release_all()
    store.registry.free_all()
    assert store.current() == {"device": 0, "host": 0, "nvme": 0}


def test_failed_writeback_leaves_the_source_resident_and_raises_at_wait(make_store):
    faulty = FaultyBackend(PosixBackend(), eio_on_write=2)
    store = make_store(backend=faulty)
    t = torch.randn(4 * BLOCK // 4)
    handle = store.registry.register(t.clone())
    handle.move_to("nvme", Priority.WRITEBACK)
    with pytest.raises(StorageIOError, match="Input/output error"):
        handle.wait()
    assert handle.tier == "device" and handle.state is ObjectState.RESIDENT
    assert store.current()["nvme"] == 0
    assert torch.equal(handle.tensor(), t)  # nothing lost
    handle.move_to("nvme")  # the fault was one-off: a second try lands
    handle.wait()
    assert torch.equal(handle.tensor(), t)
    assert store.registry.statistics().failed_moves == 1


def test_corrupt_read_raises_and_never_returns_data(make_store):
    faulty = FaultyBackend(PosixBackend(), flip_all_reads=True)
    store = make_store(backend=faulty, checksum=True)
    handle = store.registry.register(torch.randn(3 * BLOCK // 4))
    handle.move_to("nvme")
    handle.wait()
    with pytest.raises(OSError, match="checksum mismatch"):
        handle.tensor()
    assert handle.tier == "nvme"  # still there, still the right bytes on disk
    assert store.current()["device"] == 0


def test_made_objects_are_the_tiers_own_blocks_and_move_like_any(make_store):
    """``Registry.make``: an object of bytes the memory tier allocates (a block it kept, where one
    of that size was freed), counted against its capacity, read and written through its handle from
    its first byte, and moved and freed like a registered one; refused on a storage tier and where
    the tier has no room."""
    store = make_store(device_capacity=1 << 20)
    nbytes = 100_000  # not a multiple of the tier's alignment
    first = store.registry.make("host", nbytes, kind="chunk")
    block = first.obj.home.tensor.data_ptr()  # no reference kept: the tier keeps only blocks nobody holds
    assert store.current()["host"] >= nbytes
    data = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    first.tensor("host").copy_(data)
    first.move_to("nvme", Priority.WRITEBACK)
    first.wait()
    assert first.tier == "nvme" and torch.equal(first.tensor("device"), data)
    second = store.registry.make("host", nbytes)
    assert second.obj.home.tensor.data_ptr() == block  # the block the move freed, handed out again
    second.free()
    first.free()
    assert store.current() == {"device": 0, "host": 0, "nvme": 0}
    with pytest.raises(TierCapacityError, match="device tier"):
        store.registry.make("device", 2 << 20)
    with pytest.raises(Exception, match="only memory tiers"):
        store.registry.make("nvme", nbytes)


def test_objects_of_several_sizes_with_one_room_take_turns_in_one_block(make_store):
    """NOTE [ Spare tier blocks ] rule 6: objects on NVMe whose owner gave them a common ``room``
    (staged homes of several sizes) each take a host block of that room when they move there, so
    the block one leaves serves the next whatever its size; each still moves, reads and copies out
    exactly its own bytes. Without the room a smaller object gets a block of its own size."""
    store = make_store()
    sizes = (300_000, 200_000)  # neither a multiple of the alignment
    room = store.host.reserved_size(max(sizes))
    datas = [torch.arange(n, dtype=torch.int64).remainder(241 - k).to(torch.uint8) for k, n in enumerate(sizes)]
    handles = []
    for data in datas:
        handle = store.registry.register(data.clone(), "nvme", dedup=False)
        handle.obj.room = room
        handles.append(handle)
    blocks = []
    for _ in range(2):
        for handle, data in zip(handles, datas, strict=True):
            handle.move_to("host", Priority.DEMAND)
            handle.wait()
            assert handle.obj.home.reserved == room and store.current()["host"] == room
            blocks.append(handle.obj.home.tensor.data_ptr())
            assert torch.equal(handle.tensor("host"), data)
            assert torch.equal(handle.copy_out()[: data.numel()], data)
            assert handle.copy_out().numel() == store.host.reserved_size(data.numel())  # not the room
            handle.move_to("nvme", Priority.WRITEBACK)
            handle.wait()
            assert torch.equal(handle.tensor("device"), data)  # moved back: its own bytes, intact
    assert len(set(blocks)) == 1, blocks  # one block served both sizes, every time
    handles[1].obj.room = 0
    handles[1].move_to("host", Priority.DEMAND)
    handles[1].wait()
    assert handles[1].obj.home.reserved == store.host.reserved_size(sizes[1])
    for handle in handles:
        handle.free()
    assert store.current() == {"device": 0, "host": 0, "nvme": 0}


def test_capacity_exhausted_names_the_tier(make_store):
    store = make_store(device_capacity=1 << 20)
    with pytest.raises(TierCapacityError, match="device tier: cannot allocate"):
        store.registry.register(torch.empty(300_000, dtype=torch.float32), "device")  # 1.2 MB > 1 MiB
    assert store.current()["device"] == 0


def test_concurrent_store_and_fetch_from_many_threads(make_store):
    store = make_store()
    tensors = [torch.randn(1000 + 997 * i) for i in range(24)]
    errors: list[BaseException] = []

    def worker(chunk: list[torch.Tensor]) -> None:
        try:
            for t in chunk:
                handle = store.registry.register(t.clone(), dedup=False)
                handle.move_to("nvme", Priority.WRITEBACK)
                handle.move_to("host")  # waits for the first move, then moves again
                assert torch.equal(handle.tensor(), t)
                handle.free()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(tensors[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert store.current() == {"device": 0, "host": 0, "nvme": 0}


def test_rss_falls_when_an_object_moves_off_without_a_gc_pass(make_store):
    """TRAPS 14: the written-out source is released by reference counting alone."""
    store = make_store()
    gc.disable()
    try:
        handle = store.registry.register(torch.empty(64 << 20, dtype=torch.uint8))
        storage_ref = handle.obj.home.tensor.untyped_storage()
        import weakref

        alive = weakref.ref(storage_ref)
        del storage_ref
        handle.move_to("nvme")
        handle.wait()
        assert alive() is None, "the 64 MiB source storage outlived its move (TRAPS 14)"
    finally:
        gc.enable()
    handle.free()


def test_a_cancelled_write_does_not_count_as_on_its_way(make_store):
    """Found by the state machine: host, back to device (cancels), host again must land."""
    store = make_store(gated=True)
    handle = store.registry.register(torch.randn(2 * BLOCK // 4))
    handle.move_to("nvme")
    store.nvme.wait_pending(1)
    assert handle.move_to("device") is None  # cancels the write

    def ungate() -> None:
        store.nvme.gated = False
        store.nvme.release_all()

    threading.Timer(0.2, ungate).start()  # lets the cancelled move's in-flight block end
    transfer = handle.move_to("nvme")  # waits for the cancelled move to end, then moves again
    assert transfer is not None
    handle.wait()
    assert handle.tier == "nvme"


def test_reading_from_a_storage_tier_is_refused(make_store):
    store = make_store()
    handle = store.registry.register(torch.ones(1000))
    with pytest.raises(ValueError, match="memory tier, not 'nvme'"):
        handle.tensor("nvme")
    handle.move_to("host")
    handle.wait()
    assert torch.equal(handle.tensor("host"), torch.ones(1000)) and handle.tier == "host"
    assert torch.equal(handle.tensor("device"), torch.ones(1000)) and handle.tier == "device"


@pytest.mark.parametrize("part", ["prefix", "suffix"])
def test_known_bytes_are_copied_and_only_the_rest_is_read(make_store, part):
    """Rule 6: a move from storage told that a prefix or suffix of the object sits in memory
    copies those bytes from there (counted on the memory link) and reads only the rest. The
    test's "known" bytes differ from the stored ones, so the result shows which were used."""
    from tiermem.registry import KnownBytes

    store = make_store()
    data = torch.arange(3 * BLOCK // 4, dtype=torch.float32)  # three blocks of bytes
    handle = store.registry.register(data.clone(), "device", dedup=False)
    handle.move_to("nvme", Priority.WRITEBACK)
    handle.wait()
    third = BLOCK // 4
    memory = store.registry.register(torch.full((third,), -1.0), "device", dedup=False)
    offset = 0 if part == "prefix" else 2 * BLOCK
    before = store.scheduler.statistics().links
    handle.move_to("host", Priority.DEMAND, KnownBytes(memory.obj.home, offset, BLOCK))
    handle.wait()
    after = store.scheduler.statistics().links
    expected = data.clone()
    expected[offset // 4 : offset // 4 + third] = -1.0
    assert torch.equal(handle.tensor("host"), expected)
    moved = {name: after[name].bytes - (before[name].bytes if name in before else 0) for name in after}
    assert moved.get("nvme->host") == 2 * BLOCK and moved.get("device->host") == BLOCK
    for bad in (KnownBytes(memory.obj.home, BLOCK, BLOCK), KnownBytes(memory.obj.home, 0, 3 * BLOCK)):
        handle.move_to("nvme", Priority.WRITEBACK)
        handle.wait()
        with pytest.raises(AssertionError, match=r"prefix or a suffix|non-empty span"):
            handle.move_to("host", Priority.DEMAND, bad)
        assert handle.tier == "nvme" and store.current()["host"] == 0  # nothing half-moved
    handle.free()
    memory.free()


class DeviceCache:
    """Bytes a tier holds only as a cache (NOTE [ Managed object rules ] rule 7), as the chunk
    pool's spares are: ``drop`` is the reclaimer."""

    def __init__(self, handle: Any) -> None:
        self.handle: Any = handle

    def drop(self) -> bool:
        if self.handle is None:
            return False
        self.handle.free()
        self.handle = None
        return True


def _cache(store: Store, nbytes: int) -> DeviceCache:
    return DeviceCache(store.registry.register(torch.zeros(nbytes, dtype=torch.uint8), "device", dedup=False))


def test_reclaimers_free_caches_on_request_and_are_held_weakly(make_store):
    store = make_store(device_capacity=1 << 20)
    cache = _cache(store, 768 << 10)
    store.registry.add_reclaimer("device", cache.drop)
    with pytest.raises(TierCapacityError):
        store.registry.register(torch.zeros(512 << 10, dtype=torch.uint8), "device", dedup=False)
    assert store.registry.reclaim("host") is False  # nothing registered there
    assert store.registry.reclaim("device") is True and store.current()["device"] == 0
    assert store.registry.reclaim("device") is False  # nothing left to give
    store.registry.register(torch.zeros(512 << 10, dtype=torch.uint8), "device", dedup=False)
    gone = _cache(store, 4096)
    store.registry.add_reclaimer("device", gone.drop)
    del gone  # held weakly: a dead cache is forgotten, its bytes are its owner's business
    assert store.registry.reclaim("device") is False
    with pytest.raises(ValueError, match="no tier named"):
        store.registry.add_reclaimer("gpu", cache.drop)


def test_fill_copies_between_objects_through_the_scheduler_and_moves_neither(make_store):
    """Rule 8: a span of one object's bytes copied into another's, counted on the link; a
    target on its way elsewhere is refused (the move would drop what the copy wrote)."""
    store = make_store()
    source = store.registry.register(torch.arange(4096, dtype=torch.uint8).repeat(4), "host", dedup=False)
    target = store.registry.register(torch.zeros(3 * 4096, dtype=torch.uint8), "device", dedup=False)
    before = store.scheduler.statistics().links
    target.fill_from(source, nbytes=4096, source_offset=8192, offset=4096, priority=Priority.DEMAND).wait()
    after = store.scheduler.statistics().links
    got = target.tensor("device")
    assert torch.equal(got[4096:8192], source.tensor("host")[8192:12288])
    assert not got[:4096].any() and not got[8192:].any()
    moved = after["host->device"].bytes - (before["host->device"].bytes if "host->device" in before else 0)
    assert moved == 4096 and (source.tier, target.tier) == ("host", "device")
    target.move_to("nvme", Priority.WRITEBACK)
    with pytest.raises(AssertionError, match="filled while it moves"):
        target.fill_from(source, nbytes=4096)
    target.wait()
    source.free()
    with pytest.raises(ObjectFreedError):
        target.fill_from(source, nbytes=4096)
    target.free()


def test_copy_out_copies_a_stored_object_without_moving_it(make_store):
    """Rule 9: an NVMe object's bytes read into a fresh CPU tensor of its reserved size; it stays put."""
    store = make_store()
    data = torch.randn(3000)
    handle = store.registry.register(data.clone(), "device", dedup=False)
    handle.move_to("nvme", Priority.WRITEBACK)
    out = handle.copy_out()  # waits for the move first
    assert handle.tier == "nvme" and handle.state is ObjectState.RESIDENT
    assert out.device.type == "cpu" and out.numel() == handle.reserved >= data.numel() * 4
    assert torch.equal(out[: data.numel() * 4].view(torch.float32), data)
    out.zero_()  # a copy: the object keeps its bytes
    assert torch.equal(handle.tensor("host"), data)
    handle.free()


def test_started_copy_outs_run_together_and_each_gives_its_objects_bytes(make_store):
    """Rule 9: ``start_copy_out`` returns with its read still held by the tier; several are in
    flight at once, and each ``result()`` is its own object's bytes (the objects stay put). A read
    that fails raises at ``result()``; ``settle()`` waits for it and keeps the error to itself."""
    store = make_store(gated=True)
    values = [torch.randn(3000) for _ in range(3)]
    handles = [store.registry.register(v.clone(), "device", dedup=False) for v in values]
    for handle in handles:
        handle.move_to("nvme", Priority.WRITEBACK)
    # Ungated first: a write the scheduler submits after release_all() took the queue would be
    # held for ever otherwise.
    store.nvme.gated = False
    store.nvme.release_all()
    for handle in handles:
        handle.wait()
    store.nvme.gated = True
    started = [handle.start_copy_out() for handle in handles]
    store.nvme.wait_pending(3)  # all three reads held by the tier, none waited for
    store.nvme.release_all()
    for value, handle, copy in zip(values[::-1], handles[::-1], started[::-1], strict=True):
        out = copy.result()
        assert out.numel() == handle.reserved and torch.equal(out[: value.numel() * 4].view(torch.float32), value)
        assert handle.tier == "nvme" and handle.state is ObjectState.RESIDENT
    store.nvme.fail_next = OSError("the disk said no")
    failed = handles[0].start_copy_out()
    store.nvme.wait_pending(1)  # the read reaches the tier on the scheduler's thread
    store.nvme.release_all()
    failed.settle()
    with pytest.raises(OSError, match="the disk said no"):
        failed.result()
    store.nvme.gated = False
    for handle in handles:
        handle.free()


def test_known_bytes_of_a_handle_feed_a_move_and_their_copy_can_be_awaited(make_store):
    """Rule 6 through handles: ``known_bytes`` names a memory object's bytes for a move from
    storage; ``wait_known_copy`` returns once the copy out of them ended (at once without one)."""
    store = make_store()
    data = torch.arange(2 * BLOCK // 4, dtype=torch.float32)
    handle = store.registry.register(data.clone(), "device", dedup=False)
    handle.move_to("nvme", Priority.WRITEBACK)
    handle.wait()
    memory = store.registry.register(data[: BLOCK // 4].clone(), "device", dedup=False)
    memory.wait_known_copy()  # no move: nothing to wait for
    handle.move_to("host", Priority.DEMAND, memory.known_bytes(0, BLOCK))
    handle.wait_known_copy()
    assert handle.obj.copy is None or handle.obj.copy.done()
    handle.wait()
    assert torch.equal(handle.tensor("host"), data)
    handle.move_to("nvme", Priority.WRITEBACK)
    handle.wait()
    with pytest.raises(AssertionError, match="memory tier"):
        handle.known_bytes(0, BLOCK)  # stored bytes are no known bytes
    handle.free()
    memory.free()


def test_known_bytes_that_are_the_whole_move_are_waited_for_too(make_store, monkeypatch):
    """Rules 6 and 12: where everything past the known bytes is a zero tail, the move's own
    transfer copies them and nothing else; ``wait_known_copy`` waits for it as for a copy beside
    a read, so their owner never frees or reuses them under it (a chunk's device copy emptied
    while its home was staged from it crashed the copy thread)."""
    import threading

    from tiermem.tiers import memory as memory_tiers

    store = make_store()
    nbytes = 4 * BLOCK
    handle = store.registry.make("host", nbytes)
    handle.tensor("host").zero_()[:BLOCK].fill_(7)
    handle.move_to("nvme", Priority.WRITEBACK, zero_from=BLOCK)
    handle.wait()
    memory = store.registry.register(torch.full((BLOCK,), 7, dtype=torch.uint8), "device", dedup=False)
    gate, copying = threading.Event(), threading.Event()
    run_copy = memory_tiers._run_copy

    def held(future, dst, src):
        copying.set()
        gate.wait(10)
        run_copy(future, dst, src)

    monkeypatch.setattr(memory_tiers, "_run_copy", held)  # the memory tiers' copy threads
    handle.move_to("host", Priority.DEMAND, memory.known_bytes(0, BLOCK))
    assert copying.wait(10)  # the known bytes are being copied, and that is the whole move
    waited = threading.Thread(target=handle.wait_known_copy)
    waited.start()
    waited.join(0.2)
    assert waited.is_alive()  # it waits while the copy reads them
    gate.set()
    waited.join(10)
    assert not waited.is_alive()
    handle.wait()
    assert handle.tensor("host")[:BLOCK].eq(7).all() and not handle.tensor("host")[BLOCK:].any()
    handle.free()
    memory.free()


def test_cached_bytes_are_accounted_until_freed_and_refused_past_capacity(make_store):
    """Rule 7: ``adopt_cache`` accounts a buffer on the tier without copying it."""
    store = make_store(device_capacity=1 << 20)
    buffer = torch.ones(768 << 10, dtype=torch.uint8)
    cached = store.registry.adopt_cache("device", buffer)
    assert cached.tensor.data_ptr() == buffer.data_ptr() and store.current()["device"] == 768 << 10
    with pytest.raises(TierCapacityError):
        store.registry.adopt_cache("device", torch.ones(512 << 10, dtype=torch.uint8))
    cached.free()
    cached.free()  # idempotent
    assert store.current()["device"] == 0
    with pytest.raises(ObjectFreedError):
        cached.tensor  # noqa: B018
    with pytest.raises(ValueError, match="not a memory tier"):
        store.registry.adopt_cache("nvme", buffer)


def _stale_nvme(store: Store, nbytes: int) -> None:
    """Leave ``nbytes`` of 0xFF bytes on the NVMe tier's file where the next objects go, so a
    read of bytes never written there returns them, not the zeros of a fresh file."""
    stale = store.registry.register(torch.full((nbytes,), 255, dtype=torch.uint8), "nvme", dedup=False)
    stale.free()


def _dirty_host(store: Store, nbytes: int) -> None:
    """Leave a host block of ``nbytes`` holding 0xAB bytes for the next object of that size, so
    bytes a move back does not write show up as such, not as the zeros of fresh pages."""
    block = store.registry.make("host", nbytes)
    block.tensor("host").fill_(0xAB)
    block.free()


def _nvme_written(store: Store) -> int:
    return store.nvme.statistics().bytes_written


def _link_bytes(store: Store, link: str) -> int:
    stats = store.scheduler.statistics().links.get(link)
    return 0 if stats is None else stats.bytes


def test_a_zero_tail_is_neither_written_to_storage_nor_read_back(make_store):
    """Rule 12: an object moved to NVMe with ``zero_from`` writes only the bytes before it (from
    the next alignment boundary on); read back (a move, ``copy_out``) its tail is zeros although
    the file holds other bytes there, and only the stored bytes cross the link. Back in memory the
    tail ends: the next write-back writes the whole object."""
    store = make_store()
    nbytes = 4 * BLOCK
    _stale_nvme(store, 2 * nbytes)
    data = torch.zeros(nbytes, dtype=torch.uint8)
    data[: BLOCK + 100] = torch.arange(BLOCK + 100, dtype=torch.int64).remainder(251).to(torch.uint8) + 1
    handle = store.registry.make("host", nbytes)
    handle.tensor("host").copy_(data)
    written = _nvme_written(store)
    handle.move_to("nvme", Priority.WRITEBACK, zero_from=BLOCK + 100)
    handle.wait()
    assert handle.obj.zero_from == BLOCK + 4096  # rounded up to the alignment: whole blocks of direct I/O
    assert _nvme_written(store) - written == BLOCK + 4096
    assert torch.equal(handle.copy_out()[:nbytes], data)
    before = _link_bytes(store, "nvme->host")
    _dirty_host(store, nbytes)
    handle.move_to("host", Priority.DEMAND)
    handle.wait()
    assert _link_bytes(store, "nvme->host") - before == BLOCK + 4096
    assert torch.equal(handle.tensor("host"), data) and handle.obj.zero_from is None
    handle.tensor("host")[-1] = 7  # changed in memory: written whole, no tail any more
    written = _nvme_written(store)
    handle.move_to("nvme", Priority.WRITEBACK)
    handle.wait()
    assert _nvme_written(store) - written == nbytes and handle.obj.zero_from is None
    data[-1] = 7
    assert torch.equal(handle.copy_out()[:nbytes], data)
    handle.free()


def test_a_zero_tail_at_or_past_the_end_is_no_tail_and_one_outside_the_object_is_refused(make_store):
    """Rule 12: a tail that rounds up to the object's end leaves every byte written; a tail
    outside the object is a caller's error, and the object stays where it was."""
    store = make_store()
    handle = store.registry.make("host", 2 * BLOCK)
    handle.tensor("host").fill_(3)
    handle.move_to("nvme", Priority.WRITEBACK, zero_from=2 * BLOCK - 10)
    handle.wait()
    assert handle.obj.zero_from is None
    assert torch.equal(handle.copy_out(), torch.full((2 * BLOCK,), 3, dtype=torch.uint8))
    handle.move_to("host", Priority.DEMAND)
    handle.wait()
    for bad in (0, 2 * BLOCK + 1):
        with pytest.raises(AssertionError, match="zero tail"):
            handle.move_to("nvme", Priority.WRITEBACK, zero_from=bad)
        assert handle.tier == "host" and handle.state is ObjectState.RESIDENT
    handle.free()


def test_a_zero_tail_read_with_known_bytes_and_by_range_copies_is_zeros(make_store):
    """Rule 12 with rules 6 and 8: a move back told its stored prefix sits in memory reads
    nothing at all; range copies out of the object read only what lies before the tail and
    zero the rest of their span; a range copy into its storage that reaches past the tail moves
    the tail to its end, and one starting past it is refused (the bytes between were never
    written). The file holds 0xFF bytes under the tail throughout."""
    from tiermem.registry import KnownBytes

    store = make_store()
    nbytes = 4 * BLOCK
    _stale_nvme(store, 2 * nbytes)
    stored = torch.arange(BLOCK, dtype=torch.int64).remainder(250).to(torch.uint8) + 1
    handle = store.registry.make("host", nbytes)
    handle.tensor("host").zero_()[:BLOCK].copy_(stored)
    handle.move_to("nvme", Priority.WRITEBACK, zero_from=BLOCK)
    handle.wait()
    expected = torch.zeros(nbytes, dtype=torch.uint8)
    expected[:BLOCK] = stored

    target = store.registry.make("host", nbytes)
    target.tensor("host").fill_(9)  # a reused block's old bytes, which the copies must replace
    before = _link_bytes(store, "nvme->host")
    target.fill_from(handle, nbytes=2 * BLOCK, source_offset=BLOCK // 2, offset=0).wait()  # across the tail
    target.fill_from(handle, nbytes=BLOCK, source_offset=3 * BLOCK, offset=3 * BLOCK).wait()  # inside it
    assert _link_bytes(store, "nvme->host") - before == BLOCK // 2
    got = target.tensor("host")
    assert torch.equal(got[: 2 * BLOCK], expected[BLOCK // 2 : BLOCK // 2 + 2 * BLOCK])
    assert not got[3 * BLOCK :].any() and (got[2 * BLOCK : 3 * BLOCK] == 9).all()

    memory = store.registry.register(stored.clone(), "device", dedup=False)
    before = _link_bytes(store, "nvme->host")
    _dirty_host(store, nbytes)
    handle.move_to("host", Priority.DEMAND, KnownBytes(memory.obj.home, 0, BLOCK))
    handle.wait()
    assert _link_bytes(store, "nvme->host") == before  # the stored bytes were known: nothing read
    assert torch.equal(handle.tensor("host"), expected)

    handle.move_to("nvme", Priority.WRITEBACK, zero_from=BLOCK)
    handle.wait()
    piece = store.registry.register(torch.full((BLOCK,), 5, dtype=torch.uint8), "host", dedup=False)
    handle.fill_from(piece, nbytes=BLOCK, offset=BLOCK).wait()  # from the tail's start: it moves on
    assert handle.obj.zero_from == 2 * BLOCK
    expected[BLOCK : 2 * BLOCK] = 5
    assert torch.equal(handle.copy_out()[:nbytes], expected)
    with pytest.raises(AssertionError, match="unwritten"):
        handle.fill_from(piece, nbytes=BLOCK, offset=3 * BLOCK)
    assert torch.equal(handle.copy_out()[:nbytes], expected)
    for h in (handle, target, memory, piece):
        h.free()
