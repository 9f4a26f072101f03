"""The activation counters of one Runtime, shared by every offload context it opens."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from torch import nn

from tiermem.activations.history import OffloadHistory
from tiermem.activations.ledger import WriteLedger


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
    #: Prefetched objects written back again to make room for a demand fetch (NOTE
    #: [ Activation offload rules ] rule 5).
    prefetch_released: int = 0
    #: Fallbacks by ``"<cause>-><action>"`` (NOTE [ Activation fallbacks ] rule 6).
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: What offloading each model learned (NOTE [ Activation offload rules ] rule 8), by model
    #: (weakly) and block names.
    models: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], OffloadHistory]] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )

    def history_for(self, model: nn.Module, block_names: tuple[str, ...]) -> OffloadHistory:
        with self.lock:
            per_model = self.models.setdefault(model, {})
            history = per_model.get(block_names)
            if history is None:
                # The ledger adds landed bytes to offloaded_bytes under this same lock.
                history = per_model[block_names] = OffloadHistory(WriteLedger(self.offloaded_bytes, self.lock))
            return history

    def add_offloaded(self, tier: str, nbytes: int) -> None:
        """Bytes written to ``tier`` synchronously (an eviction or a spill)."""
        with self.lock:
            self.offloaded_bytes[tier] = self.offloaded_bytes.get(tier, 0) + nbytes
