"""Runs of contiguous blocks handed to a vectored tier in one call (NOTE [ Scheduling rules ] 7).

A gated tier that says it is ``vectored`` shows what the scheduler issues and when; the real
NVMe tier (posix and aio, with injected faults) shows that the bytes are right and that a
fault in one block of a run fails the run and the move, with nothing left in flight. No
timing is asserted.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.gated_tier import BLOCK, GatedTier, VectoredGatedTier, filled
from tiermem.errors import StorageIOError, TransferCancelledError
from tiermem.schedulers import Priority
from tiermem.schedulers.asyncio_scheduler import RUN_SHARE
from tiermem.tiers.backends import aio
from tiermem.tiers.backends.aio import AioBackend
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.nvme import NvmeTier


@pytest.fixture
def gated(gated: Callable[..., GatedTier]) -> Callable[..., GatedTier]:
    """The shared gated tiers, vectored: they take runs, as the NVMe tier does."""
    return functools.partial(gated, VectoredGatedTier)


def _settle() -> None:
    time.sleep(0.05)  # let the loop issue whatever it is going to issue


# -- what is issued ---------------------------------------------------------------------------------
def test_a_move_goes_to_a_vectored_tier_in_runs_that_fill_its_queue(device, make_scheduler, gated) -> None:
    storage = gated(queue_depth=8)
    scheduler = make_scheduler()
    run = max(1, int(8 * RUN_SHARE))
    assert run == 2
    src = filled(device, 16 * BLOCK)
    dst = storage.allocate(16 * BLOCK)
    transfer = scheduler.submit(src, dst, priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    _settle()
    # Four calls of two blocks: the queue depth (8) counts blocks, not calls.
    assert [(op, offset, length) for op, _id, offset, length in storage.log] == [
        ("write", i * run * BLOCK, run * BLOCK) for i in range(4)
    ]
    assert dict(scheduler.statistics().inflight_bytes) == {"device": 8 * BLOCK, "nvme": 8 * BLOCK}
    storage.release(1)  # one run lands: its two slots go to the next run at once
    storage.wait_pending(4)
    assert storage.log[4][2:] == (8 * BLOCK, run * BLOCK)
    storage.gated = False
    storage.release_all()
    transfer.wait(timeout=10)
    stats = scheduler.statistics()
    assert stats.links["device->nvme"].bytes == 16 * BLOCK
    assert stats.links["device->nvme"].requests == 16  # blocks, as the device counts them
    assert dict(stats.inflight_bytes) == {"device": 0, "nvme": 0}


def test_runs_carry_the_bytes_and_the_tail_intact(device, make_scheduler, gated) -> None:
    storage = gated(queue_depth=16, gated=False)
    scheduler = make_scheduler()
    nbytes = 37 * BLOCK + 123  # a short last block inside the last run
    src = filled(device, nbytes, seed=3)
    middle = storage.allocate(nbytes)
    back = device.allocate(nbytes)
    scheduler.submit(src, middle, priority=Priority.WRITEBACK).wait(timeout=10)
    scheduler.submit(middle, back, priority=Priority.DEMAND).wait(timeout=10)
    assert torch.equal(src.view(), back.view())
    writes = [length for op, _a, _o, length in storage.log if op == "write"]
    assert sum(writes) >= nbytes and max(writes) == 4 * BLOCK  # runs of 16 * RUN_SHARE blocks
    assert scheduler.statistics().links["nvme->device"].requests == 38


def test_the_byte_bound_cuts_a_run_short(device, make_scheduler, gated) -> None:
    storage = gated(queue_depth=16)
    scheduler = make_scheduler(max_inflight=3 * BLOCK)
    transfer = scheduler.submit(filled(device, 12 * BLOCK), storage.allocate(12 * BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(1)
    _settle()
    # Blocks are admitted one by one: three fit the bound, the run's fourth does not, and
    # nothing more goes until the run lands.
    assert [length for _op, _a, _o, length in storage.log] == [3 * BLOCK]
    storage.release(1)
    storage.wait_pending(1)
    _settle()
    assert [length for _op, _a, _o, length in storage.log] == [3 * BLOCK, 3 * BLOCK]
    storage.gated = False
    storage.release_all()
    transfer.wait(timeout=10)


def test_prefetch_runs_leave_the_write_back_share(device, make_scheduler, gated) -> None:
    storage = gated(queue_depth=8)
    scheduler = make_scheduler(max_inflight=512 << 20)
    prefetch = scheduler.submit(storage.allocate(32 * BLOCK), device.allocate(32 * BLOCK), priority=Priority.PREFETCH)
    storage.wait_pending(3)
    _settle()
    assert sum(length for *_x, length in storage.log) == 6 * BLOCK  # 3/4 of 8 slots, in runs of 2
    writeback = scheduler.submit(filled(device, 2 * BLOCK), storage.allocate(2 * BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    assert storage.log[3][0] == "write" and storage.log[3][3] == 2 * BLOCK
    storage.gated = False
    storage.release_all()
    writeback.wait(timeout=10)
    prefetch.wait(timeout=10)


def test_a_demand_takes_the_slots_a_landing_run_frees(device, make_scheduler, gated) -> None:
    storage = gated(queue_depth=8)
    scheduler = make_scheduler()
    writeback = scheduler.submit(filled(device, 32 * BLOCK), storage.allocate(32 * BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    demand = scheduler.submit(storage.allocate(4 * BLOCK), device.allocate(4 * BLOCK), priority=Priority.DEMAND)
    _settle()  # the demand waits: every slot is taken
    storage.release(1)
    storage.wait_pending(4)
    assert storage.log[4][0] == "read"  # the freed run's slots went to the demand
    storage.release(1)
    storage.wait_pending(4)
    assert storage.log[5][0] == "read"
    demand_done_at = len(storage.log)
    storage.gated = False
    storage.release_all()
    demand.wait(timeout=10)
    writeback.wait(timeout=10)
    assert all(op == "write" for op, *_x in storage.log[demand_done_at:])


def test_a_failed_run_fails_the_move_and_issues_nothing_more(device, make_scheduler, gated) -> None:
    storage = gated(queue_depth=8)
    scheduler = make_scheduler()
    transfer = scheduler.submit(filled(device, 32 * BLOCK), storage.allocate(32 * BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    storage.fail_next = OSError(5, "injected I/O error in a run")
    storage.release(1)
    _settle()
    assert len(storage.log) == 4  # the failure stopped the move: no run after it
    assert not transfer.done()  # three runs still in flight: the buffers are still in use
    storage.release(3)
    with pytest.raises(OSError, match="injected"):
        transfer.wait(timeout=10)
    stats = scheduler.statistics()
    assert stats.failed == 1 and dict(stats.inflight_bytes) == {"device": 0, "nvme": 0}


def test_cancel_drops_unissued_runs_and_waits_for_those_in_flight(device, make_scheduler, gated) -> None:
    storage = gated(queue_depth=8)
    scheduler = make_scheduler()
    transfer = scheduler.submit(filled(device, 32 * BLOCK), storage.allocate(32 * BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    transfer.cancel()
    _settle()
    assert not transfer.done()
    storage.release(4)
    with pytest.raises(TransferCancelledError):
        transfer.wait(timeout=10)
    assert len(storage.log) == 4


def test_a_tier_that_is_not_vectored_gets_one_block_per_call(device, make_scheduler) -> None:
    storage = GatedTier(queue_depth=8, gated=False)
    scheduler = make_scheduler()
    scheduler.submit(filled(device, 8 * BLOCK), storage.allocate(8 * BLOCK), priority=Priority.WRITEBACK).wait(
        timeout=10
    )
    assert [length for *_x, length in storage.log] == [BLOCK] * 8


# -- the real NVMe tier ---------------------------------------------------------------------------
@pytest.fixture(params=["posix", "aio"])
def backend_name(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "aio":
        ok, reason = aio.probe(tmp_path)
        if not ok:
            pytest.skip(f"aio unusable here: {reason}")
    return str(request.param)


def _nvme(tmp_path: Path, backend: object, *, queue_depth: int = 8, npaths: int = 1) -> NvmeTier:
    paths = []
    for i in range(npaths):
        path = tmp_path / f"stripe{i}"
        path.mkdir()
        paths.append(path)
    return NvmeTier(paths, 64 << 20, backend=backend, block_size=BLOCK, queue_depth=queue_depth)  # type: ignore[arg-type]


@pytest.mark.parametrize("npaths", [1, 2])
def test_nvme_round_trip_in_runs(device, make_scheduler, tmp_path: Path, backend_name: str, npaths: int) -> None:
    backend = AioBackend() if backend_name == "aio" else PosixBackend()
    nvme = _nvme(tmp_path, backend, npaths=npaths)
    try:
        scheduler = make_scheduler()
        nbytes = 45 * BLOCK + 5000  # several runs, a short last block (padded for O_DIRECT)
        src = filled(device, nbytes, seed=7)
        home = nvme.allocate(nbytes)
        back = device.allocate(nbytes)
        scheduler.submit(src, home, priority=Priority.WRITEBACK).wait(timeout=30)
        scheduler.submit(home, back, priority=Priority.DEMAND).wait(timeout=30)
        assert torch.equal(src.view(), back.view())
        # A part in the middle, starting inside a block: runs need not start on a block boundary.
        part = device.allocate(9 * BLOCK)
        scheduler.submit(home, part, nbytes=9 * BLOCK, src_offset=BLOCK + 4096, priority=Priority.DEMAND).wait(
            timeout=30
        )
        assert torch.equal(part.view(), src.view(BLOCK + 4096, 9 * BLOCK))
        stats = scheduler.statistics()
        assert stats.links["nvme->device"].requests == 46 + 9
        assert nvme.statistics().bytes_read >= nbytes + 9 * BLOCK
    finally:
        nvme.close()
    assert list(tmp_path.rglob("data")) == []


@pytest.mark.parametrize("op", ["write", "read"])
def test_nvme_fault_in_one_block_fails_the_run_and_the_move(
    device, make_scheduler, tmp_path: Path, backend_name: str, op: str
) -> None:
    backend = FaultyBackend(AioBackend() if backend_name == "aio" else PosixBackend())
    nvme = _nvme(tmp_path, backend)
    try:
        scheduler = make_scheduler()
        nbytes = 32 * BLOCK
        src = filled(device, nbytes, seed=1)
        home = nvme.allocate(nbytes)
        back = device.allocate(nbytes)
        if op == "write":
            backend.eio_on_write = backend.writes + 11  # a block inside a run, not its first
            transfer = scheduler.submit(src, home, priority=Priority.WRITEBACK)
        else:
            scheduler.submit(src, home, priority=Priority.WRITEBACK).wait(timeout=30)
            backend.eio_on_read = backend.reads + 11
            transfer = scheduler.submit(home, back, priority=Priority.DEMAND)
        with pytest.raises(StorageIOError) as info:
            transfer.wait(timeout=30)
        message = str(info.value)
        assert nvme.data_files[0] in message and op in message and info.value.errno == 5
        stats = scheduler.statistics()
        assert stats.failed == 1 and dict(stats.inflight_bytes) == {"device": 0, "nvme": 0}
        # Nothing of the move is in flight any more: the tier can free its extent at once.
        nvme.free(home)
        assert nvme.statistics().current_bytes == 0
    finally:
        nvme.close()
