"""The planner's errors, one class per failure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tiermem.states.errors import PlanError
from tiermem.units import format_size


class NoPlanFitsError(PlanError, MemoryError):
    """Raised when no plan the planner can build fits every tier's capacity.

    ``shortfall`` maps each tier to the bytes it lacks (0 where it fits) for the plan that
    came closest; ``advice`` says what to change."""

    def __init__(
        self,
        shortfall: Mapping[str, int],
        capacities: Mapping[str, int],
        peaks: Mapping[str, int],
        advice: Sequence[str],
    ) -> None:
        self.shortfall = dict(shortfall)
        self.capacities = dict(capacities)
        self.peaks = dict(peaks)
        self.advice = list(advice)
        tiers = "; ".join(
            f"{tier} short by {format_size(short)} (needs {format_size(self.peaks.get(tier, 0))} plus the margin, "
            f"has {format_size(self.capacities.get(tier, 0))})"
            if short
            else f"{tier} fits"
            for tier, short in self.shortfall.items()
        )
        super().__init__(
            f"tiermem planner: no plan fits the tiers: {tiers}. " + " ".join(a[0].upper() + a[1:] + "." for a in advice)
        )


class ProfileError(PlanError, RuntimeError):
    """Raised when the profiling step cannot run on the sample it was given."""
