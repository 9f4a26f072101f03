"""The machinery every tier shares: allocations, accounting, statistics and argument checks.

:class:`AccountedTier` does the bookkeeping and checking around the hooks that a new tier
implements (documented in :mod:`tiermem.tiers.base`, where :class:`~tiermem.tiers.base.Tier`
subclasses it), so every tier accounts the same way: ``current_bytes`` is the sum of
``reserved`` over live allocations and returns to zero when everything is freed.
"""

from __future__ import annotations

import abc
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tiermem.errors import ObjectFreedError, RuntimeClosedError, TierCapacityError, internal_error
from tiermem.units import ALIGNMENT, round_up

if TYPE_CHECKING:
    from tiermem.tiers.base import Tier

TIER_NAMES = ("device", "host", "nvme")


@dataclass(frozen=True)
class TierStatistics:
    """An immutable snapshot of one tier's accounting. Sizes are int bytes."""

    name: str
    capacity: int
    current_bytes: int
    peak_bytes: int
    bytes_written: int
    bytes_read: int
    allocations: int

    def as_dict(self) -> dict[str, int]:
        return {
            "capacity": self.capacity,
            "current_bytes": self.current_bytes,
            "peak_bytes": self.peak_bytes,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "allocations": self.allocations,
        }


_allocation_ids = itertools.count(1)


class Allocation:
    """A reservation of ``nbytes`` in one tier (``reserved`` bytes accounted, rounded up).

    Memory tiers set ``tensor`` to a ``uint8`` tensor of ``reserved`` bytes starting on an
    ``ALIGNMENT`` boundary; the bytes past ``nbytes`` are padding that moves may carry
    so direct I/O never needs a bounce buffer. Storage tiers set ``location`` to
    whatever they need to find the bytes (e.g. a logical offset).
    """

    __slots__ = ("__weakref__", "_freed", "id", "location", "nbytes", "reserved", "tensor", "tier")

    def __init__(
        self,
        tier: Tier,
        nbytes: int,
        reserved: int,
        *,
        tensor: torch.Tensor | None = None,
        location: Any = None,
    ) -> None:
        self.tier = tier
        self.nbytes = nbytes
        self.reserved = reserved
        self.tensor = tensor
        self.location = location
        self.id = next(_allocation_ids)
        self._freed = False

    @property
    def freed(self) -> bool:
        return self._freed

    def view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """The bytes ``[offset, offset + nbytes)`` of a memory-tier allocation as a uint8 tensor."""
        if self._freed:
            raise ObjectFreedError(f"tiermem {self.tier.name} tier: allocation {self.id} was freed")
        if self.tensor is None:
            raise internal_error(f"{self.tier.name} allocations have no tensor view")
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.reserved:
            raise internal_error(f"view [{offset}, {offset + nbytes}) outside allocation of {self.reserved} bytes")
        return self.tensor[offset : offset + nbytes]

    def __repr__(self) -> str:
        state = "freed" if self._freed else "live"
        return f"Allocation({self.tier.name}#{self.id}, nbytes={self.nbytes}, {state})"


