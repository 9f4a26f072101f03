"""What the activation offloader learns about a model and keeps across its contexts
(NOTE [ Activation offload rules ] rule 8, in ``tiermem/activations/offloader.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiermem.activations.ledger import WriteLedger
from tiermem.layout.activation_policy import BlockPolicy

#: Forwards a failing tier stays out at most (NOTE [ Activation fallbacks ] rule 3).
MAX_OUTAGE_FORWARDS = 64


@dataclass
class Outage:
    """A tier out of use for activations (NOTE [ Activation fallbacks ] rule 3)."""

    until: int  # the first forward that may use the tier again
    streak: int
    cause: str
    message: str


@dataclass
class OffloadHistory:
    """What offloading one model has learned, kept across ``offload_activations`` contexts
    (``tiermem train`` opens one per step): forward count, block sizes, adaptive keep's
    policies, tier outages and the write ledger."""

    ledger: WriteLedger
    forwards: int = 0
    #: Saved bytes per element of the block's first tensor input, and raw saved bytes,
    #: measured the last time each block ran without recompute.
    bytes_per_input: dict[int, float] = field(default_factory=dict)
    block_bytes: dict[int, int] = field(default_factory=dict)
    adapted: list[BlockPolicy] | None = None
    #: Bytes backward prefetches ahead of need (NOTE [ Prefetch window ]); None until the
    #: first backward starts from the measured block sizes.
    prefetch_window: int | None = None
    outages: dict[str, Outage] = field(default_factory=dict)
    #: Bytes saved outside the blocks in the last complete forward, and so far in this one.
    outside_bytes: int = 0
    outside_now: int = 0

    def forward_started(self) -> None:
        self.forwards += 1
        if self.outside_now:
            self.outside_bytes, self.outside_now = self.outside_now, 0

    def measured(self, index: int, saved_bytes: int, input_numel: int) -> None:
        self.block_bytes[index] = saved_bytes
        if input_numel > 0:
            self.bytes_per_input[index] = saved_bytes / input_numel
        else:
            self.bytes_per_input.pop(index, None)

    def estimate(self, index: int, input_numel: int) -> int | None:
        """Bytes block ``index`` will save now, or None when nothing was measured yet.
        A block not measured yet is taken to be like the largest measured one (the
        blocks are a model's repeated layers)."""

        def one(i: int) -> int:
            ratio = self.bytes_per_input.get(i)
            return int(ratio * input_numel) if ratio is not None and input_numel > 0 else self.block_bytes[i]

        if index in self.block_bytes:
            return one(index)
        if not self.block_bytes:
            return None
        return max(one(i) for i in self.block_bytes)

    def outage(self, tier: str) -> Outage | None:
        """The tier's outage when it is out for the current forward."""
        out = self.outages.get(tier)
        return out if out is not None and self.forwards < out.until else None

    def tier_failed(self, tier: str, cause: str, message: str) -> bool:
        """Record a failure of ``tier``; True when it starts a new outage (NOTE [ Activation fallbacks ] rule 3)."""
        out = self.outages.get(tier)
        if out is not None and self.forwards < out.until:
            return False  # the same outage: writes started before it was known
        streak = out.streak + 1 if out is not None else 1
        skip = min(2 ** (streak - 1), MAX_OUTAGE_FORWARDS)
        self.outages[tier] = Outage(self.forwards + 1 + skip, streak, cause, message)
        return True

    def tier_worked(self, tier: str) -> None:
        """A write landed on ``tier``: an outage that has ended is forgotten (streak reset)."""
        out = self.outages.get(tier)
        if out is not None and self.forwards >= out.until:
            del self.outages[tier]
