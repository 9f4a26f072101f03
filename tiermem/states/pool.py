"""The device buffer pool: which streamed chunks hold bytes on the device, and moving them.

Carries out rules 1, 3 and 6 of NOTE [ Model-state rules ] (in ``manager.py``) for the
chunks' parameter storage: fetch (DEMAND), prefetch, evict, release, and the retry ladder when
the device tier is full. It decides nothing about order; the hooks tell it what is needed.

:class:`ChunkPool` owns which streamed chunks are resident, their last use, the spares and the
count of device copies written home. It may touch: the chunks' device storage and their ``dev``
handle and in-flight fetch, a chunk's home only to fill the device copy from it or write a
changed copy back (``Handle.fill_from``), and gradient buffers only to wait for their
write-backs; bytes move through the registry alone (NOTE [ Managed object rules ]).

# NOTE [ Spare chunk storage ]
1. On the CPU device a released streamed chunk's bytes are kept as a *spare* and the next
   fetch takes them (``UntypedStorage._swap_data_ptr_`` moves the bytes between storage
   objects, so each chunk keeps its own storage and its parameters' views, TRAPS 2). A
   fresh buffer costs the kernel a zeroed page for every page the NVMe read touches first,
   on the cores that compute, inside ``io_submit`` on the I/O thread (TRAPS 27; measured
   on the 200M GPT of issue 5: 84% of that thread's samples). So that a spare fits many
   chunks, every streamed chunk of at most the plan's chunk size holds the largest such
   chunk's bytes (a chunk's own bytes are a prefix; the device tier accounts the whole
   storage): the buffer the plan budgets per slot anyway (NOTE [ Cost model ] rule 1). When
   the trainable chunks are at most half the frozen ones, each kind has its own slot: a LoRA
   adapter chunk (170 KiB on the test Llama) is pinned beside its base layer's chunk in
   backward, and in a frozen chunk's slot (2 MiB) the two would not fit a device of a tenth
   of the base's bytes. Otherwise one slot serves both kinds, so a spare serves every chunk
   (two sizes would drop and allocate spares whenever the kinds alternate).
   A chunk larger than the chunk size (an outlier's own, NOTE [ Chunk layout rules ] rule 4)
   holds its own bytes. Spares are kept per size and a fetch takes one of its chunk's size
   only; sizing every storage to the largest chunk instead would make each buffer an
   embedding's (16 MiB beside 2 MiB chunks on the 8 x 512 GPT of issue 20), and the CPU
   device would gain nothing from the outlier's own chunk. On CUDA the caching allocator
   already reuses blocks: no spares; with kvikio and GPUDirect Storage the blocks come from
   the device tier's registered pool (NOTE [ Registered device pool ] in ``tiers/device_pool.py``).
2. A spare is real memory, so it is accounted on the device tier (adopted) while it waits;
   resident streamed chunks and spares together stay within ``buffers``, the pool the plan
   budgets (a fetch finding no spare of its size drops another spare before it allocates),
   and there are never more storages of one size than streamed chunks of that size. So the
   pool holds at most the ``buffers`` largest streamed chunks' slots, what the plan reserves
   (NOTE [ Default placement rule ] rule 1): spares never take room the plan gave to
   anything else.
3. A spare takes over a chunk's storage only where its bytes no longer matter: after
   ``empty_storage`` waited for every copy that read them (TRAPS 24); the fetch overwrites
   all of them before anything reads the chunk.
4. Spares go first when the device is short (the retry ladder of rule 6 in the manager, and
   any other user of the device tier through ``Registry.reclaim``: the activation offloader
   before it waits or spills; NOTE [ Managed object rules ] rule 7), and all go when the
   chunks are rebuilt (re-pack, first-step plan) and at close.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from tiermem import tracing
from tiermem.errors import TierCapacityError
from tiermem.malloc import StreamingTrim
from tiermem.registry import CachedBytes, ObjectState, Priority, Registry
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesMemoryError

T = TypeVar("T")


class ChunkPool:
    """``buffers`` streamed chunks resident on the device (one more while all are pinned and the
    device tier has room); persistent ones always are."""

    def __init__(
        self, registry: Registry, chunks: Sequence[Chunk], buffers: int, chunk_size: int | None = None
    ) -> None:
        """``chunks``: all of the model's chunks, built; ``chunk_size``: the plan's (chunks above
        it hold their own bytes, rule 1; None: every chunk a slot of the largest)."""
        self.registry = registry
        self.chunks = chunks
        self.buffers = buffers
        #: resident streamed chunks, by index
        self.resident: dict[int, Chunk] = {}
        self._clock = 0
        #: bumped whenever a device copy is written home (readers of homes re-read)
        self.writes = 0
        # ``_swap_data_ptr_`` is new in torch (2026); without it chunks are refilled by ``resize_``.
        keeps_spares = (
            registry.has_tier("device")
            and registry.device == torch.device("cpu")
            and hasattr(torch.UntypedStorage, "_swap_data_ptr_")
        )
        streamed = [c for c in chunks if not c.persistent]
        regular = [c for c in streamed if chunk_size is None or c.nbytes <= chunk_size]
        largest = {kind: max((c.nbytes for c in regular if c.trainable == kind), default=0) for kind in (True, False)}
        #: NOTE [ Spare chunk storage ] rule 1: the bytes a streamed chunk's storage holds on the
        #: CPU device (the largest regular streamed chunk's; a larger chunk's own), per kind
        #: (trainable or frozen) where trainable chunks are at most half the frozen ones; 0 where
        #: spares are not kept
        self.slot_bytes = max(largest.values()) if keeps_spares else 0
        apart = keeps_spares and 0 < 2 * largest[True] <= largest[False]
        self._kind_slot = dict(largest) if apart else {True: self.slot_bytes, False: self.slot_bytes}
        self._keeps_spares = keeps_spares and bool(streamed)
        #: released chunks' storage, accounted on the device tier
        self._spares: list[CachedBytes] = []
        #: the chunks a room request of the pool's own is for (never released to make it)
        self._keeping: tuple[Chunk, ...] = ()
        #: trims the heap between a step's phases as chunks stream (NOTE [ Returning freed memory ]
        #: rule 5): the manager and the backward tracker call its ``boundary``
        self.trimming = StreamingTrim()
        if self._keeps_spares:
            registry.add_reclaimer("device", self.drop_spares)  # rule 4: others short of room take it
        if streamed:  # rule 6 of NOTE [ Model-state rules ]: after the spares, chunks no module uses now
            registry.add_reclaimer("device", self.evict_unused, moves_objects=True)

    def acquire(self, chunks: tuple[Chunk, ...], direction: int, following: int | None = None) -> None:
        """Make ``chunks`` resident (DEMAND), prefetch the next chunk in ``direction`` (0: none), or
        the chunk ``following`` names (NOTE [ Forward order ]), wait."""
        traced = tracing.span("fetch chunk", "fetch", chunks[0].index)  # NOTE [ Timeline trace ]
        try:
            self._acquire(chunks, direction, following)
        finally:
            if traced is not None:
                traced.end()

    def _acquire(self, chunks: tuple[Chunk, ...], direction: int, following: int | None) -> None:
        self._clock += 1
        for chunk in chunks:
            chunk.last_use = self._clock
        for chunk in chunks:
            self.fetch(chunk, Priority.DEMAND, chunks)
        if direction and following is not None:
            target = self.chunks[following]
            # Used last long ago (the tied chunk: at forward's start), it would be the first victim
            # of the next fetch or reclaim before its own module comes.
            target.last_use = self._clock
            if not target.resident:
                self.fetch(target, Priority.PREFETCH, chunks, direction)
        elif direction:
            self.prefetch_next(chunks, direction)
        for chunk in chunks:
            self.wait(chunk)

    def prefetch_next(self, chunks: tuple[Chunk, ...], direction: int) -> None:
        """Prefetch the next streamed chunk past ``chunks`` in ``direction`` (-1: backward's order)."""
        edge = chunks[-1].index + 1 if direction > 0 else chunks[0].index - 1
        self._prefetch(edge, direction, chunks)

    def fetch(self, chunk: Chunk, priority: Priority, keep: tuple[Chunk, ...], direction: int = 0) -> bool:
        """Start refilling ``chunk``'s own storage from its home (TRAPS 2); False when a
        prefetch found no room."""
        if chunk.persistent:
            return True
        if chunk.resident:
            if priority == Priority.DEMAND and chunk.fetching is not None:
                chunk.fetching.promote(Priority.DEMAND)
            return True
        home = chunk.home
        assert home is not None
        if priority != Priority.DEMAND and home.state is not ObjectState.RESIDENT:
            return False  # a prefetch never waits for the master's write-back to land
        if not self._make_slot(priority, keep, direction):
            return False
        home.wait()  # the master must have landed where it lives
        # Counted for the trim at the next phase of the step (NOTE [ Returning freed memory ] rule 5).
        self.trimming.streamed(chunk.nbytes)
        self._fill_storage(chunk)
        try:
            dev = self.device_room(
                lambda: self.registry.register(
                    chunk.storage_tensor(), "device", dedup=False, kind="chunk", label="chunk copy"
                ),
                keep,
                demand=priority == Priority.DEMAND,
                what=f"chunk {chunk.index}",
            )
        except BaseException:
            chunk.data.untyped_storage().resize_(0)
            raise
        if dev is None:
            chunk.data.untyped_storage().resize_(0)
            return False
        chunk.dev = dev
        self.resident[chunk.index] = chunk
        try:
            chunk.fetching = dev.fill_from(
                home, nbytes=chunk.nbytes, source_offset=chunk.working_base, priority=priority
            )
        except BaseException:
            self.release(chunk)
            raise
        return True

    def wait(self, chunk: Chunk) -> None:
        """Wait until ``chunk``'s fetch has landed (a failed fetch releases it and raises)."""
        transfer = chunk.fetching
        if transfer is None:
            return
        try:
            transfer.wait()
        except BaseException:
            chunk.fetching = None
            self.release(chunk)
            raise
        chunk.fetching = None

    def _prefetch(self, index: int, direction: int, keep: tuple[Chunk, ...]) -> None:
        """The next streamed chunk from ``index`` in ``direction``, if it is not resident."""
        while 0 <= index < len(self.chunks):
            chunk = self.chunks[index]
            if not chunk.persistent:
                if not chunk.resident:
                    self.fetch(chunk, Priority.PREFETCH, keep, direction)
                return
            index += direction

    def _make_slot(self, priority: Priority, keep: tuple[Chunk, ...], direction: int) -> bool:
        while len(self.resident) >= self.buffers:
            victim = self._victim(keep, 0 if priority == Priority.DEMAND else direction)
            if victim is None:
                # Every buffer is pinned: a module in backward waits while a checkpointed block
                # is recomputed for it, say. A demand takes one more buffer if the device tier
                # has the bytes (``device_room`` raises with the numbers if it has not): the
                # buffer count is the plan's working set, the tier's capacity is the promise.
                return priority == Priority.DEMAND
            self.release(victim)
        return True

    def _victim(self, keep: tuple[Chunk, ...], direction: int) -> Chunk | None:
        """The least recently used unpinned streamed chunk; a prefetch takes only one behind it."""
        low, high = (keep[0].index, keep[-1].index) if keep else (len(self.chunks), -1)
        candidates = [
            c
            for c in self.resident.values()
            if c.pins == 0
            and c not in keep
            and (direction == 0 or (c.index < low if direction > 0 else c.index > high))
        ]
        return min(candidates, key=lambda c: c.last_use, default=None)

    def device_room(self, allocate: Callable[[], T], keep: tuple[Chunk, ...], *, demand: bool, what: str) -> T | None:
        """Rule 6: ``allocate()``; on a full device drop the spares, wait for gradient
        write-backs, evict unpinned chunks, then have other users of the device give room back
        (caches, kept activations: NOTE [ Managed object rules ] rule 7), then raise. Without
        ``demand``, give up (None) once the spares are gone."""
        while True:
            try:
                return allocate()
            except TierCapacityError as exc:
                if self.drop_spares():
                    continue
                if not demand:
                    return None
                if self._wait_writebacks():
                    continue
                victim = self._victim(keep, 0)
                if victim is not None:
                    self.release(victim)
                    continue
                self._keeping = keep  # the reclaim below may reach evict_unused
                try:
                    reclaimed = self.registry.reclaim("device", needed=exc.requested)
                finally:
                    self._keeping = ()
                if reclaimed:
                    continue
                raise StatesMemoryError.tier_full(
                    exc, what, " and nothing more can be released, or give plan= fewer persistent_chunks or buffers"
                ) from exc

    def _wait_writebacks(self) -> bool:
        waited = False
        for chunk in self.chunks:
            if chunk.grad is not None and chunk.grad.state is ObjectState.MOVING:
                chunk.grad.wait()
                waited = True
        return waited

    def release(self, chunk: Chunk) -> None:
        """Empty a streamed chunk's storage with ``resize_(0)`` (TRAPS 2), writing it home first
        when dirty."""
        if chunk.persistent or chunk.dev is None:
            return
        if chunk.fetching is not None:
            transfer, chunk.fetching = chunk.fetching, None
            transfer.cancel()
            with contextlib.suppress(Exception):  # cancelled or landed: either way nobody reads it now
                transfer.wait()
        elif chunk.dirty:
            self.write_home(chunk)
        chunk.dirty = False
        dev, chunk.dev = chunk.dev, None
        self.resident.pop(chunk.index, None)
        spare = chunk.empty_storage(keep=self._keeps_spares and len(self.resident) + len(self._spares) < self.buffers)
        dev.free()  # real memory goes first, then the accounting
        if spare is not None:
            self._keep_spare(spare)

    def release_all(self) -> None:
        for chunk in list(self.resident.values()):
            self.release(chunk)

    def clear(self) -> None:
        """Release every streamed chunk and drop the spares (rule 4): the chunks are rebuilt."""
        self.release_all()
        self.drop_spares()

    # -- NOTE [ Spare chunk storage ] ------------------------------------------------------
    def slot_of(self, chunk: Chunk) -> int:
        """The bytes ``chunk``'s storage holds while resident (rule 1)."""
        slot = self._kind_slot[chunk.trainable]
        if not self._keeps_spares or chunk.nbytes > slot:
            return chunk.nbytes
        return slot

    def _fill_storage(self, chunk: Chunk) -> None:
        """Give ``chunk``'s empty storage its bytes: a spare of its size (rule 1), else new ones,
        dropping another spare first when the pool would hold more than ``buffers`` (rule 2)."""
        storage = chunk.data.untyped_storage()
        size = self.slot_of(chunk)
        match = next((i for i, s in enumerate(self._spares) if s.tensor.untyped_storage().nbytes() == size), None)
        if match is None:
            while self._spares and len(self.resident) + 1 + len(self._spares) > self.buffers:
                self._spares.pop(0).free()
            self.registry.resize_for_io(storage, size, chunk.home_tier)  # NOTE [ Registered device pool ] on CUDA
            return
        spare = self._spares.pop(match)
        storage._swap_data_ptr_(spare.tensor.untyped_storage())
        spare.free()  # its bytes are the chunk's now; the chunk's own accounting follows

    def _keep_spare(self, storage: torch.UntypedStorage) -> None:
        """Account a released chunk's bytes on the device tier as a spare (rule 2); without
        room, drop them."""
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        with contextlib.suppress(TierCapacityError):  # no room: dropping the only reference frees it
            self._spares.append(self.registry.adopt_cache("device", buffer))

    def evict_unused(self, needed: int | None) -> bool:
        """Release unpinned streamed chunks, least recently used first, until the device tier has
        ``needed`` bytes free (every one when None): what another user of the device asks for when
        it is short (NOTE [ Managed object rules ] rule 7; a saved activation backward needs back
        while the buffers hold chunks it does not use now). They are fetched again when needed.
        True when one was released."""
        released = False
        while needed is None or self.registry.free_bytes("device") < needed:
            victim = self._victim(self._keeping, 0)  # never what the pool's own request is for
            if victim is None:
                break
            self.release(victim)
            released = True
        return released

    def drop_spares(self) -> bool:
        """Free every spare; True when there was one."""
        spares, self._spares = self._spares, []
        for spare in spares:
            spare.free()
        return bool(spares)

    def write_home(self, chunk: Chunk) -> None:
        """Write the device copy of a streamed chunk into its home's working bytes, and wait."""
        assert chunk.home is not None and chunk.dev is not None
        chunk.home.wait()
        transfer = chunk.home.fill_from(chunk.dev, nbytes=chunk.nbytes, offset=chunk.working_base)
        transfer.wait()
        self.writes += 1
