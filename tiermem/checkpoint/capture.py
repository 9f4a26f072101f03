"""Copies of chunks for an asynchronous checkpoint: made on the training thread at safe points
and before a chunk changes, read by the writer thread (NOTE [ Asynchronous saves ] rules 1-5 in
:mod:`tiermem.checkpoint.background`).

:class:`Capture` owns the copies and the writer's position. Its training-thread side may touch
the registry (capture buffers) and chunk homes and device copies through their handles (read
only, via ``StateIO.capture_layout``); its writer side only waits for copies and reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence

import torch

from tiermem import tracing
from tiermem.checkpoint.dcp_planners import ChunkKey
from tiermem.errors import CheckpointError, TierCapacityError
from tiermem.registry import Handle, ObjectState, Priority, Registry, Transfer
from tiermem.states import ModelStates
from tiermem.states.stateio import CapturedView, StateIO, StateTensor

#: rule 4: chunks ahead of the writer's hold at most this many of the largest chunk's saved bytes
AHEAD_CHUNKS = 2


@dataclasses.dataclass
class ChunkCopy:
    """One chunk's saved bytes, copied: ``copies`` (one per region) once ``transfers`` landed."""

    nbytes: int
    copies: list[torch.Tensor]
    view: CapturedView
    #: registered host buffers (rule 5); empty for a copy made synchronously
    buffers: list[Handle]
    transfers: list[Transfer]
    #: the writer is done with it: the training thread frees it at its next safe point
    written: bool = False


class SaveAbandoned(CheckpointError):
    """The other side of an asynchronous save failed first; its error is the one reported."""


