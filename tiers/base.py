"""The Tier protocol: where bytes live, and what a new tier implements.

A tier has a capacity, hands out :class:`Allocation` s and accounts every byte from
allocation to free. It moves bytes between one of its allocations and a contiguous
``uint8`` CPU/CUDA tensor with :meth:`Tier.write` / :meth:`Tier.read`, both of which
return a :class:`concurrent.futures.Future` and never block the caller.

A tier knows nothing of chunks, activations or priorities; the scheduler decides
when to call it. Memory tiers (device, host) expose each allocation as a tensor;
storage tiers (NVMe) do not, so a move between two tiers is always carried out by
calling the non-memory side with the memory side's tensor (see
``tiermem.schedulers``).

Alignment: every allocation is reserved in multiples of :data:`ALIGNMENT` bytes and,
in memory tiers, starts on an :data:`ALIGNMENT` boundary. That lets the NVMe tier do
``O_DIRECT`` I/O straight into memory-tier buffers without staging (TRAPS 5).

This file is the whole of what a new tier implements; the checks, accounting and
statistics every tier shares are in :mod:`tiermem.tiers.accounting`.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import Any

import torch

from tiermem import tracing
from tiermem.tiers.accounting import TIER_NAMES, AccountedTier, Allocation, TierStatistics
from tiermem.units import ALIGNMENT

__all__ = ["ALIGNMENT", "TIER_NAMES", "AccountedTier", "Allocation", "Tier", "TierStatistics"]


class Tier(AccountedTier):
    """One level of the store. A new tier subclasses this, sets the class attributes below,
    calls ``super().__init__(name, capacity, queue_depth=...)`` (``name`` one of
    :data:`TIER_NAMES`; ``queue_depth``: how many requests it serves at once, the most the
    scheduler keeps in flight on it) and implements the four abstract hooks.

    The public methods (``allocate``, ``take``, ``free``, ``write``, ``read``, ``close``,
    ``statistics``; :class:`~tiermem.tiers.accounting.AccountedTier`) check their arguments,
    charge the capacity and count the bytes, then call the hooks: a hook never sees a freed
    allocation, a range outside ``reserved``, a closed tier or a buffer that is not a
    contiguous 1-D ``uint8`` tensor. Hooks may be called from any thread, concurrently.
    """

    #: "device", "host" or "nvme"
    name: str
    #: True when allocations expose a tensor (device, host)
    is_memory: bool = True
    #: True when the tier carries out a request spanning several blocks as block-sized I/Os
    #: of its own (the NVMe tier splits every request at its stripe unit, ``block_size``),
    #: so a scheduler may hand it a *run* of contiguous blocks in one call — one future, one
    #: buffer view, one submission — without the device seeing larger requests. A run's
    #: future completes when all of its blocks have, and fails as a whole if any block does.
    vectored: bool = False

    # -- what a new tier must implement ----------------------------------------------------
    @abc.abstractmethod
    def _allocate(self, nbytes: int, reserved: int) -> Allocation:
        """Make room for ``nbytes`` and return ``Allocation(self, nbytes, reserved, ...)``.

        ``reserved`` (``nbytes`` rounded up to :data:`ALIGNMENT`) is already charged against
        the capacity, and refunded if this raises. A memory tier passes ``tensor=``: a ``uint8``
        tensor of ``reserved`` bytes starting on an :data:`ALIGNMENT` boundary; a storage tier
        passes ``location=``, whatever finds the bytes again. Raise
        :class:`~tiermem.errors.TierCapacityError` when the bytes fit in total but not in one
        piece (fragmentation)."""

    @abc.abstractmethod
    def _free(self, allocation: Allocation) -> None:
        """Give back what :meth:`_allocate` took; called once per allocation, after the
        accounting dropped it, and must not raise. A request still running on it (a move
        that failed or was abandoned) must not land on bytes already handed to another
        allocation: keep the space until it ends (the NVMe tier defers such frees)."""

    @abc.abstractmethod
    def _write(self, allocation: Allocation, offset: int, src: torch.Tensor) -> Future[None]:
        """Start copying ``src`` into ``allocation`` at ``offset`` and return at once.

        The future completes (on any thread) when every byte has landed, or fails with the
        error the I/O met; raise here only for a request refused outright, never block.
        Do not keep ``src`` referenced once the future is done: it would outlive the move
        (TRAPS 14). A :attr:`vectored` tier splits the request into block-sized I/Os."""

    @abc.abstractmethod
    def _read(self, allocation: Allocation, offset: int, dst: torch.Tensor) -> Future[None]:
        """Start copying ``dst.numel()`` bytes of ``allocation`` at ``offset`` into ``dst``,
        with the same promises as :meth:`_write`."""

    # -- what a tier may override ----------------------------------------------------------
    def _close(self) -> None:
        """Release the tier's own resources (threads, files, pinned pools). Called once, by
        :meth:`close`, after every allocation was freed."""

    def fence(self) -> None:
        """Order moves submitted after this call after the device work the calling thread has
        queued (TRAPS 28). The scheduler calls it on the submitting thread; only a CUDA device
        tier has anything to do."""

    def take(self, data: torch.Tensor, *, label: str = "") -> Allocation:
        """Hold the bytes of ``data`` (a contiguous 1-D uint8 tensor) in an allocation of this tier.

        A tier adopts them in place where it can (a memory tier on ``data``'s device: see
        :meth:`MemoryTier.take <tiermem.tiers.memory.MemoryTier.take>`); otherwise, as here, it
        allocates ``data.numel()`` bytes and copies ``data`` in, waiting for the copy (a storage
        tier is handed ``data.cpu()``): a wait of the calling thread, named in the timeline trace
        after ``label`` (what the bytes are). On failure what was allocated is freed and the error
        raised.
        """
        allocation = self.allocate(data.numel())
        traced = tracing.span(f"wait {label or 'bytes'} write {self.name}", "wait", None, {"bytes": data.numel()})
        try:
            # The copy runs on another thread (a copier, a worker), whose current stream is not the
            # caller's: order it after the device work that produced ``data`` (TRAPS 28). The fence
            # orders this tier's own copy stream; a CUDA source read elsewhere (the host tier's
            # worker, ``.cpu()``) waits for the caller's stream here, as the copy is waited for anyway.
            self.fence()
            if data.is_cuda:
                torch.cuda.current_stream(data.device).synchronize()
            self.write(allocation, 0, data.cpu() if not self.is_memory else data).result()
        except BaseException:
            self.free(allocation)
            raise
        finally:
            if traced is not None:
                traced.end()
        return allocation

    def describe(self) -> dict[str, Any]:
        """Facts about the tier for headers and logs (device name, backend, paths, ...)."""
        return {"tier": self.name, "capacity": self.capacity}
