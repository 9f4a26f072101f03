"""A re-pack's snapshot that waits on the NVMe tier, not in memory (issue 20 item 2): the
model's values, gradients and optimizer states taken chunk by chunk, written to NVMe (or left
in an old chunk's NVMe home, which already holds them), and read back one old chunk at a time
while the new chunks are built.

:func:`spill` owns the snapshot's NVMe objects (kind ``"snapshot"``) and the old NVMe homes it
takes over until :meth:`SpilledSnapshot.free`. It may touch: the chunks' values through
:class:`~tiermem.states.stateio.StateIO`, :class:`~tiermem.states.homes.Homes` and
:class:`~tiermem.states.gradients.Gradients` (read only), an old chunk's ``home`` (taken over,
or given back when the spill fails: rule 5), and the registry (register, read out, free).

# NOTE [ Spilled snapshots ]
1. Why: a re-pack (rule 2 of NOTE [ Model-state rules ], or the first-step plan of rule 9)
   frees the old chunks and builds new ones from a snapshot; held in memory, it is a plain
   copy of the model states beside the chunks, past what the capacities promise. When that
   copy does not fit in what the device and host tiers have free, the relayout spills it.
2. Spilling: for each old chunk in turn, every parameter's full-precision value and gradient
   are copied into one flat CPU buffer and its optimizer-state tensors into a second, both
   registered on the NVMe tier and waited for before the next chunk's are made: one chunk's
   buffers (plus the home read of an NVMe chunk) are in memory at a time. Two buffers,
   because the states are read at different times for different new chunks (with an NVMe
   home, as it is built; else by the states' import after the build): in one buffer, each old
   chunk was read back twice, whole (measured on the 30M first-step bench: 16 reads of 7
   chunks' buffers, 1.1 s of a 3.0 s re-pack).
   Scalar states (``step``) stay in memory. Without NVMe room the spill frees what it wrote
   and raises ``StatesMemoryError``: nothing was changed and the caller keeps the layout in
   force.
3. Reading: :meth:`SpilledSnapshot.as_snapshot` is a ``Snapshot`` whose lists and state
   mapping read an old chunk's buffer (of values and gradients, of states, or its adopted
   home: rule 5) back on first use (``Handle.copy_out``), keeping the last ``CACHED_CHUNKS``
   buffers; values handed out are views of them, copied by the build. The build reads
   exactly the bytes that were written: training after the re-pack is bitwise what it would
   have been.
   Told the new chunks' parameters in build order (:meth:`SpilledSnapshot.expect`), it reads
   the next buffer the build will need while the build copies from the last one and writes
   new homes (``Handle.start_copy_out``, one buffer in flight): read one at a time on demand,
   the reads were half of the 210M first-step bench's re-pack (1.95 s of 3.8 s wall, 2.5 GiB
   at 1.3 GiB/s). The build reads a new chunk's values, then, where its home goes to NVMe and
   is streamed, its optimizer states, then its gradients; the other chunks' states are read by
   the states' import after the build, chunk by chunk. The expected order is a hint only: a
   buffer read out of it is read on demand, a read ahead the build did not take is waited for
   and dropped, and a read ahead that cannot start is left to the demand read.
4. Memory: besides the tiers' capacities, a spilled re-pack holds one old chunk's buffers
   (its values, gradients and states: ``(2 + sections) x`` the chunk's bytes at most, fp32
   masters counted) while spilling and ``CACHED_CHUNKS`` buffers (one of values and
   gradients and one of states, about one old chunk's; or two adopted homes, ``(1 +
   sections) x`` a chunk's bytes each, since a new chunk usually spans two old ones and
   reads each one's values, then its states) while building, one more being read ahead
   (rule 3), and the build's own transients: a new NVMe home is made in a block of the host
   tier (within its capacity) and written while the next is filled, at most one home's write
   in flight (``store._HomeWriter``); without host room, in one buffer per size for the last two
   sizes, written before the next is made (``store._HomeScratch``).
5. In place: an old chunk whose home is on NVMe, landed, its step finished and no device copy
   resident (the re-pack empties the pool first) already holds its values and optimizer
   states on NVMe, laid out as the chunk layout says (master at 0, each state section at
   ``section_base``). The snapshot adopts that home as the chunk's buffer (the old chunk
   forgets it, so freeing the old chunks leaves it alone) and records where each tensor is
   in it, instead of reading the home back and writing its bytes to NVMe again (measured on
   the 210M first-step bench, a loaded 2-core VM, cProfile wall: the spill was 5.3 s of an
   11.5 s re-pack, 2.1 s reading homes and 3.2 s copying and writing them, and the re-pack
   read 75 objects back; in place, the spill took 0.01 s and the re-pack 3.8 s, reading 27).
   Only its gradients, if any, are written, as rule 2 says. A home staged elsewhere or read
   by slices (NOTE [ Sliced steps ]) is spilled as rule 2 says. When the spill fails, every
   adopted home goes back to its chunk: nothing changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.errors import TierCapacityError
from tiermem.registry import CopyOut, Handle, Registry
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesMemoryError
from tiermem.states.facts import ModelFacts, ParamState, Snapshot
from tiermem.states.gradients import Gradients
from tiermem.states.homes import Homes
from tiermem.states.stateio import StateIO
from tiermem.states.store import ChunkStore

CACHED_CHUNKS = 2
"""Rule 3: old chunks' buffers kept in memory while the new chunks are built (re-packing in
execution order reads the old chunks nearly in their order: a miss costs an NVMe read); two,
because a new chunk's NVMe home reads its values' buffer and its states' buffer in turn."""
_ALIGN = 64
"""Every tensor in a flat buffer starts at a multiple of this (any dtype views it in place)."""

