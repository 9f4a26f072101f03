"""Scheduler ordering, bounds, cancellation and error propagation (NOTE [ Scheduling rules ])."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from tests.gated_tier import BLOCK, GatedTier, filled
from tiermem.errors import RuntimeClosedError, TransferCancelledError
from tiermem.schedulers import AsyncioScheduler, Priority, Scheduler


def test_demand_fetch_overtakes_a_long_writeback(device, make_scheduler, gated):
    storage = gated(queue_depth=1)
    scheduler = make_scheduler()
    big = filled(device, 8 * BLOCK)
    big_dst = storage.allocate(8 * BLOCK)
    writeback = scheduler.submit(big, big_dst, priority=Priority.WRITEBACK)
    storage.wait_pending(1)  # first write-back block in flight; the rest queued behind the bound
    small_src = storage.allocate(BLOCK)
    small_dst = device.allocate(BLOCK)
    demand = scheduler.submit(small_src, small_dst, priority=Priority.DEMAND)
    time.sleep(0.05)  # the demand request reaches the loop while the write-back block is held
    storage.release(1)  # the write-back block ends; the dispatcher now chooses
    storage.wait_pending(1)
    storage.release(1)
    demand.wait(timeout=10)
    assert not writeback.done()
    ops = [(op, alloc) for op, alloc, _off, _len in storage.log]
    # Issue order: one write-back block, then the demand read, then the rest of the write-back.
    assert ops[0] == ("write", big_dst.id)
    assert ops[1] == ("read", small_src.id)
    storage.gated = False
    storage.release_all()
    writeback.wait(timeout=10)
    assert [op for op, _ in ops[2:]] == ["write"] * (len(ops) - 2)


def test_blocks_are_split_and_bytes_arrive_intact(device, make_scheduler, gated):
    storage = gated(queue_depth=4, gated=False)
    scheduler = make_scheduler()
    nbytes = 5 * BLOCK + 123
    src = filled(device, nbytes, seed=3)
    middle = storage.allocate(nbytes)
    back = device.allocate(nbytes)
    scheduler.submit(src, middle, priority=Priority.WRITEBACK).wait(timeout=10)
    scheduler.submit(middle, back, priority=Priority.DEMAND).wait(timeout=10)
    assert torch.equal(src.view(), back.view())
    lengths = [length for op, _a, _o, length in storage.log if op == "write"]
    assert len(lengths) == 6 and max(lengths) == BLOCK
    stats = scheduler.statistics()
    assert stats.links["device->nvme"].bytes == nbytes
    assert stats.links["nvme->device"].bytes == nbytes
    assert stats.links["device->nvme"].requests == 6
    assert stats.completed == 2 and stats.failed == 0
    assert stats.links["device->nvme"].busy_s > 0


def test_move_larger_than_inflight_bound_proceeds_block_by_block(device, make_scheduler, gated):
    storage = gated(queue_depth=8, gated=False)
    scheduler = make_scheduler(max_inflight=BLOCK // 2)  # smaller than one block
    src = filled(device, 4 * BLOCK)
    dst = storage.allocate(4 * BLOCK)
    scheduler.submit(src, dst, priority=Priority.PREFETCH).wait(timeout=10)
    assert scheduler.statistics().links["device->nvme"].bytes == 4 * BLOCK


def test_inflight_bytes_stay_within_the_bound(device, make_scheduler, gated):
    storage = gated(queue_depth=64)
    scheduler = make_scheduler(max_inflight=4 * BLOCK)
    src = filled(device, 32 * BLOCK)
    dst = storage.allocate(32 * BLOCK)
    transfer = scheduler.submit(src, dst, priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    time.sleep(0.05)
    assert len(storage.pending) == 4  # the bound, not the queue depth, limits it
    storage.gated = False
    storage.release_all()
    transfer.wait(timeout=10)


def test_prefetch_never_starves_writeback(device, make_scheduler, gated):
    storage = gated(queue_depth=64)
    scheduler = make_scheduler(max_inflight=4 * BLOCK)
    prefetch_src = storage.allocate(64 * BLOCK)
    prefetch_dst = device.allocate(64 * BLOCK)
    prefetch = scheduler.submit(prefetch_src, prefetch_dst, priority=Priority.PREFETCH)
    storage.wait_pending(3)  # prefetch may fill 3/4 of the bound
    wb_src = filled(device, BLOCK)
    wb_dst = storage.allocate(BLOCK)
    writeback = scheduler.submit(wb_src, wb_dst, priority=Priority.WRITEBACK)
    storage.wait_pending(4)  # the write-back got the reserved share at once
    assert storage.log[3][0] == "write"
    storage.gated = False
    storage.release_all()
    writeback.wait(timeout=10)
    prefetch.wait(timeout=10)


@pytest.mark.parametrize("bound", ["queue", "bytes"])
def test_a_long_writeback_leaves_a_waiting_prefetch_its_share(device, make_scheduler, gated, bound):
    """Rule 4 counts the prefetches' own blocks: a write-back holding more than their share does
    not keep a prefetch out until it ends; as its blocks land the prefetch takes the slots first
    (rule 2), up to its share."""
    storage = gated(queue_depth=4) if bound == "queue" else gated(queue_depth=64)
    scheduler = make_scheduler() if bound == "queue" else make_scheduler(max_inflight=4 * BLOCK)
    writeback = scheduler.submit(filled(device, 16 * BLOCK), storage.allocate(16 * BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(4)  # the write-back fills the queue (or the bytes bound)
    prefetch = scheduler.submit(storage.allocate(8 * BLOCK), device.allocate(8 * BLOCK), priority=Priority.PREFETCH)
    time.sleep(0.05)  # the prefetch reaches the loop while the tier is full
    storage.release(3)  # three write-back blocks land, one by one
    storage.wait_pending(4)
    time.sleep(0.05)  # nothing more is issued past the bound
    assert [op for op, *_ in storage.log[4:]] == ["read"] * 3  # the prefetch's share; the write-back keeps 1
    # The write-back's last block in flight lands: the prefetch holds its share, so the slot is the write-back's.
    storage.release(1)
    storage.wait_pending(4)
    assert storage.log[7][0] == "write"
    storage.gated = False
    storage.release_all()
    prefetch.wait(timeout=10)
    writeback.wait(timeout=10)


def test_cancel_drops_queued_blocks_and_waits_for_inflight(device, make_scheduler, gated):
    storage = gated(queue_depth=1)
    scheduler = make_scheduler()
    src = filled(device, 8 * BLOCK)
    dst = storage.allocate(8 * BLOCK)
    transfer = scheduler.submit(src, dst, priority=Priority.WRITEBACK)
    storage.wait_pending(1)
    transfer.cancel()
    time.sleep(0.05)
    assert not transfer.done()  # one block still in flight: its buffers are still in use
    storage.release(1)
    with pytest.raises(TransferCancelledError, match="cancelled"):
        transfer.wait(timeout=10)
    assert transfer.cancelled()
    assert len(storage.log) == 1  # nothing issued after the cancel
    assert scheduler.statistics().cancelled == 1


def test_error_reaches_the_waiter_and_stops_the_move(device, make_scheduler, gated):
    storage = gated(queue_depth=1)
    scheduler = make_scheduler()
    src = filled(device, 4 * BLOCK)
    dst = storage.allocate(4 * BLOCK)
    transfer = scheduler.submit(src, dst, priority=Priority.WRITEBACK)
    storage.wait_pending(1)
    storage.fail_next = OSError(5, "injected I/O error")
    storage.release(1)
    with pytest.raises(OSError, match="injected"):
        transfer.wait(timeout=10)
    assert isinstance(transfer.exception(), OSError)
    assert len(storage.log) == 1
    assert scheduler.statistics().failed == 1


def test_promote_moves_a_prefetch_ahead(device, make_scheduler, gated):
    storage = gated(queue_depth=1)
    scheduler = make_scheduler()
    first_src, first_dst = storage.allocate(2 * BLOCK), device.allocate(2 * BLOCK)
    second_src, second_dst = storage.allocate(BLOCK), device.allocate(BLOCK)
    first = scheduler.submit(first_src, first_dst, priority=Priority.PREFETCH)
    storage.wait_pending(1)
    second = scheduler.submit(second_src, second_dst, priority=Priority.PREFETCH)
    second.promote(Priority.DEMAND)
    time.sleep(0.05)
    storage.release(1)
    storage.wait_pending(1)
    assert storage.log[1][1] == second_src.id
    storage.gated = False
    storage.release_all()
    first.wait(timeout=10)
    second.wait(timeout=10)


def test_memory_to_memory_copies_are_asynchronous_and_exact(device, make_scheduler):
    scheduler = make_scheduler()
    src = filled(device, 3 * (8 << 20) + 5)
    dst = device.allocate(src.nbytes)
    transfer = scheduler.submit(src, dst)
    transfer.wait(timeout=30)
    assert torch.equal(src.view(), dst.view())


def test_submit_after_close_is_a_clear_error(device):
    scheduler = AsyncioScheduler(loop="asyncio")
    scheduler.close()
    scheduler.close()  # idempotent
    a, b = device.allocate(10), device.allocate(10)
    with pytest.raises(RuntimeClosedError, match="scheduler is closed"):
        scheduler.submit(a, b)


def test_close_cancels_queued_moves(device):
    storage = GatedTier(queue_depth=1)
    scheduler = AsyncioScheduler(loop="asyncio", block_size=BLOCK)
    src = filled(device, 4 * BLOCK)
    dst = storage.allocate(4 * BLOCK)
    transfer = scheduler.submit(src, dst, priority=Priority.WRITEBACK)
    storage.wait_pending(1)
    # The in-flight block ends only after close() has begun: close must cancel the queued
    # blocks and still wait for that one.
    threading.Timer(0.2, storage.release, args=(1,)).start()
    scheduler.close()
    assert transfer.done()
    with pytest.raises(TransferCancelledError):
        transfer.wait()
    assert len(storage.log) == 1  # nothing issued after close began


def test_the_loop_is_never_blocked(device, caplog):
    """asyncio debug mode logs any callback slower than the threshold."""
    storage = GatedTier(queue_depth=8, gated=False)
    scheduler = AsyncioScheduler(loop="asyncio", block_size=BLOCK, debug=True)
    # Generous: a shared 2-core machine can stall any callback for tens of milliseconds.
    scheduler._loop.slow_callback_duration = 0.25
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        src = filled(device, 64 * BLOCK)
        dst = storage.allocate(64 * BLOCK)
        for _ in range(5):
            scheduler.submit(src, dst, priority=Priority.WRITEBACK).wait(timeout=10)
        scheduler.close()
    assert not [r for r in caplog.records if "took" in r.getMessage()]


def test_statistics_is_an_immutable_snapshot(device, make_scheduler):
    scheduler = make_scheduler()
    src = filled(device, BLOCK)
    dst = device.allocate(BLOCK)
    scheduler.submit(src, dst).wait(timeout=10)
    stats = scheduler.statistics()
    with pytest.raises(TypeError):
        stats.links["x"] = None  # type: ignore[index]
    with pytest.raises(AttributeError):
        stats.completed = 5  # type: ignore[misc]
    assert stats.as_dict()["completed"] == 1


def test_prefetch_leaves_request_slots_for_writebacks(device, make_scheduler, gated):
    """Rule 4 holds for request slots too: with the byte bound far away, prefetch takes at
    most 3 of 4 slots, so a write-back is issued at once (found in review)."""
    storage = gated(queue_depth=4)
    scheduler = make_scheduler(max_inflight=512 << 20)
    prefetch = scheduler.submit(storage.allocate(16 * BLOCK), device.allocate(16 * BLOCK), priority=Priority.PREFETCH)
    storage.wait_pending(3)
    time.sleep(0.05)
    assert len(storage.pending) == 3
    writeback = scheduler.submit(filled(device, BLOCK), storage.allocate(BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    assert storage.log[3][0] == "write"
    storage.gated = False
    storage.release_all()
    writeback.wait(timeout=10)
    prefetch.wait(timeout=10)


def test_a_waiting_demand_is_not_overtaken_by_smaller_blocks(device, make_scheduler, gated):
    storage = gated(queue_depth=64)
    scheduler = make_scheduler(max_inflight=2 * BLOCK)
    big = scheduler.submit(filled(device, 2 * BLOCK), storage.allocate(2 * BLOCK), priority=Priority.WRITEBACK)
    storage.wait_pending(2)  # the byte bound is full
    demand = scheduler.submit(storage.allocate(BLOCK), device.allocate(BLOCK), priority=Priority.DEMAND)
    small = [
        scheduler.submit(filled(device, 4096), storage.allocate(4096), priority=Priority.WRITEBACK) for _ in range(4)
    ]
    time.sleep(0.05)
    storage.release(2)
    storage.wait_pending(1)
    assert storage.log[2][0] == "read"  # the demand went first, no small write-back slipped in
    storage.gated = False
    storage.release_all()
    for transfer in (big, demand, *small):
        transfer.wait(timeout=10)


def test_a_partial_move_never_pads_into_bytes_it_does_not_own(device, make_scheduler):
    scheduler = make_scheduler()
    src = filled(device, 8192, seed=1)
    dst = filled(device, 8192, seed=2)
    before = dst.view().clone()
    scheduler.submit(src, dst, nbytes=100).wait(timeout=10)
    assert torch.equal(dst.view(0, 100), src.view(0, 100))
    assert torch.equal(dst.view(100, 8092), before[100:])


def test_a_burst_of_completions_is_dispatched_by_priority(device, make_scheduler, gated):
    # Blocks that finish together reach the loop as one batch and are dispatched once: the
    # slots they free still go to the waiting demand first (rule 2), none to the write-back.
    storage = gated(queue_depth=4)
    scheduler = make_scheduler()
    big = filled(device, 16 * BLOCK)
    big_dst = storage.allocate(16 * BLOCK)
    writeback = scheduler.submit(big, big_dst, priority=Priority.WRITEBACK)
    storage.wait_pending(4)
    fetched = storage.allocate(4 * BLOCK)
    fetched_dst = device.allocate(4 * BLOCK)
    demand = scheduler.submit(fetched, fetched_dst, priority=Priority.DEMAND)
    time.sleep(0.05)  # the demand reaches the loop while all four slots are taken
    burst = threading.Thread(target=storage.release, args=(4,))  # from another thread, back to back
    burst.start()
    burst.join()
    storage.wait_pending(4)
    assert [op for op, *_ in storage.log[4:8]] == ["read"] * 4
    storage.gated = False
    storage.release_all()
    demand.wait(timeout=10)
    writeback.wait(timeout=10)
    stats = scheduler.statistics()
    assert stats.completed == 2 and dict(stats.inflight_bytes) == {"device": 0, "nvme": 0}
    assert stats.links["device->nvme"].requests == 16 and stats.links["nvme->device"].requests == 4


def test_asyncio_scheduler_implements_the_scheduler_protocol(make_scheduler):
    scheduler = make_scheduler()
    assert isinstance(scheduler, Scheduler)
    # Every method the protocol names is the scheduler's own, not the protocol's stub.
    for name in ("submit", "statistics", "close"):
        assert getattr(AsyncioScheduler, name) is not getattr(Scheduler, name)
    assert AsyncioScheduler.closed is not Scheduler.closed
    assert not scheduler.closed
    scheduler.close()
    assert scheduler.closed


def test_a_move_after_a_future_waits_unissued_until_it_is_done(device, make_scheduler, gated):
    """Rule 8: held while the future is pending (counted, issued nothing), queued once it is done
    (an error of the work counts as done), and its bytes arrive intact."""
    storage = gated(queue_depth=4, gated=False)
    scheduler = make_scheduler()
    for outcome in ("result", "error"):
        work: Future[None] = Future()
        src = filled(device, 3 * BLOCK + 7, seed=5)
        dst = storage.allocate(src.nbytes)
        transfer = scheduler.submit(src, dst, priority=Priority.WRITEBACK, after=work)
        time.sleep(0.1)  # time enough for the loop to issue it, were it queued
        assert not transfer.done() and storage.log == []
        assert scheduler.statistics().submitted >= 1
        threading.Thread(
            target=work.set_result if outcome == "result" else work.set_exception,
            args=(None,) if outcome == "result" else (ValueError("the step failed"),),
        ).start()
        transfer.wait(timeout=10)
        assert [op for op, *_ in storage.log] == ["write"] * 4
        back = device.allocate(src.nbytes)
        scheduler.submit(dst, back, priority=Priority.DEMAND).wait(timeout=10)
        assert torch.equal(src.view(), back.view())
        storage.log.clear()
    done: Future[None] = Future()
    done.set_result(None)  # already done: queued at once
    src = filled(device, BLOCK)
    scheduler.submit(src, storage.allocate(BLOCK), after=done).wait(timeout=10)


def test_a_held_move_can_be_promoted_cancelled_and_closed(device, gated):
    """Rule 8: a held move keeps a promotion for when it queues; cancelled while held it ends
    cancelled and never issues, even once the future is done; close() cancels held moves."""
    storage = gated(queue_depth=1, gated=False)
    scheduler = AsyncioScheduler(loop="asyncio", block_size=BLOCK)
    try:
        work: Future[None] = Future()
        held = scheduler.submit(filled(device, BLOCK), storage.allocate(BLOCK), priority=Priority.WRITEBACK, after=work)
        held.promote(Priority.DEMAND)
        time.sleep(0.05)
        assert held.priority == Priority.DEMAND and not held.done()
        work.set_result(None)
        held.wait(timeout=10)
        cancelled_work: Future[None] = Future()
        cancelled = scheduler.submit(filled(device, BLOCK), storage.allocate(BLOCK), after=cancelled_work)
        cancelled.cancel()
        with pytest.raises(TransferCancelledError):
            cancelled.wait(timeout=10)
        cancelled_work.set_result(None)
        time.sleep(0.05)
        assert len(storage.log) == 1  # only the promoted move's block
        pending: Future[None] = Future()
        at_close = scheduler.submit(filled(device, BLOCK), storage.allocate(BLOCK), after=pending)
    finally:
        scheduler.close()
    assert at_close.done()
    with pytest.raises(TransferCancelledError):
        at_close.wait()
    pending.set_result(None)  # the loop is gone: releasing the held move changes nothing
    assert len(storage.log) == 1


def test_a_landing_asks_the_bounds_once_past_a_tier_whose_request_slots_are_all_taken(
    device, make_scheduler, gated, monkeypatch
):
    """Rules 3-5 are asked, at each landing, up to the first move they refuse because its
    executing tier's request slots are all taken; that tier's other queued moves are passed by
    (asked move by move at every landing, a few hundred queued moves took most of the loop's
    time). The moves still go in submission order, each as a slot frees."""
    from tiermem.schedulers.admission import TierLimits

    storage = gated(queue_depth=2)
    scheduler = make_scheduler()
    asked = [0]
    admitted_run = TierLimits.admitted_run

    def counted(self: TierLimits, move: object, held: set[str]) -> tuple[int, int]:
        asked[0] += 1
        return admitted_run(self, move, held)

    monkeypatch.setattr(TierLimits, "admitted_run", counted)
    destinations = [storage.allocate(BLOCK) for _ in range(40)]
    moves = [
        scheduler.submit(filled(device, BLOCK, seed=i), dst, priority=Priority.WRITEBACK)
        for i, dst in enumerate(destinations)
    ]
    storage.wait_pending(2)
    deadline = time.monotonic() + 10
    while scheduler.statistics().queued["writeback"] < 38 and time.monotonic() < deadline:
        time.sleep(0.01)  # every submission reaches the loop: 38 moves queued behind the 2 slots
    assert scheduler.statistics().queued["writeback"] == 38
    before = asked[0]
    for _ in range(5):
        storage.release(1)  # a slot frees: one move is issued, the rest passed by
        storage.wait_pending(2)
    time.sleep(0.05)  # the last landing's dispatch ended
    assert asked[0] - before <= 2 * 5, asked[0] - before  # the issued move and the next, refused
    storage.gated = False
    storage.release_all()
    for move in moves:
        move.wait(timeout=10)
    assert [alloc for op, alloc, _off, _len in storage.log if op == "write"] == [d.id for d in destinations]
