"""Managed objects: bytes that live in one tier or move between two.

# NOTE [ Managed object rules ]
1. An object is RESIDENT in exactly one allocation, or MOVING from a source
   allocation to a target. While moving, the source stays allocated and readable:
   a read of an object being written out is served from memory (forwarding).
2. A move ends on the scheduler's thread: on success the source is freed and the
   target becomes home; on failure the target is freed and the object stays resident
   at its source, and the error is raised to the next ``wait()`` (nothing is lost).
3. Asking for an object back where its write-back started cancels that write
   (a write nobody needs any more), and the object simply stays home.
4. Freeing an object cancels its move; its allocations are released once the
   scheduler reports the move ended (never while a block may still touch them).
5. Dedup is at storage granularity (TRAPS 9): registering a tensor whose storage
   (the same storage object, at the same version) is already managed returns a new
   handle on the existing object with the tensor's own view (dtype, shape, stride,
   offset). Keys hold the storage weakly and never use ``data_ptr``, which is reused
   after free. Handles are reference counted; the last ``free()`` frees the object.
6. A move from storage may be told that some of the object's bytes already sit in
   memory (:class:`KnownBytes`, a prefix or a suffix of the object): those are copied
   from there, memory to memory through the scheduler (so the link counts them), while
   only the rest is read from storage; the move ends when both have landed and fails
   if either does. The caller vouches that the bytes are equal and stay so; the
   model-state manager uses it for a chunk's device copy, which is its home's master
   (or working copy) as fetched, so staging the home reads only the optimizer states.
7. Bytes kept on a tier only as a cache, outside any object (the chunk pool's spares,
   NOTE [ Spare chunk storage ]), come with a reclaimer: a caller short of room on that
   tier calls :meth:`Registry.reclaim` before it spills, waits or fails, so a cache never
   pushes real data off a tier. Reclaimers are held weakly.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tiermem.errors import ObjectFreedError, internal_error
from tiermem.schedulers.asyncio_scheduler import AsyncioScheduler
from tiermem.schedulers.base import LinkStatistics, Priority, Transfer
from tiermem.tiers.base import Allocation, Tier, TierStatistics
from tiermem.tiers.memory import MemoryTier

#: Move priorities and in-flight moves, re-exported: managed-object code imports them from here,
#: never from the scheduler (the registry is the one door through which managed bytes move).
__all__ = ["Handle", "KnownBytes", "ManagedObject", "ObjectState", "Priority", "Registry", "Transfer"]


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

    def __init__(self, registry: Registry, home: Allocation, nbytes: int, kind: str = "tensor") -> None:
        self.id = next(_object_ids)
        self.registry = registry
        self.nbytes = nbytes
        #: What the bytes are ("tensor", "activation", "chunk"): resident bytes are counted per kind.
        self.kind = kind
        self.home: Allocation = home
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
        #: Set once the current move has ended and the object's state reflects it.
        self.settled = threading.Event()
        self.settled.set()

    @property
    def tier(self) -> str:
        """Where the object is resident (its source, while it moves)."""
        return self.home.tier.name

    def __repr__(self) -> str:
        moving = f"->{self.target.tier.name}" if self.target is not None else ""
        return f"ManagedObject#{self.id}({self.nbytes} bytes, {self.state.value} {self.tier}{moving})"


@dataclass(frozen=True)
class KnownBytes:
    """Rule 6: bytes ``[offset, offset + nbytes)`` of an object equal the first ``nbytes`` of
    ``source``, a memory allocation; a move from storage copies them from there."""

    source: Allocation
    offset: int
    nbytes: int


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

    def move_to(
        self, tier: str, priority: Priority = Priority.PREFETCH, known: KnownBytes | None = None
    ) -> Transfer | None:
        """Start moving the object to ``tier``; None when it is already there. ``known``:
        rule 6 of NOTE [ Managed object rules ]."""
        self._check()
        return self.obj.registry.move(self.obj, tier, priority, known)

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


class Registry:
    """Owns every managed object and their moves through the scheduler."""

    def __init__(self, tiers: Mapping[str, Tier], scheduler: AsyncioScheduler) -> None:
        self.tiers = dict(tiers)
        self.scheduler = scheduler
        self._lock = threading.RLock()
        self._objects: dict[int, ManagedObject] = {}
        # id(storage) -> (weak storage, version, object); see rule 5 / TRAPS 9.
        self._dedup: dict[int, tuple[weakref.ref[torch.UntypedStorage], int, ManagedObject]] = {}
        self._registered = 0
        self._dedup_hits = 0
        self._forwarded = 0
        self._cancelled = 0
        self._moves = 0
        self._failed_moves = 0
        # Bytes of live objects per (kind, tier), counted where each object is resident
        # (its source while it moves), and their peaks.
        self._resident: dict[tuple[str, str], int] = {}
        self._peak_resident: dict[tuple[str, str], int] = {}
        # Moves that may still touch allocations, freed objects' included (rule 4).
        self._inflight: dict[Transfer, ManagedObject] = {}
        #: rule 7: per tier, bound methods that free cached bytes (True when they freed some)
        self._reclaimers: dict[str, list[weakref.WeakMethod[Callable[[], bool]]]] = {}

    # -- registration ----------------------------------------------------------------------
    def register(
        self, tensor: torch.Tensor, tier: str = "device", *, dedup: bool = True, kind: str = "tensor"
    ) -> Handle:
        """Manage ``tensor``'s storage in ``tier`` and return a handle with its view.

        When the tensor already lives on ``tier``'s device its storage is adopted without
        a copy (it is then shared with the caller until the object moves away);
        otherwise its bytes are copied into a new allocation.
        """
        target = self._tier(tier)
        storage = tensor.untyped_storage()
        version = tensor._version
        with self._lock:
            self._registered += 1
            key = id(storage)
            entry = self._dedup.get(key) if dedup else None
            if entry is not None:
                ref, entry_version, obj = entry
                if ref() is storage and entry_version == version and obj.state is not ObjectState.FREED:
                    self._dedup_hits += 1
                    return Handle(obj, tensor)
            home = self._adopt_or_copy(target, tensor)
            obj = ManagedObject(self, home, storage.nbytes(), kind)
            self._objects[obj.id] = obj
            self._count_resident(obj, home.tier, +1)
            if dedup:
                obj.dedup_key = key
                self._dedup[key] = (weakref.ref(storage, self._storage_died(key)), version, obj)
            return Handle(obj, tensor)

    def _storage_died(self, key: int) -> Callable[[weakref.ref[torch.UntypedStorage]], None]:
        """The weakref callback that drops ``key``'s dedup entry (holding the registry weakly)."""
        registry_ref = weakref.ref(self)

        def drop(ref: weakref.ref[torch.UntypedStorage]) -> None:
            registry = registry_ref()
            if registry is None:
                return
            with registry._lock:
                entry = registry._dedup.get(key)
                if entry is not None and entry[0] is ref:
                    del registry._dedup[key]

        return drop

    @staticmethod
    def _adopt_or_copy(tier: Tier, tensor: torch.Tensor) -> Allocation:
        data = storage_bytes(tensor)
        # A pinned host tier copies pageable bytes into its pool: adopting them would break its
        # promise that its bytes are page-locked (CUDA copies from pageable memory run
        # synchronously, through a staging buffer).
        unpinned = getattr(tier, "pinned", False) and not data.is_pinned()
        if isinstance(tier, MemoryTier) and data.device == tier.device and not unpinned:
            return tier.adopt(data)
        allocation = tier.allocate(data.numel())
        try:
            tier.write(allocation, 0, data.cpu() if not tier.is_memory else data).result()
        except BaseException:
            tier.free(allocation)
            raise
        return allocation

    # -- moves -------------------------------------------------------------------------------
    def move(
        self, obj: ManagedObject, tier: str, priority: Priority = Priority.PREFETCH, known: KnownBytes | None = None
    ) -> Transfer | None:
        target_tier = self._tier(tier)
        with self._lock:
            self._check_live(obj)
            if obj.state is ObjectState.MOVING:
                assert obj.target is not None and obj.transfer is not None
                if obj.target.tier is target_tier and not obj.cancelling:  # already on its way
                    if priority < obj.transfer.priority:
                        obj.transfer.promote(priority)
                        if obj.copy is not None:
                            obj.copy.promote(priority)
                    return obj.transfer
                if obj.home.tier is target_tier and obj.home.tier.is_memory:
                    # Rule 3: wanted back where it still is; the write is no longer needed.
                    if not obj.cancelling:
                        obj.cancelling = True
                        self._cancelled += 1
                        obj.transfer.cancel()
                    return None
            elif obj.home.tier is target_tier:
                return None
            else:
                return self._start_move(obj, target_tier, priority, known)
        # Otherwise let the current move land first, then move again.
        self.wait(obj)
        return self.move(obj, tier, priority, known)

    def _start_move(self, obj: ManagedObject, tier: Tier, priority: Priority, known: KnownBytes | None) -> Transfer:
        """Under the lock. With ``known`` bytes (rule 6) two transfers run at once, the copy from
        memory and the read of the rest; the move ends when both have."""
        if not obj.home.tier.is_memory and not tier.is_memory:
            raise internal_error(f"{obj!r}: storage-to-storage moves go through a memory tier")
        if obj.home.tier.is_memory:
            known = None  # nothing to save: the whole object is copied from memory anyway
        offset, nbytes = (0, obj.nbytes) if known is None else self._rest_of(obj, known)
        target = tier.allocate(obj.nbytes)
        copy: Transfer | None = None
        try:
            if known is not None:
                copy = self.scheduler.submit(
                    known.source, target, nbytes=known.nbytes, dst_offset=known.offset, priority=priority
                )
            transfer = self.scheduler.submit(
                obj.home, target, nbytes=nbytes, src_offset=offset, dst_offset=offset, priority=priority
            )
        except BaseException:
            if copy is not None:  # rule 4: the target is freed only once nothing writes into it
                copy.cancel()
                with contextlib.suppress(Exception):
                    copy.wait()
            tier.free(target)
            raise
        obj.target, obj.transfer, obj.copy, obj.state = target, transfer, copy, ObjectState.MOVING
        obj.error = None
        obj.settled.clear()
        self._moves += 1
        self._inflight[transfer] = obj
        if copy is None:
            transfer.add_done_callback(lambda t: self._move_ended(obj, t))
        else:
            remaining = [2]

            def part_ended(_part: Transfer) -> None:
                # No reference to either transfer here: the callback lives in their futures
                # (TRAPS 14). The object holds both until the move ends.
                with self._lock:
                    remaining[0] -= 1
                    if remaining[0]:
                        return
                    read = obj.transfer
                assert read is not None
                self._move_ended(obj, read)

            copy.add_done_callback(part_ended)
            transfer.add_done_callback(part_ended)
        return transfer

    @staticmethod
    def _rest_of(obj: ManagedObject, known: KnownBytes) -> tuple[int, int]:
        """Rule 6: the span (offset, count) still to read when ``known`` is a prefix or a suffix."""
        end = known.offset + known.nbytes
        if not known.source.tier.is_memory or known.nbytes > known.source.nbytes or known.nbytes <= 0:
            raise internal_error(f"{obj!r}: known bytes must be a non-empty span of a memory allocation, got {known}")
        if known.offset == 0 and end < obj.nbytes:
            return end, obj.nbytes - end
        if end == obj.nbytes and known.offset > 0:
            return 0, known.offset
        raise internal_error(f"{obj!r}: known bytes must be a prefix or a suffix of its {obj.nbytes} bytes: {known}")

    def _move_ended(self, obj: ManagedObject, transfer: Transfer) -> None:
        """Rules 2 and 4, on the scheduler's thread."""
        with self._lock:
            try:
                if obj.transfer is not transfer:
                    raise internal_error(f"{obj!r}: move ended for a transfer it no longer owns")
                target, source = obj.target, obj.home
                assert target is not None
                # Rule 3: a cancel asked for may arrive after every block landed; the object
                # still stays home, as move() promised (the landed copy is dropped).
                copy, obj.copy = obj.copy, None
                cancelled = transfer.cancelled() or obj.cancelling or (copy is not None and copy.cancelled())
                obj.target, obj.transfer, obj.cancelling = None, None, False
                error = transfer.exception() or (copy.exception() if copy is not None else None)
                if obj.state is ObjectState.FREED:
                    target.tier.free(target)
                    source.tier.free(source)
                    self._count_resident(obj, source.tier, -1)
                    return
                obj.state = ObjectState.RESIDENT
                if error is None and not cancelled:
                    obj.home = target
                    source.tier.free(source)
                    self._count_resident(obj, source.tier, -1)
                    self._count_resident(obj, target.tier, +1)
                else:
                    target.tier.free(target)
                    if error is not None and not cancelled:
                        self._failed_moves += 1
                        obj.error = error
            finally:
                self._inflight.pop(transfer, None)
                obj.settled.set()

    def wait(self, obj: ManagedObject) -> None:
        """Wait until ``obj``'s move has ended; raise the error it ended with (rule 2)."""
        with self._lock:
            transfer = obj.transfer
        if transfer is not None:
            # The wait is counted in the scheduler's statistics; the object's own error,
            # as recorded when the move ended, is what we raise below.
            with contextlib.suppress(Exception):  # Ctrl-C and friends still propagate
                transfer.wait()
        obj.settled.wait()
        with self._lock:
            error, obj.error = obj.error, None
        if error is not None:
            raise error

    def read(self, obj: ManagedObject, tier: str = "device") -> torch.Tensor:
        """Bytes of ``obj`` in ``tier`` (a memory tier), forwarding from a moving source
        that is in ``tier`` (rule 1); otherwise moved there on demand."""
        target = self._tier(tier)
        if not target.is_memory:
            raise ValueError(f"tiermem registry: objects are read from a memory tier, not {tier!r}")
        while True:
            with self._lock:
                self._check_live(obj)
                if obj.home.tier is target:
                    if obj.state is ObjectState.MOVING:
                        self._forwarded += 1
                    return obj.home.view(0, obj.nbytes)
            self.move(obj, tier, Priority.DEMAND)
            self.wait(obj)

    def release(self, obj: ManagedObject) -> None:
        """Drop one handle's reference; the last one frees the object (rule 4)."""
        with self._lock:
            if obj.state is ObjectState.FREED:
                return
            obj.refs -= 1
            if obj.refs > 0:
                return
            obj.state = ObjectState.FREED
            self._objects.pop(obj.id, None)
            if obj.dedup_key is not None:
                entry = self._dedup.get(obj.dedup_key)
                if entry is not None and entry[2] is obj:
                    del self._dedup[obj.dedup_key]
            transfer, copy = obj.transfer, obj.copy
            if transfer is None:
                obj.home.tier.free(obj.home)
                self._count_resident(obj, obj.home.tier, -1)
                return
        self._cancelled += 1
        transfer.cancel()  # allocations are freed by _move_ended
        if copy is not None:
            copy.cancel()

    # -- rule 7: caches outside objects ---------------------------------------------------------
    def add_reclaimer(self, tier: str, reclaim: Callable[[], bool]) -> None:
        """``reclaim`` (a bound method, held weakly) frees bytes ``tier`` holds only as a cache."""
        self._tier(tier)
        with self._lock:
            self._reclaimers.setdefault(tier, []).append(weakref.WeakMethod(reclaim))  # type: ignore[arg-type]

    def reclaim(self, tier: str) -> bool:
        """Ask every live reclaimer of ``tier`` to free its cache; True when one freed bytes."""
        with self._lock:
            refs = self._reclaimers.get(tier, [])
            live = [(ref, method) for ref in refs if (method := ref()) is not None]
            self._reclaimers[tier] = [ref for ref, _ in live]
        freed = False
        for _, method in live:  # outside the lock: a reclaimer frees allocations
            freed = method() or freed
        return freed

    # -- what callers may ask of the tiers (read-only; bytes move only through the methods above) --
    @property
    def tier_names(self) -> tuple[str, ...]:
        """The names of this runtime's tiers, fastest first."""
        return tuple(self.tiers)

    def has_tier(self, name: str) -> bool:
        return name in self.tiers

    @property
    def device(self) -> torch.device:
        """The torch device of the device tier (the CPU without CUDA)."""
        return self._tier("device").device  # type: ignore[attr-defined,no-any-return]

    def tier_statistics(self, tier: str) -> TierStatistics:
        """``tier``'s own accounting (capacity, current and peak bytes, ...)."""
        return self._tier(tier).statistics()

    def free_bytes(self, tier: str) -> int:
        """Bytes ``tier`` can still allocate: its capacity minus what it holds now."""
        stats = self._tier(tier).statistics()
        return stats.capacity - stats.current_bytes

    def reserved_size(self, tier: str, nbytes: int) -> int:
        """What an allocation of ``nbytes`` takes from ``tier``'s capacity (alignment included)."""
        return self._tier(tier).reserved_size(nbytes)  # type: ignore[attr-defined,no-any-return]

    def link_statistics(self) -> Mapping[str, LinkStatistics]:
        """Bytes and busy seconds per link (``"device->nvme"``, ...) since the runtime started."""
        return self.scheduler.statistics().links

    # -- helpers ---------------------------------------------------------------------------
    def _tier(self, name: str) -> Tier:
        tier = self.tiers.get(name)
        if tier is None:
            raise ValueError(f"tiermem registry: no tier named {name!r}; this runtime has {sorted(self.tiers)}")
        return tier

    @staticmethod
    def _check_live(obj: ManagedObject) -> None:
        if obj.state is ObjectState.FREED:
            raise ObjectFreedError(f"tiermem registry: {obj!r} was freed")

    def objects(self) -> list[ManagedObject]:
        with self._lock:
            return list(self._objects.values())

    def free_all(self) -> None:
        """Free every object (Runtime exit) and wait until no move touches an allocation."""
        for obj in self.objects():
            while obj.refs > 0 and obj.state is not ObjectState.FREED:
                self.release(obj)
        with self._lock:
            draining = list(self._inflight.values())
        for obj in draining:
            obj.settled.wait()

    def _count_resident(self, obj: ManagedObject, tier: Tier, sign: int) -> None:
        key = (obj.kind, tier.name)
        value = self._resident.get(key, 0) + sign * obj.nbytes
        self._resident[key] = value
        if value > self._peak_resident.get(key, 0):
            self._peak_resident[key] = value

    def resident_bytes(self, kind: str, tier: str) -> int:
        """Bytes of live ``kind`` objects resident in ``tier`` now."""
        with self._lock:
            return self._resident.get((kind, tier), 0)

    def peak_resident_bytes(self, kind: str, tier: str) -> int:
        """The most bytes of ``kind`` objects ever resident in ``tier`` at once."""
        with self._lock:
            return self._peak_resident.get((kind, tier), 0)

    def statistics(self) -> RegistryStatistics:
        with self._lock:
            return RegistryStatistics(
                objects=len(self._objects),
                registered=self._registered,
                dedup_hits=self._dedup_hits,
                forwarded=self._forwarded,
                cancelled=self._cancelled,
                moves=self._moves,
                failed_moves=self._failed_moves,
            )