Key = tuple[int, str]
"""(parameter index, ``"data"`` | ``"grad"`` | an optimizer-state name)."""
_VALUES = ("data", "grad")
"""Rule 2: the keys the build reads; every other key is an optimizer state, spilled apart."""


@dataclass(frozen=True)
class _Piece:
    buffer: int
    """Index of the NVMe object (``handles``) the piece is in."""
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class SpilledSnapshot:
    """Rule 2's NVMe objects and where each tensor is in them."""

    registry: Registry
    handles: list[Handle] = field(default_factory=list)
    pieces: dict[Key, _Piece] = field(default_factory=dict)
    #: per parameter with optimizer state: its keys in order and its scalar states
    records: dict[int, tuple[list[str], dict[str, Any]]] = field(default_factory=dict)
    count: int = 0
    #: rule 5: the old chunks whose NVMe homes are among ``handles``, given back on failure
    adopted: list[tuple[Chunk, Handle]] = field(default_factory=list)
    _cache: OrderedDict[int, torch.Tensor] = field(default_factory=OrderedDict)
    #: rule 3: reads started ahead of the build, by buffer; the buffers in the order the build
    #: is expected to read them, and where in that order it last read
    _ahead: dict[int, CopyOut] = field(default_factory=dict)
    _sequence: list[int] = field(default_factory=list)
    _position: int = 0

    def free(self) -> None:
        self._drop_reads()
        for handle in self.handles:
            handle.free()
        self.handles.clear()
        self.adopted.clear()
        self._cache.clear()

    def give_back(self) -> None:
        """Rule 5: a spill that failed hands each adopted home back to its old chunk, and frees
        what it wrote."""
        self._drop_reads()
        for chunk, home in self.adopted:
            chunk.home = home
        kept = {id(home) for _, home in self.adopted}
        self.handles = [h for h in self.handles if id(h) not in kept]
        self.adopted.clear()
        self.free()

    def tensor(self, key: Key) -> torch.Tensor | None:
        """Rule 3: the tensor spilled under ``key`` (a view of its chunk's buffer), or None."""
        piece = self.pieces.get(key)
        if piece is None:
            return None
        data = self._buffer(piece.buffer)
        nbytes = _nbytes(piece.shape, piece.dtype)
        return data[piece.offset : piece.offset + nbytes].view(piece.dtype).view(piece.shape)

    def expect(self, groups: Iterable[tuple[Sequence[int], bool]]) -> None:
        """Rule 3: the order the build reads in, new chunk by new chunk: ``groups`` of parameter
        indices, each with whether the build writes that chunk's optimizer states (a streamed
        chunk whose home goes to NVMe); the others' states come last, read by the import."""
        groups = list(groups)
        keys: list[Key] = []
        for group, with_states in groups:
            keys += [(i, "data") for i in group]
            if with_states:
                keys += self._state_keys(group)
            keys += [(i, "grad") for i in group]
        for group, with_states in groups:
            if not with_states:
                keys += self._state_keys(group)
        sequence: list[int] = []
        for key in keys:
            piece = self.pieces.get(key)
            if piece is not None and (not sequence or sequence[-1] != piece.buffer):
                sequence.append(piece.buffer)
        self._sequence, self._position = sequence, 0

    def _state_keys(self, group: Sequence[int]) -> list[Key]:
        return [(i, key) for i in group for key in self.records.get(i, ((), {}))[0]]

    def _buffer(self, index: int) -> torch.Tensor:
        """Rule 3: buffer ``index``'s bytes: cached, read ahead, or read now; the next one started."""
        data = self._cache.get(index)
        if data is not None:
            self._cache.move_to_end(index)
        else:
            pending = self._ahead.pop(index, None)
            data = pending.result() if pending is not None else self.handles[index].copy_out()
            self._cache[index] = data
            while len(self._cache) > CACHED_CHUNKS:
                self._cache.popitem(last=False)
        self._read_next(index)
        return data

    def _read_next(self, index: int) -> None:
        """Rule 3: the build reads ``index``: start reading the first buffer after it in the
        expected order that is not in memory. Off that order, nothing is read ahead."""
        sequence = self._sequence
        try:
            self._position = sequence.index(index, self._position)
        except ValueError:
            following = None
        else:
            following = next((b for b in sequence[self._position + 1 :] if b not in self._cache), None)
        for stale in [b for b in self._ahead if b != following]:  # the build went another way
            self._ahead.pop(stale).settle()
        if following is None or following in self._ahead:
            return
        try:
            self._ahead[following] = self.handles[following].start_copy_out()
        except Exception:  # noqa: BLE001 - a hint only: the demand read meets the error, if any
            return

    def _drop_reads(self) -> None:
        """Reads still in flight end before their buffers' objects are freed or given back."""
        for pending in self._ahead.values():
            pending.settle()
        self._ahead.clear()

    def as_snapshot(self) -> Snapshot:
        """Rule 3."""
        return Snapshot(_Column(self, "data"), _Column(self, "grad"), _States(self))  # type: ignore[arg-type]


