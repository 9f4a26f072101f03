"""Shared checks that every tier and backend must pass, run against each one.

Round trips of random bytes at many sizes and offsets, accounting back to zero,
capacity errors that name the tier, concurrent requests, and I/O on freed
allocations refused.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest
import torch

from tiermem.errors import ObjectFreedError, TierCapacityError
from tiermem.tiers.backends import aio
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.base import ALIGNMENT, Tier
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.memory import aligned_empty
from tiermem.tiers.nvme import NvmeTier

CAPACITY = 64 << 20
BLOCK = 64 << 10

TierFactory = Callable[[object], Tier]

FACTORIES: dict[str, TierFactory] = {
    "device": lambda tmp: DeviceTier(CAPACITY, "cpu"),
    "host": lambda tmp: HostTier(CAPACITY),
    "nvme-posix-direct": lambda tmp: NvmeTier([tmp], CAPACITY, backend="posix", block_size=BLOCK, queue_depth=4),
    "nvme-posix-buffered": lambda tmp: NvmeTier(
        [tmp], CAPACITY, backend=FaultyBackend(PosixBackend(), refuse_direct=True), block_size=BLOCK, queue_depth=4
    ),
    "nvme-striped": lambda tmp: NvmeTier(
        [tmp / "a", tmp / "b"], CAPACITY, backend="posix", block_size=BLOCK, queue_depth=4
    ),
    "nvme-checksum": lambda tmp: NvmeTier(
        [tmp], CAPACITY, backend="posix", block_size=BLOCK, queue_depth=4, checksum=True
    ),
    # Linux AIO: aligned segments through the kernel queue, the rest on the worker pool.
    "nvme-aio-direct": lambda tmp: NvmeTier([tmp], CAPACITY, backend="aio", block_size=BLOCK, queue_depth=4),
    "nvme-aio-striped": lambda tmp: NvmeTier(
        [tmp / "a", tmp / "b"], CAPACITY, backend="aio", block_size=BLOCK, queue_depth=2
    ),
}


@pytest.fixture(params=sorted(FACTORIES))
def tier(request, tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    if "aio" in request.param:
        ok, reason = aio.probe(tmp_path)
        if not ok:
            pytest.skip(f"aio unusable here: {reason}")
    made = FACTORIES[request.param](tmp_path)
    yield made
    made.close()
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def _random(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("nbytes", [1, 100, ALIGNMENT - 1, ALIGNMENT, BLOCK + 1, 3 * BLOCK + 777, 2 << 20])
def test_round_trip_at_many_sizes(tier, nbytes):
    data = _random(nbytes, nbytes)
    allocation = tier.allocate(nbytes)
    tier.write(allocation, 0, data).result(timeout=30)
    back = torch.zeros(nbytes, dtype=torch.uint8)
    tier.read(allocation, 0, back).result(timeout=30)
    assert torch.equal(back, data)
    tier.free(allocation)
    stats = tier.statistics()
    assert stats.current_bytes == 0 and stats.allocations == 0
    assert stats.peak_bytes >= nbytes
    assert stats.bytes_written >= nbytes and stats.bytes_read >= nbytes


def test_writes_at_offsets_and_unaligned_buffers(tier):
    nbytes = 2 * BLOCK + 5000
    allocation = tier.allocate(nbytes)
    expected = _random(nbytes, 1)
    # Three writes at uneven offsets, from buffers that are not page-aligned.
    cuts = [0, 4095, BLOCK + 17, nbytes]
    for lo, hi in itertools.pairwise(cuts):
        src = torch.empty(hi - lo + 3, dtype=torch.uint8)[3:]
        src.copy_(expected[lo:hi])
        tier.write(allocation, lo, src).result(timeout=30)
    # Read back whole into an aligned buffer, and a middle piece into an unaligned one.
    whole = aligned_empty(nbytes, torch.device("cpu"))
    tier.read(allocation, 0, whole).result(timeout=30)
    assert torch.equal(whole, expected)
    piece = torch.empty(BLOCK + 1, dtype=torch.uint8)[1:]
    tier.read(allocation, 5000, piece).result(timeout=30)
    assert torch.equal(piece, expected[5000 : 5000 + BLOCK])
    tier.free(allocation)


@pytest.mark.parametrize("nbytes", [ALIGNMENT, BLOCK, 5 * BLOCK + ALIGNMENT])
def test_round_trip_from_page_aligned_buffers(tier, nbytes):
    # Page-aligned host buffers: the zero-copy path (for the aio backend, its kernel queue).
    data = aligned_empty(nbytes, torch.device("cpu"))
    data.copy_(_random(nbytes, 7 + nbytes))
    allocation = tier.allocate(nbytes)
    tier.write(allocation, 0, data).result(timeout=30)
    back = aligned_empty(nbytes, torch.device("cpu"))
    tier.read(allocation, 0, back).result(timeout=30)
    assert torch.equal(back, data)
    tier.free(allocation)


def test_capacity_is_enforced_and_named(tier):
    allocation = tier.allocate(CAPACITY - ALIGNMENT)
    with pytest.raises(TierCapacityError, match=f"{tier.name} tier"):
        tier.allocate(2 * ALIGNMENT)
    tier.free(allocation)
    tier.free(tier.allocate(CAPACITY))  # everything fits again once freed
    assert tier.statistics().current_bytes == 0


def test_concurrent_requests_from_many_threads(tier):
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for round_ in range(6):
                nbytes = 10_000 + 7919 * ((seed * 6 + round_) % 40)
                data = _random(nbytes, seed * 100 + round_)
                allocation = tier.allocate(nbytes)
                tier.write(allocation, 0, data).result(timeout=30)
                back = torch.empty(nbytes, dtype=torch.uint8)
                tier.read(allocation, 0, back).result(timeout=30)
                assert torch.equal(back, data)
                tier.free(allocation)
        except BaseException as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert tier.statistics().current_bytes == 0


def test_io_on_a_freed_allocation_is_refused(tier):
    allocation = tier.allocate(100)
    tier.free(allocation)
    with pytest.raises(ObjectFreedError):
        tier.write(allocation, 0, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(AssertionError, match="freed twice"):
        tier.free(allocation)


def test_close_frees_everything_and_is_idempotent(tier):
    for size in (10, 5000, BLOCK):
        tier.write(tier.allocate(size), 0, torch.ones(size, dtype=torch.uint8)).result(timeout=30)
    tier.close()
    tier.close()
    assert tier.statistics().current_bytes == 0


@pytest.mark.parametrize("nbytes", [1, ALIGNMENT + 5, BLOCK + 1])
def test_take_holds_the_bytes(tier, nbytes):
    # Every memory tier here is on the CPU and unpinned: it adopts CPU bytes in place, exactly
    # as many as it is given; a storage tier allocates (rounded up) and copies them in.
    data = _random(nbytes, 11 + nbytes)
    expected = data.clone()
    allocation = tier.take(data)
    if tier.is_memory:
        assert allocation.tensor is not None and allocation.tensor.data_ptr() == data.data_ptr()
        assert allocation.reserved == nbytes
    else:
        assert allocation.reserved == tier.reserved_size(nbytes)
        assert tier.statistics().bytes_written == nbytes
    assert allocation.nbytes == nbytes and tier.statistics().current_bytes == allocation.reserved
    back = torch.zeros(nbytes, dtype=torch.uint8)
    tier.read(allocation, 0, back).result(timeout=30)
    assert torch.equal(back, expected)
    tier.free(allocation)
    assert tier.statistics().current_bytes == 0


def test_take_frees_what_it_allocated_when_the_copy_fails(tier):
    # Meta bytes are on no device this tier adopts from and cannot be copied: the copy fails
    # after the allocation was made, and take() must give it back.
    with pytest.raises(NotImplementedError, match="meta"):
        tier.take(torch.empty(BLOCK, dtype=torch.uint8, device="meta"))
    stats = tier.statistics()
    assert stats.current_bytes == 0 and stats.allocations == 0 and stats.bytes_written == 0
    with pytest.raises(TierCapacityError, match=f"{tier.name} tier"):
        tier.take(torch.zeros(CAPACITY + 1, dtype=torch.uint8))
    assert tier.statistics().current_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_take_adopts_only_what_the_tier_may_hold_in_place(tmp_path):
    cuda = torch.device("cuda", torch.cuda.current_device())
    device, host = DeviceTier(CAPACITY, cuda), HostTier(CAPACITY, pinned=True)
    nvme = NvmeTier([tmp_path], CAPACITY, backend="posix", block_size=BLOCK)
    try:
        on_device = _random(BLOCK, 1).to(cuda)
        pageable, pinned = _random(BLOCK, 2), _random(BLOCK, 3).pin_memory()
        cases = [
            (device, on_device, True),
            (device, pageable, False),  # another device: copied onto this one
            (host, pinned, True),
            (host, pageable, False),  # a pinned tier keeps its bytes page-locked: copied into its pool
            (host, on_device, False),
            (nvme, on_device, False),  # a storage tier is handed data.cpu()
        ]
        for tier, data, adopted in cases:
            allocation = tier.take(data)
            if tier.is_memory:
                assert (allocation.view().data_ptr() == data.data_ptr()) is adopted, (tier.name, data.device)
            back = torch.zeros(BLOCK, dtype=torch.uint8)
            tier.read(allocation, 0, back).result(timeout=30)
            torch.cuda.synchronize()
            assert torch.equal(back, data.cpu()), (tier.name, data.device)
            tier.free(allocation)
    finally:
        for tier in (device, host, nvme):
            tier.close()


def test_peak_counts_only_allocations_that_exist(tmp_path):
    host = HostTier(CAPACITY)
    host._allocate = lambda nbytes, reserved: (_ for _ in ()).throw(MemoryError("injected"))  # type: ignore[method-assign]
    with pytest.raises(MemoryError, match="injected"):
        host.allocate(1 << 20)
    stats = host.statistics()
    assert stats.current_bytes == 0 and stats.peak_bytes == 0
    host.close()
    with pytest.raises(Exception, match="closed"):
        host.adopt(torch.zeros(10, dtype=torch.uint8))


@pytest.mark.parametrize("make", [lambda: HostTier(16 << 20), lambda: DeviceTier(16 << 20, device="cpu")])
def test_a_cpu_memory_tier_hands_a_freed_block_out_again_within_its_capacity(make):
    """NOTE [ Spare tier blocks ] rules 2-3: a freed block comes back for the next allocation of its
    size (no fresh pages to zero); one a view still reaches is let go, so the view's bytes stay
    its own; kept and live blocks never exceed the capacity, since an allocation that needs the
    room drops the kept ones first."""
    tier = make()
    try:
        block = tier.allocate(6 << 20)
        address = block.tensor.data_ptr()
        tier.free(block)
        again = tier.allocate(6 << 20)
        assert again.tensor.data_ptr() == address  # the same bytes, handed out again
        view = again.tensor[:4096]
        view.fill_(7)
        tier.free(again)  # a view lives on: not kept
        other = tier.allocate(6 << 20)
        other.tensor.fill_(1)
        assert other.tensor.data_ptr() != address and bool((view == 7).all())
        held = other.tensor  # another reference to the tensor: not kept either
        tier.free(other)
        assert tier._spare_bytes == 0
        del held
        kept = tier.allocate(6 << 20)
        tier.free(kept)
        assert tier._spare_bytes == tier.reserved_size(6 << 20)
        whole = tier.allocate(tier.capacity)  # needs the kept block's room: it is dropped
        assert tier._spare_bytes == 0 and tier.statistics().current_bytes == tier.capacity
        tier.free(whole)
        small = tier.allocate(2 << 20)
        tier.free(small)
        small = tier.allocate(2 << 20)  # the only kept block of its size handed out again
        larger = tier.allocate(4 << 20)
        tier.free(larger)
        rest = tier.allocate(tier.capacity - small.reserved)  # drops the 4 MiB block, the one kept
        assert tier._spare_bytes == 0
        tier.free(rest)
        kept = tier.allocate(6 << 20)
        tier.free(kept)  # kept again; adopted bytes that need its room drop it
        adopted = tier.adopt(torch.zeros(tier.capacity - small.reserved, dtype=torch.uint8))
        assert tier._spare_bytes == 0
        tier.free(adopted)
        assert tier._spare_bytes == 0  # an adopted buffer is not the tier's to keep
        tier.free(small)
    finally:
        tier.close()
    assert tier._spare_bytes == 0


@pytest.mark.parametrize("make", [lambda: HostTier(16 << 20), lambda: DeviceTier(16 << 20, device="cpu")])
def test_a_block_made_with_room_serves_the_next_request_of_any_size_up_to_it(make):
    """NOTE [ Spare tier blocks ] rule 6: an allocation asking for ``room`` holds its own bytes but
    accounts, and is kept at, the room's; the kept block then serves a request of another size
    with the same room (no fresh pages), where a request of its own size only takes fresh bytes.
    The room counts against the capacity like any byte."""
    tier = make()
    try:
        room = 6 << 20
        block = tier.allocate(5 << 20, room=room)
        assert (block.nbytes, block.reserved, block.view().numel()) == (5 << 20, room, 5 << 20)
        assert tier.statistics().current_bytes == room
        address = block.tensor.data_ptr()
        tier.free(block)
        other = tier.allocate(3 << 20, room=room)  # another size, the same room: the same bytes
        assert other.tensor.data_ptr() == address and (other.nbytes, other.reserved) == (3 << 20, room)
        tier.free(other)
        plain = tier.allocate(3 << 20)  # without the room: a block of its own size, fresh
        assert plain.tensor.data_ptr() != address and plain.reserved == 3 << 20
        with pytest.raises(TierCapacityError, match=f"{tier.name} tier"):
            tier.allocate(1 << 20, room=tier.capacity)  # its room does not fit beside the 3 MiB
        tier.free(plain)
        with pytest.raises(ValueError, match="negative"):
            tier.allocate(1 << 20, room=-1)
    finally:
        tier.close()
