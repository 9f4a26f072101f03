"""Managed objects: bytes that live in one tier or move between two.

The registry is the one door through which managed bytes move: code that manages bytes
(the activation offloader, the model-state manager) holds :class:`Handle` s and calls the
operations below, never a tier or the scheduler. The objects themselves are in
:mod:`tiermem.objects` (importable from here).

# NOTE [ Managed object rules ]
1. An object is RESIDENT in exactly one allocation, or MOVING from a source
   allocation to a target. While moving, the source stays allocated and readable:
   a read of an object being written out is served from memory (forwarding).
2. A move ends on the scheduler's thread: on success the source is freed and the
   target becomes home (``ManagedObject.moves_landed`` counts these); on failure the
   target is freed and the object stays resident at its source, and the error is raised
   to the next ``wait()`` (nothing is lost).
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
   ``Handle.known_bytes`` names such bytes (an object resident in memory), and
   ``Handle.wait_known_copy`` waits until no copy reads them any more, before their
   owner frees or reuses them; also where the known bytes are all the move copies (the
   rest a zero tail, rule 12), when the move's own transfer reads them.
7. Bytes kept on a tier only as a cache, outside any object (the chunk pool's spares,
   NOTE [ Spare chunk storage ]), are accounted on the tier with :meth:`Registry.adopt_cache`
   (a :class:`CachedBytes`, freed by its owner) and come with a reclaimer: a caller short of
   room on that tier calls :meth:`Registry.reclaim` before it spills, waits or fails, so a
   cache never pushes real data off a tier. Reclaimers are held weakly. One that *moves* objects (kept
   activations, NOTE [ Activation fallbacks ] rule 8) runs after the caches, only given ``needed``.
8. A copy between two live objects (``Handle.fill_from``: a chunk's device copy filled from
   its home, or a changed device copy written back into it; a range of an NVMe object read
   into a host object or written back from one, at any offsets: a slice of a home too large to
   stage whole, NOTE [ Sliced steps ]) goes through the scheduler, so the link counts it, and
   changes where neither lives. The target must be resident (not
   moving: the move would drop what the copy wrote); the caller keeps both objects alive and
   unmoved until the copy ended (``wait()`` on the transfer returned).
9. Reading an object where it lives without moving it (``Handle.copy_out``: exporting a
   chunk's NVMe home) reads its allocation straight from the tier into a fresh CPU tensor of
   its reserved size, outside the scheduler, once its move (if any) ended.
   ``Handle.start_copy_out`` starts that read and returns at once (a re-pack reads the next
   old chunk while it builds from the last, NOTE [ Spilled snapshots ] rule 3); its
   :class:`CopyOut` gives the bytes, or the read's error, when waited for. The caller keeps
   the object alive and unmoved until then: its allocation must not be freed under the read.
10. ``fence(tier)`` orders every copy the tier starts from now on after the device work the
   calling thread has queued (TRAPS 28): for bytes a kernel wrote that a later submit,
   perhaps from another thread, reads.
11. A move may wait for a future (``Handle.move_to(..., after=)``: a chunk step computing on
   the step thread into the staged home it writes back). The object is MOVING from the call,
   as for any move (its source readable, a read of it served from memory, asking it back
   cancels the write: rules 1 and 3), and its bytes go once the future is done, whatever its
   outcome (NOTE [ Scheduling rules ] rule 8): the caller vouches that nothing but that work
   writes the source meanwhile, and that the future ends.
12. Zero tails: a move to storage may be told that the object's bytes from ``zero_from`` on are
   zeros (``Handle.move_to(..., zero_from=)``; the caller vouches): it writes only the bytes
   before it (from the next ``ALIGNMENT`` boundary on, so the write stays whole blocks), and
   while the object rests there every read of it (a move back, with or without known bytes; a
   range copy out of it; ``copy_out``) reads only the stored bytes and zeroes the rest of its
   target itself, on the calling thread, before the read is submitted. A new chunk home is the
   case (``ChunkStore``'s build in ``states/store.py``: its optimizer-state sections are zeros
   until a step or a state import writes them): measured on the 210M first-step bench,
   ``rt.manage`` wrote 2.4 GiB of homes, 1.6 GiB of it zeros, and the first backward read those
   zeros back (1.6 GiB) while the saved activations' reads queued behind them. A move back into
   memory ends the tail (the whole object is in memory; its next write-back writes it all
   unless told again); a range copy into the object's storage that reaches past the tail moves
   it to the copy's end, and one that starts past it is refused (the bytes between were never
   written).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future

import torch

from tiermem import tracing
from tiermem.errors import ObjectFreedError, internal_error
from tiermem.objects import (
    CachedBytes,
    Handle,
    KnownBytes,
    ManagedObject,
    ObjectState,
    RegistryStatistics,
    storage_bytes,
)
from tiermem.schedulers.base import LinkStatistics, Priority, Scheduler, Transfer
from tiermem.tiers.base import Allocation, Tier, TierStatistics
from tiermem.units import ALIGNMENT, round_up

#: Move priorities and in-flight moves, re-exported: managed-object code imports them from here,
#: never from the scheduler (the registry is the one door through which managed bytes move).
__all__ = [
    "CachedBytes",
    "CopyOut",
    "Handle",
    "KnownBytes",
    "ManagedObject",
    "ObjectState",
    "Priority",
    "Registry",
    "RegistryStatistics",
    "Transfer",
    "storage_bytes",
]


class CopyOut:
    """Rule 9: a read of an object's bytes into a fresh CPU tensor, started; :meth:`result` waits."""

    def __init__(self, data: torch.Tensor, done: Future[None], label: str) -> None:
        self._data = data
        self._done = done
        self._label = label

    def result(self) -> torch.Tensor:
        """The bytes once read (the read's error raised here)."""
        traced = tracing.span(self._label, "wait", None, {"bytes": self._data.numel()})
        try:
            self._done.result()
        finally:
            if traced is not None:
                traced.end()
        return self._data

    def settle(self) -> None:
        """Wait for the read to end, whatever it did: before the object it reads is freed."""
        with contextlib.suppress(Exception):
            self._done.result()


