"""What the activation offloader does when a tier fails or the device budget runs short.

# NOTE [ Activation fallbacks ]
1. When: a block's policy is decided when its forward starts (its forward pre-hook),
   because ``recompute`` wraps the block's forward in ``torch.utils.checkpoint`` and cannot
   be chosen once that forward runs. A decision can only use what is known then: the
   failures reported so far, the device budget free now, and the bytes the block saved the
   last time it ran (scaled by the size of its first tensor input). So a disk that fails
   while block ``i`` runs changes blocks ``i+1...`` of this forward and the next forwards,
   never block ``i`` itself: block ``i`` is *kept*.
2. Which blocks: blocks that offload (``host``, ``nvme``) and blocks whose policy tiermem
   chose (every block under ``auto``; the last block of a plain ``host``/``nvme`` policy,
   kept because backward starts there). A block the user set to ``keep`` or ``recompute``
   is never changed: that is an instruction, and breaking the budget under it is an error.
3. Tier failures: a write-back that fails (disk full, I/O error, tier full) leaves its
   object resident on the device with its bytes intact (NOTE [ Managed object rules ] 2):
   that block is kept. The failure reaches the training thread through the
   :class:`WriteLedger` (filled on the scheduler's thread) and is acted on at the next
   block start or saved tensor. The tier is then *out* for the rest of this forward and the
   next 1, 2, 4, ... 64 forwards (doubling while retries keep failing; a write that lands
   after the outage ends clears it). Blocks planned for a tier that is out fall back to
   keep, or to recompute when the device cannot hold them (rule 4).
4. Device budget: the *room* is the device budget minus what stays resident: bytes in use
   now, less the write-backs in flight to working tiers (they free theirs on landing). A
   kept block needs its estimate in that room now; an offloaded block needs it in
   backward, to come back into (what stays resident now is still there when backward
   reaches it: kept blocks before it, tensors saved outside the blocks). A flexible block
   whose estimate exceeds the room is recomputed instead. The room also keeps back what the
   last forward saved outside the blocks (embeddings, head, loss): backward needs the
   head's tensors first, before any block frees its bytes. A block that fits by estimate
   but meets a full device while it runs waits for the write-backs in flight (rule 5).
5. A saved tensor that still does not fit on the device (the estimate was short, a failing
   write freed nothing, or the first forward had nothing to estimate from) first makes
   room by *evicting*: kept tensors of earlier flexible blocks of this forward are written
   synchronously to a working tier, the earliest block first (backward needs it last).
   If that is not enough, the tensor itself is written synchronously to the first working
   tier of: the block's offload tier, ``nvme``, ``host``. Both are stalls, not errors
   (blocks under a user's explicit ``keep`` excepted, rule 2). Only when nothing takes it
   does :class:`ActivationMemoryError` name the block, the bytes, each tier's state and
   what to change. A model's first forward has nothing measured: its first block's size
   and the bytes saved after the last block are unknown when decisions are made, so in a
   budget within about one block of the need the first step can still end in the clear
   error at backward (a tensor that cannot come back); later steps decide from
   measurements.
6. Every fallback logs a warning (once per block, forward and kind) and counts in
   ``activations.fallbacks`` and ``activations.fallback_reasons["<cause>-><action>"]``,
   cause ``disk_full | io_error | tier_full | device_full``, action ``keep | recompute |
   evict:<tier> | spill:<tier>``.
7. Gradients never change: keep and spill only move bytes, and recompute is
   ``torch.utils.checkpoint`` (which restores the RNG state), bitwise on the CPU.
"""

from __future__ import annotations

import errno
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiermem.errors import DiskFullError, TierCapacityError
from tiermem.layout.activation_policy import BlockPolicy
from tiermem.registry import ManagedObject, Transfer

#: Forwards a failing tier stays out at most (rule 3).
MAX_OUTAGE_FORWARDS = 64


def failure_cause(exc: BaseException) -> str:
    """The cause name of rule 6 for a failed write (or allocation) on a tier."""
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
                self._failures.append(
                    WriteFailure(forward_id, index, tier, nbytes, failure_cause(error), str(error))
                )
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
            self._cond.wait_for(lambda: self._inflight == 0)


