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
   tier's. A parameter is what a module holds *when it runs*, never a list taken at entry
   (TRAPS 30: FSDP2 swaps ``module._parameters[name]`` to the full parameter it gathers
   for each forward and frees it after): the set of their storages (held weakly, matched
   by identity) is taken again in forward pre-hooks on the model (anew, each forward), on
   every block (its subtree) and on every other module holding parameters or buffers
   itself (so tensors saved outside the blocks are covered too), each registered after
   the hooks already there, so after FSDP2's unshard (prepended). See
   :mod:`tiermem.activations.storages`.
4. Every other saved tensor is registered as a managed ``activation`` object, adopted
   without a copy and deduplicated by storage and version (TRAPS 9); each pack returns
   its own :class:`SavedActivation` with its own view. Blocks whose policy offloads start
   a write-back to ``host`` or ``nvme`` at once.
5. Unpack checks the version recorded at pack (TRAPS 1: hooks switch autograd's own
   check off, for the tensors rule 3 keeps as they are too: ``KeptTensor``) and raises
   PyTorch's error on a mismatch; a block's saved tensors are held
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
9. A saved tensor whose storage something else frees or resizes (``resize_``) while its
   write-back is in flight may be written from freed memory (TRAPS 24, 30). The storage's
   address and size when the write started are compared at every block start and end
   (cheap: writes in flight only) and when the write ends; if it landed from a storage that
   changed, every unpack of it raises
   :class:`~tiermem.activations.storages.ActivationStorageError` naming the block and what
   to do, never the copy. Only a write that landed counts: one that did not (cancelled by
   forwarding, or failed) leaves the tensor at home in its own storage, read as plain
   PyTorch would read it. An unpack that finds the write ended but not yet judged judges
   it itself (on the safe side: a change since it landed counts there too). Detection, not
   a copy at pack: a copy would double the memory traffic and
   the peak of every offloaded byte (rule 4 adopts storages in place) to guard against
   something rule 3 already keeps parameters out of; detection costs two integer reads
   per write in flight at each block start and end, nothing per pack or unpack (a check
   there would walk every write in flight for every saved tensor). Unseen only: a storage
   freed *and* given back the same address and size between two checkpoints while its
   write is in flight (FSDP2 frees in its post-forward hook, which runs before the block
   end's check, and gives back only in backward; writes start only inside blocks, so the
   first checkpoint after any pack is its block's end).

The offloader composes collaborators, each given what it reads and writes explicitly:
:class:`~tiermem.activations.hooks.SavedTensorHooks` (pack and unpack, rules 2 to 6 and 9),
:class:`~tiermem.activations.fallback.Fallbacks` (rule 7), :class:`~tiermem.activations.prefetch.Prefetcher`
(rule 5's prefetches and their window) and :class:`~tiermem.activations.adaptive.AdaptiveKeep`; it
tracks the blocks (rule 1) in a :class:`~tiermem.activations.saved.Forwards` they share, and the
model's :class:`~tiermem.activations.history.OffloadHistory` (rule 8). Bytes move only through the
registry.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn

from tiermem import tracing
from tiermem.activations.adaptive import AdaptiveKeep
from tiermem.activations.blocks import BlockSpec, ForwardPatches, find_blocks
from tiermem.activations.counters import ActivationCounters
from tiermem.activations.fallback import ActivationMemoryError, Fallbacks, first_tensor_numel
from tiermem.activations.giveback import DeviceGiveBack
from tiermem.activations.hooks import SavedTensorHooks
from tiermem.activations.prefetch import Prefetcher
from tiermem.activations.recompute import checkpointed
from tiermem.activations.saved import BlockGroup, Forwards, in_backward, version_error
from tiermem.layout.activation_policy import BlockPolicy, PolicySpec, flexible_blocks, resolve_policies
from tiermem.malloc import StreamingTrim
from tiermem.registry import Registry

# Imported from here by the runtime, the planner's calibration and the tests.
__all__ = ["ActivationCounters", "ActivationMemoryError", "ActivationOffloader"]


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
        chosen: bool = False,
    ) -> None:
        """``chosen``: ``policy`` is tiermem's own choice (a plan's, applied under ``activations="auto"``),
        so a fallback may change any block (NOTE [ Activation fallbacks ] rule 2), its ``keep`` and
        ``recompute`` included."""
        self.registry = registry
        self.model = model
        self.counters = counters
        self.blocks = find_blocks(model, blocks)
        #: the policy asked for (None: ``default_policy``), as given
        self.requested = policy
        self.names = [name for name, _ in self.blocks]
        self.policies, self.adaptive = resolve_policies(policy, self.names, default_policy)
        self.flexible = flexible_blocks(policy if policy is not None else default_policy, self.policies, self.adaptive)
        if chosen:
            self.flexible = [True] * len(self.policies)
        self.history = counters.history_for(model, tuple(self.names))
        if self.adaptive and self.history.adapted is not None:
            self.policies = list(self.history.adapted)  # rule 8: what the last step chose
        # ``self.policies`` is shared from here on: adaptive keep updates it in place.
        self.forwards = Forwards(self.history.forwards, len(self.blocks))
        self.fallbacks = Fallbacks(
            registry,
            self.history,
            counters,
            self.forwards,
            names=self.names,
            policies=self.policies,
            flexible=self.flexible,
        )
        self.prefetcher = Prefetcher(registry, self.history, counters, self.forwards, lookahead=lookahead)
        self.hooks = SavedTensorHooks(
            registry,
            self.history,
            counters,
            self.forwards,
            self.fallbacks,
            self.prefetcher,
            names=self.names,
            min_bytes=min_bytes,
        )
        self.adaptive_keep = AdaptiveKeep(registry, self.history, self.forwards, self.policies)
        #: on CUDA the blocks' forward times come from events: the host's clock reads only the
        #: kernels' queueing (NOTE [ Adaptive keep ] rule 4)
        self._gpu_timed = self.adaptive and registry.device.type == "cuda"
        #: NOTE [ Activation fallbacks ] rule 8: room for the model states, through the registry
        self.give_back = DeviceGiveBack(registry, self.history, self.forwards, self.fallbacks, self.prefetcher)
        self._module_hooks: list[Any] = []
        self._patches = ForwardPatches()  # the blocks' recompute wrappers
        self._saved_hooks: Any = None
        self._lock = threading.Lock()
        #: trims the heap as blocks offload (NOTE [ Returning freed memory ] rule 5)
        self.trimming = StreamingTrim()
        self._offloaded = 0  # saved bytes offloaded in this forward so far

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> ActivationOffloader:
        self.install()
        self.prefetcher.context_entered()
        try:
            self.push_saved_hooks()
        except BaseException:
            self._undo_module_changes()  # __exit__ never runs for a context whose __enter__ raised
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.pop_saved_hooks()
        finally:
            self._undo_module_changes()
            self.finish()

    # -- the context's parts (rt.manage applies them per forward: NOTE [ Managed activations ]) --
    def install(self) -> None:
        """Rules 1 and 3: the block hooks, the protecting pre-hooks and the recompute wrappers;
        on failure the model is left as it was."""
        try:
            # rule 3: the parameters a module holds when it runs stay where they are
            self._module_hooks.extend(self.hooks.protect(self.model, [block for _, block in self.blocks]))
            for index, (_name, block) in enumerate(self.blocks):
                self._module_hooks.append(block.register_forward_pre_hook(self._block_started(index)))
                self._module_hooks.append(block.register_forward_hook(self._block_ended(index), always_call=True))
                always = self.policies[index] is BlockPolicy.RECOMPUTE and not self.flexible[index]
                if always or self.flexible[index]:
                    self._wrap_recompute(block, index, always)
        except BaseException:
            self._undo_module_changes()
            raise

    def uninstall(self) -> None:
        """Undo :meth:`install`: a block that runs afterwards is not tracked (a recomputation in
        backward calls the block's forward it captured, never these hooks)."""
        self._undo_module_changes()
        self.forwards.current = None

    def push_saved_hooks(self) -> None:
        """Rule 1: push this offloader's saved-tensor hooks on this thread's stack."""
        saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack)
        saved_hooks.__enter__()
        self._saved_hooks = saved_hooks  # only once pushed: the pop pops exactly what was pushed

    def pop_saved_hooks(self) -> None:
        """Pop what :meth:`push_saved_hooks` pushed (nothing when nothing was pushed)."""
        saved_hooks, self._saved_hooks = self._saved_hooks, None
        if saved_hooks is not None:
            saved_hooks.__exit__(None, None, None)

    def abandon_saved_hooks(self) -> None:
        """Forget a push without popping (the stack's top is someone else's)."""
        self._saved_hooks = None

    @property
    def pushed(self) -> bool:
        return self._saved_hooks is not None

    def on_top(self) -> bool:
        """Whether this offloader's hooks are the innermost saved-tensor hooks of this thread."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] == self.hooks.pack

    def finish(self) -> None:
        """The end of a step (rules 5 and 7): the prefetch window learns from the backward, and
        write-back failures reported by now are acted on (and warned about)."""
        self.forwards.current = None
        self.prefetcher.settle()
        self.fallbacks.drain()

    def _undo_module_changes(self) -> None:
        """Remove the module hooks and undo ``_wrap_recompute``, restoring what was there."""
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks.clear()
        self._patches.restore()

    def _wrap_recompute(self, block: nn.Module, index: int, always: bool) -> None:
        """Checkpoint the block's forward: always (a user's ``recompute``), or when the
        policy decided at its start says so (NOTE [ Activation fallbacks ] rule 1)."""
        # The instance's own forward when something (accelerate, peft, a user) patched one in.
        original = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and (always or self._recomputing(index)):
                # its recomputation finds a decoding cache as its first run did (NOTE [ Recomputed blocks and caches ])
                return checkpointed(block, original, args, kwargs)
            return original(*args, **kwargs)

        self._patches.patch(block, forward)

    def _recomputing(self, index: int) -> bool:
        group = self.forwards.current
        return group is not None and group.index == index and group.policy is BlockPolicy.RECOMPUTE

    # -- block tracking: which block runs, from the hooks ------------------------------------------
    def _block_started(self, index: int) -> Any:
        def hook(_module: nn.Module, args: Any) -> None:
            if in_backward() or not torch.is_grad_enabled():
                return
            self.hooks.watch.check()  # rule 9: a storage freed mid-write would be written from freed memory
            with self._lock:
                forwards = self.forwards
                if index <= forwards.last_index:  # a new forward pass begins
                    self._forward_started()
                forwards.last_index = index
                group = BlockGroup(
                    forwards.forward_id,
                    index,
                    self.policies[index],
                    input_numel=first_tensor_numel(args),
                    flexible=self.flexible[index],
                )
                forwards.groups[(forwards.forward_id, index)] = group
                self.fallbacks.drain()
                if group.flexible:
                    group.policy = self.fallbacks.decide(group)
                group.started = time.perf_counter()
                if self._gpu_timed:
                    group.events.append(_recorded_event(self.registry.device))
                forwards.current = group

        return hook

    def _forward_started(self) -> None:
        if (recorder := tracing.RECORDER) is not None:
            # where a loop without step spans begins a step (rule 7 of NOTE [ Timeline trace ])
            recorder.instant("forward pass begins", "pass")
        self.prefetcher.settle()  # after a backward in this same context
        self.history.forward_started()
        self.forwards.forward_id = self.history.forwards
        self.fallbacks.forward_started()
        self.prefetcher.forward_started()
        self.forwards.prune()

    def _block_ended(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            self.hooks.watch.check()  # rule 9: after the hooks already there (FSDP2's reshard frees here)
            group = self.forwards.current
            if group is None or group.index != index:
                return
            group.forward_s = time.perf_counter() - group.started
            if group.events:
                group.events.append(_recorded_event(self.registry.device))
            self.forwards.current = None
            for saved, tensor in group.pending:  # rule 5: in-place changes made inside the block
                if tensor._version != saved.version:
                    saved.modified = version_error(tensor, saved.version)
            group.pending.clear()
            if group.policy is not BlockPolicy.RECOMPUTE:  # a recomputed block saves ~nothing here
                self.history.measured(index, group.saved_bytes, group.input_numel)
            if group.policy.offloads:
                self._offloaded += group.saved_bytes
            if index == len(self.blocks) - 1:  # once a forward, at its end
                offloaded, self._offloaded = self._offloaded, 0
                self.trimming.streamed(offloaded)
                self.trimming.boundary()
            if self.adaptive and index == len(self.blocks) - 1:
                self.adaptive_keep.forward_ended(group.forward_id)

        return hook


def _recorded_event(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded on ``device``'s current stream (NOTE [ Adaptive keep ] rule 4): the
    device named, since a rank's device need not be the current one."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event
