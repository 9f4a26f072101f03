"""Backward's prefetches: what comes back to the device ahead of need, bounded by the
prefetch window (NOTE [ Prefetch window ], ``tiermem/layout/activation_policy.py``), and
what a demand fetch may take back from them (NOTE [ Activation offload rules ] rule 5,
``tiermem/activations/offloader.py``)."""

from __future__ import annotations

import contextlib
import sys
import time
import weakref

from tiermem.activations.counters import ActivationCounters
from tiermem.activations.history import OffloadHistory
from tiermem.activations.ledger import failure_cause
from tiermem.activations.saved import BlockGroup, Forwards, live_handles
from tiermem.errors import ObjectFreedError, StorageError, TierCapacityError
from tiermem.layout.activation_policy import PREFETCH_START, next_prefetch_window
from tiermem.registry import Handle, ManagedObject, ObjectState, Priority, Registry


class Prefetcher:
    """One offloader's prefetches: issued at each unpack for the ``lookahead`` blocks before
    it, given back when a demand fetch needs their room, and the window settled after each
    backward. ``forwards`` is the offloader's forward state; ``memory`` holds the window."""

    def __init__(
        self,
        registry: Registry,
        history: OffloadHistory,
        counters: ActivationCounters,
        forwards: Forwards,
        *,
        lookahead: int,
    ) -> None:
        self.registry = registry
        self.history = history
        self.counters = counters
        self.forwards = forwards
        self.lookahead = lookahead
        #: Objects prefetched for backward and not unpacked since, by object id: (object,
        #: its block, the tier it came from, its place in that block's order). A demand
        #: fetch that finds no room may give them back (NOTE [ Activation offload rules ] rule 5).
        self.prefetched: dict[int, tuple[weakref.ref[ManagedObject], BlockGroup, str, int]] = {}
        #: The backward since the window was last settled: its first and last unpack, and the
        #: runtime's wait total at that settlement (NOTE [ Prefetch window ] rule 3).
        self._backward_span: list[float] = []
        self._wait_seen = 0.0
        #: Objects backward unpacked since the last forward began, by object id: autograd may
        #: still hold the tensor it was given (NOTE [ Activation fallbacks ] rule 8 leaves them).
        self._unpacked: set[int] = set()

    def context_entered(self) -> None:
        """The window's wait total counts from here (NOTE [ Prefetch window ] rule 3)."""
        with self.counters.lock:
            self._wait_seen = self.counters.backward_wait_s

    def forward_started(self) -> None:
        """A new forward: nothing prefetched before it is a prefetch of its backward."""
        self.prefetched.clear()
        self._unpacked.clear()

    def unpacked(self, obj: ManagedObject) -> None:
        """Backward needs ``obj`` now: it extends the backward's span, and it is no prefetch
        that a demand may take back."""
        now = time.perf_counter()
        if self._backward_span:
            self._backward_span[1] = now
        else:
            self._backward_span = [now, now]
        self.prefetched.pop(obj.id, None)
        self._unpacked.add(obj.id)

    def was_unpacked(self, obj: ManagedObject) -> bool:
        """Whether backward unpacked ``obj`` since the last forward began."""
        return obj.id in self._unpacked

    def forget(self, obj: ManagedObject) -> None:
        """``obj`` left the device for someone else's room: no prefetch of it is ahead of backward."""
        self.prefetched.pop(obj.id, None)

    def before(self, group: BlockGroup) -> None:
        """NOTE [ Activation offload rules ] rule 5: bring back what backward needs next, in
        that order, and only into free device bytes: the rest of this block, then the
        ``lookahead`` blocks before it, each block's tensors in reverse pack order, until the
        prefetch window's bytes are ahead of backward (NOTE [ Prefetch window ]). A prefetch
        never takes the room something needed sooner must be fetched into: it stops at the
        first that does not fit, and that block is tried again at the next unpack."""
        window = self.window()
        ahead = self.ahead_bytes()
        for index in range(group.index, max(group.index - 1 - self.lookahead, -1), -1):
            earlier = self.forwards.group(group.forward_id, index)
            if earlier is None or earlier.prefetched:
                continue
            for order, handle in enumerate(live_handles(earlier.saved[::-1])):
                source = handle.tier
                if source == "device":
                    self._cancel_write(handle)
                    continue
                if handle.state is not ObjectState.RESIDENT:
                    continue
                if ahead >= window:
                    return  # the rest of this block comes at a later unpack
                if self.registry.reserved_size("device", handle.obj.nbytes) > self.registry.free_bytes("device"):
                    return
                try:
                    handle.move_to("device", Priority.PREFETCH)
                except TierCapacityError:
                    return
                except Exception:  # noqa: BLE001 - a failed prefetch surfaces at the demand fetch
                    continue
                ahead += handle.obj.nbytes
                self.prefetched[handle.obj.id] = (weakref.ref(handle.obj), earlier, source, -order)
                with self.counters.lock:
                    self.counters.fetched_bytes[source] += handle.obj.nbytes
            earlier.prefetched = True  # every tensor of the block is back or on its way

    def _cancel_write(self, handle: Handle) -> None:
        """A tensor still on the device whose write to storage is in flight, and backward
        needs it soon: cancel the write (NOTE [ Activation offload rules ] rule 5's forwarding,
        early), or it would land and need a fetch into room that earlier blocks' prefetches
        had meanwhile taken."""
        obj = handle.obj
        target = obj.target_tier if obj.state is ObjectState.MOVING else None
        if target is not None and not self.registry.is_memory(target):
            handle.move_to("device")
            with self.counters.lock:
                self.counters.cancelled += 1

    def release(self, needed: int, exclude: ManagedObject) -> bool:
        """NOTE [ Activation offload rules ] rule 5: give the device room a demand fetch needs
        back from prefetches, the object backward needs last first: each is written back to
        the tier it came from (synchronously; a prefetch in flight lands first) and its block
        is prefetched again later. Only objects no saved tensor has been unpacked from since
        they were prefetched are touched: nothing backward holds. True when one was given
        back."""
        entries = sorted(self.prefetched.items(), key=lambda item: (item[1][1].index, item[1][3]))
        released = False
        for key, (ref, group, tier, _order) in entries:
            if self.registry.free_bytes("device") >= needed:
                break
            del self.prefetched[key]
            obj = ref()
            if obj is None or obj is exclude or obj.state is ObjectState.FREED:
                continue
            group.prefetched = False  # fetched again when there is room
            with contextlib.suppress(Exception):  # a failed prefetch left it where it was
                self.registry.wait(obj)
            if obj.state is not ObjectState.RESIDENT or obj.tier != "device" or obj.refs == 0:
                continue
            try:
                self.registry.move(obj, tier, Priority.DEMAND)
                self.registry.wait(obj)
            except (StorageError, TierCapacityError) as exc:
                exc.__traceback__ = None  # TRAPS 16
                self.history.tier_failed(tier, failure_cause(exc), str(exc))
                continue
            except ObjectFreedError:
                continue
            released = True
            with self.counters.lock:
                self.counters.prefetch_released += 1
        return released

    def ahead_bytes(self) -> int:
        """Bytes prefetched and not unpacked since; forgets objects freed meanwhile."""
        total = 0
        for key, (ref, _group, _tier, _order) in list(self.prefetched.items()):
            obj = ref()
            if obj is None or obj.state is ObjectState.FREED:
                del self.prefetched[key]
            else:
                total += obj.nbytes
        return total

    def cap(self) -> int:
        """NOTE [ Prefetch window ] rule 3: the ``lookahead + 1`` blocks the window grows to at most."""
        return (self.lookahead + 1) * max(self.history.block_bytes.values(), default=0)

    def window(self) -> int:
        """NOTE [ Prefetch window ] rule 2: the bytes backward prefetches ahead of need."""
        if self.history.prefetch_window is None:
            largest = max(self.history.block_bytes.values(), default=0)
            if not largest:
                return sys.maxsize  # nothing measured: only ``lookahead`` bounds it, block-wise
            self.history.prefetch_window = max(1, int(PREFETCH_START * largest))
        return self.history.prefetch_window

    def settle(self) -> None:
        """NOTE [ Prefetch window ] rule 3: grow the window when the backward since the last
        look waited (at the context's end, and at a new forward inside one context)."""
        span, self._backward_span = self._backward_span, []
        with self.counters.lock:
            total = self.counters.backward_wait_s
        waited, self._wait_seen = total - self._wait_seen, total
        if len(span) < 2 or self.history.prefetch_window is None:
            return
        self.history.prefetch_window = next_prefetch_window(
            self.history.prefetch_window, waited, span[1] - span[0], self.cap()
        )