class Registry:
    """Owns every managed object and their moves through the scheduler."""

    def __init__(self, tiers: Mapping[str, Tier], scheduler: Scheduler) -> None:
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
        # Per tier, who can free room when it is full (weakly held: a closed offloader drops out).
        self._reclaimers: dict[str, list[tuple[weakref.WeakMethod[Callable[..., bool]], bool]]] = {}

    # -- registration ----------------------------------------------------------------------
    def register(
        self,
        tensor: torch.Tensor,
        tier: str = "device",
        *,
        dedup: bool = True,
        kind: str = "tensor",
        label: str | None = None,
    ) -> Handle:
        """Manage ``tensor``'s storage in ``tier`` and return a handle with its view.

        When the tensor already lives on ``tier``'s device its storage is adopted without
        a copy (it is then shared with the caller until the object moves away);
        otherwise its bytes are copied into a new allocation, waiting for the copy.
        ``kind`` is the object's accounting class, ``label`` what its bytes are in the
        timeline trace (default: the kind; see :class:`ManagedObject`).
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
            what = kind if label is None else label
            home = target.take(storage_bytes(tensor), label=what)  # adopted in place where the tier can
            obj = ManagedObject(self, home, storage.nbytes(), kind, what)
            self._objects[obj.id] = obj
            self._count_resident(obj, home.tier, +1)
            if dedup:
                obj.dedup_key = key
                self._dedup[key] = (weakref.ref(storage, self._storage_died(key)), version, obj)
            return Handle(obj, tensor)

    def make(self, tier: str, nbytes: int, *, kind: str = "tensor", label: str | None = None, room: int = 0) -> Handle:
        """A new object of ``nbytes`` uninitialised bytes allocated by ``tier`` itself (a memory
        tier hands out a block it kept, where :meth:`register` would adopt fresh pages the
        kernel zeroes first), its block holding ``room`` bytes where that is more (NOTE [ Spare
        tier blocks ] rule 6); a ``uint8`` handle. :class:`TierCapacityError` without room."""
        target = self._tier(tier)
        if not target.is_memory:
            raise internal_error(f"make() on the {tier} tier: only memory tiers hand out bytes to fill")
        what = kind if label is None else label
        allocation = target.allocate(nbytes, room=room)
        with self._lock:
            self._registered += 1
            obj = ManagedObject(self, allocation, nbytes, kind, what)
            self._objects[obj.id] = obj
            self._count_resident(obj, allocation.tier, +1)
        # the handle's view counts from the object's first byte (its block may start inside a larger buffer)
        return Handle(obj, torch.empty(nbytes, dtype=torch.uint8, device="meta"))

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

    # -- moves -------------------------------------------------------------------------------
    def move(
        self,
        obj: ManagedObject,
        tier: str,
        priority: Priority = Priority.PREFETCH,
        known: KnownBytes | None = None,
        after: Future[None] | None = None,
        zero_from: int | None = None,
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
                        if (recorder := tracing.RECORDER) is not None:  # NOTE [ Timeline trace ]
                            recorder.instant(f"cancel {obj.label} write", "cancel", {"bytes": obj.nbytes})
                    return None
            elif obj.home.tier is target_tier:
                return None
            else:
                return self._start_move(obj, target_tier, priority, known, after, zero_from)
        # Otherwise let the current move land first, then move again.
        self.wait(obj)
        return self.move(obj, tier, priority, known, after, zero_from)

    def _start_move(
        self,
        obj: ManagedObject,
        tier: Tier,
        priority: Priority,
        known: KnownBytes | None,
        after: Future[None] | None,
        zero_from: int | None = None,
    ) -> Transfer:
        """Under the lock. With ``known`` bytes (rule 6) two transfers run at once, the copy from
        memory and the read of the rest; the move ends when both have. With ``after``, the move
        is MOVING now and its bytes go once that future is done (rule 11). With a zero tail (rule
        12) only the bytes before it are written to storage, or read from there."""
        if not obj.home.tier.is_memory and not tier.is_memory:
            raise internal_error(f"{obj!r}: storage-to-storage moves go through a memory tier")
        if obj.home.tier.is_memory:
            known = None  # nothing to save: the whole object is copied from memory anyway
        offset, nbytes = (0, obj.nbytes) if known is None else known.rest(obj)
        tail = None if tier.is_memory else _aligned_tail(obj, zero_from)
        if tail is not None:
            nbytes = tail  # rule 12: the zeros stay unwritten
        target = tier.allocate(obj.nbytes, room=obj.room if tier.is_memory else 0)
        copy: Transfer | None = None
        try:
            if not obj.home.tier.is_memory:
                nbytes = _read_stored(obj, target, offset, nbytes, offset)  # rule 12: zeros are not read
            if known is not None and nbytes == 0:  # nothing stored to read: the known bytes are the move
                offset, nbytes, source = known.offset, known.nbytes, known.source
                known = None
            else:
                source = obj.home
            if known is not None:
                copy = self.scheduler.submit(
                    known.source,
                    target,
                    nbytes=known.nbytes,
                    dst_offset=known.offset,
                    priority=priority,
                    label=f"{obj.label} known bytes",
                )
            transfer = self.scheduler.submit(
                source,
                target,
                nbytes=nbytes,
                src_offset=offset if source is obj.home else 0,
                dst_offset=offset,
                priority=priority,
                label=obj.label if source is obj.home else f"{obj.label} known bytes",
                after=after,
            )
        except BaseException:
            if copy is not None:  # rule 4: the target is freed only once nothing writes into it
                copy.cancel()
                with contextlib.suppress(Exception):
                    copy.wait()
            tier.free(target)
            raise
        obj.target, obj.transfer, obj.copy, obj.state = target, transfer, copy, ObjectState.MOVING
        obj.target_zero_from = tail
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
                tail, obj.target_zero_from = obj.target_zero_from, None
                if error is None and not cancelled:
                    obj.home, obj.zero_from = target, tail
                    obj.moves_landed += 1
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
            transfer, copy = obj.transfer, obj.copy
        if transfer is not None:
            # The waits are counted in the scheduler's statistics and traced as waits on their
            # moves (NOTE [ Timeline trace ]); the object's own error, as recorded when the move
            # ended, is what we raise below.
            with contextlib.suppress(Exception):  # Ctrl-C and friends still propagate
                transfer.wait()
            if copy is not None:  # rule 6: the move ends once its copy of known bytes has too
                with contextlib.suppress(Exception):
                    copy.wait()
        if not obj.settled.is_set():
            # Both transfers ended; the scheduler's thread is still booking the move's end (rule
            # 2). A wait of its own in the timeline trace, or its time would be nobody's.
            traced = tracing.span(f"wait {obj.label} move end", "wait", None, self._wait_args(obj, transfer))
            try:
                obj.settled.wait()
            finally:
                if traced is not None:
                    traced.end()
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
                        if (recorder := tracing.RECORDER) is not None:  # NOTE [ Timeline trace ]
                            recorder.instant(f"forwarded {obj.label} read", "forwarded", {"bytes": obj.nbytes})
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

    # -- copies and reads that move no object (rules 6, 8, 9) ------------------------------------
    def fill(
        self,
        target: ManagedObject,
        source: ManagedObject,
        nbytes: int,
        source_offset: int = 0,
        target_offset: int = 0,
        priority: Priority = Priority.DEMAND,
    ) -> Transfer:
        """Rule 8: copy ``nbytes`` from ``source`` (at ``source_offset``) into ``target`` (at
        ``target_offset``) through the scheduler; the caller waits on the transfer."""
        with self._lock:
            self._check_live(source)
            self._check_live(target)
            if target.state is ObjectState.MOVING:
                raise internal_error(f"{target!r}: filled while it moves (the move would drop the copy)")
            src, dst = source.home, target.home
            # rule 12: the zeros past a tail are not read; zeroed below, outside the lock (the
            # caller keeps both objects alive and unmoved until the copy ended: rule 8)
            stored = nbytes if src.tier.is_memory else _stored_count(source, source_offset, nbytes)
            if not dst.tier.is_memory and target.zero_from is not None and target_offset + nbytes > target.zero_from:
                # rule 12: written up to its end, the tail starts there (never past a gap of unwritten bytes)
                if target_offset > target.zero_from:
                    raise internal_error(
                        f"{target!r}: bytes [{target_offset}, {target_offset + nbytes}) written past its zero "
                        f"tail at {target.zero_from} would leave the bytes between unwritten"
                    )
                end = target_offset + nbytes
                target.zero_from = end if end < target.nbytes else None
        if stored < nbytes:
            dst.view(target_offset + stored, nbytes - stored).zero_()
        return self.scheduler.submit(
            src,
            dst,
            nbytes=stored,
            src_offset=source_offset,
            dst_offset=target_offset,
            priority=priority,
            label=f"{target.label} fill",
        )

    def known_bytes(self, obj: ManagedObject, offset: int, nbytes: int) -> KnownBytes:
        """Rule 6: ``obj``'s first ``nbytes`` (resident in memory) as known bytes at ``offset``."""
        with self._lock:
            self._check_live(obj)
            if not obj.home.tier.is_memory:
                raise internal_error(f"{obj!r}: known bytes must sit in a memory tier")
            return KnownBytes(obj.home, offset, nbytes)

    def wait_known_copy(self, obj: ManagedObject) -> None:
        """Rule 6: wait for the copy of known bytes running beside ``obj``'s move, or for the move
        itself where it reads known bytes alone (the rest a zero tail, rule 12), if any."""
        with self._lock:
            copy, transfer = obj.copy, obj.transfer
            if copy is None and transfer is not None and transfer.src is not obj.home:
                copy = transfer  # it reads the known bytes, not the object's home
        if copy is not None:
            with contextlib.suppress(Exception):  # its error is the move's, raised at the object's wait()
                copy.wait()

    def copy_out(self, obj: ManagedObject) -> torch.Tensor:
        """Rule 9: a fresh CPU tensor of ``obj``'s bytes (rounded up to the tier's alignment) as they
        are where it lives."""
        return self.start_copy_out(obj).result()

    def start_copy_out(self, obj: ManagedObject) -> CopyOut:
        """Rule 9: :meth:`copy_out`'s read, started (once ``obj``'s move ended) and not waited for."""
        self.wait(obj)
        with self._lock:
            self._check_live(obj)
            home = obj.home
            stored = obj.zero_from if not home.tier.is_memory else None
        # its bytes with their alignment padding, not the room a memory tier's block may hold past
        # them (NOTE [ Spare tier blocks ] rule 6)
        data = torch.empty(home.tier.reserved_size(obj.nbytes), dtype=torch.uint8)
        if stored is not None:  # rule 12: the zero tail is not read
            data[stored:].zero_()
        home.tier.fence()  # a device-resident object is read after the caller's stream's work (TRAPS 28)
        # outside the scheduler: the wait is traced where it happens, naming itself
        read = home.tier.read(home, 0, data if stored is None else data[:stored])
        return CopyOut(data, read, f"wait {obj.label} read {home.tier.name}")

    @staticmethod
    def _wait_args(obj: ManagedObject, transfer: Transfer | None) -> dict[str, object]:
        """What a wait on ``obj``'s move says in the timeline trace (NOTE [ Timeline trace ])."""
        link = transfer.link if transfer is not None else ""
        return {"object": obj.label, "object_id": obj.id, "bytes": obj.nbytes, "link": link}

    def fence(self, tier: str) -> None:
        """Rule 10: ``tier``'s copies started from now on wait for device work queued so far (TRAPS 28)."""
        self._tier(tier).fence()

    # -- rule 7: caches outside objects ---------------------------------------------------------
    def adopt_cache(self, tier: str, buffer: torch.Tensor) -> CachedBytes:
        """Account ``buffer`` (a 1-D uint8 tensor on ``tier``'s device) on ``tier`` as a cache;
        raises :class:`~tiermem.errors.TierCapacityError` when it has no room."""
        target = self._tier(tier)
        if not target.is_memory:
            raise ValueError(f"tiermem registry: the {tier} tier keeps no cached bytes (not a memory tier)")
        return CachedBytes(target.adopt(buffer))  # type: ignore[attr-defined]  # memory tiers adopt

    def resize_for_io(self, storage: torch.UntypedStorage, nbytes: int, home_tier: str) -> None:
        """Give an empty device storage ``nbytes`` for a buffer refilled from and written to ``home_tier``
        again and again: the device tier's registered pool where it keeps one (NOTE [ Registered device pool ])."""
        resize = getattr(self._tier("device"), "resize_for_io", None)
        if resize is None:
            storage.resize_(nbytes)
        else:
            resize(storage, nbytes, self.tiers.get(home_tier))

    def add_reclaimer(self, tier: str, reclaim: Callable[..., bool], *, moves_objects: bool = False) -> None:
        """``reclaim`` (a bound method, held weakly) frees ``tier``'s cached bytes or moves objects off it (rule 7)."""
        self._tier(tier)
        with self._lock:  # dead owners' entries go here too: offloaders come and go
            refs = [entry for entry in self._reclaimers.get(tier, []) if entry[0]() is not None]
            self._reclaimers[tier] = [*refs, (weakref.WeakMethod(reclaim), moves_objects)]  # type: ignore[arg-type]

    def reclaim(self, tier: str, needed: int | None = None) -> bool:
        """Rule 7: caches first, then (given ``needed``) movers until ``needed`` bytes are free; True if any freed."""
        with self._lock:
            live = [(ref, moves, m) for ref, moves in self._reclaimers.get(tier, []) if (m := ref()) is not None]
            self._reclaimers[tier] = [(ref, moves) for ref, moves, _ in live]
        freed = False
        for _, moves, method in sorted(live, key=lambda entry: entry[1]):  # outside the lock: they free allocations
            if not moves or (needed is not None and self.free_bytes(tier) < needed):
                freed = (method(needed) if moves else method()) or freed
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

    def is_memory(self, tier: str) -> bool:
        """True when ``tier`` holds its bytes in memory (device, host), False for storage (NVMe)."""
        return self._tier(tier).is_memory

    def tier_statistics(self, tier: str) -> TierStatistics:
        """``tier``'s own accounting (capacity, current and peak bytes, ...)."""
        return self._tier(tier).statistics()

    def free_bytes(self, tier: str) -> int:
        """Bytes ``tier`` can still allocate: its capacity minus what it holds now."""
        stats = self._tier(tier).statistics()
        return stats.capacity - stats.current_bytes

    def reserved_size(self, tier: str, nbytes: int) -> int:
        """What an allocation of ``nbytes`` takes from ``tier``'s capacity (alignment included)."""
        return self._tier(tier).reserved_size(nbytes)

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


