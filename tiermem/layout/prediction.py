"""What a planner predicted for a plan, carried with it (pure: no I/O, no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STATE_TIERS = ("device", "host", "nvme")


@dataclass(frozen=True)
class Prediction:
    """What a planner predicted for a plan (``None`` until one did): seconds a step takes,
    peak managed bytes per tier, the transient operator peak on top of the device's (not
    managed, NOTE [ Cost model ] rule 3) and the fragmentation margin the fit was checked with."""

    step_s: float | None = None
    peak_bytes: Mapping[str, int | None] = field(default_factory=lambda: {"device": None, "host": None, "nvme": None})
    transient_bytes: int | None = None
    fragmentation_margin: float | None = None

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"step_s": self.step_s, "peak_bytes": dict(self.peak_bytes)}
        if self.step_s is not None:  # the planner's extras; the contract's two keys otherwise
            data["transient_bytes"] = self.transient_bytes
            data["fragmentation_margin"] = self.fragmentation_margin
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Prediction:
        """The inverse of :meth:`as_dict` (``None``: nothing predicted); raises ``ValueError``."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping) or not isinstance(data.get("peak_bytes") or {}, Mapping):
            raise ValueError(f"expected {{'step_s': ..., 'peak_bytes': {{...}}}} or null, got {data!r}")
        unknown = set(data) - {"step_s", "peak_bytes", "transient_bytes", "fragmentation_margin"}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)}")
        peaks: dict[str, int | None] = {tier: None for tier in STATE_TIERS}
        peaks.update(data.get("peak_bytes") or {})
        return cls(data.get("step_s"), peaks, data.get("transient_bytes"), data.get("fragmentation_margin"))
