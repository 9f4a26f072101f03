"""Adaptive keep, measured: at the end of each forward, the next forward's policies from the
NVMe link's measured bandwidths and this forward's blocks (NOTE [ Adaptive keep ], in
``tiermem/layout/activation_policy.py``, which holds the pure rule)."""

from __future__ import annotations

import logging

from tiermem.activations.history import OffloadHistory
from tiermem.activations.saved import Forwards
from tiermem.layout.activation_policy import BlockPolicy, BlockProfile, adaptive_keep
from tiermem.registry import Registry

log = logging.getLogger("tiermem.activations")


class AdaptiveKeep:
    """Chooses an ``auto`` offloader's policies. ``policies`` is the offloader's own list,
    updated in place (its collaborators hold it); the choice is also kept in ``history``, so
    the next context starts from it (NOTE [ Activation offload rules ] rule 8)."""

    def __init__(
        self, registry: Registry, history: OffloadHistory, forwards: Forwards, policies: list[BlockPolicy]
    ) -> None:
        self.registry = registry
        self.history = history
        self.forwards = forwards
        self.policies = policies

    def forward_ended(self, forward_id: int) -> None:
        """NOTE [ Adaptive keep ]: choose the next forward's policies from this one."""
        links = self.registry.link_statistics()
        write, read = links.get("device->nvme"), links.get("nvme->device")
        if write is None or write.busy_s <= 0 or write.bytes == 0:
            return  # nothing measured yet: keep offloading all but the last block
        write_bw = write.bytes / write.busy_s
        read_bw = read.bytes / read.busy_s if read is not None and read.busy_s > 0 and read.bytes else write_bw
        blocks = len(self.policies)
        profile = [
            # A block recomputed by a fallback saved nothing this time: use its last size.
            BlockProfile(g.compute_seconds(), self.history.estimate(i, g.input_numel) or g.saved_bytes)
            for i in range(blocks)
            if (g := self.forwards.group(forward_id, i)) is not None
        ]
        if len(profile) != blocks:
            return
        keep = adaptive_keep(profile, write_bw, read_bw)
        policies = [BlockPolicy.NVME] * (blocks - keep) + [BlockPolicy.KEEP] * keep
        if policies != self.policies:
            log.info(
                "adaptive keep: write %.0f MB/s, read %.0f MB/s -> keep the last %d of %d blocks",
                write_bw / 1e6,
                read_bw / 1e6,
                keep,
                blocks,
            )
            self.policies[:] = policies  # in place: the offloader and its collaborators hold this list
        self.history.adapted = list(policies)
