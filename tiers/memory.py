"""Memory tiers (device and host): allocations are tensors, copies run asynchronously.

Two copy engines sit behind one small interface:

- :class:`WorkerCopier` (CPU): ``dst.copy_(src)`` on a worker thread. Even on the CPU
  the copy is asynchronous, so code that forgets to wait on a future fails in CPU tests
  the way it would fail on a GPU.
- :class:`CudaStreamCopier` (CUDA): a dedicated copy stream, ordered after the
  producer's stream by :meth:`~CudaStreamCopier.fence` on the submitting thread, an event
  per copy, and a waiter thread that completes the future when the event fires. Written
  against PyTorch's documented stream semantics (``wait_stream``, ``record_stream``,
  ``non_blocking``); skipped in tests without CUDA.

# NOTE [ Spare tier blocks ]
1. Why: a block at or above glibc's mmap threshold (NOTE [ Returning freed memory ]) is mapped
   afresh at each allocation, and a smaller one freed in the heap is handed back by that NOTE's
   trims; either way the kernel zeroes its pages again at first touch. The tiers allocate and
   free the same sizes again and again (a chunk's staging, its gradient's write-back), so on the
   CPU that zeroing was the scheduler thread's largest cost: the 210M HF GPT-2 of
   ``bench/hf_states.py`` (declared, device and host 10%; the threshold then at 4 MiB) faulted in
   1,408-1,531 MiB of fresh pages a step, 3.1% of the process's CPU samples in its reads alone.
2. What: a CPU memory tier keeps the blocks it allocated and frees, by size, and hands one out
   again for an allocation of the same reserved size. Kept blocks and live ones together never
   exceed the capacity: an allocation or an adopted buffer that needs their room drops kept blocks
   first. So what the tier holds in RAM stays within the capacity the user set, as before.
3. A block is kept only when nothing else can reach its bytes: no other Python reference to its
   tensor and no other tensor on its storage (torch's own count; where a torch lacks that call,
   nothing is kept). Freed while a view of it lives, the block is let go as before.
4. Measured (same bench, single runs): 1,012-1,193 MiB faulted a step, the scheduler thread 0.66-0.71
   CPU s a step against 1.11-1.29, the device copies 0.05 against 0.10; ru_maxrss unchanged
   (1,389-1,422 MiB). CUDA's caching allocator and a pinned host pool keep their own blocks.
5. So the chunk-sized buffers the runtime fills by copying are made by their tier
   (``Registry.make``), not allocated and adopted: a chunk's gradient buffer in backward, a
   stored gradient's host copy, a slice of a home, a shadow. An adopted buffer is fresh pages,
   zeroed again at its first write (zero-filled gradients stay adopted; streamed chunk copies
   have the pool's NOTE [ Spare chunk storage ]). A CPU gain only: CUDA's caching allocator
   already reuses blocks. Measured on ``bench/states_headline.py --ratio 0.15`` (declared, device
   2 GiB; one ``perf`` run each): 24% of the steady steps' CPU samples zeroed fresh pages before,
   9% after, mostly backward's first copy into a gradient buffer; the step time moved within the
   VM's noise, and ru_maxrss rose 0.23 GiB (the kept blocks, within the device capacity). On the
   210M GPT-2 at 10% the host reused at least 190 of its 224 gradient copies and shadows, yet
   neither the step nor the pages faulted in a step changed measurably: most of those are the
   heap's (NOTE [ Returning freed memory ]).
6. A block serves only requests of its own reserved size, so objects of several sizes that take
   turns in a tier ask for a common *room* (``allocate(nbytes, room=)``; ``ManagedObject.room``
   for a move): the block holds and accounts ``room`` bytes while the object holds and moves its
   own. Three owners do, each at the size its plan already budgets, so no plan's peak grows:
   every NVMe home staged whole on the host (to step, or copied as a shadow) takes the largest
   such home's bytes (the planner keeps ``staged_homes`` of those: rule 3 of NOTE [ Default
   placement rule ]); so does every host copy of a gradient that waits on NVMe, at the largest
   such gradient's (``staged_homes`` of those); and a streamed chunk's gradient buffer on the
   CPU device the largest regular streamed untied trainable chunk's (``Chunk.grad_room``; the
   plan counts the largest untied one, rule 1 of NOTE [ Cost model ]). Why: the 210M HF GPT-2
   (``bench/hf_states.py``, declared, host 320 MiB) stages homes of 84, 60 and 48 MiB in turn.
   While a write-back lagged, three were on the host and the room left kept one block, always of
   the wrong size for the next home, so each home took a fresh block: 17-46 of the 96 host
   blocks of 3 steps, in about 2 of 5 processes on a quiet VM, whose steps then ran 6-9 s
   instead of 5 (a bimodal bench). Measured (``--worker declared --warmup 2 --steps 3``, fresh
   processes alternated, 2-vCPU Intel VM, a disk tenant writing and reading 256 MiB with
   O_DIRECT in a loop): host blocks made afresh 1, 0, 1 against 22, 33, 3 before; pages faulted
   in 439-521 MiB a step against 504-1,198; median steps 5.59, 5.42, 5.57 s against 8.06, 7.24,
   5.24; ru_maxrss 1,851-1,945 MiB against 1,872-2,039. Without the tenant (3 pairs) 0 against
   0-3 fresh blocks, steps alike within the noise. The device made 9 gradient buffers afresh in
   3 steps against 18 (57 fresh blocks in all against 66: the rest are saved activations read
   back, of two sizes, whose kept blocks the device's pressure drops).
"""

