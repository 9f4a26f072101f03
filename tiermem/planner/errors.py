"""The planner's errors, one class per failure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tiermem.errors import PlanError
from tiermem.units import format_size, format_size_up


class NoPlanFitsError(PlanError, MemoryError):
    """Raised when no plan the planner can build fits every tier's capacity.

    ``shortfall`` maps each tier to the bytes it lacks (0 where it fits) for the plan that
    came closest, and ``peaks`` to what that plan needs there (before the margin; the device
    without opportunistic prefetches). ``raise_alone`` maps a tier to the least raise of that
    tier alone (the other tiers as given, the margin included) with which the planner finds a
    plan; tiers where none does are absent (None: not computed). When it is empty,
    ``raise_together`` maps tiers to raises that together let the planner find a plan (None:
    none found). ``advice`` says what to change: the single-tier raises, one of which is
    enough, where there are any; else the raises to make together."""

    def __init__(
        self,
        shortfall: Mapping[str, int],
        capacities: Mapping[str, int],
        peaks: Mapping[str, int],
        advice: Sequence[str],
        raise_alone: Mapping[str, int] | None = None,
        raise_together: Mapping[str, int] | None = None,
    ) -> None:
        self.shortfall = dict(shortfall)
        self.capacities = dict(capacities)
        self.peaks = dict(peaks)
        self.advice = list(advice)
        self.raise_alone = None if raise_alone is None else dict(raise_alone)
        self.raise_together = None if raise_together is None else dict(raise_together)
        if self.raise_alone:
            tiers = "; ".join(
                f"{tier} short by {format_size_up(self.raise_alone[tier])} alone "
                f"(has {format_size(self.capacities.get(tier, 0))})"
                if tier in self.raise_alone
                else f"raising {tier} alone is not enough (has {format_size(self.capacities.get(tier, 0))})"
                for tier in self.capacities
            )
            alternatives = ", or ".join(advice)
            super().__init__(
                f"tiermem planner: no plan fits the tiers: {tiers} (each figure the least raise of that tier "
                "alone with which a plan fits, the other tiers as given, the margin included). "
                + alternatives[:1].upper()
                + alternatives[1:]
                + "."
            )
            return
        tiers = "; ".join(
            f"{tier} short by {format_size(short)} (needs {format_size(self.peaks.get(tier, 0))} plus the margin, "
            f"has {format_size(self.capacities.get(tier, 0))})"
            if short
            else f"{tier} fits"
            for tier, short in self.shortfall.items()
        )
        lead = "no plan fits the tiers"
        if self.raise_alone is not None:
            lead += ", and raising one tier alone is not enough; the plan that came closest has"
        super().__init__(f"tiermem planner: {lead}: {tiers}. " + " ".join(a[0].upper() + a[1:] + "." for a in advice))


class ProfileError(PlanError, RuntimeError):
    """Raised when the profiling step cannot run on the sample it was given."""
