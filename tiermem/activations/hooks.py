"""The saved-tensor hook pair: what autograd's pack and unpack do with a saved tensor
(NOTE [ Activation offload rules ] rules 2 to 6, in ``tiermem/activations/offloader.py``;
"rule N" below cites that NOTE)."""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tiermem.activations.counters import ActivationCounters
from tiermem.activations.fallback import ActivationMemoryError, Fallbacks
from tiermem.activations.history import OffloadHistory
from tiermem.activations.ledger import failure_cause
from tiermem.activations.prefetch import Prefetcher
from tiermem.activations.saved import BlockGroup, Forwards, KeptTensor, SavedActivation, in_backward, version_error
from tiermem.activations.storages import ProtectedStorages, StorageWatch
from tiermem.errors import StorageError, TierCapacityError
from tiermem.layout.activation_policy import BlockPolicy
from tiermem.registry import Handle, ManagedObject, ObjectState, Priority, Registry


class SavedTensorHooks:
    """Pack and unpack for one offloader. ``forwards`` says which block is running;
    ``fallbacks`` registers what is packed (NOTE [ Activation fallbacks ]); ``prefetcher``
    brings back what backward needs next; ``names`` name the blocks in errors."""

    def __init__(
        self,
        registry: Registry,
        history: OffloadHistory,
        counters: ActivationCounters,
        forwards: Forwards,
        fallbacks: Fallbacks,
        prefetcher: Prefetcher,
        *,
        names: Sequence[str],
        min_bytes: int,
    ) -> None:
        self.registry = registry
        self.history = history
        self.counters = counters
        self.forwards = forwards
        self.fallbacks = fallbacks
        self.prefetcher = prefetcher
        self.names = names
        self.min_bytes = min_bytes
        #: Saved tensors on another device stay where they are (rule 3).
        self.device = registry.device
        #: Storages of the parameters and buffers the modules hold when they run (rule 3).
        self.protected = ProtectedStorages()
        #: Storages under a write-back in flight (rule 9).
        self.watch = StorageWatch()
        #: Called at every unpack of a captured tensor (in backward): how ``rt.manage``'s capture
        #: learns a backward reached it (NOTE [ Managed activations ] rule 4).
        self.on_unpack: Callable[[], None] | None = None

    def protect(self, model: nn.Module, blocks: Sequence[nn.Module]) -> list[Any]:
        """Rule 3: parameters and buffers (and views of them) stay where they are; the forward
        pre-hooks that keep the set current are returned, to remove at exit (TRAPS 30).

        Nothing is hooked inside a compiled region (a ``torch.compile(block)`` wrapper): dynamo
        would trace the hook and compile another graph than plain PyTorch's (NOTE [ Compiling a
        managed model ] rule 1 in ``tiermem/states/compile.py``); the wrapper's own pre-hook,
        which runs eagerly, adds the region's whole subtree."""
        handles = self.protected.register(model, blocks)
        regions = _compiled_regions(model)
        if not regions:
            return handles
        inner = [m for region in regions for m in region.modules() if m is not region]
        inside = {key for module in inner for key in module._forward_pre_hooks}
        kept = []
        for handle in handles:
            if handle.id in inside:
                handle.remove()
            else:
                kept.append(handle)
        block_ids = {id(block) for block in blocks}
        for region in regions:
            if id(region) not in block_ids:  # a block's pre-hook adds its subtree already
                kept.append(region.register_forward_pre_hook(lambda m, _a: self.protected.add(m, recurse=True)))
        return kept

    # -- pack ----------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        if in_backward():
            return tensor  # rule 2: a recomputing backward needs it at once
        storage = tensor.untyped_storage()
        if storage.nbytes() < self.min_bytes or storage in self.protected or tensor.device != self.device:
            return KeptTensor(tensor)  # rule 3: small, a parameter's, or on another device: kept as it is
        if self.history.ledger.pending_failures:
            self.fallbacks.drain()
        group = self.forwards.current
        handle = self.fallbacks.register(tensor, group)
        saved = SavedActivation(handle, tensor, group)
        hit = handle.obj.refs > 1
        with self.counters.lock:
            if hit:
                self.counters.dedup_hits += 1
            else:
                self.counters.captured_bytes += handle.obj.nbytes
        if group is None and not hit:
            self.history.outside_now += handle.obj.nbytes
        if group is not None:
            group.saved.append(weakref.ref(saved))
            group.pending.append((saved, tensor))
            if not hit:
                group.saved_bytes += handle.obj.nbytes
            if group.policy.offloads and not hit and handle.tier == "device":
                self.write_back(handle, group)
                self.watch.started(handle.obj, storage, f"block {group.index} ({self.names[group.index]})")
        return saved

    def write_back(self, handle: Handle, group: BlockGroup) -> None:
        """Rule 4: start writing a saved tensor of an offloading block to its tier."""
        tier = group.policy.value
        try:
            transfer = handle.move_to(tier, Priority.WRITEBACK)
        except (StorageError, TierCapacityError) as exc:
            # NOTE [ Activation fallbacks ] rule 3, found at once: keep this block resident.
            cause = failure_cause(exc)
            self.history.tier_failed(tier, cause, str(exc))
            group.policy = BlockPolicy.KEEP
            self.fallbacks.report(group.forward_id, group.index, f"{cause}->keep", f"writing to {tier} failed: {exc}")
            return
        error = handle.obj.error
        if error is not None:
            # The write failed before move_to returned, so the registry read its error on
            # this thread: Transfer.exception() re-raises it, and its traceback now holds
            # this frame and pack's (with the saved tensor) in a cycle only the GC frees.
            # Cut it; the failure is still reported, by message (TRAPS 16).
            error.__traceback__ = None
        if transfer is not None:
            self.history.ledger.started(transfer, handle.obj, handle.obj.nbytes, tier, group.forward_id, group.index)

    # -- unpack --------------------------------------------------------------------------------
    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, KeptTensor):
            return saved.unpacked()  # rule 5: PyTorch's error if it changed in place since pack
        if isinstance(saved, torch.Tensor):
            return saved  # rule 2: packed in backward, needed at once
        if self.on_unpack is not None:
            self.on_unpack()
        if saved.modified is not None:
            raise saved.modified  # changed in place after pack: autograd would use wrong values (TRAPS 1)
        original = saved.tensor_ref()
        if original is not None and original._version != saved.version:
            raise version_error(original, saved.version)
        handle: Handle = saved.handle
        obj = handle.obj
        group = saved.group
        self.prefetcher.unpacked(obj)
        if obj.state is ObjectState.MOVING and obj.tier == "device":  # the device tier is memory
            # Forwarding: still in memory; the write is no longer needed.
            with self.counters.lock:
                self.counters.forwarded += 1
                self.counters.cancelled += 1
            handle.move_to("device")
            if group is not None:
                self.prefetcher.before(group)
            return self._checked(handle)
        source = obj.tier
        prefetching = obj.state is ObjectState.MOVING and obj.target_tier == "device"
        start = time.perf_counter()
        # The demand first, prefetches after: the room it needs is never taken by blocks
        # backward needs later (rule 5). The fetch runs while the prefetches are issued.
        self.demand(handle, group)
        if group is not None:
            self.prefetcher.before(group)
        try:
            tensor = handle.tensor("device")
        except TierCapacityError as exc:  # the object left the device meanwhile (not expected)
            raise self._demand_error(obj, source, group, exc) from exc
        self._checked(handle, tensor)
        if source != "device":
            with self.counters.lock:
                self.counters.backward_wait_s += time.perf_counter() - start
                if not prefetching:  # a prefetch in flight counted its bytes when it started
                    self.counters.fetched_bytes[source] += obj.nbytes
        return tensor

    def _checked(self, handle: Handle, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """``handle``'s tensor, unless rule 9 found its write landed from a storage that changed
        under it (a cancelled write may still have landed: NOTE [ Managed object rules ] rule 3)."""
        tensor = handle.tensor() if tensor is None else tensor
        broken = self.watch.broken(handle.obj)
        if broken is not None:
            raise broken
        return tensor

    def demand(self, handle: Handle, group: BlockGroup | None) -> None:
        """Start bringing ``handle``'s object back into the device budget for backward, now
        (rule 5). When it does not fit: wait for the write-backs in flight to land, then
        give back prefetched objects backward needs later; the clear error only when it
        still does not fit."""
        obj = handle.obj
        if obj.tier == "device" or (obj.state is ObjectState.MOVING and obj.target_tier is not None):
            return  # on the device, or on its way (a prefetch, promoted by the read)
        needed = self.registry.reserved_size("device", obj.nbytes)
        waited = False
        while True:
            try:
                handle.move_to("device", Priority.DEMAND)
                return
            except TierCapacityError as exc:
                if self.registry.reclaim("device"):  # caches first (registry rule 7)
                    continue
                if not waited and self.history.ledger.inflight_bytes():
                    waited = True
                    self.history.ledger.wait_idle()
                    continue
                if self.prefetcher.release(needed, exclude=obj):
                    continue
                # others' objects that can move (model-state chunks no module uses now): rule 7
                # of NOTE [ Managed object rules ]
                if self.registry.reclaim("device", needed=needed):
                    continue
                error = self._demand_error(obj, obj.tier, group, exc)
                exc.__traceback__ = None  # TRAPS 16: it may hold this frame's callers
                raise error from exc

    def _demand_error(
        self, obj: ManagedObject, source: str, group: BlockGroup | None, exc: TierCapacityError
    ) -> ActivationMemoryError:
        where = f"block {group.index} ({self.names[group.index]})" if group is not None else "outside the blocks"
        unknown = (
            " Nothing was measured of this block when it started (a model's first forward), so it could not "
            "be switched to recompute in time (NOTE [ Activation fallbacks ] rule 1); the next forward would."
            if group is not None and group.flexible and group.expected is None
            else ""
        )
        return ActivationMemoryError(
            f"tiermem activations: backward needs a saved tensor of {obj.nbytes} bytes ({where}) back from "
            f"{source}, but the device budget has {exc.used} of {exc.capacity} bytes in use.{unknown} Raise "
            "[device] capacity or recompute more blocks (policy 'recompute' or a mapping such as "
            "{0: 'recompute'})."
        )


def _compiled_regions(model: nn.Module) -> list[nn.Module]:
    """The ``torch.compile`` wrappers below ``model`` (none without dynamo imported)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return []
    return [m for m in model.modules() if m is not model and isinstance(m, eval_frame.OptimizedModule)]
