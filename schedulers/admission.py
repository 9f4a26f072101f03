"""What the asyncio scheduler knows of one move and of the tiers it runs on: the move's
record, which tier executes it, and the per-tier bounds that admit its blocks.

NOTE [ Scheduling rules ] (in :mod:`tiermem.schedulers.asyncio_scheduler`) rules 3-5 and 7
are decided here, by :class:`TierLimits`; the loop, the queues and rules 1, 2, 6 and 8 stay with
the scheduler. Everything here is touched only on the scheduler's loop thread.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from tiermem.errors import internal_error
from tiermem.layout.shares import PREFETCH_SHARE
from tiermem.schedulers.base import Priority, Transfer
from tiermem.tiers.base import ALIGNMENT, Tier
from tiermem.units import round_up

__all__ = ["MEMORY_BLOCK_SIZE", "RUN_SHARE", "Link", "Move", "TierLimits", "executor_for", "new_move", "padded"]

#: Memory-to-memory copies have no queue to overtake in; bigger blocks cost less overhead.
MEMORY_BLOCK_SIZE = 8 << 20
#: The most of a vectored tier's queue depth one run may take (rule 7).
RUN_SHARE = 0.25


@dataclass
class Link:
    """One link's counters (``"device->nvme"``), kept on the loop thread."""

    bytes: int = 0
    busy_s: float = 0.0
    requests: int = 0
    inflight: int = 0
    busy_since: float = 0.0


@dataclass
class Move:
    transfer: Transfer
    src_offset: int
    dst_offset: int
    executor: Tier
    block_size: int
    issued: int = 0  # bytes issued so far
    inflight: int = 0  # runs in flight (a run is one call to the executing tier, rule 7)
    error: BaseException | None = None
    cancelled: bool = False
    queued: bool = True
    # Resolved once per move rather than per block (small blocks are counted per request,
    # TRAPS 15): the distinct tiers whose in-flight bytes it holds, and its link's counters.
    tier_names: tuple[str, ...] = ()
    link: Link | None = None
    #: The most blocks one call to the executor may carry (rule 7); 1 for tiers that are not vectored.
    max_run: int = 1
    landed: int = 0  # bytes landed so far
    #: For the timeline trace (NOTE [ Timeline trace ]): when it was submitted (0.0: not traced)
    #: and its first block issued.
    queued_at: float = 0.0
    started_at: float | None = None

    @property
    def remaining(self) -> int:
        return self.transfer.nbytes - self.issued


def executor_for(src: Tier, dst: Tier) -> Tier:
    """The tier that carries out a move: the storage side, else the device (its copy
    stream), else the destination."""
    if not src.is_memory and not dst.is_memory:
        raise internal_error(f"no direct path {src.name}->{dst.name}: stage through a memory tier")
    if not dst.is_memory:
        return dst
    if not src.is_memory:
        return src
    if src.name == "device":
        return src
    return dst


def new_move(transfer: Transfer, src_offset: int, dst_offset: int, executor: Tier, block_size: int) -> Move:
    """The record of ``transfer``: its block size (bigger between two memory tiers) and the
    longest run its executor takes in one call (rule 7)."""
    src, dst = transfer.src.tier, transfer.dst.tier
    memory_only = src.is_memory and dst.is_memory
    return Move(
        transfer,
        src_offset,
        dst_offset,
        executor,
        max(block_size, MEMORY_BLOCK_SIZE) if memory_only else block_size,
        tier_names=tuple(dict.fromkeys((src.name, dst.name))),
        max_run=max(1, int(executor.queue_depth * RUN_SHARE)) if executor.vectored else 1,
    )


def padded(move: Move, src_off: int, dst_off: int, length: int) -> int:
    """The last block may carry the allocations' alignment padding, so direct I/O
    needs no bounce buffer; padding stays inside both reservations."""
    transfer = move.transfer
    end = move.issued == transfer.nbytes
    if not end or length % ALIGNMENT == 0:
        return length
    # Only where the move ends both allocations' bytes: padding past a partial range
    # would overwrite destination bytes the move does not own.
    if src_off + length != transfer.src.nbytes or dst_off + length != transfer.dst.nbytes:
        return length
    padded = round_up(length, ALIGNMENT)
    if src_off + padded <= transfer.src.reserved and dst_off + padded <= transfer.dst.reserved:
        return padded
    return length