@dataclass
class Outage:
    """A tier out of use for activations (rule 3)."""

    until: int  # the first forward that may use the tier again
    streak: int
    cause: str
    message: str


@dataclass
class ModelMemory:
    """What offloading one model has learned, kept across ``offload_activations`` contexts
    (``tiermem train`` opens one per step): forward count, block sizes, adaptive keep's
    policies, tier outages and the write ledger."""

    ledger: WriteLedger
    forwards: int = 0
    #: Saved bytes per element of the block's first tensor input, and raw saved bytes,
    #: measured the last time each block ran without recompute.
    bytes_per_input: dict[int, float] = field(default_factory=dict)
    block_bytes: dict[int, int] = field(default_factory=dict)
    adapted: list[BlockPolicy] | None = None
    #: Bytes backward prefetches ahead of need (NOTE [ Prefetch window ]); None until the
    #: first backward starts from the measured block sizes.
    prefetch_window: int | None = None
    outages: dict[str, Outage] = field(default_factory=dict)
    #: Bytes saved outside the blocks in the last complete forward, and so far in this one.
    outside_bytes: int = 0
    outside_now: int = 0

    def forward_started(self) -> None:
        self.forwards += 1
        if self.outside_now:
            self.outside_bytes, self.outside_now = self.outside_now, 0

    def measured(self, index: int, saved_bytes: int, input_numel: int) -> None:
        self.block_bytes[index] = saved_bytes
        if input_numel > 0:
            self.bytes_per_input[index] = saved_bytes / input_numel
        else:
            self.bytes_per_input.pop(index, None)

    def estimate(self, index: int, input_numel: int) -> int | None:
        """Bytes block ``index`` will save now, or None when nothing was measured yet.
        A block not measured yet is taken to be like the largest measured one (the
        blocks are a model's repeated layers)."""

        def one(i: int) -> int:
            ratio = self.bytes_per_input.get(i)
            return int(ratio * input_numel) if ratio is not None and input_numel > 0 else self.block_bytes[i]

        if index in self.block_bytes:
            return one(index)
        if not self.block_bytes:
            return None
        return max(one(i) for i in self.block_bytes)

    def outage(self, tier: str) -> Outage | None:
        """The tier's outage when it is out for the current forward."""
        out = self.outages.get(tier)
        return out if out is not None and self.forwards < out.until else None

    def tier_failed(self, tier: str, cause: str, message: str) -> bool:
        """Record a failure of ``tier``; True when it starts a new outage (rule 3)."""
        out = self.outages.get(tier)
        if out is not None and self.forwards < out.until:
            return False  # the same outage: writes started before it was known
        streak = out.streak + 1 if out is not None else 1
        skip = min(2 ** (streak - 1), MAX_OUTAGE_FORWARDS)
        self.outages[tier] = Outage(self.forwards + 1 + skip, streak, cause, message)
        return True

    def tier_worked(self, tier: str) -> None:
        """A write landed on ``tier``: an outage that has ended is forgotten (streak reset)."""
        out = self.outages.get(tier)
        if out is not None and self.forwards >= out.until:
            del self.outages[tier]


def first_tensor_numel(args: Sequence[object]) -> int:
    """Elements of a block's first tensor input (its hidden states), 0 when there is none."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.numel()
    return 0


def decide(planned: BlockPolicy, outage_cause: str | None, expected: int | None, room: int) -> tuple[BlockPolicy, str]:
    """A flexible block's policy for this forward (rules 3, 4) and the fallback taken
    ("" when none). ``outage_cause``: why the planned offload tier is out, or None;
    ``expected``: the block's estimated saved bytes (None: not measured yet); ``room``:
    the device budget minus what stays resident (rule 4)."""
    if planned is BlockPolicy.RECOMPUTE:
        return planned, ""
    cause = outage_cause or "device_full"
    if expected is not None and expected > room:
        return BlockPolicy.RECOMPUTE, f"{cause}->recompute"
    if planned.offloads and outage_cause is not None:
        return BlockPolicy.KEEP, f"{cause}->keep"
    return planned, ""
