"""The I/O side of ``tiermem bench io``: one case's tiers and buffers, and its timed passes.

A *case* is one (block size, queue depth) of one tier, reached one of two ways:

- ``raw``: straight through the tier's ``write``/``read``, one request per block, with
  exactly ``queue_depth`` requests in flight (a new one is issued as one completes, as
  fio's ``iodepth`` does), between the tier and a host buffer.
- ``scheduler``: end to end, the way a managed tensor is stored and fetched: one move of
  the whole size through :class:`AsyncioScheduler` between an allocation in a peer memory
  tier and the tier under test. The scheduler splits it into blocks and keeps
  ``queue_depth`` in flight on the NVMe tier itself (its rule 5).

A *pass* moves all ``size`` bytes once. Write passes end with ``NvmeTier.sync()`` so the
bytes are durable when the clock stops (TRAPS 5). Read passes never come from the page
cache: the tier uses ``O_DIRECT``; where a filesystem refuses it the cache is dropped
with ``posix_fadvise(DONTNEED)`` before every read pass (the header says which).

The data is :mod:`tiermem.benchio.pattern`'s pattern, which ``--verify`` checks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import queue
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.benchio.pattern import fill_pattern, first_mismatch
from tiermem.errors import TiermemError, TiermemWarning
from tiermem.schedulers.asyncio_scheduler import MEMORY_BLOCK_SIZE, AsyncioScheduler
from tiermem.schedulers.base import Priority, Transfer
from tiermem.tiers.base import ALIGNMENT, Allocation, Tier
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.memory import aligned_empty
from tiermem.units import format_size, round_up

__all__ = ["CaseEnv", "PassResult", "VerificationError"]

_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class VerificationError(TiermemError):
    """Raised when ``--verify`` finds bytes read back that differ from what was written."""


@dataclass
class PassResult:
    """One pass over all bytes: wall seconds, requests issued to the tier, their latencies."""

    seconds: float
    requests: int
    latencies: list[float]


# -- one case -------------------------------------------------------------------------------------
class _LatencyProbe:
    """Times every request a tier serves (call to completion). Installed on the executing
    tier in scheduler mode, where the requests are issued by the scheduler, not by us."""

    def __init__(self) -> None:
        self.latencies: list[float] = []

    def wrap(self, method: Callable[[Allocation, int, torch.Tensor], Future[None]]) -> Callable[..., Future[None]]:
        latencies = self.latencies

        def timed(allocation: Allocation, offset: int, buffer: torch.Tensor) -> Future[None]:
            start = time.perf_counter()
            future = method(allocation, offset, buffer)
            # Closes over a float and a list only: no buffer kept alive (TRAPS 14).
            future.add_done_callback(lambda _f: latencies.append(time.perf_counter() - start))
            return future

        return timed


def _wait(transfer: Transfer) -> None:
    """``transfer.wait()``, but interruptible. ``Transfer.wait`` swallows a KeyboardInterrupt
    raised while it blocks and then fails with a bare TimeoutError, so Ctrl-C would not
    unwind as an interrupt; an Event wait lets it through, and ``wait()`` after completion
    only raises the move's own error."""
    done = threading.Event()
    transfer.add_done_callback(lambda _t: done.set())
    done.wait()
    transfer.wait()


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while cleanup runs (an impatient second Ctrl-C would otherwise
    leave files behind), then raise KeyboardInterrupt if one came. Main thread only: Python
    runs signal handlers there and nowhere else."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in _HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if received:
        raise KeyboardInterrupt


def _sync(tier: Tier) -> None:
    """Make the writes so far durable; memory tiers have nothing to flush."""
    sync = getattr(tier, "sync", None)
    if sync is not None:
        sync().result()


