"""Parameters packed into chunks: the layout (pure: no I/O, no tiers).

# NOTE [ Chunk layout rules ]
1. Parameters are packed in one given order (see NOTE [ Model-state rules ] rule 2 for which)
   into chunks of at most ``chunk_size`` bytes. A chunk holds only trainable or only frozen
   parameters, so a frozen chunk carries no gradient or optimizer-state bytes: each kind
   fills its own open chunk, and chunks are numbered by the position of their first
   parameter, i.e. in the order they are first needed. One exception: when every trainable
   parameter packs into one chunk beside frozen ones (LoRA adapters over a frozen base), that
   chunk comes first, so the persistent prefix (NOTE [ Default placement rule ] rule 2) and
   the planner can keep it on the device: its parameters are used in every block, and
   streamed it took the base's buffer in each of them (measured on the 200M LoRA of
   ``bench/lora.py``: the base read 3.3 times a step instead of twice). The streamed chunks
   keep their order of first use.
2. Every parameter starts at a multiple of ``PARAM_ALIGNMENT`` (64) bytes inside its chunk,
   and a chunk's storage starts 64-byte aligned, as a standalone tensor would (TRAPS 3).
3. A chunk occupies its used bytes rounded up to ``ALIGNMENT`` (4096); every section of a
   chunk's home object (master parameters, each optimizer state) is that long, so each one
   starts page-aligned for O_DIRECT (TRAPS 5).
4. A parameter never spans two chunks, and is stored contiguous (a non-contiguous one becomes
   contiguous). The chunk size is at least the largest parameter, except for *outliers*: the
   largest ``MAX_OUTLIERS`` parameters or fewer, each more than ``OUTLIER_RATIO`` (2) times
   the largest of the others (``packing_floor``; a vocabulary's embedding, 0.15-2 GiB, beside
   blocks of a few MiB). A chunk size of at least the floor packs (``pack(oversized=True)``)
   every parameter larger than it into a chunk of its own, sized to it (its used bytes
   rounded up as rule 3 says), closing its kind's open chunk first; the others pack at the
   chunk size. Chunks then differ in size: what the device reserves, the pool's buffers and
   the waste of rule 5 count each chunk's own bytes (a chunk below the size still takes a
   slot of the size). Measured: an 8 x 512 GPT, vocabulary 8192, at a device of 10-15% of
   its state bytes found no plan, its 16 MiB embedding making every chunk at least 16 MiB.
6. Mixed precision (``rt.manage(param_dtype=)``): chunks hold bf16/fp16 working parameters;
   the fp32 masters and optimizer states live in home sections ``master_scale`` (2) times as
   long, each parameter at ``master_scale`` times its working offset (128-byte aligned), and
   an offloaded home ends with a working copy the device fetches and the step refreshes.
5. Chunk size rule: the candidates run from the largest parameter (rounded up to 4096) to
   ``min(MAX_CHUNK_SIZE, all parameter bytes)``, ``CANDIDATES_PER_OCTAVE`` a doubling on a
   geometric scale, each rounded up to 4096. With outliers (rule 4), ``outlier_candidates``
   run the same scale from the floor up to below the largest parameter: packings in which
   the outliers have chunks of their own. A candidate wastes the bytes of its chunks (each at
   least the size) that hold no parameter bytes (alignment padding plus unused tails). The
   default rule keeps the candidates whose streaming buffers fit the device and takes the
   least waste, the larger size on a tie (fewer, larger transfers); it tries the outlier
   candidates only when no other fits. The planner searches both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiermem.units import ALIGNMENT, round_up

#: Offset alignment of a parameter inside its chunk (rule 2).
PARAM_ALIGNMENT = 64
#: The largest chunk the default rule considers (rule 5).
MAX_CHUNK_SIZE = 256 << 20
#: Chunk-size candidates per doubling (rule 5).
CANDIDATES_PER_OCTAVE = 8
#: Rule 4: a parameter more than this many times the largest of the others is an outlier...
OUTLIER_RATIO = 2
#: ...when it is among the largest this many parameters.
MAX_OUTLIERS = 4


@dataclass(frozen=True)
class ParamInfo:
    """What packing needs to know about one parameter."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a chunk: ``index`` into the manager's parameter list."""

    index: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def view(self, data: torch.Tensor, base: int = 0) -> torch.Tensor:
        """This parameter's bytes inside ``data`` (a 1-D uint8 tensor), typed and shaped.

        ``base`` is where the chunk's section starts inside ``data`` (rule 3)."""
        start = base + self.offset
        return data[start : start + self.nbytes].view(self.dtype).view(self.shape)

    def master_view(self, data: torch.Tensor, base: int, scale: int) -> torch.Tensor:
        """This parameter's fp32 master inside a home section laid out ``scale`` times wider
        than the working chunk (rule 6); ``scale`` 1 is :meth:`view`."""
        if scale == 1:
            return self.view(data, base)
        start = base + self.offset * scale
        return data[start : start + self.nbytes * scale].view(torch.float32).view(self.shape)


