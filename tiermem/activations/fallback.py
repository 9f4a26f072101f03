"""What the activation offloader does when a tier fails or the device budget runs short.

# NOTE [ Activation fallbacks ]
1. When: a block's policy is decided when its forward starts (its forward pre-hook),
   because ``recompute`` wraps the block's forward in ``torch.utils.checkpoint`` and cannot
   be chosen once that forward runs. A decision can only use what is known then: the
   failures reported so far, the device budget free now, and the bytes the block saved the
   last time it ran (scaled by the size of its first tensor input). So a disk that fails
   while block ``i`` runs changes blocks ``i+1...`` of this forward and the next forwards,
   never block ``i`` itself: block ``i`` is *kept*.
2. Which blocks: blocks that offload (``host``, ``nvme``) and blocks whose policy tiermem
   chose (every block under ``auto``, the planner's per-block policy that ``rt.manage``
   applies under ``activations="auto"`` included; the last block of a plain ``host``/``nvme``
   policy, kept because backward starts there). A block the user set to ``keep`` or
   ``recompute`` (a policy, a mapping, a hand plan's ``block_policy``) is never changed: that
   is an instruction, and breaking the budget under it is an error.
3. Tier failures: a write-back that fails (disk full, I/O error, tier full) leaves its
   object resident on the device with its bytes intact (NOTE [ Managed object rules ] 2):
   that block is kept. The failure reaches the training thread through the
   :class:`WriteLedger` (filled on the scheduler's thread) and is acted on at the next
   block start or saved tensor. The tier is then *out* for the rest of this forward and the
   next 1, 2, 4, ... 64 forwards (doubling while retries keep failing; a write that lands
   after the outage ends clears it). Blocks planned for a tier that is out fall back to
   keep, or to recompute when the device cannot hold them (rule 4).
4. Device budget: the *room* is the device budget minus what stays resident: bytes in use
   now, less the write-backs in flight to working tiers (they free theirs on landing). A
   kept block needs its estimate in that room now; an offloaded block needs it in
   backward, to come back into (what stays resident now is still there when backward
   reaches it: kept blocks before it, tensors saved outside the blocks). A flexible block
   whose estimate exceeds the room is recomputed instead. The room also keeps back what the
   last forward saved outside the blocks (embeddings, head, loss): backward needs the
   head's tensors first, before any block frees its bytes. A block that fits by estimate
   but meets a full device while it runs waits for the write-backs in flight (rule 5).
5. A saved tensor that still does not fit on the device (the estimate was short, a failing
   write freed nothing, or the first forward had nothing to estimate from) first makes
   room by *evicting*: kept tensors of earlier flexible blocks of this forward are written
   synchronously to a working tier, the earliest block first (backward needs it last).
   If that is not enough, the tensor itself is written synchronously to the first working
   tier of: the block's offload tier, ``nvme``, ``host``. Both are stalls, not errors
   (blocks under a user's explicit ``keep`` excepted, rule 2). Only when nothing takes it
   does :class:`ActivationMemoryError` name the block, the bytes, each tier's state and
   what to change. A model's first forward has nothing measured: its first block's size
   and the bytes saved after the last block are unknown when decisions are made, so in a
   budget within about one block of the need the first step can still end in the clear
   error at backward (a tensor that cannot come back); later steps decide from
   measurements.
6. Every fallback logs a warning (once per block, forward and kind) and counts in
   ``activations.fallbacks`` and ``activations.fallback_reasons["<cause>-><action>"]``,
   cause ``disk_full | io_error | tier_full | device_full | model_states`` (rule 8), action
   ``keep | recompute | evict:<tier> | spill:<tier>``.
7. Gradients never change: keep and spill only move bytes, and recompute is
   ``torch.utils.checkpoint`` (which restores the RNG state), bitwise on the CPU.
8. Room for the model states: rules 4 and 5 see only the device bytes in use, not what the
   model states will ask for later in the step (a gradient buffer that comes back to the
   device to accumulate as a chunk's backward begins: the bytes the kept blocks hold then
   were free when they were kept). A demand of the model states that finds the device full
   once its own retry ladder is spent (NOTE [ Model-state rules ] rule 6) asks the registry
   for room (NOTE [ Managed object rules ] rule 7), and each offloader gives it back
   (``giveback.py``): its write-backs in flight land, then kept saved tensors are written
   out synchronously as rule 5 evicts them (the earliest forward and block first, each
   block's first saved first: what backward needs last), until the bytes asked for are free.
   Never moved: tensors backward unpacked since the last forward began (autograd may hold
   what it was given), the running block's, those saved outside the blocks (backward needs
   them first), and a user's explicit ``keep`` (rule 2). Backward fetches them back like
   any offloaded tensor: a stall, not an error, counted as ``model_states->evict:<tier>``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch

from tiermem.activations.counters import ActivationCounters
from tiermem.activations.history import OffloadHistory
from tiermem.activations.ledger import failure_cause
from tiermem.activations.saved import BlockGroup, Forwards, live_handles
from tiermem.errors import StorageError, TierCapacityError, TiermemError
from tiermem.layout.activation_policy import BlockPolicy
from tiermem.registry import Handle, ObjectState, Priority, Registry

log = logging.getLogger("tiermem.activations")


class ActivationMemoryError(TiermemError, MemoryError):
    """Raised when a saved activation fits nowhere: not in the device budget after the
    write-backs in flight landed, and no other tier would take it (NOTE [ Activation
    fallbacks ] rule 5); or when backward cannot bring one back into the device budget."""


def first_tensor_numel(args: Sequence[object]) -> int:
    """Elements of a block's first tensor input (its hidden states), 0 when there is none."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.numel()
    return 0


