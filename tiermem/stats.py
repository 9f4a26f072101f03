"""``rt.stats()``: one immutable snapshot of every tier, link and counter.

The dict shape of :meth:`Stats.as_dict` is a contract that scripts rely on (README.md
documents it under ``rt.stats().as_dict()``): sizes are plain int bytes, counts cumulative
since the Runtime started. Keys may be added; the documented ones stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiermem.registry import RegistryStatistics
from tiermem.schedulers.base import SchedulerStatistics
from tiermem.tiers.base import TierStatistics


@dataclass(frozen=True)
class ActivationStatistics:
    """Saved activations captured by ``offload_activations``, cumulative since the Runtime started."""

    peak_resident_bytes: int = 0
    resident_bytes: int = 0
    captured_bytes: int = 0
    backward_wait_s: float = 0.0
    bytes_written: Mapping[str, int] = field(default_factory=dict)
    bytes_read: Mapping[str, int] = field(default_factory=dict)
    dedup_hits: int = 0
    forwarded: int = 0
    cancelled: int = 0
    #: Prefetched saved tensors written back to their tier to make room for a demand read
    #: (NOTE [ Activation offload rules ] 5): a sign the look-ahead is too long for the device budget.
    prefetch_released: int = 0
    fallbacks: int = 0
    #: Fallbacks by ``"<cause>-><action>"`` (NOTE [ Activation fallbacks ] rule 6).
    fallback_reasons: Mapping[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_resident_bytes": self.peak_resident_bytes,
            "resident_bytes": self.resident_bytes,
            "captured_bytes": self.captured_bytes,
            "backward_wait_s": self.backward_wait_s,
            "bytes_written": dict(self.bytes_written),
            "bytes_read": dict(self.bytes_read),
            "dedup_hits": self.dedup_hits,
            "forwarded": self.forwarded,
            "cancelled": self.cancelled,
            "prefetch_released": self.prefetch_released,
            "fallbacks": self.fallbacks,
            "fallback_reasons": dict(self.fallback_reasons),
        }


@dataclass(frozen=True)
class ModelStateStatistics:
    """Chunks of managed models (``rt.manage``), summed over models; bytes per tier."""

    models: int = 0
    chunks: int = 0
    persistent_chunks: int = 0
    resident_bytes: Mapping[str, int] = field(default_factory=dict)
    peak_resident_bytes: Mapping[str, int] = field(default_factory=dict)
    chunk_steps: int = 0
    early_chunk_steps: int = 0
    #: an undeclared loop's chunk steps run in backward into copies of their homes, then kept by
    #: ``optimizer.step()`` or discarded (NOTE [ Speculative steps ] in ``tiermem.states.speculation``)
    speculative_steps_kept: int = 0
    speculative_steps_discarded: int = 0
    #: their copies of homes made ahead of the step, and when the step asked (it waited); every
    #: copy made counts, also one later discarded
    speculative_homes_read_ahead: int = 0
    speculative_homes_read_on_demand: int = 0
    #: backwards whose copies gave their NVMe room back to a stored gradient (rule 2 there)
    speculative_nvme_reclaims: int = 0
    #: a declared loop's homes of tied weights read once they were the next to step early (NOTE
    #: [ Tied homes read ahead ] in ``tiermem.states.step_order``)
    tied_homes_read_ahead: int = 0
    #: stored gradients (NOTE [ Stored gradients ] in ``tiermem.states.stored_grads``) read back from
    #: NVMe into the host, and copied there on their way to NVMe for a step in the same backward (rule 7)
    stored_gradients_read_back: int = 0
    stored_gradients_staged_on_the_way: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "models": self.models,
            "chunks": self.chunks,
            "persistent_chunks": self.persistent_chunks,
            "resident_bytes": dict(self.resident_bytes),
            "peak_resident_bytes": dict(self.peak_resident_bytes),
            "chunk_steps": self.chunk_steps,
            "early_chunk_steps": self.early_chunk_steps,
            "speculative_steps_kept": self.speculative_steps_kept,
            "speculative_steps_discarded": self.speculative_steps_discarded,
            "speculative_homes_read_ahead": self.speculative_homes_read_ahead,
            "speculative_homes_read_on_demand": self.speculative_homes_read_on_demand,
            "speculative_nvme_reclaims": self.speculative_nvme_reclaims,
            "tied_homes_read_ahead": self.tied_homes_read_ahead,
            "stored_gradients_read_back": self.stored_gradients_read_back,
            "stored_gradients_staged_on_the_way": self.stored_gradients_staged_on_the_way,
        }


@dataclass(frozen=True)
class Stats:
    tiers: Mapping[str, TierStatistics]
    scheduler: SchedulerStatistics
    registry: RegistryStatistics
    activations: ActivationStatistics = ActivationStatistics()
    model_states: ModelStateStatistics = ModelStateStatistics()

    def as_dict(self) -> dict[str, Any]:
        return {
            "tiers": {name: tier.as_dict() for name, tier in self.tiers.items()},
            "links": {name: link.as_dict() for name, link in self.scheduler.links.items()},
            "activations": self.activations.as_dict(),
            "model_states": self.model_states.as_dict(),
            "dedup_hits": self.registry.dedup_hits,
            "forwarded": self.registry.forwarded,
            "cancelled": self.registry.cancelled,
            "objects": self.registry.objects,
            "moves": self.registry.moves,
            "failed_moves": self.registry.failed_moves,
            "scheduler": self.scheduler.as_dict(),
        }

    def __str__(self) -> str:
        from tiermem.units import format_size

        lines = ["tier     capacity      current       peak          written       read"]
        for name, t in self.tiers.items():
            lines.append(
                f"{name:<8} {format_size(t.capacity):<13} {format_size(t.current_bytes):<13} "
                f"{format_size(t.peak_bytes):<13} {format_size(t.bytes_written):<13} {format_size(t.bytes_read)}"
            )
        for name, link in self.scheduler.links.items():
            rate = link.bytes / link.busy_s if link.busy_s else 0.0
            lines.append(f"link {name:<14} {format_size(link.bytes):<12} in {link.busy_s:.3f}s ({format_size(rate)}/s)")
        r = self.registry
        lines.append(f"dedup hits {r.dedup_hits}, forwarded {r.forwarded}, cancelled {r.cancelled}")
        return "\n".join(lines)