class _Column(Sequence[torch.Tensor | None]):
    """Per parameter: its spilled ``what`` (``"data"`` or ``"grad"``), None where it has none."""

    def __init__(self, spilled: SpilledSnapshot, what: str) -> None:
        self._spilled = spilled
        self._what = what

    def __len__(self) -> int:
        return self._spilled.count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._spilled.tensor((index, self._what))


class _States(Mapping[int, dict[str, Any]]):
    """Per parameter with optimizer state: its state dict, tensors read back on use."""

    def __init__(self, spilled: SpilledSnapshot) -> None:
        self._spilled = spilled

    def __getitem__(self, index: int) -> dict[str, Any]:
        keys, scalars = self._spilled.records[index]
        return {key: scalars[key] if key in scalars else self._spilled.tensor((index, key)) for key in keys}

    def __iter__(self) -> Iterator[int]:
        return iter(self._spilled.records)

    def __len__(self) -> int:
        return len(self._spilled.records)

    def __contains__(self, index: object) -> bool:
        return index in self._spilled.records


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def _grad_sources(chunk: Chunk, store: ChunkStore, gradients: Gradients) -> list[tuple[Key, torch.Tensor]]:
    """Rule 2: one old chunk's gradients where they wait now."""
    if chunk.grad is None:
        return []
    buffer = gradients.grad_bytes(chunk)
    return [((s.index, "grad"), s.view(buffer)) for s in chunk.layout.slots if store.has_grad[s.index]]


def _chunk_sources(
    chunk: Chunk, facts: ModelFacts, store: ChunkStore, homes: Homes, gradients: Gradients, stateio: StateIO
) -> tuple[list[tuple[Key, torch.Tensor]], dict[int, tuple[list[str], dict[str, Any]]]]:
    """Rule 2: one old chunk's tensors where they live now, and its parameters' state records
    (as :meth:`StateIO.snapshot` reads them)."""
    sources: list[tuple[Key, torch.Tensor]] = []
    for slot in chunk.layout.slots:
        sources.append(((slot.index, "data"), stateio.master_source(slot.index)))
    sources += _grad_sources(chunk, store, gradients)
    records: dict[int, tuple[list[str], dict[str, Any]]] = {}
    kept = [(s, store.pstate[s.index]) for s in chunk.layout.slots if s.index in store.pstate]
    home = homes.readable(chunk) if kept and chunk.home is not None else None
    names = facts.state_names
    for slot, record in kept:
        for key in record.keys:
            if key not in record.scalars:
                assert home is not None
                view = slot.master_view(home, chunk.section_base(names.index(key)), chunk.master_scale)
                sources.append(((slot.index, key), view))
        records[slot.index] = (list(record.keys), _scalars(record))
    return sources, records