def decide(planned: BlockPolicy, outage_cause: str | None, expected: int | None, room: int) -> tuple[BlockPolicy, str]:
    """A flexible block's policy for this forward (rules 3, 4) and the fallback taken
    ("" when none). ``outage_cause``: why the planned offload tier is out, or None;
    ``expected``: the block's estimated saved bytes (None: not measured yet); ``room``:
    the device budget minus what stays resident (rule 4)."""
    if planned is BlockPolicy.RECOMPUTE:
        return planned, ""
    cause = outage_cause or "device_full"
    if expected is not None and expected > room:
        return BlockPolicy.RECOMPUTE, f"{cause}->recompute"
    if planned.offloads and outage_cause is not None:
        return BlockPolicy.KEEP, f"{cause}->keep"
    return planned, ""


class Fallbacks:
    """The fallbacks of one offloader, acted on (rules 1 to 6): a block's policy decided as it
    starts, the write ledger's news drained, saved tensors registered on the device or
    evicted and spilled to make them fit, and every fallback reported once.

    ``policies`` is the offloader's own list (adaptive keep updates it in place);
    ``flexible`` and ``names`` are per block; ``forwards`` is the offloader's forward state.
    """

    def __init__(
        self,
        registry: Registry,
        history: OffloadHistory,
        counters: ActivationCounters,
        forwards: Forwards,
        *,
        names: Sequence[str],
        policies: Sequence[BlockPolicy],
        flexible: Sequence[bool],
    ) -> None:
        self.registry = registry
        self.history = history
        self.counters = counters
        self.forwards = forwards
        self.names = names
        self.policies = policies
        self.flexible = flexible
        #: Fallbacks already reported, by (forward, block, reason): one warning each.
        self._reported: set[tuple[int, int, str]] = set()

    def forward_started(self) -> None:
        """A new forward: its fallbacks are reported again (rule 6)."""
        self._reported.clear()

    def room(self) -> int:
        """Rule 4: the device budget minus what stays resident (write-backs in flight to
        working tiers free their bytes on landing) and what the tensors saved outside the
        blocks will need."""
        working = [t for t in ("host", "nvme") if self.history.outage(t) is None]
        room = self.registry.free_bytes("device") + self.history.ledger.inflight_bytes(working)
        return room - self.history.outside_bytes

    def decide(self, group: BlockGroup) -> BlockPolicy:
        """Rules 3 and 4: this forward's policy for a flexible block, as it starts."""
        planned = group.policy
        if planned is BlockPolicy.RECOMPUTE:
            return planned
        expected = group.expected = self.history.estimate(group.index, group.input_numel)
        ledger = self.history.ledger
        if expected is not None and expected > self.registry.free_bytes("device") and ledger.inflight_bytes():
            # Tight: whether the block fits depends on write-backs in flight landing (the
            # block would wait for them at its first saved tensor anyway). Learn how they
            # end first, so a failing disk is known before the room is counted on.
            ledger.wait_idle()
            self.drain()
        outage = self.history.outage(planned.value) if planned.offloads else None
        room = self.room()
        policy, fallback = decide(planned, outage.cause if outage else None, expected, room)
        if fallback:
            why = f"{planned.value} is out ({outage.message})" if outage else "the device budget is short"
            if policy is BlockPolicy.RECOMPUTE:
                later = "now" if planned is BlockPolicy.KEEP or outage else "when backward brings them back"
                free = (
                    f"{room} bytes of the device budget are not held by what stays resident"
                    if room >= 0
                    else f"what stays resident already holds {-room} bytes more than the device budget"
                )
                why += f"; its ~{expected} saved bytes would not fit {later}: {free}"
            self.report(group.forward_id, group.index, fallback, why)
        return policy

    def drain(self) -> None:
        """Act on write-backs that ended since the last look (rule 3): a failure puts its
        tier out and keeps the rest of its block, including the block running now."""
        failures, landed = self.history.ledger.take_failures()
        for tier in landed:
            self.history.tier_worked(tier)
        for failure in failures:
            self.history.tier_failed(failure.tier, failure.cause, failure.message)
            group = self.forwards.group(failure.forward_id, failure.index)
            if group is not None and group.policy.value == failure.tier:
                group.policy = BlockPolicy.KEEP
            self.report(
                failure.forward_id,
                failure.index,
                f"{failure.cause}->keep",
                f"a write-back of {failure.nbytes} bytes to {failure.tier} failed ({failure.message}); "
                "what did not land stays on the device",
            )
        current = self.forwards.current
        if current is not None and current.policy.offloads:
            outage = self.history.outage(current.policy.value)
            if outage is not None:
                current.policy = BlockPolicy.KEEP
                self.report(
                    current.forward_id,
                    current.index,
                    f"{outage.cause}->keep",
                    f"its tier is out ({outage.message})",
                )

    def report(self, forward_id: int, index: int, reason: str, why: str) -> None:
        """Rule 6: count a fallback and warn, once per forward, block and reason."""
        key = (forward_id, index, reason)
        if key in self._reported:
            return
        self._reported.add(key)
        with self.counters.lock:
            self.counters.fallbacks += 1
            self.counters.fallback_reasons[reason] = self.counters.fallback_reasons.get(reason, 0) + 1
        where = f"block {index} ({self.names[index]})" if index >= 0 else "a saved tensor outside the blocks"
        log.warning("tiermem activations: %s falls back to %s [%s]: %s", where, reason.split("->")[1], reason, why)

    def register(self, tensor: torch.Tensor, group: BlockGroup | None) -> Handle:
        """A saved tensor registered on the device; when it does not fit, room is made
        (caches reclaimed, write-backs in flight waited for, rule 5's eviction) or the
        tensor is spilled to another tier (rule 5)."""
        try:
            return self.registry.register(tensor, "device", kind="activation", label="saved activation")
        except TierCapacityError:
            pass
        # Caches give their bytes first (NOTE [ Managed object rules ] rule 7: the chunk pool's
        # spares); write-backs in flight free device memory when they land: wait, then retry.
        if self.registry.reclaim("device"):
            with contextlib.suppress(TierCapacityError):
                return self.registry.register(tensor, "device", kind="activation", label="saved activation")
        self.history.ledger.wait_idle()
        self.drain()
        try:
            return self.registry.register(tensor, "device", kind="activation", label="saved activation")
        except TierCapacityError as exc:
            # A helper, not a local holding ``exc``: that local would sit in a reference
            # cycle through the traceback and keep the block's tensors alive (TRAPS 14).
            return self._spill(tensor, group, exc)

    def _spill(self, tensor: torch.Tensor, group: BlockGroup | None, device_error: TierCapacityError) -> Handle:
        """Rule 5: write a tensor the device cannot hold synchronously to another tier,
        where a fallback may; else the clear error."""
        nbytes = tensor.untyped_storage().nbytes()
        index = group.index if group is not None else -1
        forward_id = group.forward_id if group is not None else self.forwards.forward_id
        tried: list[str] = []
        spill = group.flexible if group is not None else any(self.flexible)
        if spill and self.evict(self.registry.reserved_size("device", nbytes)):
            with contextlib.suppress(TierCapacityError):
                return self.registry.register(tensor, "device", kind="activation", label="saved activation")
        for tier in self.spill_tiers(group) if spill else []:
            outage = self.history.outage(tier)
            if outage is not None:
                tried.append(f"{tier} is out ({outage.message})")
                continue
            try:
                handle = self.registry.register(tensor, tier, kind="activation", label="saved activation")
            except (StorageError, TierCapacityError) as exc:
                self.history.tier_failed(tier, failure_cause(exc), str(exc))
                tried.append(f"{tier}: {exc}")
                continue
            self.counters.add_offloaded(tier, handle.obj.nbytes)
            self.report(
                forward_id,
                index,
                f"device_full->spill:{tier}",
                f"a saved tensor of {nbytes} bytes does not fit in the device budget "
                f"({device_error.used} of {device_error.capacity} bytes in use); written to {tier} synchronously",
            )
            return handle
        raise self._nowhere(nbytes, group, tried, device_error) from device_error

    def _nowhere(
        self, nbytes: int, group: BlockGroup | None, tried: list[str], device_error: TierCapacityError
    ) -> ActivationMemoryError:
        """Rule 5's clear error: the block, the bytes, each tier's state and what to change."""
        where = f"block {group.index} ({self.names[group.index]})" if group is not None else "outside the blocks"
        elsewhere = (
            "; ".join(tried)
            if tried
            else "no other tier was tried: a block the policy keeps stays on the device (NOTE [ Activation "
            "fallbacks ] rule 2)"
        )
        return ActivationMemoryError(
            f"tiermem activations: a saved tensor of {nbytes} bytes ({where}) does not fit in the device budget "
            f"({device_error.used} of {device_error.capacity} bytes in use after the write-backs in flight "
            f"landed), and nowhere else: {elsewhere}. Recompute is chosen when a block starts, so it could not "
            "take this one. Raise [device] capacity, recompute this block or more blocks (policy 'recompute', or "
            "a mapping such as {0: 'recompute'}), offload more blocks (policy nvme/host/auto), or free space for "
            "the nvme/host tiers."
        )

    def evict(self, needed: int) -> bool:
        """Rule 5: make ``needed`` device bytes free by writing kept blocks of this forward
        out, synchronously, the block backward needs last first. True when it worked."""
        forwards = self.forwards
        ours = (g for (f, _), g in forwards.groups.items() if f == forwards.forward_id and g is not forwards.current)
        candidates = sorted((g for g in ours if g.flexible), key=lambda g: g.index)
        for group in candidates:
            for handle in live_handles(group.saved):
                if self.registry.free_bytes("device") >= needed:
                    return True
                if handle.tier != "device" or handle.state is not ObjectState.RESIDENT:
                    continue
                tier = self.usable_spill_tier(group)
                if tier is None:
                    return False
                if not self.write_out(handle, tier):
                    continue
                self.report(
                    group.forward_id,
                    group.index,
                    f"device_full->evict:{tier}",
                    f"the device budget is full; its kept tensors are written to {tier} to make room for later ones "
                    "(backward needs this block after them)",
                )
        return self.registry.free_bytes("device") >= needed

    def usable_spill_tier(self, group: BlockGroup | None) -> str | None:
        """The first of :meth:`spill_tiers` without an outage now; None when none is left."""
        return next((t for t in self.spill_tiers(group) if self.history.outage(t) is None), None)

    def write_out(self, handle: Handle, tier: str) -> bool:
        """Rule 5: move a kept saved tensor to ``tier`` and wait (counted as offloaded); False
        when the tier failed (its outage recorded, so the next :meth:`usable_spill_tier` skips it)."""
        try:
            handle.move_to(tier, Priority.DEMAND)
            handle.wait()
        except (StorageError, TierCapacityError) as exc:
            exc.__traceback__ = None  # TRAPS 16: it may hold this frame's callers
            self.history.tier_failed(tier, failure_cause(exc), str(exc))
            return False
        self.counters.add_offloaded(tier, handle.obj.nbytes)
        return True

    def spill_tiers(self, group: BlockGroup | None) -> list[str]:
        """Where a tensor the device cannot hold may go (rule 5), in order, without repeats."""
        order = []
        if group is not None:
            order += [p.value for p in (group.policy, self.policies[group.index]) if p.offloads]
        order += ["nvme", "host"]
        return [t for i, t in enumerate(order) if self.registry.has_tier(t) and t not in order[:i]]