class Capture:
    """The copies of one asynchronous save, in the writer's chunk order."""

    def __init__(self, all_states: Sequence[ModelStates], registry: Registry, order: Sequence[ChunkKey]) -> None:
        self.stateios: list[StateIO] = [states.checkpoint_io("save") for states in all_states]
        self.registry = registry
        self.order = list(order)
        self._position = {key: n for n, key in enumerate(self.order)}
        self.sizes = {key: sum(n for _, n in self.stateios[key[0]].capture_layout(key[1])[0]) for key in self.order}
        largest = max(self.sizes.values(), default=0)
        self.ahead_bound = AHEAD_CHUNKS * largest
        #: rule 4's bound on the bytes copies hold at once
        self.bound = self.ahead_bound + largest
        # Every model's step may stage its homes while the save runs, so the reserve is the sum of
        # the room each plan keeps for that (a frozen model stages none).
        self._host_reserve = sum(stateio.staging_room() for stateio in self.stateios)
        self._cond = threading.Condition()
        self._copies: dict[ChunkKey, ChunkCopy] = {}
        self._taken: set[ChunkKey] = set()
        #: index in ``order`` of the chunk the writer writes or waits for
        self._writer_at = 0
        self._writer_done = False
        self.failed: BaseException | None = None
        self.peak_bytes = 0
        #: copies made synchronously for want of host room (rule 5)
        self.unbuffered = 0

    # -- the training thread --------------------------------------------------------------------
    def pump(self) -> None:
        """Rule 3: free what the writer wrote; copy the writer's chunk, then chunks ahead of it
        within the bound, skipping none (a home that moves now waits for the next safe point)."""
        self.free_written(everything=self._writer_done)
        if self._writer_done or self.failed is not None:
            return
        at = self._writer_at
        for key in self.order[at:]:
            if key in self._taken:
                continue
            ahead = self._position[key] != at
            if ahead and (self._ahead(at) + self.sizes[key] > self.ahead_bound or self._moving(key)):
                return
            self._take(key)

    def before_step(self, key: ChunkKey) -> None:
        """Rule 2: ``key``'s bytes are copied, and landed, before it steps."""
        if key not in self._position:
            return
        self._take_forced(key)
        self._land(key, Priority.DEMAND)

    def before_move(self, key: ChunkKey) -> None:
        """Rule 2: a copy reading ``key``'s home lands before the home moves."""
        self._land(key, Priority.PREFETCH)

    def before_rewrite(self) -> None:
        """Rule 2: every chunk is copied and landed before any may change."""
        for key in self.order:
            self._take_forced(key)
        for key in self.order:
            self._land(key, Priority.DEMAND)

    def _land(self, key: ChunkKey, priority: Priority) -> None:
        copy = self._copies.get(key)
        if copy is None:
            return
        for transfer in copy.transfers:
            transfer.promote(priority)
        try:
            for transfer in copy.transfers:
                transfer.wait()
        except Exception as exc:  # noqa: BLE001 - the save fails; training goes on (rule 6)
            self.fail(exc)

    def _take_forced(self, key: ChunkKey) -> None:
        """Copy ``key`` now, within the bound: when chunks ahead of the writer fill it, wait for
        the writer to finish its chunk, copied first so it never waits for us (rule 4)."""
        while key not in self._taken:
            self.free_written()
            if self._writer_done or self.failed is not None:
                return
            at = self._writer_at
            writer = self.order[at]
            if self._position[key] == at or self._ahead(at) + self.sizes[key] <= self.ahead_bound:
                self._take(key)
            elif writer not in self._taken:
                self._take(writer)
            else:
                self._wait_writer(at)

    def _wait_writer(self, at: int) -> None:
        with tracing.traced("wait checkpoint writer", "wait", {"chunk": at}), self._cond:  # NOTE [ Timeline trace ]
            self._cond.wait_for(lambda: self._writer_at != at or self._writer_done, timeout=1.0)

    def _ahead(self, at: int) -> int:
        with self._cond:
            return sum(c.nbytes for k, c in self._copies.items() if self._position[k] > at and not c.written)

    def _moving(self, key: ChunkKey) -> bool:
        regions, _ = self.stateios[key[0]].capture_layout(key[1])
        return any(handle.state is ObjectState.MOVING for handle, _ in regions)

    def _take(self, key: ChunkKey) -> None:
        """Copy ``key``'s regions: into a registered host buffer at WRITEBACK priority (rule 3),
        or synchronously where the host keeps no room for it (rule 5)."""
        regions, view = self.stateios[key[0]].capture_layout(key[1])
        for handle, _ in regions:
            if handle.state is ObjectState.MOVING:
                handle.wait()  # never copied while it moves (registry rule 8)
        size = sum(n for _, n in regions)
        buffer = self._buffer(size)
        copies: list[torch.Tensor] = []
        transfers: list[Transfer] = []
        if buffer is None:
            self.unbuffered += 1
            copies = [_read_now(handle, n) for handle, n in regions]
        else:
            if any(handle.tier == "device" for handle, _ in regions):
                self.registry.fence("device")  # after the step's kernels that wrote it (TRAPS 28)
            data, offset = buffer.tensor("host"), 0
            for handle, n in regions:
                transfers.append(buffer.fill_from(handle, nbytes=n, offset=offset, priority=Priority.WRITEBACK))
                copies.append(data[offset : offset + n])
                offset += n
        with self._cond:
            self._copies[key] = ChunkCopy(size, copies, view, [buffer] if buffer else [], transfers)
            self._taken.add(key)
            held = sum(c.nbytes for c in self._copies.values())
            self.peak_bytes = max(self.peak_bytes, held)
            self._cond.notify_all()

    def _buffer(self, size: int) -> Handle | None:
        if self.registry.free_bytes("host") < size + self._host_reserve:
            return None
        try:
            return self.registry.register(torch.empty(size, dtype=torch.uint8), "host", dedup=False, kind="checkpoint")
        except TierCapacityError:
            return None

    def free_written(self, everything: bool = False) -> None:
        """Free the copies the writer is done with (all of them once it ended)."""
        with self._cond:
            done = [k for k, c in self._copies.items() if c.written or everything]
            freed = [self._copies.pop(k) for k in done]
        for copy in freed:
            for transfer in copy.transfers:  # a buffer is freed only once nothing writes into it
                transfer.cancel()
                with contextlib.suppress(Exception):  # a failed copy: the save reported it
                    transfer.wait()
            for buffer in copy.buffers:
                buffer.free()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.failed is None:
                self.failed = exc
            self._cond.notify_all()

    # -- the writer thread ----------------------------------------------------------------------
    def read(self, key: ChunkKey, tensor: StateTensor) -> torch.Tensor:
        """``tensor``'s bytes as they were at the save: moving on to ``key`` tells the training
        thread the previous chunk is written."""
        with self._cond:
            at = self._position[key]
            if at != self._writer_at:
                self._mark_written(self._writer_at)
                self._writer_at = at
                self._cond.notify_all()
            self._cond.wait_for(lambda: key in self._copies or self.failed is not None)
            if self.failed is not None:
                raise SaveAbandoned(f"tiermem checkpoint: copying the chunks failed: {self.failed}")
            copy = self._copies[key]
        for transfer in copy.transfers:
            transfer.wait()
        return copy.view(tensor, copy.copies)

    def writer_ended(self) -> None:
        with self._cond:
            self._writer_done = True
            for copy in self._copies.values():
                copy.written = True
            self._cond.notify_all()

    def _mark_written(self, at: int) -> None:
        copy = self._copies.get(self.order[at])
        if copy is not None:
            copy.written = True


def _read_now(handle: Handle, nbytes: int) -> torch.Tensor:
    """Rule 5: a region copied on the training thread into memory of its own (an NVMe home read
    where it lives, as a blocking save reads it)."""
    if handle.tier == "nvme":
        return handle.copy_out()[:nbytes]
    data = handle.tensor(handle.tier).reshape(-1).view(torch.uint8)[:nbytes]
    return data.to("cpu", copy=True)
