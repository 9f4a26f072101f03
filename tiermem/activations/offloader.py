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
   flight from memory and cancels that write (forwarding); prefetches the ``lookahead``
   blocks before it in reverse forward order; and otherwise fetches on demand.
6. A saved activation is freed when autograd drops it (the graph is released), never at
   unpack: ``retain_graph=True`` unpacks again (TRAPS 9).
7. Disk full or the host tier full: the block falls back to keep, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiermem.activations.blocks import BlockSpec, find_blocks
from tiermem.activations.policy import BlockPolicy, BlockProfile, PolicySpec, adaptive_keep, resolve_policies
from tiermem.errors import DiskFullError, TierCapacityError, TiermemError
from tiermem.registry import Handle, ObjectState, Registry
from tiermem.schedulers.base import Priority

if TYPE_CHECKING:
    from tiermem.tiers.memory import MemoryTier

log = logging.getLogger("tiermem.activations")


class ActivationMemoryError(TiermemError, MemoryError):
    """Raised when saved activations do not fit in the device budget even after the
    write-backs in flight have landed."""


@dataclass
class ActivationCounters:
    """Cumulative activation counts of one Runtime (all offload contexts), thread-safe."""

    captured_bytes: int = 0
    dedup_hits: int = 0
    forwarded: int = 0
    cancelled: int = 0
    backward_wait_s: float = 0.0
    offloaded_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "nvme": 0})
    fetched_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "nvme": 0})
    fallbacks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class SavedActivation:
    """What autograd holds for one saved tensor: a handle plus its version at pack."""

    __slots__ = ("__weakref__", "group", "handle", "modified", "tensor_ref", "version")

    def __init__(self, handle: Handle, tensor: torch.Tensor, group: _Group | None) -> None:
        self.handle = handle
        self.version = tensor._version
        # Weak: holding the tensor would keep its storage in memory after the write-back.
        self.tensor_ref = weakref.ref(tensor)
        self.group = group
        #: The error to raise at unpack, when the block's end found the tensor modified.
        self.modified: RuntimeError | None = None

    def __del__(self) -> None:
        # Rule 6: the graph released this saved tensor.
        with contextlib.suppress(Exception):
            self.handle.free()


@dataclass(eq=False)
class _Group:
    """One block's saved tensors in one forward pass."""

    forward_id: int
    index: int
    policy: BlockPolicy
    saved: list[weakref.ref[SavedActivation]] = field(default_factory=list)
    #: Saved tensors held until the block's forward ends, so an in-place change made
    #: inside the block is seen even when the tensor dies before backward (TRAPS 1).
    pending: list[tuple[SavedActivation, torch.Tensor]] = field(default_factory=list)
    saved_bytes: int = 0
    started: float = 0.0
    forward_s: float = 0.0
    prefetched: bool = False


