"""Device room the activation offloader gives back when the model states must have it
(NOTE [ Activation fallbacks ] rule 8, in ``tiermem/activations/fallback.py``).

:class:`DeviceGiveBack` is one offloader's reclaimer that moves objects (NOTE [ Managed object
rules ] rule 7): the registry calls it for a caller that needs device bytes for data it cannot do
without, once that caller's own ways to make room are spent. It may touch the saved tensors of its
offloader's forwards (moved off the device through the registry, never freed), the prefetcher's
record of what it prefetched (moves go through the fallbacks' ``write_out``); it decides no block's policy.
"""

from __future__ import annotations

from collections.abc import Iterator

from tiermem.activations.fallback import Fallbacks
from tiermem.activations.history import OffloadHistory
from tiermem.activations.prefetch import Prefetcher
from tiermem.activations.saved import BlockGroup, Forwards, live_handles
from tiermem.registry import Handle, ObjectState, Registry
from tiermem.units import format_size


class DeviceGiveBack:
    """Writes one offloader's kept saved tensors out to make room on the device for others."""

    def __init__(
        self,
        registry: Registry,
        history: OffloadHistory,
        forwards: Forwards,
        fallbacks: Fallbacks,
        prefetcher: Prefetcher,
    ) -> None:
        self.registry = registry
        self.history = history
        self.forwards = forwards
        self.fallbacks = fallbacks
        self.prefetcher = prefetcher
        if registry.has_tier("device"):
            registry.add_reclaimer("device", self.give_back, moves_objects=True)

    def give_back(self, needed: int) -> bool:
        """Rule 8: make ``needed`` device bytes free: the write-backs in flight land first, then
        kept saved tensors are written out, the one backward needs last first. True when bytes
        were freed (the caller tries again)."""
        freed = False
        if self.history.ledger.inflight_bytes():
            self.history.ledger.wait_idle()  # they free device bytes as they land
            self.fallbacks.drain()
            freed = True
        for group, handle in self._candidates():
            if self.registry.free_bytes("device") >= needed:
                break
            tier = self.fallbacks.usable_spill_tier(group)
            if tier is None or not self.fallbacks.write_out(handle, tier):
                continue
            freed = True
            group.prefetched = False  # backward brings it back: by prefetch again, else on demand
            self.prefetcher.forget(handle.obj)
            self.fallbacks.report(
                group.forward_id,
                group.index,
                f"model_states->evict:{tier}",
                f"the model states need {format_size(needed)} free on the device; its kept tensors are written to "
                f"{tier} (backward fetches them back)",
            )
        return freed

    def _candidates(self) -> Iterator[tuple[BlockGroup, Handle]]:
        """Kept saved tensors that may move, the one backward needs last first: of flexible blocks
        (a user's ``keep`` stays, rule 2) other than the one running, earliest forward and block
        first, each block's first saved first; never one backward unpacked since the last forward
        (autograd may still hold the tensor it was given)."""
        current = self.forwards.current
        groups = [g for g in list(self.forwards.groups.values()) if g.flexible and g is not current]
        for group in sorted(groups, key=lambda g: (g.forward_id, g.index)):
            for handle in list(live_handles(group.saved)):
                resident = handle.tier == "device" and handle.obj.state is ObjectState.RESIDENT
                if resident and not self.prefetcher.was_unpacked(handle.obj):
                    yield group, handle