from __future__ import annotations

import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from tiermem.tiers.base import ALIGNMENT, Allocation, Tier


class Copier(Protocol):
    """Copies bytes between two uint8 tensors asynchronously."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Future[None]: ...

    def fence(self) -> None:
        """Order copies issued after this call after the device work the calling thread
        has queued (its current CUDA stream); copies are issued on another thread."""

    def close(self) -> None: ...


def _run_copy(future: Future[None], dst: torch.Tensor, src: torch.Tensor) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        dst.copy_(src)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiter
        future.set_exception(exc)
    else:
        future.set_result(None)


class WorkerCopier:
    """CPU copies on a small worker pool (TRAPS 7: the pool shares the cores with compute)."""

    def __init__(self, workers: int = 2, name: str = "tiermem-copy") -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Future[None]:
        future: Future[None] = Future()
        self._pool.submit(_run_copy, future, dst, src)
        return future

    def fence(self) -> None:
        """CPU work the caller queued is done when its call returned: nothing to order."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaStreamCopier:
    """CUDA copies on a dedicated stream; futures complete when the copy's event fires."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        self._pending: queue.SimpleQueue[tuple[Future[None], torch.cuda.Event, tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._waiter = threading.Thread(target=self._wait_events, name="tiermem-cuda-events", daemon=True)
        self._waiter.start()

    def fence(self) -> None:
        """The copy stream waits for the calling thread's current stream (TRAPS 28): copies run
        on the scheduler's thread, whose current stream is the default one, while the bytes
        may come from a kernel on the caller's stream (autograd runs backward on the stream
        of the forward op, a user may run on a side stream)."""
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Future[None]:
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        try:
            # No wait on the issuing thread's stream here: copies are issued on the scheduler's
            # thread, whose current stream is the default one, and waiting on it would hold every
            # copy behind all compute queued there. The ordering after the producer is fence()'s,
            # called on the submitting thread (the scheduler's submit, Tier.take). The caching
            # allocator is told the tensors are in use on the copy stream, so it does not recycle them early.
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                for tensor in (dst, src):
                    if tensor.is_cuda:
                        tensor.record_stream(self._stream)
                event = torch.cuda.Event()
                event.record(self._stream)
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)
            return future
        # Keep both tensors referenced until the event fires (host memory has no record_stream).
        self._pending.put((future, event, (dst, src)))
        return future

    def _wait_events(self) -> None:
        while (item := self._pending.get()) is not None:
            future, event, keepalive = item
            del item
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001
                del keepalive
                future.set_exception(exc)
            else:
                # Drop the tensors before anyone is woken: while this thread blocks in the
                # next get(), nothing here may keep the last copy's buffers alive (TRAPS 14).
                del keepalive
                future.set_result(None)

    def close(self) -> None:
        self._pending.put(None)
        self._waiter.join()


def aligned_empty(nbytes: int, device: torch.device, *, pin_memory: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose first byte is ``ALIGNMENT``-aligned.

    torch aligns CPU tensors to 64 bytes only; O_DIRECT wants 4 KiB (TRAPS 5). We
    over-allocate by one alignment unit and slice.
    """
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift : shift + nbytes]


#: references to a storage (torch's own count; None where this torch has no such call: no spares kept)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
#: the ``location`` of a block a memory tier allocated itself (rule 3: only those may be kept)
_MADE = object()