def _version_error(tensor: torch.Tensor, expected: int) -> RuntimeError:
    # The wording of autograd's own check (torch/csrc/autograd/saved_variable.cpp).
    name = f"{tensor.type()} {list(tensor.shape)}"
    grad_fn = tensor.grad_fn
    origin = f", which is output 0 of {grad_fn.name()}" if grad_fn is not None else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{name}]{origin}, is at version {tensor._version}; expected version {expected} instead. "
        "Hint: the backtrace further above shows the operation that failed to compute its gradient. "
        "(tiermem checked this: saved-tensor hooks turn autograd's own check off, TRAPS 1.)"
    )


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
        names = [name for name, _ in self.blocks]
        self.policies, self.adaptive = resolve_policies(policy, names, default_policy)
        self._device_tier: MemoryTier = registry.tiers["device"]  # type: ignore[assignment]
        self._protected: set[int] = set()
        self._groups: dict[tuple[int, int], _Group] = {}
        self._current: _Group | None = None
        self._forward_id = 0
        self._last_index = len(self.blocks)
        self._hooks: list[Any] = []
        self._wrapped: list[tuple[nn.Module, Any]] = []
        self._saved_hooks: Any = None
        self._lock = threading.Lock()

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> ActivationOffloader:
        # Rule 3: parameters and buffers (and views of them) stay where they are.
        self._protected = {id(t.untyped_storage()) for t in (*self.model.parameters(), *self.model.buffers())}
        for index, (_name, block) in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._block_started(index)))
            self._hooks.append(block.register_forward_hook(self._block_ended(index), always_call=True))
            if self.policies[index] is BlockPolicy.RECOMPUTE:
                self._wrapped.append((block, block.__dict__.get("forward")))
                self._wrap_recompute(block)
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
            self._current = None

    @staticmethod
    def _wrap_recompute(block: nn.Module) -> None:
        # The instance's own forward when something (accelerate, peft, a user) patched one in.
        original = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]

    # -- block tracking ----------------------------------------------------------------------
    def _block_started(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            if self._in_backward() or not torch.is_grad_enabled():
                return
            with self._lock:
                if index <= self._last_index:  # a new forward pass begins
                    self._forward_id += 1
                    self._prune()
                self._last_index = index
                group = _Group(self._forward_id, index, self.policies[index], started=time.perf_counter())
                self._groups[(self._forward_id, index)] = group
                self._current = group

        return hook

    def _block_ended(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            group = self._current
            if group is None or group.index != index:
                return
            group.forward_s = time.perf_counter() - group.started
            self._current = None
            for saved, tensor in group.pending:
                if tensor._version != saved.version:
                    saved.modified = _version_error(tensor, saved.version)
            group.pending.clear()
            if self.adaptive and index == len(self.blocks) - 1:
                self._adapt(group.forward_id)

        return hook

    def _prune(self) -> None:
        """Forget groups of earlier forwards whose saved tensors autograd has released
        (or that saved none, e.g. recomputed blocks)."""
        dead = [
            key
            for key, g in self._groups.items()
            if g.forward_id < self._forward_id and all(ref() is None for ref in g.saved)
        ]
        for key in dead:
            del self._groups[key]

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    # -- adaptive keep -----------------------------------------------------------------------
    def _adapt(self, forward_id: int) -> None:
        """NOTE [ Adaptive keep ]: choose the next forward's policies from this one."""
        links = self.registry.scheduler.statistics().links
        write, read = links.get("device->nvme"), links.get("nvme->device")
        if write is None or write.busy_s <= 0 or write.bytes == 0:
            return  # nothing measured yet: keep offloading all but the last block
        write_bw = write.bytes / write.busy_s
        read_bw = read.bytes / read.busy_s if read is not None and read.busy_s > 0 and read.bytes else write_bw
        profile = [
            BlockProfile(g.forward_s, g.saved_bytes)
            for i in range(len(self.blocks))
            if (g := self._groups.get((forward_id, i))) is not None
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
            self.policies = policies

    # -- hooks ---------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._in_backward():
            return tensor  # rule 2
        storage = tensor.untyped_storage()
        if (
            storage.nbytes() < self.min_bytes
            or id(storage) in self._protected
            or tensor.device != self._device_tier.device
        ):
            return tensor  # rule 3
        group = self._current
        handle = self._register(tensor)
        saved = SavedActivation(handle, tensor, group)
        hit = handle.obj.refs > 1
        with self.counters.lock:
            if hit:
                self.counters.dedup_hits += 1
            else:
                self.counters.captured_bytes += handle.obj.nbytes
        if group is not None:
            group.saved.append(weakref.ref(saved))
            group.pending.append((saved, tensor))
            if not hit:
                group.saved_bytes += handle.obj.nbytes
            if group.policy.offloads and not hit:
                self._write_back(handle, group)
        return saved

    def _register(self, tensor: torch.Tensor) -> Handle:
        try:
            return self.registry.register(tensor, "device", kind="activation")
        except TierCapacityError:
            pass
        # Write-backs in flight free device memory when they land: wait for them, then retry.
        for obj in self.registry.objects():
            if obj.kind == "activation" and obj.state is ObjectState.MOVING:
                with contextlib.suppress(Exception):
                    self.registry.wait(obj)
        try:
            return self.registry.register(tensor, "device", kind="activation")
        except TierCapacityError as exc:
            raise ActivationMemoryError(
                f"tiermem activations: a saved tensor of {tensor.untyped_storage().nbytes()} bytes does not fit "
                f"in the device budget ({exc.used} of {exc.capacity} bytes in use after the write-backs in flight "
                "landed). Offload more blocks (policy nvme/host), recompute some, or raise [device] capacity."
            ) from exc

    def _write_back(self, handle: Handle, group: _Group) -> None:
        tier = group.policy.value
        try:
            handle.move_to(tier, Priority.WRITEBACK)
        except (DiskFullError, TierCapacityError) as exc:
            # Rule 7: keep this block resident rather than fail the step.
            log.warning("tiermem activations: block %d falls back to keep: %s", group.index, exc)
            group.policy = BlockPolicy.KEEP
            with self.counters.lock:
                self.counters.fallbacks += 1
            return
        with self.counters.lock:
            self.counters.offloaded_bytes[tier] += handle.obj.nbytes

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.modified is not None:
            raise saved.modified  # rule 5, TRAPS 1
        original = saved.tensor_ref()
        if original is not None and original._version != saved.version:
            raise _version_error(original, saved.version)
        if saved.group is not None:
            self._prefetch_before(saved.group)
        handle: Handle = saved.handle
        obj = handle.obj
        if obj.state is ObjectState.MOVING and obj.home.tier.is_memory and obj.home.tier.name == "device":
            # Forwarding: still in memory; the write is no longer needed.
            with self.counters.lock:
                self.counters.forwarded += 1
                self.counters.cancelled += 1
            handle.move_to("device")
            return handle.tensor()
        source = obj.tier
        target = obj.target
        prefetching = obj.state is ObjectState.MOVING and target is not None and target.tier.name == "device"
        start = time.perf_counter()
        tensor = handle.tensor("device")
        if source != "device":
            with self.counters.lock:
                self.counters.backward_wait_s += time.perf_counter() - start
                if not prefetching:  # a prefetch in flight counted its bytes when it started
                    self.counters.fetched_bytes[source] += obj.nbytes
        return tensor

    def _prefetch_before(self, group: _Group) -> None:
        """Rule 5: bring back the ``lookahead`` blocks backward needs next."""
        for index in range(group.index - 1, max(group.index - 1 - self.lookahead, -1), -1):
            earlier = self._groups.get((group.forward_id, index))
            if earlier is None or earlier.prefetched:
                continue
            earlier.prefetched = True
            for handle in self._live_handles(earlier.saved):
                source = handle.tier
                if source == "device" or handle.state is not ObjectState.RESIDENT:
                    continue
                with contextlib.suppress(Exception):  # a failed prefetch surfaces at the demand fetch
                    handle.move_to("device", Priority.PREFETCH)
                    with self.counters.lock:
                        self.counters.fetched_bytes[source] += handle.obj.nbytes

    @staticmethod
    def _live_handles(refs: Sequence[weakref.ref[SavedActivation]]) -> Iterator[Handle]:
        for ref in refs:
            saved = ref()
            if saved is not None and not saved.handle._freed:
                yield saved.handle
