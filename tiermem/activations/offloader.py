"""Activation offloading (TBA) through autograd's saved-tensor hooks.

# NOTE [ Activation offload rules ]
1. One ``saved_tensors_hooks`` pair is pushed when the context opens, outside the model,
   so a non-reentrant ``torch.utils.checkpoint`` inside a block pushes its own hooks
   *inside* ours and keeps working (TRAPS 6). Blocks are tracked with forward pre/post
   hooks registered with ``always_call=True``, so an exception never leaves a block
   marked as running.
2. Tensors packed during backward (reentrant checkpoint recomputing forward) are
   returned as they are: backward needs them at once (TRAPS 6).
3. Kept as they are: tensors whose storage is below ``min_bytes``, parameters, buffers
   and views of either (``weight.t()``), and tensors on another device than the device
   tier's.
4. Every other saved tensor is registered as a managed ``activation`` object, adopted
   without a copy and deduplicated by storage and version (TRAPS 9); each pack returns
   its own :class:`SavedActivation` with its own view. Blocks whose policy offloads start
   a write-back to ``host`` or ``nvme`` at once.
5. Unpack checks the version recorded at pack (TRAPS 1: hooks switch autograd's own
   check off) and raises PyTorch's error on a mismatch; a block's saved tensors are held
   until its forward ends and checked there too, since most in-place changes happen
   inside the block, to tensors that are gone by backward; serves a tensor whose write is in
   flight from memory and cancels that write (forwarding); otherwise starts its fetch on
   demand *before* any prefetch; then prefetches the rest of its block and the
   ``lookahead`` blocks before it, in the order backward needs them (reverse forward order,
   each block's tensors in reverse pack order), up to the prefetch window's bytes (NOTE
   [ Prefetch window ]) and only into free device bytes, stopping at the first that does
   not fit, and cancels their writes still in flight. So a
   prefetch never takes the room something needed sooner must be fetched into. Should a
   demand still find no room (a guess of the order that autograd did not follow), it waits
   for the write-backs in flight, then writes prefetched objects nobody unpacked yet back
   to their tier, the one needed last first; the clear error only when nothing is left.
6. A saved activation is freed when autograd drops it (the graph is released), never at
   unpack: ``retain_graph=True`` unpacks again (TRAPS 9).
7. A tier that fails (disk full, I/O error, tier full) or a device budget that runs short
   changes blocks as NOTE [ Activation fallbacks ] says: kept, recomputed from the next
   block on, or evicted/spilled synchronously; a clear error only when nothing fits.
   Decisions are taken when a block starts, since recompute must wrap the block's forward.
8. What the offloader learns about a model (block sizes, adaptive keep's choice, tier
   outages, write-backs in flight) outlives one context: ``tiermem train`` opens a
   context per step, and the next step starts from what the last one measured.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import torch
from torch import nn

from tiermem.activations.blocks import BlockSpec, find_blocks
from tiermem.activations.counters import ActivationCounters
from tiermem.activations.fallback import ActivationMemoryError, Fallbacks, failure_cause, first_tensor_numel
from tiermem.activations.prefetch import Prefetcher
from tiermem.activations.saved import (
    BlockGroup,
    Forwards,
    SavedActivation,
    in_backward,
    moving_to,
    version_error,
)
from tiermem.errors import StorageError, TierCapacityError
from tiermem.layout.activation_policy import (
    BlockPolicy,
    BlockProfile,
    PolicySpec,
    adaptive_keep,
    flexible_blocks,
    resolve_policies,
)
from tiermem.registry import Handle, ManagedObject, ObjectState, Priority, Registry

log = logging.getLogger("tiermem.activations")


class ActivationOffloader:
    """Context manager: offloads a model's saved activations block by block."""

    def __init__(
        self,
        registry: Registry,
        model: nn.Module,
        counters: ActivationCounters,
        *,
        policy: PolicySpec,
        default_policy: str,
        blocks: BlockSpec = None,
        min_bytes: int = 1 << 20,
        lookahead: int = 2,
    ) -> None:
        self.registry = registry
        self.model = model
        self.counters = counters
        self.min_bytes = min_bytes
        self.lookahead = lookahead
        self.blocks = find_blocks(model, blocks)
        self.names = [name for name, _ in self.blocks]
        self.policies, self.adaptive = resolve_policies(policy, self.names, default_policy)
        self.flexible = flexible_blocks(policy if policy is not None else default_policy, self.policies, self.adaptive)
        self.memory = counters.memory_for(model, tuple(self.names))
        if self.adaptive and self.memory.adapted is not None:
            self.policies = list(self.memory.adapted)  # rule 8: what the last step chose
        #: Saved tensors on another device stay where they are (rule 3).
        self._device = registry.device
        self._protected: set[int] = set()
        self.forwards = Forwards(self.memory.forwards, len(self.blocks))
        self._hooks: list[Any] = []
        self._wrapped: list[tuple[nn.Module, Any]] = []
        self._saved_hooks: Any = None
        self._lock = threading.Lock()
        self.fallbacks = Fallbacks(
            registry,
            self.memory,
            counters,
            self.forwards,
            names=self.names,
            policies=self.policies,
            flexible=self.flexible,
        )
        self.prefetcher = Prefetcher(registry, self.memory, counters, self.forwards, lookahead=lookahead)

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> ActivationOffloader:
        # Rule 3: parameters and buffers (and views of them) stay where they are.
        self._protected = {id(t.untyped_storage()) for t in (*self.model.parameters(), *self.model.buffers())}
        for index, (_name, block) in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._block_started(index)))
            self._hooks.append(block.register_forward_hook(self._block_ended(index), always_call=True))
            always = self.policies[index] is BlockPolicy.RECOMPUTE and not self.flexible[index]
            if always or self.flexible[index]:
                self._wrapped.append((block, block.__dict__.get("forward")))
                self._wrap_recompute(block, index, always)
        self.prefetcher.context_entered()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._saved_hooks is not None:
                self._saved_hooks.__exit__(*exc_info)
        finally:
            self._saved_hooks = None
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            for block, previous in self._wrapped:  # undo _wrap_recompute, restoring what was there
                if previous is None:
                    block.__dict__.pop("forward", None)
                else:
                    block.__dict__["forward"] = previous
            self._wrapped.clear()
            self.forwards.current = None
            self.prefetcher.settle()
            self.fallbacks.drain()  # failures reported by now are warned about at the end of the step

    def _wrap_recompute(self, block: nn.Module, index: int, always: bool) -> None:
        """Checkpoint the block's forward: always (a user's ``recompute``), or when the
        policy decided at its start says so (NOTE [ Activation fallbacks ] rule 1)."""
        # The instance's own forward when something (accelerate, peft, a user) patched one in.
        original = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and (always or self._recomputing(index)):
                return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)
            return original(*args, **kwargs)

        block.forward = forward  # type: ignore[method-assign]

    def _recomputing(self, index: int) -> bool:
        group = self.forwards.current
        return group is not None and group.index == index and group.policy is BlockPolicy.RECOMPUTE

    # -- block tracking ----------------------------------------------------------------------
    def _block_started(self, index: int) -> Any:
        def hook(_module: nn.Module, args: Any) -> None:
            if in_backward() or not torch.is_grad_enabled():
                return
            with self._lock:
                if index <= self.forwards.last_index:  # a new forward pass begins
                    self.prefetcher.settle()  # after a backward in this same context
                    self.memory.forward_started()
                    self.forwards.forward_id = self.memory.forwards
                    self.fallbacks.forward_started()
                    self.prefetcher.forward_started()
                    self.forwards.prune()
                self.forwards.last_index = index
                group = BlockGroup(
                    self.forwards.forward_id,
                    index,
                    self.policies[index],
                    input_numel=first_tensor_numel(args),
                    flexible=self.flexible[index],
                )
                self.forwards.groups[(self.forwards.forward_id, index)] = group
                self.fallbacks.drain()
                if group.flexible:
                    group.policy = self.fallbacks.decide(group)
                group.started = time.perf_counter()
                self.forwards.current = group

        return hook

    def _block_ended(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            group = self.forwards.current
            if group is None or group.index != index:
                return
            group.forward_s = time.perf_counter() - group.started
            self.forwards.current = None
            for saved, tensor in group.pending:
                if tensor._version != saved.version:
                    saved.modified = version_error(tensor, saved.version)
            group.pending.clear()
            if group.policy is not BlockPolicy.RECOMPUTE:  # a recomputed block saves ~nothing here
                self.memory.measured(index, group.saved_bytes, group.input_numel)
            if self.adaptive and index == len(self.blocks) - 1:
                self._adapt(group.forward_id)

        return hook

    # -- adaptive keep -----------------------------------------------------------------------
    def _adapt(self, forward_id: int) -> None:
        """NOTE [ Adaptive keep ]: choose the next forward's policies from this one."""
        links = self.registry.link_statistics()
        write, read = links.get("device->nvme"), links.get("nvme->device")
        if write is None or write.busy_s <= 0 or write.bytes == 0:
            return  # nothing measured yet: keep offloading all but the last block
        write_bw = write.bytes / write.busy_s
        read_bw = read.bytes / read.busy_s if read is not None and read.busy_s > 0 and read.bytes else write_bw
        profile = [
            # A block recomputed by a fallback saved nothing this time: use its last size.
            BlockProfile(g.forward_s, self.memory.estimate(i, g.input_numel) or g.saved_bytes)
            for i in range(len(self.blocks))
            if (g := self.forwards.group(forward_id, i)) is not None
        ]
        if len(profile) != len(self.blocks):
            return
        keep = adaptive_keep(profile, write_bw, read_bw)
        policies = [BlockPolicy.NVME] * (len(self.blocks) - keep) + [BlockPolicy.KEEP] * keep
        if policies != self.policies:
            log.info(
                "adaptive keep: write %.0f MB/s, read %.0f MB/s -> keep the last %d of %d blocks",
                write_bw / 1e6,
                read_bw / 1e6,
                keep,
                len(self.blocks),
            )
            self.policies[:] = policies  # in place: the collaborators hold this list
        self.memory.adapted = list(policies)

    # -- hooks ---------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if in_backward():
            return tensor  # rule 2
        storage = tensor.untyped_storage()
        if (
            storage.nbytes() < self.min_bytes
            or id(storage) in self._protected
            or tensor.device != self._device
        ):
            return tensor  # rule 3
        if self.memory.ledger.pending_failures:
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
            self.memory.outside_now += handle.obj.nbytes
        if group is not None:
            group.saved.append(weakref.ref(saved))
            group.pending.append((saved, tensor))
            if not hit:
                group.saved_bytes += handle.obj.nbytes
            if group.policy.offloads and not hit and handle.tier == "device":
                self._write_back(handle, group)
        return saved

    def _write_back(self, handle: Handle, group: BlockGroup) -> None:
        tier = group.policy.value
        try:
            transfer = handle.move_to(tier, Priority.WRITEBACK)
        except (StorageError, TierCapacityError) as exc:
            # NOTE [ Activation fallbacks ] rule 3, found at once: keep this block resident.
            cause = failure_cause(exc)
            self.memory.tier_failed(tier, cause, str(exc))
            group.policy = BlockPolicy.KEEP
            self.fallbacks.report(group.forward_id, group.index, f"{cause}->keep", f"writing to {tier} failed: {exc}")
            return
        error = handle.obj.error
        if error is not None:
            # The write failed before move_to returned, so the registry read its error on
            # this thread: Transfer.exception() re-raises it, and its traceback now holds
            # this frame and _pack's (with the saved tensor) in a cycle only the GC frees.
            # Cut it; the failure is still reported, by message (TRAPS 16).
            error.__traceback__ = None
        if transfer is not None:
            self.memory.ledger.started(transfer, handle.obj, handle.obj.nbytes, tier, group.forward_id, group.index)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.modified is not None:
            raise saved.modified  # rule 5, TRAPS 1
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
            return handle.tensor()
        source = obj.tier
        prefetching = obj.state is ObjectState.MOVING and moving_to(obj) == "device"
        start = time.perf_counter()
        # The demand first, prefetches after: the room it needs is never taken by blocks
        # backward needs later (rule 5). The fetch runs while the prefetches are issued.
        self._demand(handle, group)
        if group is not None:
            self.prefetcher.before(group)
        try:
            tensor = handle.tensor("device")
        except TierCapacityError as exc:  # the object left the device meanwhile (not expected)
            raise self._demand_error(obj, source, group, exc) from exc
        if source != "device":
            with self.counters.lock:
                self.counters.backward_wait_s += time.perf_counter() - start
                if not prefetching:  # a prefetch in flight counted its bytes when it started
                    self.counters.fetched_bytes[source] += obj.nbytes
        return tensor

    def _demand(self, handle: Handle, group: BlockGroup | None) -> None:
        """Start bringing ``handle``'s object back into the device budget for backward, now
        (rule 5). When it does not fit: wait for the write-backs in flight to land, then
        give back prefetched objects backward needs later; the clear error only when it
        still does not fit."""
        obj = handle.obj
        if obj.tier == "device" or (obj.state is ObjectState.MOVING and moving_to(obj) is not None):
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
                if not waited and self.memory.ledger.inflight_bytes():
                    waited = True
                    self.memory.ledger.wait_idle()
                    continue
                if self.prefetcher.release(needed, exclude=obj):
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
