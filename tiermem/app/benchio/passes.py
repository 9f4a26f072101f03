"""The I/O side of ``tiermem bench io``: one case's tiers and buffers, and its timed passes.

A *case* is one (block size, queue depth) of one tier, reached one of two ways:

- ``raw``: straight through the tier's ``write``/``read``, between the tier and a host
  buffer (or, ``buffer="device"`` on the NVMe tier, CUDA memory: a backend that takes device
  memory, kvikio, hands it to cuFile, registered for the case where GDS is active; the others
  stage it through page-locked bounce buffers), with at most ``queue_depth`` blocks in flight
  (new ones are issued as soon as slots free, as fio's ``iodepth`` does). On a vectored tier (NVMe) the blocks go in
  *runs*, as the scheduler issues them (its rule 7): one call of up to ``run_blocks``
  contiguous blocks, which the tier splits into block-sized I/Os again and submits
  together — so the device sees ``block_size`` requests, up to ``queue_depth`` of them in
  flight, and Python pays for one call, not one per block. ``run_blocks=1`` is one call
  per block. Requests counted are blocks; a latency is one call's (its last block's).
- ``scheduler``: end to end, the way a managed tensor is stored and fetched: one move of
  the whole size through :class:`AsyncioScheduler` between an allocation in a peer memory
  tier and the tier under test. The scheduler splits it into blocks and keeps
  ``queue_depth`` in flight on the NVMe tier itself (its rule 5), in runs (rule 7).

A *pass* moves all ``size`` bytes once. Write passes end with ``NvmeTier.sync()`` so the
bytes are durable when the clock stops (TRAPS 5). Read passes never come from the page
cache: the tier uses ``O_DIRECT``; where a filesystem refuses it the cache is dropped
with ``posix_fadvise(DONTNEED)`` before every read pass (the header says which).

The data is :mod:`tiermem.app.benchio.pattern`'s pattern, which ``--verify`` checks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.app.benchio.pattern import fill_pattern, first_mismatch
from tiermem.errors import TiermemError, TiermemWarning
from tiermem.interrupts import DeferredInterrupts
from tiermem.schedulers.asyncio_scheduler import MEMORY_BLOCK_SIZE, RUN_SHARE, AsyncioScheduler
from tiermem.schedulers.base import Priority, Transfer
from tiermem.tiers.backends.base import StorageBackend, deregister_buffer, register_buffer, select_backend
from tiermem.tiers.base import ALIGNMENT, Allocation, Tier
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.memory import aligned_empty
from tiermem.units import format_size, round_up

__all__ = ["CaseEnv", "PassResult", "VerificationError"]

#: How often a wait on a whole scheduler move looks for a held Ctrl-C.
_INTERRUPT_POLL_SECONDS = 0.1


class VerificationError(TiermemError):
    """Raised when ``--verify`` finds bytes read back that differ from what was written."""


@dataclass
class PassResult:
    """One pass over all bytes: wall seconds, requests issued to the tier, their latencies."""

    seconds: float
    requests: int
    latencies: list[float]


# -- one case -------------------------------------------------------------------------------------
def _check_buffer(buffer: str, tier_name: str, through: str) -> None:
    """``buffer="device"`` is for raw NVMe passes on a machine with CUDA (the CLI says so first)."""
    if buffer == "host":
        return
    if buffer != "device":
        raise ValueError(f"tiermem bench io: buffer {buffer!r}: expected 'host' or 'device'")
    if tier_name != "nvme" or through != "raw":
        raise ValueError(
            f"tiermem bench io: device buffers are for raw passes on the nvme tier, not {through} on {tier_name}"
        )
    if not torch.cuda.is_available():
        raise ValueError("tiermem bench io: device buffers need a CUDA device; torch.cuda.is_available() is false")


class _LatencyProbe:
    """Times every call a tier serves (call to completion) and counts the requests in it.
    Installed on the executing tier in scheduler mode, where the calls are made by the
    scheduler, not by us. A call to a vectored tier may carry a run of blocks (scheduler
    rule 7): it counts as that many requests, its latency is its last block's."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.latencies: list[float] = []
        self.requests = 0

    def wrap(
        self, tier: Tier, method: Callable[[Allocation, int, torch.Tensor], Future[None]]
    ) -> Callable[..., Future[None]]:
        latencies = self.latencies
        block = self.block_size if tier.vectored else 0

        def timed(allocation: Allocation, offset: int, buffer: torch.Tensor) -> Future[None]:
            start = time.perf_counter()
            self.requests += -(-buffer.numel() // block) if block else 1
            future = method(allocation, offset, buffer)
            # Closes over a float and a list only: no buffer kept alive (TRAPS 14).
            future.add_done_callback(lambda _f: latencies.append(time.perf_counter() - start))
            return future

        return timed


def _wait(transfer: Transfer, interrupts: DeferredInterrupts) -> None:
    """``transfer.wait()``, but stopping at a Ctrl-C held by ``interrupts`` (checked a few
    times a second). ``wait()`` after completion only raises the move's own error."""
    done = threading.Event()
    transfer.add_done_callback(lambda _t: done.set())
    while not done.wait(_INTERRUPT_POLL_SECONDS):
        interrupts.check()
    transfer.wait()


def _sync(tier: Tier) -> None:
    """Make the writes so far durable; memory tiers have nothing to flush."""
    sync = getattr(tier, "sync", None)
    if sync is not None:
        sync().result()


class CaseEnv:
    """The tiers, allocations, buffer and (optionally) scheduler of one case. Use as a
    context manager: leaving it closes every tier, which removes the NVMe run directory.

    Passes stop at a Ctrl-C or SIGTERM held by ``interrupts`` (an open
    :class:`DeferredInterrupts`), between two calls to the tier, never inside one: a
    KeyboardInterrupt raised wherever the signal lands can leave a tier's lock taken or
    a request counted in flight that never went to the kernel, and closing the tier then
    waits for it forever (TRAPS 25). Without one, a signal interrupts wherever it lands,
    as Python's default handler does.
    """

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
        run_blocks: int | None = None,
        interrupts: DeferredInterrupts | None = None,
        buffer: str = "host",
    ) -> None:
        self.tier_name = tier_name
        _check_buffer(buffer, tier_name, through)
        #: How the bytes meet the buffer (the header's "buffer:" line); set for NVMe raw cases.
        self.buffer_path = ""
        self._device_buffer = buffer == "device"
        self._backend: StorageBackend | None = None
        self._backend_reason = ""
        self._registered = False
        # Never entered when not given: ``check()`` then never raises.
        self._interrupts = interrupts if interrupts is not None else DeferredInterrupts()
        self.size = size
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.through = through
        self.notes: list[str] = []
        #: Raw passes: the most blocks in one call to the tier (None: as the scheduler runs them).
        self.run_blocks = 1
        self._tiers: list[Tier] = []
        self._scheduler: AsyncioScheduler | None = None
        self._probe = _LatencyProbe(block_size)
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self.peer: Tier | None = None
        self.peer_alloc: Allocation | None = None
        capacity = round_up(size, ALIGNMENT)
        try:
            self.tier = self._make_tier(tier_name, capacity, paths, backend)
            self.alloc = self.tier.allocate(size)
            self.direct = bool(self.tier.describe().get("direct", False))
            if run_blocks is None:
                # The scheduler's run length for this tier (its rule 7): 1 where the tier is
                # not vectored, since there a call of several blocks would be one larger I/O.
                run_blocks = max(1, int(queue_depth * RUN_SHARE)) if self.tier.vectored else 1
            elif run_blocks > 1 and not self.tier.vectored:
                raise ValueError(
                    f"tiermem bench io: runs of {run_blocks} blocks need a tier that splits a call into "
                    f"block-sized I/Os (the nvme tier); the {tier_name} tier would do one larger copy"
                )
            self.run_blocks = max(1, min(int(run_blocks), queue_depth))
            if through == "raw":
                self.buffer = (
                    self._device_side(capacity, size) if self._device_buffer else self._host_side(capacity, size)
                )
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
                    tier.write = self._probe.wrap(tier, tier.write)  # type: ignore[method-assign]
                    tier.read = self._probe.wrap(tier, tier.read)  # type: ignore[method-assign]
        except BaseException:
            self.close()
            raise

    def _host_side(self, capacity: int, size: int) -> torch.Tensor:
        """The host side of a raw case's I/O: 4096-aligned so O_DIRECT runs zero-copy (TRAPS 5)."""
        if self.tier_name == "nvme":
            self.buffer_path = "page-aligned host memory: zero-copy where O_DIRECT allows"
        if self.tier_name == "device" and torch.cuda.is_available():
            # Pinned, as a real host->device copy source is; CUDA's pinned memory is page-aligned
            # already (aligned_empty's extra page would double a power-of-two size in the pinned allocator).
            return torch.empty(capacity, dtype=torch.uint8, pin_memory=True)[:size]
        return aligned_empty(capacity, torch.device("cpu"))[:size]

    def _device_side(self, capacity: int, size: int) -> torch.Tensor:
        """CUDA memory for a ``buffer="device"`` case, declared long-lived to the backend for the case
        (NOTE [ Registered device buffers ]), and what path its bytes take."""
        assert self._backend is not None  # _make_tier made the backend instance for device buffers
        buffer = torch.empty(capacity, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        buffer = buffer[:size]
        name = self._backend.name
        if getattr(self._backend, "takes_device_memory", False):
            self._registered = register_buffer(self._backend, buffer)
            how = (
                "registered with cuFile for the case"
                if self._registered
                else "not registered: GDS inactive (compatibility mode) or an expandable segment"
            )
            self.buffer_path = f"CUDA memory handed to {name} as it is, {how}"
        else:
            self.buffer_path = f"CUDA memory staged through page-locked host bounce buffers ({name} takes host memory)"
        return buffer

    def _make_tier(self, name: str, capacity: int, paths: list[str], backend: Any) -> Tier:
        tier: Tier
        if name == "nvme":
            from tiermem.tiers.nvme import NvmeTier  # storage machinery only when measured

            if self._device_buffer and isinstance(backend, str):
                # The instance itself: the case declares its device buffer to it (register_buffer).
                backend, self._backend_reason = select_backend(backend, paths[0])
            if self._device_buffer:
                self._backend = backend

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
        facts = self.tier.describe()
        if self._backend_reason:  # the backend was chosen here, not by the tier
            facts["backend_reason"] = self._backend_reason
        return facts

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
        # Between passes too: a pass that ends within one poll of ``_wait`` never looks.
        self._interrupts.check()
        if self._scheduler is not None:
            return self._scheduler_pass(op)
        return self._raw_pass(op)

    def _raw_pass(self, op: str) -> PassResult:
        tier, alloc, block, depth = self.tier, self.alloc, self.block_size, self.queue_depth
        size, max_run = self.size, self.run_blocks
        issue = tier.write if op == "write" else tier.read
        views = self._views
        # Completions come back through a SimpleQueue (C, no Python-level lock or Condition):
        # the harness should cost per request as little as fio's does, so small requests
        # measure the tier, not this loop (TRAPS 15).
        landed: queue.SimpleQueue[int] = queue.SimpleQueue()
        perf = time.perf_counter
        starts: list[float] = []
        ends: list[float] = []

        def on_done(index: int, _future: Future[None]) -> None:
            ends[index] = perf()
            landed.put(index)

        # Only the calls in flight are kept: holding every future of a pass (tens of
        # thousands at 64 KiB) would make the harness churn memory the tier does not.
        pending: dict[int, tuple[Future[None], int]] = {}
        error: BaseException | None = None
        inflight = 0  # blocks in flight, at most ``depth``: the queue depth counts blocks, not calls
        offset = 0
        interrupts = self._interrupts
        if self._device_buffer:
            # Rule 7 of NOTE [ NVMe tier layout and I/O ]: the tier's workers wait for the kernels
            # queued on this thread's stream (the pattern fill, the scribble) before they touch the buffer.
            tier.fence()
        start_all = perf()
        try:
            while offset < size:
                while inflight >= depth:
                    future, blocks = pending.pop(landed.get())
                    inflight -= blocks
                    error = error or future.exception()  # done: exception() does not wait
                if error is not None:
                    break
                interrupts.check()  # between two calls: nothing half-issued (TRAPS 25)
                # As the scheduler does (its rule 7): as many blocks as there are free slots,
                # at most a run's worth, in one call on one view.
                blocks = min(max_run, depth - inflight)
                nbytes = min(blocks * block, size - offset)
                key = (offset, nbytes)
                view = views.get(key)
                if view is None:
                    # Sliced once (the untimed prepare pass fills this cache): fio does not
                    # build its buffers per request either.
                    view = views[key] = self.buffer[offset : offset + nbytes]
                index = len(starts)
                starts.append(perf())
                ends.append(0.0)
                future = issue(alloc, offset, view)
                pending[index] = (future, blocks)
                inflight += blocks
                offset += nbytes
                future.add_done_callback(functools.partial(on_done, index))
            while pending:  # every issued call puts its index exactly once
                future, _blocks = pending.pop(landed.get())
                error = error or future.exception()
        finally:
            # Every request in flight must land before anyone frees or reuses the buffer, on
            # an error or Ctrl-C too (NvmeTier futures cannot be cancelled). Wait on the
            # futures themselves: a Ctrl-C may have left the loop above with puts pending.
            concurrent.futures.wait([future for future, _blocks in pending.values()])
        if error is not None:
            raise error
        if op == "write":
            _sync(tier)
        seconds = perf() - start_all
        return PassResult(seconds, -(-size // block), [e - s for s, e in zip(starts, ends, strict=True)])

    def _scheduler_pass(self, op: str) -> PassResult:
        scheduler, peer_alloc = self._scheduler, self.peer_alloc
        assert scheduler is not None and peer_alloc is not None
        self._probe.latencies.clear()
        self._probe.requests = 0
        start = time.perf_counter()
        if op == "write":  # a store: write-back priority, as Runtime.store uses
            move = scheduler.submit(peer_alloc, self.alloc, nbytes=self.size, priority=Priority.WRITEBACK)
            _wait(move, self._interrupts)
            _sync(self.tier)
        else:  # a fetch the caller waits on: demand priority
            move = scheduler.submit(self.alloc, peer_alloc, nbytes=self.size, priority=Priority.DEMAND)
            _wait(move, self._interrupts)
        seconds = time.perf_counter() - start
        latencies = list(self._probe.latencies)
        return PassResult(seconds, self._probe.requests, latencies)

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
        with DeferredInterrupts(second_interrupts=False):
            if self._registered and self._backend is not None:
                # Before the buffer can be freed (NOTE [ Registered device buffers ] rule 4).
                self._registered = False
                try:
                    deregister_buffer(self._backend, self.buffer)
                except Exception as exc:  # noqa: BLE001 - keep closing the tiers
                    errors.append(exc)
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