def _scalars(record: ParamState) -> dict[str, Any]:
    """A parameter's scalar optimizer state (``step``) in key order, tensors cloned: the
    snapshot outlives the chunks they came with."""
    scalars: dict[str, Any] = {}
    for key in record.keys:
        if key in record.scalars:
            value = record.scalars[key]
            scalars[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return scalars


def _in_place(chunk: Chunk, homes: Homes) -> bool:
    """Rule 5: whether ``chunk``'s NVMe home holds its values and states as they are now."""
    home = chunk.home
    if home is None or chunk.resident or chunk.dirty or chunk.slice_span is not None:
        return False
    homes.fence(chunk)  # its step in flight writes the home
    home.wait()  # a write-back on its way lands first
    return home.tier == "nvme"


def _adopt(chunk: Chunk, facts: ModelFacts, store: ChunkStore, spilled: SpilledSnapshot) -> None:
    """Rule 5: ``chunk``'s NVMe home becomes the snapshot's buffer of its values and states."""
    home = chunk.home
    assert home is not None
    # freeing the old chunk waits for a copy of known bytes into its home (registry rule 6)
    # before emptying its storage; once the home is adopted that wait is this one
    home.wait_known_copy()
    buffer = len(spilled.handles)
    spilled.handles.append(home)
    spilled.adopted.append((chunk, home))
    chunk.home = None
    scale = chunk.master_scale
    names = facts.state_names
    for slot in chunk.layout.slots:
        # where Slot.master_view reads: fp32 masters under mixed precision, else the slot's dtype
        dtype = torch.float32 if scale > 1 else slot.dtype
        spilled.pieces[(slot.index, "data")] = _Piece(buffer, slot.offset * scale, slot.shape, dtype)
        record = store.pstate.get(slot.index)
        if record is None:
            continue
        for key in record.keys:
            if key not in record.scalars:
                offset = chunk.section_base(names.index(key)) + slot.offset * scale
                spilled.pieces[(slot.index, key)] = _Piece(buffer, offset, slot.shape, dtype)
        spilled.records[slot.index] = (list(record.keys), _scalars(record))


def _write(registry: Registry, spilled: SpilledSnapshot, sources: list[tuple[Key, torch.Tensor]]) -> Handle:
    """Rule 2: ``sources`` copied into one flat CPU buffer, registered on the NVMe tier (written
    there when this returns); their pieces recorded."""
    offsets, total = [], 0
    for _, source in sources:
        offsets.append(total)
        total += -(-source.numel() * source.element_size() // _ALIGN) * _ALIGN
    flat = torch.empty(max(total, _ALIGN), dtype=torch.uint8)
    for (key, source), offset in zip(sources, offsets, strict=True):
        piece = _Piece(len(spilled.handles), offset, tuple(source.shape), source.dtype)
        end = offset + _nbytes(piece.shape, piece.dtype)
        flat[offset:end].view(source.dtype).view(source.shape).copy_(source)
        spilled.pieces[key] = piece
    handle = registry.register(flat, "nvme", dedup=False, kind="snapshot")
    spilled.handles.append(handle)
    return handle


def spill(
    registry: Registry, facts: ModelFacts, store: ChunkStore, homes: Homes, gradients: Gradients, stateio: StateIO
) -> SpilledSnapshot:
    """Rule 2: every chunk's values, gradients and states on the NVMe tier (rule 5: in the
    chunk's own NVMe home where they are there already)."""
    spilled = SpilledSnapshot(registry, count=len(facts.params))
    try:
        for chunk in store.chunks:
            if _in_place(chunk, homes):
                # gradients are not part of a home: they go to a buffer of their own, as rule 2 says
                sources = _grad_sources(chunk, store, gradients)
                _adopt(chunk, facts, store, spilled)
            else:
                sources, records = _chunk_sources(chunk, facts, store, homes, gradients, stateio)
                spilled.records.update(records)
            # values and gradients apart from optimizer states: the build reads the first, the
            # states' import the second, each once (rule 3)
            groups = [
                [(key, source) for key, source in sources if key[1] in _VALUES],
                [(key, source) for key, source in sources if key[1] not in _VALUES],
            ]
            written = [_write(registry, spilled, group) for group in groups if group]
            del groups, sources
            for handle in written:
                handle.wait()  # one chunk's buffers in memory at a time
            homes.forget()  # nor an NVMe home's read
    except TierCapacityError as exc:
        spilled.give_back()
        raise StatesMemoryError.tier_full(exc, "the re-pack's snapshot") from exc
    except BaseException:
        spilled.give_back()
        raise
    return spilled
