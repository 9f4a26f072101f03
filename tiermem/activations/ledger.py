"""The write ledger: one model's activation write-backs in flight, and how they ended.

Fed on the scheduler's thread, read on the training thread; how the offloader acts on what it
reports is NOTE [ Activation fallbacks ] (in ``tiermem/activations/fallback.py``) rule 3.
"""

from __future__ import annotations

import errno
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from tiermem import tracing
from tiermem.errors import DiskFullError, TierCapacityError
from tiermem.registry import ManagedObject, Transfer


def failure_cause(exc: BaseException) -> str:
    """The cause name of NOTE [ Activation fallbacks ] rule 6 for a failed write (or allocation) on a tier."""
    if isinstance(exc, DiskFullError) or getattr(exc, "errno", None) == errno.ENOSPC:
        return "disk_full"
    if isinstance(exc, TierCapacityError):
        return "tier_full"
    return "io_error"


@dataclass(frozen=True)
class WriteFailure:
    """One write-back that ended in an error (no exception kept: its traceback would hold
    frames, and with them buffers, alive; TRAPS 14)."""

    forward_id: int
    index: int
    tier: str
    nbytes: int
    cause: str
    message: str


class WriteLedger:
    """Write-backs of one model's activations in flight, and how they ended.

    Fed by transfer callbacks on the scheduler's thread; read by the training thread.
    Holds no transfer, tensor or handle: only byte counts and outcomes (TRAPS 14). A
    failure whose error a concurrent ``wait()`` consumed first goes unseen here; the
    object still stays on the device (kept), and the tier's next failure is seen.
    """

    def __init__(self, written: dict[str, int], written_lock: threading.Lock) -> None:
        self._written = written  # the Runtime's bytes-written-per-tier counter
        self._written_lock = written_lock
        self._cond = threading.Condition()
        self._inflight = 0
        self._inflight_bytes: dict[str, int] = {}
        self._failures: list[WriteFailure] = []
        self._landed: set[str] = set()

    def started(
        self, transfer: Transfer, obj: ManagedObject, nbytes: int, tier: str, forward_id: int, index: int
    ) -> None:
        with self._cond:
            self._inflight += 1
            self._inflight_bytes[tier] = self._inflight_bytes.get(tier, 0) + nbytes
        # Weak: the object holds its bytes (TRAPS 14).
        ref = weakref.ref(obj)
        transfer.add_done_callback(lambda t: self._ended(t, ref, nbytes, tier, forward_id, index))

    def _ended(
        self,
        transfer: Transfer,
        ref: weakref.ref[ManagedObject],
        nbytes: int,
        tier: str,
        forward_id: int,
        index: int,
    ) -> None:
        # Read from the object's state, never via transfer.exception(): that re-raises the
        # stored error, whose traceback then holds this caller's frames (a saved-tensor
        # hook's, with the saved tensor) while the object keeps the error: TRAPS 16.
        # The registry's own callback ran first: the object is home on ``tier`` if the
        # write landed, with ``error`` set if it failed (NOTE [ Managed object rules ] 2).
        obj = ref()
        landed = obj is not None and obj.tier == tier
        error = None if obj is None or landed or transfer.cancelled() else obj.error
        if landed:
            with self._written_lock:
                self._written[tier] = self._written.get(tier, 0) + nbytes
        with self._cond:
            self._inflight -= 1
            self._inflight_bytes[tier] -= nbytes
            if error is not None:
                self._failures.append(WriteFailure(forward_id, index, tier, nbytes, failure_cause(error), str(error)))
            elif landed:
                self._landed.add(tier)
            self._cond.notify_all()

    @property
    def pending_failures(self) -> bool:
        return bool(self._failures)  # a racy peek is fine: take_failures() is exact

    def inflight_bytes(self, tiers: Sequence[str] | None = None) -> int:
        """Bytes of write-backs in flight (to ``tiers``, or to any tier)."""
        with self._cond:
            return sum(n for tier, n in self._inflight_bytes.items() if tiers is None or tier in tiers)

    def take_failures(self) -> tuple[list[WriteFailure], set[str]]:
        """The failures reported since the last call, and the tiers a write landed on."""
        with self._cond:
            failures, self._failures = self._failures, []
            landed, self._landed = self._landed, set()
        return failures, landed

    def wait_idle(self) -> None:
        """Wait until every write-back started so far has ended (landed, failed or cancelled)."""
        with self._cond:
            if self._inflight == 0:
                return
            # A wait on no one transfer (Transfer.wait names those): the timeline trace names it here.
            args = {"moves": self._inflight, "bytes": sum(self._inflight_bytes.values())}
            traced = tracing.span("wait saved activation write-backs", "wait", None, args)
            try:
                self._cond.wait_for(lambda: self._inflight == 0)
            finally:
                if traced is not None:
                    traced.end()