class AccountedTier(abc.ABC):
    """The shared half of :class:`~tiermem.tiers.base.Tier`: argument checks, accounting,
    statistics and the lifecycle, around the hooks a tier implements."""

    def __init__(self, name: str, capacity: int, *, queue_depth: int = 2) -> None:
        if name not in TIER_NAMES:
            raise internal_error(f"unknown tier name {name!r}")
        self.name = name
        self.capacity = int(capacity)
        #: How many requests the tier serves concurrently; the scheduler keeps at most this
        #: many in flight so that priorities are decided by it, not by a hidden queue.
        self.queue_depth = max(1, int(queue_depth))
        self._lock = threading.Lock()
        self._current = 0
        self._peak = 0
        self._bytes_written = 0
        self._bytes_read = 0
        self._live: dict[int, Allocation] = {}
        self._closed = False

    # -- allocation ------------------------------------------------------------------
    def reserved_size(self, nbytes: int) -> int:
        """Bytes accounted for an allocation of ``nbytes`` (rounded up to ``ALIGNMENT``)."""
        return round_up(max(int(nbytes), 1), ALIGNMENT)

    def allocate(self, nbytes: int, *, room: int = 0) -> Allocation:
        """Reserve ``nbytes``, or ``room`` bytes where that is more (the allocation still holds
        ``nbytes``: what it moves; the rest is accounted and kept with it, so a memory tier can
        hand the block out again for any request of up to ``room``, NOTE [ Spare tier blocks ]
        rule 6); raises :class:`TierCapacityError` when they do not fit."""
        if nbytes < 0 or room < 0:
            raise ValueError(f"tiermem {self.name} tier: cannot allocate a negative size ({nbytes} bytes, room {room})")
        self._check_open()
        reserved = self.reserved_size(max(nbytes, room))
        return self._account(nbytes, reserved, lambda: self._allocate(nbytes, reserved))

    def _account(self, nbytes: int, reserved: int, make: Callable[[], Allocation]) -> Allocation:
        """Charge ``reserved`` bytes against the capacity, then build the allocation."""
        self._check_open()
        with self._lock:
            if self._current + reserved > self.capacity:
                raise TierCapacityError(self.name, reserved, self._current, self.capacity)
            self._current += reserved
        try:
            allocation = make()
        except BaseException:
            with self._lock:
                self._current -= reserved
            raise
        with self._lock:
            self._live[allocation.id] = allocation
            # The peak counts allocations that exist, not attempts that failed.
            self._peak = max(self._peak, self._current)
        return allocation

    def free(self, allocation: Allocation) -> None:
        """Release an allocation. Freeing twice is an internal error, not a silent no-op."""
        if allocation.tier is not self:
            raise internal_error(f"{allocation!r} freed through the {self.name} tier")
        with self._lock:
            if allocation._freed or self._live.pop(allocation.id, None) is None:
                raise internal_error(f"{allocation!r} freed twice")
            allocation._freed = True
            self._current -= allocation.reserved
        self._free(allocation)

    # -- data movement -----------------------------------------------------------------
    def write(self, allocation: Allocation, offset: int, src: torch.Tensor) -> Future[None]:
        """Copy the bytes of ``src`` (contiguous, uint8, 1-D) into ``allocation`` at ``offset``."""
        self._check_io(allocation, offset, src)
        future = self._write(allocation, offset, src)
        nbytes = src.numel()  # the callback must not capture ``src``: it would outlive the move (TRAPS 14)
        future.add_done_callback(lambda f: self._count(f, written=nbytes))
        return future

    def read(self, allocation: Allocation, offset: int, dst: torch.Tensor) -> Future[None]:
        """Copy ``dst.numel()`` bytes of ``allocation`` starting at ``offset`` into ``dst``."""
        self._check_io(allocation, offset, dst)
        future = self._read(allocation, offset, dst)
        nbytes = dst.numel()  # see write(): capture the count, not the buffer
        future.add_done_callback(lambda f: self._count(f, read=nbytes))
        return future

    def _count(self, future: Future[None], *, written: int = 0, read: int = 0) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            self._bytes_written += written
            self._bytes_read += read

    def _check_io(self, allocation: Allocation, offset: int, buffer: torch.Tensor) -> None:
        self._check_open()
        if allocation.tier is not self:
            raise internal_error(f"{allocation!r} used through the {self.name} tier")
        if allocation._freed:
            raise ObjectFreedError(f"tiermem {self.name} tier: {allocation!r} was freed")
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise internal_error(
                f"tier I/O needs a contiguous 1-D uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}"
            )
        if offset < 0 or offset + buffer.numel() > allocation.reserved:
            raise internal_error(
                f"I/O [{offset}, {offset + buffer.numel()}) outside {allocation!r} "
                f"of {allocation.reserved} reserved bytes"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError(f"the {self.name} tier")

    # -- lifecycle and statistics ----------------------------------------------------------
    def reset_peak(self) -> None:
        """Start ``peak_bytes`` over from the bytes held now (as ``torch.cuda.reset_peak_memory_stats``),
        so a later peak is that of what ran since: a training loop's, not a profiling probe's."""
        with self._lock:
            self._peak = self._current

    @property
    def current_bytes(self) -> int:
        """Bytes allocated now (what :meth:`statistics` reports), read without building a snapshot:
        for the timeline trace's counter, sampled at every move's end."""
        return self._current

    def statistics(self) -> TierStatistics:
        with self._lock:
            return TierStatistics(
                name=self.name,
                capacity=self.capacity,
                current_bytes=self._current,
                peak_bytes=self._peak,
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                allocations=len(self._live),
            )

    def live_allocations(self) -> list[Allocation]:
        with self._lock:
            return list(self._live.values())

    def close(self) -> None:
        """Free whatever is still allocated and release the tier's resources. Idempotent."""
        if self._closed:
            return
        for allocation in self.live_allocations():
            self.free(allocation)
        self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the hooks: their promises are documented where a new tier reads them (tiermem.tiers.base.Tier)
    @abc.abstractmethod
    def _allocate(self, nbytes: int, reserved: int) -> Allocation: ...

    @abc.abstractmethod
    def _free(self, allocation: Allocation) -> None: ...

    @abc.abstractmethod
    def _write(self, allocation: Allocation, offset: int, src: torch.Tensor) -> Future[None]: ...

    @abc.abstractmethod
    def _read(self, allocation: Allocation, offset: int, dst: torch.Tensor) -> Future[None]: ...

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity})"
