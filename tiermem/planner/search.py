"""The search: the fastest plan whose predicted peaks fit every tier. Pure (profile + budgets in).
Rules 1 and 2 enumerate in :mod:`~tiermem.planner.candidates`, rules 1-3 scan and pick in
:mod:`~tiermem.planner.scan`, rules 4 and 5 are in :mod:`~tiermem.planner.no_fit`; this module
runs them and explains the plan (and re-exports their public names).

# NOTE [ Plan search ]
1. Dimensions: chunk size (the chunk-size candidates of NOTE [ Chunk layout rules ] rule 5,
   thinned to ``MAX_SIZES``, and those below the largest parameter that give outliers chunks
   of their own, thinned to ``MAX_OUTLIER_SIZES``), persistent chunks (every prefix), buffers (the fewest one module
   needs, one more to prefetch into, or every streamed chunk), where each streamed chunk's
   states live (the longest host prefix the host holds, then NVMe), how many NVMe homes the
   host stages at once for the step (two, or one: NOTE [ Default placement rule ] rule 3; one
   only where some home is on NVMe, its step I/O then not hidden; three too for a loop whose
   gradients stream, which steps in backward: NOTE [ Early-step staging ]), and the per-block
   activation policy (or the one the caller fixed: ``block_policy=``, searched around).
2. Activation policies come from families, each with ``k`` trailing blocks kept: every
   other block recomputed, or offloaded to the host, or to NVMe, or NVMe for the blocks whose
   I/O hides and recompute for the rest; TBA's adaptive-keep rule gives one more candidate.
   Their costs do not depend on the states' choice except through the device room left, the
   host and NVMe bytes beside the states' and the shared NVMe link, so they are reduced once
   to a Pareto front over device bytes (the most at any moment, and the most in backward,
   which the streamed gradients in flight join), host and NVMe bytes and time (by device
   bytes ascending), and each states choice takes the fastest front entry that fits its
   device room (backward's beside the gradients in flight) and the host and NVMe its states
   leave.
3. Candidates are then predicted again in full (the backward timeline of gradients and
   activations, the shared NVMe link: NOTE [ Cost model ] rules 1 and 6), fastest separable
   estimate first, until ``FINALISTS`` fit (or ``MAX_EXACT`` were tried); the fastest of those
   wins, ties going to fewer device bytes.
4. When nothing fits, :class:`NoPlanFitsError` gives, per tier, the least raise of that tier
   alone (the others as given, the margin included) with which the search finds a plan (rule
   5), cheapest first as a fraction of the tier. Only when no tier alone is enough does it
   give each tier's shortfall for the plan that came closest, and raises to make together
   (``raise_together``): those shortfalls where the search then finds a plan, else those with
   one tier raised further by rule 5 from there (the least extra as a fraction of the tier).
   Its ``shortfall`` and ``peaks`` are always the closest plan's.
5. A tier's raise comes from the states choices the scan evaluated, and every figure given
   is checked: the scan and pick run again at the raised capacity (rules 1-3, reusing their
   states costs and predictions) and return a plan. Step 1: per states choice, a lower bound:
   its bytes with the smallest front entry that fits the other tiers (for the host: at the
   least host_end whose NVMe bytes fit, where an entry's host bytes must fit the slack the
   longest host prefix leaves); no bound on any choice means that tier alone is not enough.
   When the least bound fits, it is the least raise. Step 2: otherwise the capacities where
   the outcome can change (the other bounds, and per candidate that failed in full: the
   device it needs, the host at which its host_end takes in another chunk or an entry with
   more host bytes fits, the NVMe at which one with more NVMe bytes fits) are tried in turn
   (``IN_TURN_TRIES``), then galloping (the 2nd, 4th... above the last failure; at most
   ``GALLOP_TRIES`` in all), then bisected to the least of them that fits (``NARROW_TRIES``).
   Past them, the raise doubles until a plan fits (``WIDEN_TRIES``; none: that tier alone is
   not enough) and the interval is bisected. The search is not monotone in one capacity (a
   larger one can take a faster entry that then fails in full), so past step 1 the figure is
   the least found, which fits, not one proven least.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiermem.layout.placement import GRAD_HOMES, PLAN_DEPTHS, STAGED_HOMES, STAGING_DEPTHS, Plan, Prediction
from tiermem.planner.candidates import (
    MAX_SIZES,
    ActivationCandidate,
    activation_candidates,
    fixed_policies,
    packings,
    pareto,
)
from tiermem.planner.costmodel import (
    FRAGMENTATION_MARGIN,
    TIERS,
    Estimate,
    StatesChoice,
    activation_cost,
    combine,
    states_cost,
)
from tiermem.planner.early_steps import staging_stall
from tiermem.planner.no_fit import GALLOP_TRIES, IN_TURN_TRIES, NARROW_TRIES, WIDEN_TRIES, no_fit
from tiermem.planner.profile import Profile
from tiermem.planner.scan import FINALISTS, MAX_EXACT, Space
from tiermem.units import format_size

__all__ = [
    "FINALISTS",
    "GALLOP_TRIES",
    "IN_TURN_TRIES",
    "MAX_EXACT",
    "MAX_SIZES",
    "NARROW_TRIES",
    "WIDEN_TRIES",
    "ActivationCandidate",
    "Decision",
    "activation_candidates",
    "combine_for",
    "explain",
    "fixed_policies",
    "packings",
    "pareto",
    "search",
]


@dataclass(frozen=True)
class Decision:
    """The search's answer: the plan, its prediction, and why."""

    plan: Plan
    estimate: Estimate
    reasons: tuple[str, ...]
    capacities: Mapping[str, int]
    considered: int
    policies_family: str = ""
    extra: Mapping[str, object] = field(default_factory=dict)