class TierLimits:
    """Bytes and requests in flight per tier, in all and of prefetches, and the bounds that
    admit a block (rules 3-5, 7)."""

    def __init__(self, max_inflight: int, tier_max_inflight: dict[str, int]) -> None:
        self.max_inflight = max_inflight
        self.tier_max_inflight = tier_max_inflight
        self.inflight_bytes: dict[str, int] = collections.defaultdict(int)
        self._inflight_requests: dict[str, int] = collections.defaultdict(int)
        # Rule 4's share counts the prefetches' own blocks (issued as PREFETCH), by tier name.
        self._prefetch_bytes: dict[str, int] = collections.defaultdict(int)
        self._prefetch_requests: dict[str, int] = collections.defaultdict(int)

    def bound(self, tier: Tier) -> int:
        """The tier's in-flight byte bound (rule 3)."""
        return self.tier_max_inflight.get(tier.name, self.max_inflight)

    def admits(self, move: Move, nbytes: int, held: set[str], slots_ahead: int = 0, bytes_ahead: int = 0) -> bool:
        """Rules 3-5 for one block of ``nbytes``; ``held``: tiers a demand is waiting on.
        ``slots_ahead``/``bytes_ahead``: blocks of the same run before this one, not yet
        counted as in flight (rule 7: each block of a run is admitted as if issued alone)."""
        if self.saturated(move, slots_ahead):
            return False
        transfer = move.transfer
        priority = transfer.priority
        prefetch = priority == Priority.PREFETCH
        for tier in (transfer.src.tier, transfer.dst.tier):
            if priority > Priority.DEMAND and tier.name in held:
                return False  # rule 2: nothing of lower priority slips in ahead of a waiting demand
            bound = self.bound(tier)
            inflight = self.inflight_bytes[tier.name] + bytes_ahead
            if inflight and inflight + nbytes > bound:
                return False
            if prefetch:  # rule 4: the prefetches' own bytes
                own = self._prefetch_bytes[tier.name] + bytes_ahead
                if own and own + nbytes > int(bound * PREFETCH_SHARE):
                    return False
        return True

    def saturated(self, move: Move, slots_ahead: int = 0) -> bool:
        """Rules 4 and 5 for request slots: no block of ``move`` can be admitted whatever its size
        (``slots_ahead`` blocks of its run counted before it), its executor's slots being all
        taken, or, for a prefetch, the prefetches' share of them. Until a run lands this holds
        for every move of that executor and priority, so the dispatcher passes the rest by."""
        executor = move.executor
        if self._inflight_requests[executor.name] + slots_ahead >= executor.queue_depth:
            return True
        if move.transfer.priority == Priority.PREFETCH:  # the prefetches' own slots
            own = self._prefetch_requests[executor.name] + slots_ahead
            return bool(own) and own >= max(1, int(executor.queue_depth * PREFETCH_SHARE))
        return False

    def admitted_run(self, move: Move, held: set[str]) -> tuple[int, int]:
        """How much of ``move`` to issue now: (bytes, blocks), (0, 0) when rules 2-5 admit
        nothing. Blocks are admitted one by one, as if each were issued alone, up to the
        move's run length (rule 7), so a run never holds more than its blocks would."""
        block, remaining = move.block_size, move.remaining
        length = min(block, remaining)
        if not self.admits(move, length, held):
            return 0, 0
        total, blocks = length, 1
        while blocks < move.max_run and total < remaining:
            length = min(block, remaining - total)
            if not self.admits(move, length, held, blocks, total):
                break
            total += length
            blocks += 1
        return total, blocks

    def issued(self, move: Move, span: int, blocks: int, priority: Priority) -> None:
        """Count a run of ``blocks`` (``span`` bytes) of ``move``, issued at ``priority``, as in flight."""
        for name in move.tier_names:
            self.inflight_bytes[name] += span
        self._inflight_requests[move.executor.name] += blocks
        if priority == Priority.PREFETCH:  # rule 4's share counts these alone
            for name in move.tier_names:
                self._prefetch_bytes[name] += span
            self._prefetch_requests[move.executor.name] += blocks

    def landed(self, move: Move, span: int, blocks: int, priority: Priority) -> None:
        """The run counted by :meth:`issued` (at the same ``priority``) is no longer in flight."""
        for name in move.tier_names:
            self.inflight_bytes[name] -= span
        self._inflight_requests[move.executor.name] -= blocks
        if priority == Priority.PREFETCH:
            for name in move.tier_names:
                self._prefetch_bytes[name] -= span
            self._prefetch_requests[move.executor.name] -= blocks