class CaseEnv:
    """The tiers, allocations, buffer and (optionally) scheduler of one case. Use as a
    context manager: leaving it closes every tier, which removes the NVMe run directory."""

    def __init__(
        self,
        tier_name: str,
        *,
        size: int,
        block_size: int,
        queue_depth: int,
        through: str,
        paths: list[str],
        backend: Any,
    ) -> None:
        self.tier_name = tier_name
        self.size = size
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.through = through
        self.notes: list[str] = []
        self._tiers: list[Tier] = []
        self._scheduler: AsyncioScheduler | None = None
        self._probe = _LatencyProbe()
        self._views: list[torch.Tensor] | None = None
        self.peer: Tier | None = None
        self.peer_alloc: Allocation | None = None
        capacity = round_up(size, ALIGNMENT)
        try:
            self.tier = self._make_tier(tier_name, capacity, paths, backend)
            self.alloc = self.tier.allocate(size)
            self.direct = bool(self.tier.describe().get("direct", False))
            if through == "raw":
                # The host side of the I/O: 4096-aligned so O_DIRECT runs zero-copy (TRAPS 5).
                if tier_name == "device" and torch.cuda.is_available():
                    # Pinned, as a real host->device copy source is; CUDA's pinned memory is
                    # page-aligned already (aligned_empty's extra page would double a
                    # power-of-two size in the pinned allocator).
                    self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)[:size]
                else:
                    self.buffer = aligned_empty(capacity, torch.device("cpu"))[:size]
            else:
                # nvme and host moves go through the device tier (as a managed tensor's do);
                # the device tier's own moves go to and from host memory.
                peer_name = "host" if tier_name == "device" else "device"
                self.peer = self._make_tier(peer_name, capacity, paths, backend)
                self.peer_alloc = self.peer.allocate(size)
                self.buffer = self.peer_alloc.view(0, size)
                # A block per request on the NVMe tier; the bound admits queue_depth of them,
                # which is what this case measures (the runtime's default is 512 MiB).
                block = max(block_size, MEMORY_BLOCK_SIZE) if self.tier.is_memory else block_size
                self._scheduler = AsyncioScheduler(max_inflight=block * queue_depth, block_size=block_size)
                for tier in self._tiers:
                    tier.write = self._probe.wrap(tier.write)  # type: ignore[method-assign]
                    tier.read = self._probe.wrap(tier.read)  # type: ignore[method-assign]
        except BaseException:
            self.close()
            raise

    def _make_tier(self, name: str, capacity: int, paths: list[str], backend: Any) -> Tier:
        tier: Tier
        if name == "nvme":
            from tiermem.tiers.nvme import NvmeTier  # storage machinery only when measured

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", TiermemWarning)
                tier = NvmeTier(
                    paths, capacity, backend=backend, block_size=self.block_size, queue_depth=self.queue_depth
                )
            self.notes += [str(w.message) for w in caught if issubclass(w.category, TiermemWarning)]
        elif name == "host":
            tier = HostTier(capacity, pinned=torch.cuda.is_available())
        else:
            tier = DeviceTier(capacity)
        self._tiers.append(tier)
        return tier

    # -- facts ------------------------------------------------------------------------------------
    @property
    def scheduler(self) -> AsyncioScheduler | None:
        """The scheduler of a ``through="scheduler"`` case (None for raw cases)."""
        return self._scheduler

    def describe(self) -> dict[str, Any]:
        return self.tier.describe()

    @property
    def backend_name(self) -> str:
        """What carries the bytes: the NVMe backend, else the copy engine of the executing tier."""
        facts = self.tier.describe()
        if "backend" in facts:
            return str(facts["backend"])
        executor = self.tier if self.peer is None or self.tier.name == "device" else self.peer
        return "cuda-stream" if getattr(executor, "device", torch.device("cpu")).type == "cuda" else "cpu-copy"

    # -- passes ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Fill the buffer with the pattern and write it once, untimed: reads then have data,
        and timed writes overwrite written blocks, as a running job's tier files are."""
        fill_pattern(self.buffer)
        self._timed("write")

    def run_pass(self, op: str) -> PassResult:
        if op == "read" and self.tier.name == "nvme" and not self.direct:
            self._drop_page_cache()
        return self._timed(op)

    def scribble(self) -> None:
        """Overwrite the buffer before a verified read, so a read that silently did nothing
        cannot pass verification on the bytes the previous pass left."""
        self.buffer.fill_(0)

    def verify(self, what: str) -> None:
        bad = first_mismatch(self.buffer)
        if bad is not None:
            offset, want, got, count = bad
            raise VerificationError(
                f"tiermem bench io: verification failed after {what} ({self.tier_name} tier, {self.through}, "
                f"block {format_size(self.block_size)}, QD {self.queue_depth}): byte at offset {offset} is "
                f"0x{got:02x}, expected 0x{want:02x}; {count} of {self.size} bytes differ"
            )

    def _timed(self, op: str) -> PassResult:
        if self._scheduler is not None:
            return self._scheduler_pass(op)
        return self._raw_pass(op)

    def _raw_pass(self, op: str) -> PassResult:
        tier, alloc, block, depth = self.tier, self.alloc, self.block_size, self.queue_depth
        issue = tier.write if op == "write" else tier.read
        if self._views is None:
            # Sliced once, outside the clock: fio does not build its buffers per request either.
            self._views = [self.buffer[o : o + block] for o in range(0, self.size, block)]
        views = self._views
        count = len(views)
        starts = [0.0] * count
        ends = [0.0] * count
        # Completions come back through a SimpleQueue (C, no Python-level lock or Condition):
        # the harness should cost per request as little as fio's does, so small requests
        # measure the tier, not this loop (TRAPS 15).
        landed: queue.SimpleQueue[int] = queue.SimpleQueue()
        perf = time.perf_counter

        def on_done(index: int, _future: Future[None]) -> None:
            ends[index] = perf()
            landed.put(index)

        # Only the requests in flight are kept: holding every future of a pass (tens of
        # thousands at 64 KiB) would make the harness churn memory the tier does not.
        pending: dict[int, Future[None]] = {}
        error: BaseException | None = None
        issued = 0
        start_all = perf()
        try:
            for index in range(count):
                if len(pending) >= depth:
                    error = pending.pop(landed.get()).exception()  # done: exception() does not wait
                    if error is not None:
                        break
                starts[index] = perf()
                future = issue(alloc, index * block, views[index])
                pending[index] = future
                issued += 1
                future.add_done_callback(functools.partial(on_done, index))
            while pending:  # every issued request puts its index exactly once
                error = error or pending.pop(landed.get()).exception()
        finally:
            # Every request in flight must land before anyone frees or reuses the buffer, on
            # an error or Ctrl-C too (NvmeTier futures cannot be cancelled). Wait on the
            # futures themselves: a Ctrl-C may have left the loop above with puts pending.
            concurrent.futures.wait(list(pending.values()))
        if error is not None:
            raise error
        if op == "write":
            _sync(tier)
        seconds = perf() - start_all
        return PassResult(seconds, issued, [e - s for s, e in zip(starts[:issued], ends[:issued], strict=True)])

    def _scheduler_pass(self, op: str) -> PassResult:
        scheduler, peer_alloc = self._scheduler, self.peer_alloc
        assert scheduler is not None and peer_alloc is not None
        self._probe.latencies.clear()
        start = time.perf_counter()
        if op == "write":  # a store: write-back priority, as Runtime.store uses
            _wait(scheduler.submit(peer_alloc, self.alloc, nbytes=self.size, priority=Priority.WRITEBACK))
            _sync(self.tier)
        else:  # a fetch the caller waits on: demand priority
            _wait(scheduler.submit(self.alloc, peer_alloc, nbytes=self.size, priority=Priority.DEMAND))
        seconds = time.perf_counter() - start
        latencies = list(self._probe.latencies)
        return PassResult(seconds, len(latencies), latencies)

    def _drop_page_cache(self) -> None:
        """Buffered I/O only: flush, then ask the kernel to drop the files' cached pages
        (DONTNEED drops clean pages only, hence the sync first)."""
        _sync(self.tier)
        for path in getattr(self.tier, "data_files", []):
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the scheduler and close every tier (frees allocations, removes files).
        A second Ctrl-C while this runs is held until the files are gone."""
        errors: list[BaseException] = []
        with _interrupts_deferred():
            if self._scheduler is not None:
                try:
                    self._scheduler.close()
                except Exception as exc:  # noqa: BLE001 - keep closing the tiers
                    errors.append(exc)
                self._scheduler = None
            while self._tiers:
                try:
                    self._tiers.pop().close()
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> CaseEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
