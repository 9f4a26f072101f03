"""What a scheduler is and hands back: the :class:`Scheduler` protocol, priorities,
transfer handles and statistics.

A scheduler knows requests, priorities and byte counts, not what the bytes mean.
"""

from __future__ import annotations

import enum
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tiermem import tracing
from tiermem.errors import TransferCancelledError

if TYPE_CHECKING:
    from tiermem.tiers.base import Allocation


class Priority(enum.IntEnum):
    """Lower value runs first: backward needs a demand fetch now; a prefetch is
    ahead of need; a write-back only frees memory."""

    DEMAND = 0
    PREFETCH = 1
    WRITEBACK = 2


@dataclass(frozen=True)
class LinkStatistics:
    """Bytes moved over one link (``"device->nvme"``) and the seconds it was busy."""

    bytes: int = 0
    busy_s: float = 0.0
    requests: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {"bytes": self.bytes, "busy_s": self.busy_s, "requests": self.requests}


@dataclass(frozen=True)
class SchedulerStatistics:
    """An immutable snapshot of a scheduler. Counts are cumulative since it started."""

    links: Mapping[str, LinkStatistics] = field(default_factory=lambda: MappingProxyType({}))
    #: moves waiting to be (fully) issued, per priority name
    queued: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: bytes in flight per tier right now
    inflight_bytes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    #: waits on a transfer that had not finished yet, and the seconds spent in them
    waits: int = 0
    wait_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "links": {name: link.as_dict() for name, link in self.links.items()},
            "queued": dict(self.queued),
            "inflight_bytes": dict(self.inflight_bytes),
            "submitted": self.submitted,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "waits": self.waits,
            "wait_s": self.wait_s,
        }


