"""Parameters packed into chunks: the layout (pure) and the chunk objects that hold the bytes.

# NOTE [ Chunk layout rules ]
1. Parameters are packed in one given order (see NOTE [ Model-state rules ] rule 2 for which)
   into chunks of at most ``chunk_size`` bytes. A chunk holds only trainable or only frozen
   parameters, so a frozen chunk carries no gradient or optimizer-state bytes: each kind
   fills its own open chunk, and chunks are numbered by the position of their first
   parameter, i.e. in the order they are first needed.
2. Every parameter starts at a multiple of ``PARAM_ALIGNMENT`` (64) bytes inside its chunk,
   and a chunk's storage starts 64-byte aligned, as a standalone tensor would (TRAPS 3).
3. A chunk occupies its used bytes rounded up to ``ALIGNMENT`` (4096); every section of a
   chunk's home object (master parameters, each optimizer state) is that long, so each one
   starts page-aligned for O_DIRECT (TRAPS 5).
4. The chunk size is at least the largest parameter: a parameter never spans two chunks.
   A parameter is stored contiguous (a non-contiguous one becomes contiguous).
6. Mixed precision (``rt.manage(param_dtype=)``): chunks hold bf16/fp16 working parameters;
   the fp32 masters and optimizer states live in home sections ``master_scale`` (2) times as
   long, each parameter at ``master_scale`` times its working offset (128-byte aligned), and
   an offloaded home ends with a working copy the device fetches and the step refreshes.
5. Chunk size rule: the candidates run from the largest parameter (rounded up to 4096) to
   ``min(MAX_CHUNK_SIZE, all parameter bytes)``, ``CANDIDATES_PER_OCTAVE`` a doubling on a
   geometric scale, each rounded up to 4096. A candidate wastes ``chunks * size - parameter
   bytes`` (alignment padding plus unused tails). The planner keeps the candidates whose
   streaming buffers fit the device and takes the least waste, the larger size on a tie
   (fewer, larger transfers).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiermem.registry import Handle
from tiermem.schedulers.base import Transfer
from tiermem.tiers.base import ALIGNMENT
from tiermem.units import round_up

#: Offset alignment of a parameter inside its chunk (rule 2).
PARAM_ALIGNMENT = 64
#: The largest chunk the default rule considers (rule 5).
MAX_CHUNK_SIZE = 256 << 20
#: Chunk-size candidates per doubling (rule 5).
CANDIDATES_PER_OCTAVE = 8


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


def pack(params: Sequence[ParamInfo], order: Sequence[int], chunk_size: int) -> list[ChunkLayout]:
    """Rules 1, 2 and 4: the chunks of ``params`` taken in ``order``."""
    largest = max((params[i].nbytes for i in order), default=0)
    if chunk_size < largest:
        raise ValueError(f"chunk size {chunk_size} is below the largest parameter ({largest} bytes)")
    # Per kind (trainable, frozen): the open chunk's slots and its used bytes.
    open_chunks: dict[bool, tuple[list[Slot], int]] = {}
    closed: list[tuple[int, bool, list[Slot], int]] = []  # (first position, trainable, slots, used)
    first_position: dict[bool, int] = {}
    for position, index in enumerate(order):
        info = params[index]
        kind = info.trainable
        slots, used = open_chunks.get(kind, ([], 0))
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
    closed.sort(key=lambda item: item[0])
    return [ChunkLayout(n, kind, tuple(slots), used) for n, (_, kind, slots, used) in enumerate(closed)]


def waste(layouts: Sequence[ChunkLayout], chunk_size: int) -> int:
    """Rule 5: bytes of chunk capacity that hold no parameter bytes."""
    return len(layouts) * chunk_size - sum(slot.nbytes for layout in layouts for slot in layout.slots)


def size_candidates(params: Sequence[ParamInfo]) -> list[int]:
    """Rule 5: chunk sizes to try, smallest first."""
    largest = round_up(max((p.nbytes for p in params), default=1), ALIGNMENT)
    total = round_up(sum(round_up(p.nbytes, PARAM_ALIGNMENT) for p in params), ALIGNMENT)
    high = max(largest, min(MAX_CHUNK_SIZE, total))
    steps = math.ceil(math.log2(high / largest) * CANDIDATES_PER_OCTAVE) if high > largest else 0
    sizes = {round_up(int(largest * 2 ** (k / CANDIDATES_PER_OCTAVE)), ALIGNMENT) for k in range(steps)}
    return sorted({largest, high, *(s for s in sizes if s <= high)})


class Chunk:
    """One chunk at run time: its own device storage and the handles of its other copies.

    ``data`` is the chunk's device storage (TRAPS 2: one storage per chunk, never shared,
    released with ``untyped_storage().resize_(0)`` and refilled in place). ``dev`` accounts
    it in the device tier while it holds bytes. ``home`` is the registry object holding
    the master parameters followed by the optimizer-state sections (offloaded chunks), or
    only the state sections (device-homed chunks). ``grad`` is the gradient chunk.
    """

    def __init__(
        self,
        layout: ChunkLayout,
        *,
        persistent: bool,
        home: str,
        sections: int,
        device: torch.device,
        master_scale: int = 1,
    ):
        self.layout = layout
        #: fp32 master bytes per working byte (rule 6): 1 without mixed precision
        self.master_scale = master_scale
        self.index = layout.index
        self.nbytes = layout.nbytes
        self.persistent = persistent
        #: "device" | "host" | "nvme": where the master parameters and states live.
        self.home_tier = home
        #: optimizer-state tensors per parameter stored in ``home`` (0: frozen or not optimized)
        self.sections = sections
        # Full size at first: views can only be made over bytes that exist. The manager makes
        # the parameters' views, then empties a streamed chunk's storage (TRAPS 2).
        self.data = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.dev: Handle | None = None
        self.fetching: Transfer | None = None
        self.home: Handle | None = None
        self.grad: Handle | None = None
        #: modules running forward with it, plus uses pinned through backward
        self.pins = 0
        self.last_use = 0
        #: the device copy holds bytes newer than the master (load_state_dict)
        self.dirty = False
        #: its backward began in the current backward pass
        self.entered = False
        #: trainable parameters used since the last backward whose gradient has not arrived
        self.pending: set[int] = set()

    def storage_tensor(self) -> torch.Tensor:
        """Every byte of the device storage as one uint8 tensor (what the device tier accounts:
        a streamed chunk's storage may hold more than ``nbytes``, NOTE [ Spare chunk storage ])."""
        return torch.empty(0, dtype=torch.uint8, device=self.data.device).set_(self.data.untyped_storage())

    def empty_storage(self, *, keep: bool = False) -> torch.UntypedStorage | None:
        """``resize_(0)`` the device storage (TRAPS 2) once nothing reads it any more: its home
        may be being staged with its bytes copied from here (registry rule 6; NOTE [ Declared
        steps ] rule 7), and freed memory must never be read (TRAPS 24), nor reused. With
        ``keep``, the bytes move to a new storage object, returned (NOTE [ Spare chunk
        storage ] in ``pool.py``), and this storage is left empty the same way."""
        copy = self.home.obj.copy if self.home is not None else None
        if copy is not None:
            with contextlib.suppress(Exception):  # its error is the home move's, raised at the home's wait()
                copy.wait()
        storage = self.data.untyped_storage()
        if keep and storage.nbytes():
            spare = torch.UntypedStorage(0, device=storage.device)
            spare._swap_data_ptr_(storage)
            return spare
        storage.resize_(0)
        return None

    @property
    def trainable(self) -> bool:
        return self.layout.trainable

    @property
    def offloaded(self) -> bool:
        return self.home_tier != "device"

    @property
    def resident(self) -> bool:
        return self.dev is not None

    @property
    def has_master(self) -> bool:
        """The home holds the master parameters (offloaded, or fp32 masters of working chunks)."""
        return self.offloaded or self.master_scale > 1

    def section_base(self, k: int) -> int:
        """Where optimizer-state section ``k`` starts in ``home`` (after the master, if it has one)."""
        return (k + (1 if self.has_master else 0)) * self.nbytes * self.master_scale

    @property
    def working_base(self) -> int:
        """Where the device fetches the working parameters from in an offloaded home (rule 6)."""
        if self.master_scale == 1:
            return 0
        return (self.sections + 1) * self.nbytes * self.master_scale

    @property
    def home_bytes(self) -> int:
        sections = self.sections + (1 if self.has_master else 0)
        working = self.nbytes if self.offloaded and self.master_scale > 1 else 0
        return self.nbytes * self.master_scale * sections + working

    def __repr__(self) -> str:
        kind = "trainable" if self.trainable else "frozen"
        where = "persistent" if self.persistent else ("resident" if self.resident else "released")
        params = len(self.layout.slots)
        return f"Chunk#{self.index}({kind}, {params} params, {self.nbytes} bytes, {where}, home {self.home_tier})"