@dataclass(frozen=True)
class ChunkLayout:
    index: int
    trainable: bool
    slots: tuple[Slot, ...]
    #: bytes up to the end of the last parameter
    used: int

    @property
    def nbytes(self) -> int:
        """Bytes the chunk occupies, and the length of each section of its home (rule 3)."""
        return round_up(max(self.used, 1), ALIGNMENT)


def packing_floor(params: Sequence[ParamInfo]) -> int:
    """Rule 4: the least chunk size the parameters pack at: the largest one that is not an
    outlier (the largest parameter when none is)."""
    sizes = sorted((p.nbytes for p in params), reverse=True)
    for count in range(1, min(MAX_OUTLIERS, len(sizes) - 1) + 1):
        if sizes[count - 1] > OUTLIER_RATIO * sizes[count]:
            return sizes[count]
    return sizes[0] if sizes else 0


def pack(
    params: Sequence[ParamInfo], order: Sequence[int], chunk_size: int, *, oversized: bool = False
) -> list[ChunkLayout]:
    """Rules 1, 2 and 4: the chunks of ``params`` taken in ``order``; ``oversized``: a
    parameter larger than ``chunk_size`` gets a chunk of its own (rule 4) instead of an error."""
    largest = max((params[i].nbytes for i in order), default=0)
    if chunk_size < largest and not oversized:
        raise ValueError(f"chunk size {chunk_size} is below the largest parameter ({largest} bytes)")
    # Per kind (trainable, frozen): the open chunk's slots and its used bytes.
    open_chunks: dict[bool, tuple[list[Slot], int]] = {}
    closed: list[tuple[int, bool, list[Slot], int]] = []  # (first position, trainable, slots, used)
    first_position: dict[bool, int] = {}
    for position, index in enumerate(order):
        info = params[index]
        kind = info.trainable
        slots, used = open_chunks.get(kind, ([], 0))
        if info.nbytes > chunk_size:  # rule 4: an outlier's own chunk; its kind's open one closes
            if slots:
                closed.append((first_position[kind], kind, slots, used))
                open_chunks[kind] = ([], 0)
            closed.append((position, kind, [Slot(index, 0, info.nbytes, info.shape, info.dtype)], info.nbytes))
            continue
        offset = round_up(used, PARAM_ALIGNMENT)
        if slots and offset + info.nbytes > chunk_size:
            closed.append((first_position[kind], kind, slots, used))
            slots, offset = [], 0
        if not slots:
            first_position[kind] = position
        slots.append(Slot(index, offset, info.nbytes, info.shape, info.dtype))
        open_chunks[kind] = (slots, offset + info.nbytes)
    for kind, (slots, used) in open_chunks.items():
        if slots:
            closed.append((first_position[kind], kind, slots, used))
    # Rule 1: the trainable parameters' only chunk beside frozen ones (adapters) comes first.
    lead = sum(kind for _, kind, _, _ in closed) == 1 and len(closed) > 1
    closed.sort(key=lambda item: (not (lead and item[1]), item[0]))
    return [ChunkLayout(n, kind, tuple(slots), used) for n, (_, kind, slots, used) in enumerate(closed)]


def waste(layouts: Sequence[ChunkLayout], chunk_size: int) -> int:
    """Rule 5: bytes of chunk capacity that hold no parameter bytes (each chunk at least
    ``chunk_size``; an outlier's own chunk its own bytes, rule 4)."""
    capacity = sum(max(chunk_size, layout.nbytes) for layout in layouts)
    return capacity - sum(slot.nbytes for layout in layouts for slot in layout.slots)


def _scale(low: int, high: int) -> set[int]:
    """Rule 5's geometric scale from ``low`` up to (not including) ``high``, rounded up to 4096."""
    steps = math.ceil(math.log2(high / low) * CANDIDATES_PER_OCTAVE) if high > low else 0
    return {round_up(int(low * 2 ** (k / CANDIDATES_PER_OCTAVE)), ALIGNMENT) for k in range(steps)}


def size_candidates(params: Sequence[ParamInfo]) -> list[int]:
    """Rule 5: chunk sizes to try, smallest first (every one at least the largest parameter)."""
    largest = round_up(max((p.nbytes for p in params), default=1), ALIGNMENT)
    total = round_up(sum(round_up(p.nbytes, PARAM_ALIGNMENT) for p in params), ALIGNMENT)
    high = max(largest, min(MAX_CHUNK_SIZE, total))
    return sorted({largest, high, *(s for s in _scale(largest, high) if s <= high)})


def outlier_candidates(params: Sequence[ParamInfo]) -> list[int]:
    """Rule 5: chunk sizes below the largest parameter, from the floor (rule 4), smallest first;
    empty when no parameter is an outlier. Each packs with ``pack(oversized=True)``."""
    if not params:
        return []
    floor = round_up(max(packing_floor(params), 1), ALIGNMENT)
    largest = max(p.nbytes for p in params)
    return sorted(s for s in {floor, *_scale(floor, largest)} if s < largest)