class WaitRecorder:
    """Counts blocking waits (thread-safe); shared by a scheduler and its transfers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waits = 0
        self.wait_s = 0.0

    def record(self, seconds: float) -> None:
        with self._lock:
            self.waits += 1
            self.wait_s += seconds


class Transfer:
    """A handle on one move, waitable from synchronous code.

    ``wait()`` returns when every byte has landed, or raises the move's error
    (``TransferCancelledError`` when it was cancelled). Nothing is fire-and-forget:
    an error stays on the handle until someone waits or checks ``exception()``.
    """

    #: What the caller said the bytes are (the registry: the object's kind), for the timeline trace.
    label = ""

    def __init__(
        self,
        src: Allocation,
        dst: Allocation,
        nbytes: int,
        priority: Priority,
        cancel: Callable[[Transfer], None],
        promote: Callable[[Transfer, Priority], None],
        waits: WaitRecorder,
    ) -> None:
        self.src = src
        self.dst = dst
        self.nbytes = nbytes
        self.priority = priority
        self._future: Future[None] = Future()
        self._cancel = cancel
        self._promote = promote
        self._waits = waits

    @property
    def link(self) -> str:
        return f"{self.src.tier.name}->{self.dst.tier.name}"

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the move completes; raise its error if it failed or was cancelled."""
        if not self._future.done():
            traced = tracing.span(f"wait {self.label or 'move'} {self.link}", "wait", args=self._trace_args())
            start = time.perf_counter()
            try:
                self._future.result(timeout)
            except Exception:  # noqa: BLE001 - the move's own error is raised below by _raise_if_failed
                pass  # (KeyboardInterrupt and other BaseExceptions propagate as they are)
            finally:
                self._waits.record(time.perf_counter() - start)
                if traced is not None:
                    traced.end()
        self._raise_if_failed()

    def _trace_args(self) -> dict[str, object]:
        """What a wait on this move says in the timeline trace (NOTE [ Timeline trace ])."""
        return {"link": self.link, "object": self.label, "bytes": self.nbytes, "priority": self.priority.name}

    def _raise_if_failed(self) -> None:
        try:
            exc = self._future.exception(0)
        except CancelledError:
            raise TransferCancelledError(
                f"tiermem scheduler: the {self.link} move of {self.nbytes} bytes was cancelled"
            ) from None
        if exc is not None:
            raise exc

    def exception(self) -> BaseException | None:
        """The error the move ended with, or None; does not block (None while running)."""
        if not self._future.done():
            return None
        # Not via _raise_if_failed: raising and catching here would add this frame to the
        # error's traceback on every call, and a traceback keeps its frames' locals alive.
        try:
            return self._future.exception(0)
        except CancelledError:
            return TransferCancelledError(
                f"tiermem scheduler: the {self.link} move of {self.nbytes} bytes was cancelled"
            )

    def cancel(self) -> None:
        """Ask for the move to stop. Blocks not yet issued are dropped; blocks in flight
        finish first, then the transfer completes as cancelled (its buffers are then
        safe to free). Cancelling a finished transfer does nothing."""
        if not self._future.done():
            self._cancel(self)

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def promote(self, priority: Priority) -> None:
        """Raise the priority of the rest of this move (e.g. a prefetch now demanded)."""
        if priority < self.priority and not self._future.done():
            self._promote(self, priority)

    def add_done_callback(self, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(self)`` when the move ends (on the scheduler's thread, or now if done)."""
        # Weak: a strong reference would form the cycle transfer -> future -> callback ->
        # transfer, which only the cyclic GC frees (TRAPS 14).
        this = weakref.ref(self)

        def call(_future: Future[None]) -> None:
            transfer = this()
            if transfer is not None:
                fn(transfer)

        self._future.add_done_callback(call)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"Transfer({self.link}, {self.nbytes} bytes, {self.priority.name}, {state})"


@runtime_checkable
class Scheduler(Protocol):
    """What the rest of tiermem calls on a scheduler (the registry, the runtime, benchmarks).

    A scheduler carries out moves between two tiers' allocations, deciding when each part of
    a move is issued; it never allocates or frees. :class:`~tiermem.schedulers.AsyncioScheduler`
    implements it. Every method may be called from any thread. A scheduler starts working when
    it is constructed; :meth:`close` stops it.
    """

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
        """Queue a move of ``nbytes`` (default: ``src.nbytes - src_offset``) from ``src`` at
        ``src_offset`` to ``dst`` at ``dst_offset`` and return its handle without blocking.
        ``label`` says what the bytes are, for the timeline trace only (``Transfer.label``).
        ``after``: the move waits, unissued, until this future is done (its outcome aside):
        the work that writes the source runs on another thread (a chunk step), and the move
        starts as it ends rather than when the submitting thread next looks (NOTE [ Scheduling
        rules ] rule 8). It can be cancelled and promoted while it waits.

        Promises: out-of-bounds ranges and a move between two storage tiers raise at once
        (internal errors); a closed scheduler raises :class:`~tiermem.errors.RuntimeClosedError`.
        Moves run by ``priority`` (DEMAND, then PREFETCH, then WRITEBACK), and the move is
        ordered after device work the calling thread has already queued (TRAPS 28), so the
        caller may submit bytes its kernels are still writing. Both allocations must stay
        allocated until the transfer is done (``wait()`` returned or raised): the scheduler
        holds them, it does not own them. A move of 0 bytes completes at once.
        """
        ...

    def statistics(self) -> SchedulerStatistics:
        """A consistent, immutable snapshot of the counters: bytes and busy seconds per link,
        moves queued per priority, bytes in flight per tier, moves submitted / completed /
        cancelled / failed, and blocking waits. Works after :meth:`close` (the final counts)."""
        ...

    def close(self, *, cancel_pending: bool = True) -> None:
        """Stop the scheduler and return when nothing is in flight. Moves not yet issued are
        cancelled (their transfers end as cancelled), or with ``cancel_pending=False`` carried
        out first; requests already issued to a tier always finish, so every buffer is free to
        release when this returns. Later :meth:`submit` calls raise. Idempotent."""
        ...

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has begun."""
        ...
