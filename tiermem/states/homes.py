"""Access to chunk homes: staging an NVMe home on the host to write it, reading a home's bytes.

:class:`Homes` owns the cached copy of the last NVMe home read for export (one chunk at a time,
valid for one :meth:`ChunkStore.version <tiermem.states.store.ChunkStore.version>`). It may
touch chunk homes through their handles only (``move_to``, ``wait``, ``tensor``, ``read_out``:
NOTE [ Managed object rules ]), never a chunk's device storage or gradients. Before it stages,
reads or writes a chunk's home it calls ``fence`` with the chunk, so a step of that chunk still
in flight finishes first (NOTE [ Step threads ] rule 4).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tiermem.errors import TierCapacityError
from tiermem.registry import KnownBytes, ObjectState, Priority
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesMemoryError
from tiermem.states.step_thread import StepThread
from tiermem.states.store import ChunkStore


class Homes:
    """Reads and writes of the homes of ``store``'s chunks."""

    def __init__(self, store: ChunkStore, steps: StepThread) -> None:
        self.store = store
        #: where chunk steps compute: a home is touched only once its chunk's step has finished
        self.steps = steps
        self._read_cache: tuple[int, tuple[int, int], torch.Tensor] | None = None

    def fence(self, chunk: Chunk) -> None:
        """NOTE [ Step threads ] rule 4: ``chunk``'s step in flight, if any, finishes first."""
        self.steps.wait_for(chunk.index)

    def forget(self) -> None:
        """Drop the cached home read (its chunk changed, or the chunks were rebuilt)."""
        self._read_cache = None

    def wait_moves(self, skip: Chunk | None = None) -> None:
        """Wait until no home but ``skip``'s is moving: write-backs of NVMe homes free the
        host bytes they were staged in when they land."""
        for other in self.store.chunks:
            if other.home is not None and other is not skip and other.home.state is ObjectState.MOVING:
                other.home.wait()

    def stage(self, chunk: Chunk, known: KnownBytes | None = None) -> None:
        """Bring an NVMe home to the host for writing (DEMAND) and wait for it; ``known``: what
        memory holds of it already (NOTE [ Managed object rules ] rule 6). With no room, the
        write-backs in flight land first."""
        self.fence(chunk)
        handle = chunk.home
        assert handle is not None
        try:
            handle.move_to("host", Priority.DEMAND, known)
        except TierCapacityError:
            # Earlier homes' write-backs free host memory when they land (the plan has room for
            # its staged_homes: NOTE [ Default placement rule ] rule 3).
            self.wait_moves(skip=chunk)
            try:
                handle.move_to("host", Priority.DEMAND, known)
            except TierCapacityError as exc:
                what = f"staging chunk {chunk.index}'s NVMe home for its step"
                raise StatesMemoryError.tier_full(exc, what) from exc
        handle.wait()

    def send_back(self, chunk: Chunk) -> None:
        """Write a staged NVMe home back (WRITEBACK)."""
        assert chunk.home is not None
        chunk.home.move_to("nvme", Priority.WRITEBACK)
        self._read_cache = None

    @contextlib.contextmanager
    def on_host(self, chunk: Chunk, known: KnownBytes | None = None) -> Iterator[torch.Tensor]:
        """An NVMe home staged on the host for writing (:meth:`stage`), and written back after."""
        self.stage(chunk, known)
        assert chunk.home is not None
        try:
            yield chunk.home.tensor("host")
        finally:
            self.send_back(chunk)

    @contextlib.contextmanager
    def writable(self, chunk: Chunk) -> Iterator[torch.Tensor]:
        """A chunk's home bytes to write in place (an NVMe home staged, then written back)."""
        assert chunk.home is not None
        self.fence(chunk)
        if chunk.home_tier == "nvme":
            with self.on_host(chunk) as data:
                yield data
        else:
            chunk.home.wait()
            yield chunk.home.tensor(chunk.home.tier)

    def readable(self, chunk: Chunk) -> torch.Tensor:
        """A chunk's home bytes to read: in place in memory, or read from NVMe (cached per version)."""
        self.fence(chunk)
        handle = chunk.home
        assert handle is not None
        handle.wait()
        if handle.tier != "nvme":
            return handle.tensor(handle.tier)
        cache = self._read_cache
        if cache is not None and cache[0] == chunk.index and cache[1] == self.store.version():
            return cache[2]
        data = handle.read_out()
        self._read_cache = (chunk.index, self.store.version(), data)
        return data