class MemoryTier(Tier):
    """A tier whose allocations are tensors on one torch device, within a byte budget."""

    is_memory = True

    def __init__(self, name: str, capacity: int, device: torch.device, copier: Copier) -> None:
        super().__init__(name, capacity, queue_depth=2)
        self.device = device
        self._copier = copier
        #: NOTE [ Spare tier blocks ]: freed blocks kept for reuse, by reserved size
        self._spares: dict[int, list[torch.Tensor]] = {}
        self._spare_bytes = 0
        self._keeps_spares = device.type == "cpu" and _storage_use_count is not None

    def _allocate(self, nbytes: int, reserved: int) -> Allocation:
        tensor = self._take_spare(reserved) if self._keeps_spares else None
        if tensor is None:
            tensor = aligned_empty(reserved, self.device)
        # marked as made here: an adopted buffer is not the tier's to keep
        return Allocation(self, nbytes, reserved, tensor=tensor, location=_MADE)

    def _take_spare(self, reserved: int) -> torch.Tensor | None:
        with self._lock:
            spares = self._spares.get(reserved)
            if spares:
                self._spare_bytes -= reserved
                tensor = spares.pop()
                if not spares:
                    del self._spares[reserved]
                return tensor
            dropped = self._drop_spares_beyond_capacity()
        del dropped  # their memory goes back to the system here, outside the lock
        return None

    def _drop_spares_beyond_capacity(self) -> list[torch.Tensor]:
        """Take kept blocks out until they and the live allocations (whose bytes ``_current``
        already counts, a new one's included) fit the capacity; called under the lock, the
        caller drops what it returns outside it."""
        dropped = []
        while self._spare_bytes and self._current + self._spare_bytes > self.capacity:
            size, blocks = next(iter(self._spares.items()))
            dropped.append(blocks.pop())
            self._spare_bytes -= size
            if not blocks:
                del self._spares[size]
        return dropped

    def adopt(self, buffer: torch.Tensor) -> Allocation:
        """Account an existing contiguous uint8 buffer on this tier's device as an
        allocation, without copying it (e.g. a saved activation about to be offloaded).

        The allocation holds a reference to the buffer's storage until it is freed;
        only the buffer's own bytes are accounted (it is not ours to pad).
        """
        if buffer.device != self.device and not (buffer.device.type == self.device.type == "cpu"):
            raise ValueError(
                f"tiermem {self.name} tier: cannot adopt a tensor on {buffer.device}; this tier is on {self.device}"
            )
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("tiermem: adopt() needs a contiguous 1-D uint8 tensor")
        allocation = self._account(
            buffer.numel(), buffer.numel(), lambda: Allocation(self, buffer.numel(), buffer.numel(), tensor=buffer)
        )
        with self._lock:  # adopted bytes count against the capacity too: kept blocks give way
            dropped = self._drop_spares_beyond_capacity()
        del dropped
        return allocation

    def take(self, data: torch.Tensor, *, label: str = "") -> Allocation:
        """Adopt ``data`` in place (:meth:`adopt`) when it is on this tier's device and
        :meth:`_can_adopt` agrees; otherwise allocate and copy it in (:meth:`Tier.take`)."""
        if data.device == self.device and self._can_adopt(data):
            return self.adopt(data)
        return super().take(data, label=label)

    def _can_adopt(self, data: torch.Tensor) -> bool:
        """Whether :meth:`take` may adopt ``data`` (already on this tier's device) without a copy."""
        return True

    def _free(self, allocation: Allocation) -> None:
        # Dropping the only reference returns the memory (RSS falls without a GC pass:
        # nothing here sits in a reference cycle, TRAPS 14).
        tensor, allocation.tensor = allocation.tensor, None
        if not self._keeps_spares or tensor is None:
            return
        with self._lock:
            # Kept only when nothing else can reach the bytes: no other Python reference to the
            # tensor (this frame's and getrefcount's own) and no other tensor on its storage (the
            # count asked holds one, and an aligned slice's base, which the slice keeps, another).
            if (
                allocation.location is _MADE
                and sys.getrefcount(tensor) == 2
                and _storage_use_count(tensor.untyped_storage()._cdata) == 2 + (tensor._base is not None)
                and self._current + self._spare_bytes + allocation.reserved <= self.capacity
            ):
                self._spares.setdefault(allocation.reserved, []).append(tensor)
                self._spare_bytes += allocation.reserved

    def fence(self) -> None:
        self._copier.fence()

    def _write(self, allocation: Allocation, offset: int, src: torch.Tensor) -> Future[None]:
        return self._copier.copy(allocation.view(offset, src.numel()), src)

    def _read(self, allocation: Allocation, offset: int, dst: torch.Tensor) -> Future[None]:
        return self._copier.copy(dst, allocation.view(offset, dst.numel()))

    def _close(self) -> None:
        with self._lock:
            self._spares.clear()
            self._spare_bytes = 0
        self._copier.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": str(self.device)}
