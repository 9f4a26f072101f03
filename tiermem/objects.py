"""What the registry hands out and keeps: managed objects, handles on them, known bytes and
cached bytes (NOTE [ Managed object rules ] is in :mod:`tiermem.registry`, which carries out
every rule; the classes here hold state and forward to it, except :meth:`KnownBytes.rest`, which
checks rule 6's prefix-or-suffix condition). Every name here is importable
from :mod:`tiermem.registry` too.
"""

from __future__ import annotations

import enum
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiermem.errors import ObjectFreedError, internal_error
from tiermem.schedulers.base import Priority, Transfer
from tiermem.tiers.base import Allocation

if TYPE_CHECKING:
    from tiermem.registry import CopyOut, Registry


class ObjectState(enum.Enum):
    RESIDENT = "resident"
    MOVING = "moving"
    FREED = "freed"


@dataclass(frozen=True)
class RegistryStatistics:
    """Cumulative counts since the registry started."""

    objects: int
    registered: int
    dedup_hits: int
    forwarded: int
    cancelled: int
    moves: int
    failed_moves: int


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a contiguous 1-D uint8 tensor (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


_object_ids = itertools.count(1)


class ManagedObject:
    """One stored copy of some bytes (e.g. one tensor storage at one version)."""

    def __init__(
        self, registry: Registry, home: Allocation, nbytes: int, kind: str = "tensor", label: str | None = None
    ) -> None:
        self.id = next(_object_ids)
        self.registry = registry
        self.nbytes = nbytes
        #: The accounting class ("tensor", "activation", "chunk", "checkpoint"): resident bytes are
        #: counted per kind (``rt.stats()``'s model-state bytes are the "chunk" kind: homes, device
        #: copies and gradients together).
        self.kind = kind
        #: What the bytes are, as the timeline trace names the object's moves and waits: "chunk
        #: home" (a chunk's parameters and optimizer states where they live), "chunk copy" (its
        #: parameters on the device), "gradient", "saved activation", "checkpoint" (a save's copy);
        #: the kind where the owner says no more.
        self.label = kind if label is None else label
        self.home: Allocation = home
        #: Bytes a memory tier's block for this object holds at least when it moves there (NOTE
        #: [ Spare tier blocks ] rule 6 in ``tiers/memory.py``): set by an owner whose objects of
        #: several sizes take turns in one tier, so a block one leaves serves the next.
        self.room = 0
        self.target: Allocation | None = None
        self.transfer: Transfer | None = None
        #: The copy of known bytes running beside ``transfer`` (rule 6), if any.
        self.copy: Transfer | None = None
        self.state = ObjectState.RESIDENT
        self.refs = 0
        self.error: BaseException | None = None
        self.dedup_key: int | None = None
        #: The current move was cancelled (rule 3); it no longer counts as on its way.
        self.cancelling = False
        #: Moves that landed (rule 2: the target became home); a cancelled or failed one does not count.
        self.moves_landed = 0
        #: Rule 12: where the object rests on a storage tier, its bytes from here on are zeros that
        #: were never written there (None: every byte is stored); ``target_zero_from``: the same for
        #: the move in flight to storage, taken over when it lands.
        self.zero_from: int | None = None
        self.target_zero_from: int | None = None
        #: Set once the current move has ended and the object's state reflects it.
        self.settled = threading.Event()
        self.settled.set()

    @property
    def tier(self) -> str:
        """Where the object is resident (its source, while it moves)."""
        return self.home.tier.name

    @property
    def target_tier(self) -> str | None:
        """The tier the object is on its way to; None when it is not moving."""
        target = self.target
        return None if target is None else target.tier.name

    def __repr__(self) -> str:
        moving = f"->{self.target.tier.name}" if self.target is not None else ""
        return f"ManagedObject#{self.id}({self.nbytes} bytes, {self.state.value} {self.tier}{moving})"


@dataclass(frozen=True)
class KnownBytes:
    """Rule 6: bytes ``[offset, offset + nbytes)`` of an object equal the first ``nbytes`` of
    ``source``, a memory allocation; a move from storage copies them from there. Outside the
    registry, make them with :meth:`Handle.known_bytes`."""

    source: Allocation
    offset: int
    nbytes: int

    def rest(self, obj: ManagedObject) -> tuple[int, int]:
        """The span (offset, count) of ``obj`` still to read when these bytes are a prefix or a suffix."""
        end = self.offset + self.nbytes
        if not self.source.tier.is_memory or self.nbytes > self.source.nbytes or self.nbytes <= 0:
            raise internal_error(f"{obj!r}: known bytes must be a non-empty span of a memory allocation, got {self}")
        if self.offset == 0 and end < obj.nbytes:
            return end, obj.nbytes - end
        if end == obj.nbytes and self.offset > 0:
            return 0, self.offset
        raise internal_error(f"{obj!r}: known bytes must be a prefix or a suffix of its {obj.nbytes} bytes: {self}")


class CachedBytes:
    """Rule 7: bytes a tier holds only as a cache, outside any object, accounted on the tier
    until :meth:`free` (see :meth:`Registry.adopt_cache`)."""

    __slots__ = ("_allocation",)

    def __init__(self, allocation: Allocation) -> None:
        self._allocation: Allocation | None = allocation

    @property
    def tensor(self) -> torch.Tensor:
        """The cached bytes (the buffer given to ``adopt_cache``)."""
        allocation = self._allocation
        if allocation is None or allocation.tensor is None:
            raise ObjectFreedError("tiermem registry: these cached bytes were freed")
        return allocation.tensor

    def free(self) -> None:
        """Stop accounting the bytes (the tier drops its reference to them). Idempotent."""
        allocation, self._allocation = self._allocation, None
        if allocation is not None:
            allocation.tier.free(allocation)


class Handle:
    """A registered tensor: a reference on a managed object plus the tensor's own view."""

    __slots__ = ("_freed", "dtype", "obj", "shape", "storage_offset", "stride")

    def __init__(self, obj: ManagedObject, tensor: torch.Tensor) -> None:
        self.obj = obj
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.storage_offset = tensor.storage_offset()
        self._freed = False
        obj.refs += 1

    @property
    def tier(self) -> str:
        return self.obj.tier

    @property
    def state(self) -> ObjectState:
        return self.obj.state

    @property
    def reserved(self) -> int:
        """Bytes the object takes from its tier's capacity where it is resident (alignment included)."""
        return self.obj.home.reserved

    def move_to(
        self,
        tier: str,
        priority: Priority = Priority.PREFETCH,
        known: KnownBytes | None = None,
        after: Future[None] | None = None,
        zero_from: int | None = None,
    ) -> Transfer | None:
        """Start moving the object to ``tier``; None when it is already there. ``known``:
        rule 6 of NOTE [ Managed object rules ]; ``after``: its rule 11; ``zero_from``: its rule 12
        (the caller vouches that the bytes from there on are zeros: a storage tier is not written them)."""
        self._check()
        return self.obj.registry.move(self.obj, tier, priority, known, after, zero_from)

    def wait(self) -> None:
        """Wait for the object's move to end; raise its error if it failed."""
        self._check()
        self.obj.registry.wait(self.obj)

    def tensor(self, tier: str = "device") -> torch.Tensor:
        """The tensor, readable now. Served from memory while a write-back is in flight
        (forwarding); fetched on demand into ``tier`` when it is only on storage."""
        self._check()
        data = self.obj.registry.read(self.obj, tier)
        typed = data[: self.obj.nbytes].view(self.dtype)
        # as_strided offsets count from the start of the underlying storage, which may
        # begin before our bytes (aligned allocations are slices of a larger buffer).
        return typed.as_strided(self.shape, self.stride, typed.storage_offset() + self.storage_offset)

    def fill_from(
        self,
        source: Handle,
        *,
        nbytes: int,
        source_offset: int = 0,
        offset: int = 0,
        priority: Priority = Priority.DEMAND,
    ) -> Transfer:
        """Rule 8: copy ``nbytes`` of ``source``'s bytes from ``source_offset`` into this
        object's at ``offset``; neither object moves."""
        self._check()
        source._check()
        return self.obj.registry.fill(self.obj, source.obj, nbytes, source_offset, offset, priority)

    def known_bytes(self, offset: int, nbytes: int) -> KnownBytes:
        """Rule 6: this object's first ``nbytes`` (in memory), vouched equal to bytes
        ``[offset, offset + nbytes)`` of the object a move from storage is told about."""
        self._check()
        return self.obj.registry.known_bytes(self.obj, offset, nbytes)

    def wait_known_copy(self) -> None:
        """Rule 6: return once no copy of known bytes into this object's move is running."""
        self.obj.registry.wait_known_copy(self.obj)

    def copy_out(self) -> torch.Tensor:
        """Rule 9: a fresh CPU copy of the object's bytes read where they live (no move)."""
        self._check()
        return self.obj.registry.copy_out(self.obj)

    def start_copy_out(self) -> CopyOut:
        """Rule 9: :meth:`copy_out`'s read started, waited for at the result's ``result()``; the
        object stays alive and unmoved until then."""
        self._check()
        return self.obj.registry.start_copy_out(self.obj)

    @property
    def freed(self) -> bool:
        """True once :meth:`free` was called on this handle (its object may live on in others)."""
        return self._freed

    def free(self) -> None:
        """Drop this handle; the object is freed with its last handle. Idempotent."""
        if not self._freed:
            self._freed = True
            self.obj.registry.release(self.obj)

    def _check(self) -> None:
        if self._freed or self.obj.state is ObjectState.FREED:
            raise ObjectFreedError(f"tiermem registry: {self.obj!r} was freed; this handle is no longer valid")

    def __repr__(self) -> str:
        return f"Handle({self.dtype}, {list(self.shape)}, {self.obj!r})"
