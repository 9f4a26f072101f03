"""The asyncio scheduler: one event loop on a background thread owns every move.

# NOTE [ Scheduling rules ]
1. A move is split into block-sized requests; after each block completes the
   dispatcher decides again, so a demand fetch overtakes a long write-back (TRAPS 11).
2. Priorities: DEMAND before PREFETCH before WRITEBACK; FIFO within a priority.
3. Bytes in flight are bounded per tier (``max_inflight``, per-tier override). A block
   is admitted when it fits, or when nothing is in flight on that tier: a block larger
   than the bound proceeds alone instead of deadlocking.
4. Prefetches' own blocks hold at most ``PREFETCH_SHARE`` of a tier's bound and of its
   queue, so write-backs (which free memory) always find room and are never starved by
   prefetch. The share counts the prefetches' blocks alone: counted against every block in
   flight, a long write-back that held more than the share kept a prefetch out until it
   ended (refilling the queue as each of its runs landed), where rule 2 puts the prefetch
   first as each run lands. On 2 cores with a 210M HF GPT-2 in a declared loop every chunk's
   home read (PREFETCH) queued 36-46 ms behind the write-back of the home before it, and the
   step waited for it (0.23-0.27 s a step). Write-backs are not held to the rest while a
   prefetch waits: with that, HF GPT-2's activation offload ran 1.09-1.19x ``keep`` in 3 runs,
   without it 0.89-1.10x (median 1.05x of 5; fresh processes alternated).
5. At most ``tier.queue_depth`` requests are in flight on the tier that executes them,
   so no request waits in a hidden queue where priorities cannot reach it. Once a move is
   refused because its executing tier has no slot left (or, for a prefetch, no slot of the
   prefetches' share), that tier's other moves are passed by until the next landing, and a
   priority's queue whose every executor is so is not walked (demands excepted: a waiting
   demand holds its tiers, rule 2). Asked move by move, 300 queued 2 MiB moves cost the loop
   467-517 us of CPU a move, 217-233 us passed by (``bench/queued_moves.py``, 2-vCPU VM); a
   training step's queues are short, and the 210M HF GPT-2's scheduler thread took 0.28-0.30
   CPU s a step either way.
6. Every issued block is tracked by its move; a move completes (done, failed or
   cancelled) only when none of its blocks are in flight, so after ``wait()`` the
   caller may free or reuse both buffers.
7. Runs: where the executing tier is ``vectored`` (it splits a request into block-sized
   I/Os itself: the NVMe tier), the blocks of one move admitted together go to it as one
   call on one buffer view — a *run* of contiguous blocks, one future, one submission.
   Rules 3-5 still count every block of a run (a run of k blocks takes k request slots and
   its bytes), so the device sees the same block-sized requests at the same depth; what
   goes is the Python work per block (a future, a view, a dispatch), which is what limits
   small blocks on a small machine (TRAPS 15). A run takes at most ``RUN_SHARE`` of the
   tier's queue depth, so runs land staggered and the queue refills as each one does,
   instead of draining to empty before the next batch; and rule 1's granularity becomes
   "after each run", at most a quarter of the queue. A run fails as a whole when any of
   its blocks fails (the move fails with it, as it would for one failed block).
8. A move submitted ``after`` a future is *held*: known to the loop (it counts as submitted,
   can be cancelled or promoted, and ``close`` waits for it or cancels it) but in no queue
   until the future is done, whatever its outcome; then it queues as any other move. Why: a
   chunk step computes on the step thread, and its home's write-back was submitted when the
   training thread next polled, at the next module's backward: on the 2.5x-RAM headline GPT
   (one 133 MiB chunk a module) 150-290 ms after the compute ended, while the home held the
   host room the next home's read needed.

Rules 3-5 and 7 (what a tier admits now) are decided by
:class:`~tiermem.schedulers.admission.TierLimits` (a move's record, ``Move``, is defined beside
it in that module); the loop, the priority queues and the hand-over of finished runs are here.

All scheduler state is touched only on the loop thread; the training thread talks to
it through ``call_soon_threadsafe`` and waits on ``concurrent.futures`` futures. Tiers
report finished blocks through one thread-safe deque that the loop drains in one wake-up
(:meth:`AsyncioScheduler._block_landed`): the same order as one ``call_soon_threadsafe``
per block, without a loop wake-up (self-pipe write, loop iteration, full ``_dispatch``)
per block, which is what small blocks pay for (TRAPS 15).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType

from tiermem import tracing
from tiermem.errors import RuntimeClosedError, internal_error
from tiermem.schedulers.admission import (
    MEMORY_BLOCK_SIZE,
    RUN_SHARE,
    Link,
    Move,
    TierLimits,
    executor_for,
    new_move,
    padded,
)
from tiermem.schedulers.base import (
    LinkStatistics,
    Priority,
    Scheduler,
    SchedulerStatistics,
    Transfer,
    WaitRecorder,
)
from tiermem.tiers.base import Allocation
from tiermem.units import format_size

__all__ = ["MEMORY_BLOCK_SIZE", "RUN_SHARE", "AsyncioScheduler"]

log = logging.getLogger("tiermem.scheduler")


@dataclass
class _Counters:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    links: dict[str, Link] = field(default_factory=dict)


class _Queues:
    """Rule 2's queues, one per priority, first in first out, and how many moves each holds per
    executing tier: the dispatcher passes a whole queue by when every tier executing its moves
    has no request slot left (:meth:`AsyncioScheduler._dispatch`)."""

    def __init__(self) -> None:
        self.moves: dict[Priority, collections.deque[Move]] = {p: collections.deque() for p in Priority}
        self.executors: dict[Priority, collections.Counter[str]] = {p: collections.Counter() for p in Priority}

    def append(self, move: Move, priority: Priority) -> None:
        self.moves[priority].append(move)
        self.executors[priority][move.executor.name] += 1

    def remove(self, move: Move, priority: Priority) -> None:
        self.moves[priority].remove(move)
        executors = self.executors[priority]
        executors[move.executor.name] -= 1
        if not executors[move.executor.name]:
            del executors[move.executor.name]


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed; the scheduler uses asyncio's default loop")
        else:
            return uvloop.new_event_loop()
    elif kind != "asyncio":
        raise ValueError(f"tiermem scheduler: loop must be 'uvloop' or 'asyncio', got {kind!r}")
    return asyncio.new_event_loop()


class AsyncioScheduler(Scheduler):
    """Moves bytes between tiers by priority, within per-tier in-flight bounds (the
    :class:`~tiermem.schedulers.base.Scheduler` protocol, by NOTE [ Scheduling rules ])."""

    def __init__(
        self,
        *,
        max_inflight: int = 512 << 20,
        tier_max_inflight: dict[str, int] | None = None,
        block_size: int = 1 << 20,
        loop: str = "uvloop",
        debug: bool = False,
    ) -> None:
        if max_inflight <= 0 or block_size <= 0:
            raise ValueError(
                f"tiermem scheduler: max_inflight ({max_inflight}) and block_size ({block_size}) must be > 0"
            )
        self.block_size = block_size
        self._queues = _Queues()
        self._moves: dict[Transfer, Move] = {}
        # Rules 3-5 and 7: the bounds live there alone (the properties below read and set them).
        self._limits = TierLimits(max_inflight, dict(tier_max_inflight or {}))
        self._counters = _Counters()
        self._waits = WaitRecorder()
        # Finished runs, from tier threads to the loop (see the module docstring).
        self._landed: collections.deque[tuple[Move, int, int, int, Priority, Future[None], float]] = collections.deque()
        self._drain_scheduled = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop = _new_loop(loop)
        self._loop.set_debug(debug)
        self.loop_kind = type(self._loop).__module__.split(".")[0]
        self._thread = threading.Thread(target=self._run_loop, name="tiermem-scheduler", daemon=True)
        self._thread.start()

    # -- public API (any thread) -----------------------------------------------------------
    def submit(
        self,
        src: Allocation,
        dst: Allocation,
        *,
        nbytes: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        priority: Priority = Priority.PREFETCH,
        label: str = "",
        after: Future[None] | None = None,
    ) -> Transfer:
        """Queue a move of ``nbytes`` (default: all of ``src``) from ``src`` to ``dst``; with
        ``after``, once that future is done (rule 8)."""
        if self._closed:
            raise RuntimeClosedError("the scheduler")
        if nbytes is None:
            nbytes = src.nbytes - src_offset
        if nbytes < 0 or src_offset + nbytes > src.reserved or dst_offset + nbytes > dst.reserved:
            raise internal_error(
                f"move of {nbytes} bytes from {src!r}+{src_offset} to {dst!r}+{dst_offset} out of bounds"
            )
        executor = executor_for(src.tier, dst.tier)
        for tier in {src.tier, dst.tier}:
            tier.fence()  # on this thread: its current stream is the one that produced the bytes
        transfer = Transfer(src, dst, nbytes, Priority(priority), self._cancel, self._promote, self._waits)
        transfer.label = label
        move = new_move(transfer, src_offset, dst_offset, executor, self.block_size)
        if tracing.RECORDER is not None:  # NOTE [ Timeline trace ]: the time it waits in the queue starts now
            move.queued_at = tracing.now()
        with self._close_lock:  # close() cannot begin between the check and the hand-over
            if self._closed:
                raise RuntimeClosedError("the scheduler")
            if after is None:
                self._loop.call_soon_threadsafe(self._enqueue, move)
            else:  # rule 8: held first, so a cancel or a close finds it; queued once ``after`` is done
                move.queued = False
                self._loop.call_soon_threadsafe(self._hold, move)
                after.add_done_callback(lambda _done: self._release_held(move))
        return transfer

    def statistics(self) -> SchedulerStatistics:
        """An immutable snapshot (taken on the loop thread so it is consistent)."""
        if self._closed or threading.current_thread() is self._thread:
            return self._snapshot()
        asked = asyncio.run_coroutine_threadsafe(self._snapshot_async(), self._loop)
        if asked.done():
            return asked.result()
        # The caller waits for the loop's turn (behind the moves it is handling): a wait of its
        # own in the timeline trace (NOTE [ Timeline trace ]), as rt.stats() in a step is one.
        traced = tracing.span("wait scheduler statistics", "wait")
        try:
            return asked.result()
        finally:
            if traced is not None:
                traced.end()

    def close(self, *, cancel_pending: bool = True) -> None:
        """Stop the scheduler. Moves not yet issued are cancelled (or, with
        ``cancel_pending=False``, finished first); blocks in flight always finish.
        Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        drained: Future[None] = Future()
        self._loop.call_soon_threadsafe(self._begin_close, drained, cancel_pending)
        drained.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_inflight(self) -> int:
        """Bytes in flight per tier unless ``tier_max_inflight`` names the tier (rule 3)."""
        return self._limits.max_inflight

    @max_inflight.setter
    def max_inflight(self, value: int) -> None:
        self._limits.max_inflight = value

    @property
    def tier_max_inflight(self) -> dict[str, int]:
        """Per-tier overrides of ``max_inflight`` (rule 3), by tier name."""
        return self._limits.tier_max_inflight

    @tier_max_inflight.setter
    def tier_max_inflight(self, value: dict[str, int]) -> None:
        self._limits.tier_max_inflight = dict(value)

    # -- loop thread ---------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _snapshot_async(self) -> SchedulerStatistics:
        return self._snapshot()

    def _snapshot(self) -> SchedulerStatistics:
        now = time.perf_counter()
        links = {
            name: LinkStatistics(
                bytes=link.bytes,
                busy_s=link.busy_s + ((now - link.busy_since) if link.inflight else 0.0),
                requests=link.requests,
            )
            for name, link in self._counters.links.items()
        }
        c = self._counters
        return SchedulerStatistics(
            links=MappingProxyType(links),
            queued=MappingProxyType({p.name.lower(): len(q) for p, q in self._queues.moves.items()}),
            inflight_bytes=MappingProxyType(dict(self._limits.inflight_bytes)),
            submitted=c.submitted,
            completed=c.completed,
            cancelled=c.cancelled,
            failed=c.failed,
            waits=self._waits.waits,
            wait_s=self._waits.wait_s,
        )

    def _enqueue(self, move: Move) -> None:
        self._counters.submitted += 1
        self._moves[move.transfer] = move
        if move.transfer.nbytes == 0:
            self._finish(move)
            return
        self._queues.append(move, move.transfer.priority)
        self._dispatch()

    def _hold(self, move: Move) -> None:
        """Rule 8: known to the loop, in no queue yet."""
        self._counters.submitted += 1
        self._moves[move.transfer] = move

    def _release_held(self, move: Move) -> None:
        """Rule 8, on whichever thread finished the future (or the submitting one, if it was done)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: close() cancelled the held move
            self._loop.call_soon_threadsafe(self._queue_held, move)

    def _queue_held(self, move: Move) -> None:
        if move.cancelled or self._moves.get(move.transfer) is not move:
            return  # cancelled (and finished) while it was held
        if move.queued_at:
            move.queued_at = tracing.now()  # NOTE [ Timeline trace ]: its time in the queue starts now
        if move.transfer.nbytes == 0:
            self._finish(move)
            return
        move.queued = True
        self._queues.append(move, move.transfer.priority)
        self._dispatch()

    def _cancel(self, transfer: Transfer) -> None:
        # A closed loop means the transfer had already ended.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel_on_loop, transfer)

    def _cancel_on_loop(self, transfer: Transfer) -> None:
        move = self._moves.get(transfer)
        if move is None or move.cancelled:
            return
        move.cancelled = True
        self._unqueue(move)
        if move.inflight == 0:
            self._finish(move)

    def _promote(self, transfer: Transfer, priority: Priority) -> None:
        self._loop.call_soon_threadsafe(self._promote_on_loop, transfer, priority)

    def _promote_on_loop(self, transfer: Transfer, priority: Priority) -> None:
        move = self._moves.get(transfer)
        if move is None or priority >= transfer.priority:
            return
        if move.queued:
            self._queues.remove(move, transfer.priority)
            self._queues.append(move, priority)
        transfer.priority = priority
        self._dispatch()

    def _unqueue(self, move: Move) -> None:
        if move.queued:
            self._queues.remove(move, move.transfer.priority)
            move.queued = False

    def _dispatch(self) -> None:
        """Issue every block that rules 2-5 admit, highest priority first (in runs, rule 7)."""
        held: set[str] = set()
        # Executors whose request slots (all, or the prefetches' share) are taken. Nothing lands
        # while this runs, so their other moves are passed by without asking rules 3-5 again, and
        # a queue whose every executor is full is left at once (rule 5).
        full: set[tuple[str, bool]] = set()
        for priority in Priority:
            queue = self._queues.moves[priority]
            prefetch = priority == Priority.PREFETCH
            executors = self._queues.executors[priority]
            for move in list(queue):
                # a waiting demand holds its tiers from lower priorities: the demands are all walked
                if priority != Priority.DEMAND and all((name, prefetch) in full for name in executors):
                    break
                while move.remaining > 0 and move.queued:
                    if (move.executor.name, prefetch) in full:
                        blocks = 0
                    else:
                        length, blocks = self._limits.admitted_run(move, held)
                        if not blocks and self._limits.saturated(move):
                            full.add((move.executor.name, prefetch))
                            if not prefetch:  # every slot taken: prefetches find none either
                                full.add((move.executor.name, True))
                    if not blocks:
                        if priority == Priority.DEMAND:
                            held.update(move.tier_names)
                        break
                    self._issue(move, length, blocks)
                if move.remaining == 0 and move.queued:
                    self._queues.remove(move, priority)
                    move.queued = False

    def _issue(self, move: Move, length: int, blocks: int = 1) -> None:
        """Hand ``blocks`` contiguous blocks (``length`` bytes) of ``move`` to its executor
        in one call: a run (rule 7), or a single block."""
        transfer = move.transfer
        src, dst = transfer.src, transfer.dst
        src_off = move.src_offset + move.issued
        dst_off = move.dst_offset + move.issued
        move.issued += length
        span = padded(move, src_off, dst_off, length)
        try:
            if move.executor is dst.tier:
                future = dst.tier.write(dst, dst_off, src.view(src_off, span))
            else:
                future = src.tier.read(src, src_off, dst.view(dst_off, span))
        except BaseException as exc:  # noqa: BLE001 - becomes the transfer's error
            move.error = move.error or exc
            self._unqueue(move)
            move.issued = transfer.nbytes
            if move.inflight == 0:
                self._finish(move)
            return
        move.inflight += 1
        priority = transfer.priority  # a promotion before it lands must not move its count (rule 4)
        self._limits.issued(move, span, blocks, priority)
        link = move.link
        if link is None:
            link = self._counters.links.get(transfer.link)
            if link is None:
                link = self._counters.links[transfer.link] = Link()
            move.link = link
        issued_at = time.perf_counter()
        if link.inflight == 0:
            link.busy_since = issued_at
        link.inflight += 1
        if (recorder := tracing.RECORDER) is not None:
            if move.started_at is None:
                move.started_at = issued_at
            recorder.inflight(transfer.link, span)
        future.add_done_callback(lambda f: self._block_landed((move, span, length, blocks, priority, f, issued_at)))

    def _block_landed(self, block: tuple[Move, int, int, int, Priority, Future[None], float]) -> None:
        """Any thread: hand a finished run (or block) to the loop, waking it only if no drain is due.

        The flag is cleared by the drain *before* it empties the deque, and set here *after*
        the append, so a block is either taken by a drain already running or schedules one."""
        self._landed.append(block)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon_threadsafe(self._drain_landed)

    def _drain_landed(self) -> None:
        self._drain_scheduled = False
        landed = self._landed
        while landed:
            self._block_done(*landed.popleft(), dispatch=False)
        self._dispatch()  # once for the whole batch: rules 2-5 see every freed slot at once

    def _block_done(
        self,
        move: Move,
        span: int,
        length: int,
        blocks: int,
        priority: Priority,
        future: Future[None],
        issued_at: float,
        *,
        dispatch: bool = True,
    ) -> None:
        transfer = move.transfer
        move.inflight -= 1
        self._limits.landed(move, span, blocks, priority)
        link = move.link
        if link is None:
            raise internal_error("a block finished on a move that never issued one")
        link.inflight -= 1
        if link.inflight == 0:
            link.busy_s += time.perf_counter() - link.busy_since
        if (recorder := tracing.RECORDER) is not None:
            recorder.inflight(transfer.link, -span)
        exc = future.exception()
        if exc is None:
            move.landed += length
            link.bytes += length
            link.requests += blocks  # blocks, as the device counts requests (a run is several)
        elif move.error is None:
            move.error = exc
            self._unqueue(move)
            move.issued = transfer.nbytes  # issue nothing more of a failed move
        if move.inflight == 0 and (move.remaining == 0 or move.cancelled):
            self._finish(move)
        if dispatch:
            self._dispatch()

    def _finish(self, move: Move) -> None:
        transfer = move.transfer
        if self._moves.pop(transfer, None) is None:
            return
        future = transfer._future
        if move.error is not None:
            self._counters.failed += 1
            future.set_exception(move.error)
        elif move.cancelled:
            self._counters.cancelled += 1
            future.cancel()
        else:
            self._counters.completed += 1
            future.set_result(None)
        if (recorder := tracing.RECORDER) is not None and move.queued_at:
            self._trace(recorder, move)

    @staticmethod
    def _trace(recorder: tracing.Recorder, move: Move) -> None:
        """The ended move on its link's track, and the two tiers' bytes in use after it
        (the registry freed the source in the transfer's callback): NOTE [ Timeline trace ]."""
        transfer = move.transfer
        outcome = "failed" if move.error is not None else "cancelled" if move.cancelled else "done"
        args = {"bytes": move.landed, "nbytes": transfer.nbytes, "priority": transfer.priority.name}
        args["object"], args["outcome"] = transfer.label, outcome
        ended = tracing.now()
        name = f"{transfer.label or 'move'} {format_size(transfer.nbytes)}"
        recorder.transfer(transfer.link, name, move.queued_at, move.started_at, ended, args)
        for tier in {transfer.src.tier, transfer.dst.tier}:
            recorder.counter(f"{tier.name} bytes in use", {"bytes": tier.current_bytes}, ended)

    def _begin_close(self, drained: Future[None], cancel_pending: bool) -> None:
        if cancel_pending:
            for move in list(self._moves.values()):
                move.cancelled = True
                self._unqueue(move)
                if move.inflight == 0:
                    self._finish(move)
        self._check_drained(drained)

    def _check_drained(self, drained: Future[None]) -> None:
        if not self._moves:
            drained.set_result(None)
        else:
            self._loop.call_later(0.001, self._check_drained, drained)