def _aligned_tail(obj: ManagedObject, zero_from: int | None) -> int | None:
    """Rule 12: where the bytes a move to storage leaves unwritten start (the zeros from
    ``zero_from`` on, from the next ``ALIGNMENT`` boundary, so the write is whole blocks of
    direct I/O); None when every byte is written."""
    if zero_from is None:
        return None
    if not 0 < zero_from <= obj.nbytes:
        raise internal_error(f"{obj!r}: a zero tail from byte {zero_from} is outside its {obj.nbytes} bytes")
    tail = round_up(zero_from, ALIGNMENT)
    return tail if tail < obj.nbytes else None


def _stored_count(obj: ManagedObject, offset: int, nbytes: int) -> int:
    """Rule 12: of ``nbytes`` to read from ``obj`` (resting on storage) at ``offset``, the count
    before its zero tail."""
    zero_from = obj.zero_from
    if zero_from is None or offset + nbytes <= zero_from:
        return nbytes
    return max(0, zero_from - offset)


def _read_stored(obj: ManagedObject, target: Allocation, offset: int, nbytes: int, target_offset: int) -> int:
    """Rule 12: :func:`_stored_count`, the rest of the span zeroed in memory allocation ``target``
    at ``target_offset`` here, before the read is submitted (on a device, on the calling
    thread's stream, which the submit's fence puts the copies after: TRAPS 28)."""
    stored = _stored_count(obj, offset, nbytes)
    if stored < nbytes:
        target.view(target_offset + stored, nbytes - stored).zero_()
    return stored