def search(
    profile: Profile,
    capacities: Mapping[str, int],
    *,
    chunk_sizes: Sequence[int] | None = None,
    margin: float = FRAGMENTATION_MARGIN,
    block_policy: str | Sequence[str] | None = None,
    grads_stream: bool = False,
    grad_homes: Sequence[str] = GRAD_HOMES,
    staged_homes: Sequence[int] | None = None,
) -> Decision:
    """The fastest plan that fits ``capacities`` (free bytes per tier). ``block_policy``: the
    activation policy the caller fixed (a name for every block, or one per block); the model
    states are searched around it. ``grads_stream``: the loop frees NVMe
    chunks' gradients as they step (NOTE [ Default placement rule ] rule 3); ``grad_homes``: where
    the others may wait for the step (both by default: the faster plan wins); ``staged_homes``:
    how many NVMe homes the host may stage at once (by default two or one, and three too for a
    loop whose gradients stream: NOTE [ Early-step staging ])."""
    caps = {t: int(capacities[t]) for t in TIERS}
    if staged_homes is None:
        staged_homes = PLAN_DEPTHS if grads_stream else STAGING_DEPTHS
    space = Space(
        profile,
        chunk_sizes=chunk_sizes,
        margin=margin,
        block_policy=block_policy,
        grads_stream=grads_stream,
        grad_homes=grad_homes,
        staged_homes=staged_homes,
    )
    scan = space.scan(caps)
    best, failed = space.pick(scan, caps)
    if best is None:
        closest = scan.closest
        if failed and (closest is None or closest[0] > 1.0):
            row, index, _ = failed[0]
            closest = (1.0, row.choice, space.front[index])
        raise no_fit(space, caps, scan, failed, closest)
    _, _, row, index, estimate = best
    choice, act = row.choice, space.front[index]
    estimate = estimate.within(caps)
    plan = Plan(
        chunk_size=choice.packing.chunk_size,
        persistent_chunks=choice.persistent,
        buffers=choice.buffers,
        state_home=choice.homes,
        grad_home=choice.packing.grad_home if "nvme" in choice.homes else "host",
        staged_homes=choice.packing.staged_homes if "nvme" in choice.homes else STAGED_HOMES,
        # sliced steps span the chunk size, as the host bytes predicted count them (NOTE
        # [ Default placement rule ] rule 6; unused when no chunk steps in slices)
        slice_bytes=choice.packing.chunk_size,
        block_policy=act.policies,
        predicted=Prediction(
            step_s=estimate.step_s,
            peak_bytes=dict(estimate.peak_bytes),
            transient_bytes=estimate.transient_bytes,
            fragmentation_margin=margin,
        ),
    )
    return Decision(
        plan=plan,
        estimate=estimate,
        reasons=tuple(explain(profile, choice, act.family, estimate, caps)),
        capacities=caps,
        considered=len(scan.rows) * len(space.front),
        policies_family=act.family,
    )


def explain(
    profile: Profile, choice: StatesChoice, family: str, estimate: Estimate, caps: Mapping[str, int]
) -> list[str]:
    """Why this plan: which tier binds, what the persistent chunks and policies buy."""
    n = choice.packing.chunks
    ratios = {t: estimate.peak_bytes[t] / caps[t] if caps[t] else math.inf for t in TIERS}
    binding = max(ratios, key=lambda t: ratios[t])
    reasons = [
        f"binding tier: {binding} (predicted peak {format_size(estimate.peak_bytes[binding])} of "
        f"{format_size(caps[binding])}, {ratios[binding]:.0%})"
    ]
    if choice.persistent == n:
        reasons.append(f"all {n} chunks persist on the device: no chunk moves during the step")
    else:
        reasons.append(
            f"the first {choice.persistent} of {n} chunks persist (their states stepped in place); the other "
            f"{n - choice.persistent} stream through {choice.buffers} device buffers: one more persistent chunk "
            "would leave too little device room or cost more than the transfers it saves"
        )
        homes = choice.homes[choice.persistent :]
        reasons.append(
            f"streamed states live on the host for {homes.count('host')} chunks and on NVMe for "
            f"{homes.count('nvme')} (the host holds what it can; NVMe takes the rest)"
        )
        if "nvme" in homes and choice.packing.staged_homes < STAGED_HOMES:
            reasons.append(
                "the host stages one NVMe home at a time for the step (room for two would not fit): the step's NVMe "
                "reads and writes are not hidden behind it"
            )
        elif "nvme" in homes and choice.packing.staged_homes > STAGED_HOMES:
            reasons.append(
                f"the host stages {choice.packing.staged_homes} NVMe homes at once for the chunks backward steps: a "
                "write-back still in flight no longer holds up the next home's read"
            )
    reasons.append(f"activations: {family or 'keep'}")
    parts = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in estimate.parts_s.items())
    reasons.append(f"predicted step {estimate.step_s * 1000:.1f} ms = {parts}")
    dp = ", ".join(f"{k} {format_size(v)}" for k, v in estimate.device_parts.items())
    reasons.append(f"device bytes: {dp}; transient operator peak {format_size(estimate.transient_bytes)}")
    return reasons


def combine_for(profile: Profile, choice: StatesChoice, policies: Sequence[str]) -> Estimate:
    """The estimate ``search`` used for one plan (for reports and tests)."""
    states = states_cost(profile, choice, policies=policies)
    return combine(profile, states, activation_cost(profile, policies), staging_stall(profile, choice, policies))
