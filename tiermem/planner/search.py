"""The search: the fastest plan whose predicted peaks fit every tier. Pure (profile + budgets in).

# NOTE [ Plan search ]
1. Dimensions: chunk size (the chunk-size candidates of NOTE [ Chunk layout rules ] rule 5,
   thinned to ``MAX_SIZES``), persistent chunks (every prefix), buffers (the fewest one module
   needs, one more to prefetch into, or every streamed chunk), where each streamed chunk's
   states live (the longest host prefix the host holds, then NVMe), and the per-block
   activation policy (or the one the caller fixed: ``block_policy=``, searched around).
2. Activation policies come from families, each with ``k`` trailing blocks kept: every
   other block recomputed, or offloaded to the host, or to NVMe, or NVMe for the blocks whose
   I/O hides and recompute for the rest; TBA's adaptive-keep rule gives one more candidate.
   Their costs do not depend on the states' choice except through the device room left and
   the shared NVMe link, so they are reduced once to a Pareto front (device bytes against
   time) and each states choice takes the fastest front entry that fits its room.
3. Candidates are then predicted again in full (the backward timeline of gradients and
   activations, the shared NVMe link: NOTE [ Cost model ] rules 1 and 6), fastest separable
   estimate first, until ``FINALISTS`` fit (or ``MAX_EXACT`` were tried); the fastest of those
   wins, ties going to fewer device bytes.
4. When nothing fits, :class:`NoPlanFitsError` gives each tier's shortfall for the plan that
   came closest, and what to change.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tiermem.activations.policy import BlockProfile, adaptive_keep
from tiermem.planner.costmodel import (
    FRAGMENTATION_MARGIN,
    TIERS,
    Estimate,
    Packing,
    StatesChoice,
    activation_cost,
    activation_overhead_s,
    combine,
    fastest_fitting,
    predict,
    states_cost,
    states_overhead_s,
)
from tiermem.planner.errors import NoPlanFitsError
from tiermem.planner.profile import Profile
from tiermem.states.chunks import ParamInfo, pack, size_candidates
from tiermem.states.errors import PlanError
from tiermem.states.placement import BLOCK_POLICIES, ChunkNeeds, Plan, Prediction, normalize_chunk_size
from tiermem.units import format_size

MAX_SIZES = 12
"""Rule 1: chunk sizes tried at most (spread over the candidates)."""
FINALISTS = 24
"""Rule 3."""
MAX_EXACT = 2000
"""Rule 3: full predictions at most (each costs O(blocks + chunks))."""


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


@dataclass(frozen=True)
class _Act:
    policies: tuple[str, ...]
    family: str
    device: int
    host: int
    nvme: int
    time: float


def packings(
    profile: Profile, chunk_sizes: Sequence[int] | None = None, grads_stream: bool = False
) -> list[Packing]:
    """Rule 1: one packing per chunk size, in the profile's execution order (``grads_stream``:
    NOTE [ Default placement rule ] rule 3)."""
    infos = [ParamInfo(p.nbytes, (p.nbytes,), torch.uint8, p.trainable) for p in profile.params]
    if chunk_sizes is None:
        sizes = size_candidates(infos)
        if len(sizes) > MAX_SIZES:
            step = (len(sizes) - 1) / (MAX_SIZES - 1)
            sizes = sorted({sizes[round(i * step)] for i in range(MAX_SIZES)})
    else:
        sizes = [normalize_chunk_size(s) for s in chunk_sizes]
    result = []
    for size in sizes:
        layouts = pack(infos, profile.order, size)
        needs = []
        for layout in layouts:
            sections = max((profile.params[s.index].sections for s in layout.slots), default=0)
            needs.append(ChunkNeeds(layout.nbytes, layout.trainable, sections))
        where = {slot.index: layout.index for layout in layouts for slot in layout.slots}
        span = max((len({where[i] for i in module}) for module in profile.modules if module), default=1)
        shared = len({where[i] for i in profile.shared})
        stages = None
        if profile.param_block:
            # NOTE [ Cost model ] rule 1: a gradient chunk appears at its latest-used parameter.
            stages = [max(profile.param_block[s.index] for s in layout.slots) for layout in layouts]
        result.append(Packing(size, needs, span + shared, shared, stages, grads_stream))
    return result


def fixed_policies(profile: Profile, block_policy: str | Sequence[str]) -> tuple[str, ...]:
    """A caller's activation policy (one name for every block, or one per block) as one per
    block; raises ``PlanError`` when it names an unknown policy or the wrong number of blocks."""
    count = len(profile.blocks)
    policies = (block_policy,) * count if isinstance(block_policy, str) else tuple(block_policy)
    unknown = sorted(set(policies) - set(BLOCK_POLICIES))
    if unknown or len(policies) != count:
        raise PlanError(
            f"tiermem planner: block_policy must be one of {'|'.join(BLOCK_POLICIES)} or a list of them, one per "
            f"activation block ({count} blocks), got {list(policies)!r}"
        )
    return policies


def activation_candidates(profile: Profile, block_policy: str | Sequence[str] | None = None) -> list[_Act]:
    """Rule 2 (``block_policy``: the one candidate the caller fixed)."""
    count = len(profile.blocks)
    memcpy_bw = profile.memcpy_bw or math.inf
    has_nvme = bool(profile.links.get("device->nvme"))
    families: list[tuple[str, tuple[str, ...]]] = [("keep", ("keep",) * count)]
    if block_policy is not None:
        fixed = fixed_policies(profile, block_policy)
        families = [(f"fixed by the caller ({', '.join(sorted(set(fixed)))})", fixed)]
        kinds: list[str] = []
    else:
        kinds = ["recompute", "host"] + (["nvme"] if has_nvme else [])
    for kept in range(count if kinds else 0):
        for kind in kinds:
            families.append((f"{kind}, last {kept} kept", (kind,) * (count - kept) + ("keep",) * kept))
    if has_nvme and count and block_policy is None:
        write_bw = profile.links["device->nvme"]
        read_bw = profile.links.get("nvme->device") or write_bw
        tba = adaptive_keep([BlockProfile(b.forward_s, b.saved_bytes) for b in profile.blocks], write_bw, read_bw)
        families.append((f"TBA adaptive keep (last {tba} kept)", ("nvme",) * (count - tba) + ("keep",) * tba))
        # NVMe where the I/O hides, recompute where it would stall (coarse grid over the split).
        step = max(1, count // 10)
        for kept in range(0, count, step):
            for split in range(0, count - kept, step):
                policies = ("nvme",) * split + ("recompute",) * (count - kept - split) + ("keep",) * kept
                families.append((f"nvme then recompute, last {kept} kept", policies))
    seen: set[tuple[str, ...]] = set()
    result = []
    for family, policies in families:
        if policies in seen:
            continue
        seen.add(policies)
        cost = activation_cost(profile, policies)
        time = cost.recompute_s + cost.stall_s + cost.memcpy_bytes / memcpy_bw
        if profile.cpu:
            time += cost.nvme_bytes_moved / memcpy_bw  # staging copies share the cores (TRAPS 7)
        time += activation_overhead_s(profile, cost)
        result.append(_Act(policies, family, cost.device_demand, cost.host_bytes, cost.nvme_bytes, time))
    return result


def pareto(acts: Sequence[_Act]) -> list[_Act]:
    """Entries no other beats on both device bytes and time, by device bytes ascending."""
    front: list[_Act] = []
    for act in sorted(acts, key=lambda a: (a.device, a.time)):
        if not front or act.time < front[-1].time:
            front.append(act)
    # Ascending bytes, descending time: the last entry under a room is the fastest there.
    return front


def search(
    profile: Profile,
    capacities: Mapping[str, int],
    *,
    states_offload: bool = True,
    chunk_sizes: Sequence[int] | None = None,
    margin: float = FRAGMENTATION_MARGIN,
    block_policy: str | Sequence[str] | None = None,
    grads_stream: bool = False,
) -> Decision:
    """The fastest plan that fits ``capacities`` (free bytes per tier). ``states_offload``:
    whether streamed chunks are possible (not yet on CUDA, NOTE [ Model-state rules ] rule 8).
    ``block_policy``: the activation policy the caller fixed (a name for every block, or one
    per block); the model states are searched around it. ``grads_stream``: the loop frees NVMe
    chunks' gradients as they step (NOTE [ Default placement rule ] rule 3)."""
    caps = {t: int(capacities[t]) for t in TIERS}
    usable = {t: caps[t] / (1 + margin) for t in TIERS}
    acts = activation_candidates(profile, block_policy)
    front = pareto(acts)
    front_keys = [(a.device, a.time, i) for i, a in enumerate(front)]
    memcpy_bw = profile.memcpy_bw or math.inf
    read_bw = profile.links.get("nvme->device") or math.inf
    feasible: list[tuple[float, int, StatesChoice, _Act]] = []
    closest: tuple[float, StatesChoice, _Act] | None = None
    considered = 0
    tie = 0
    for packing in packings(profile, chunk_sizes, grads_stream):
        n = packing.chunks
        for persistent in range(0 if states_offload else n, n + 1):
            streamed = n - persistent
            low = min(packing.min_buffers, streamed)
            options = {low, min(packing.min_buffers + 1, streamed), streamed} if streamed else {0}
            host_end = packing.host_end(persistent, int(usable["host"])) if streamed else n
            for buffers in sorted(options):
                choice = StatesChoice(packing, persistent, buffers, host_end)
                states = states_cost(profile, choice, timeline=False)
                considered += 1
                states_time = (
                    states.optimizer_s
                    + states.memcpy_bytes / memcpy_bw
                    + (states.nvme_read_forward + states.nvme_read_backward + states.nvme_step_bytes)
                    * (1 / memcpy_bw if profile.cpu else 0.0)
                    + max(0.0, (states.nvme_read_forward + states.nvme_read_backward) / read_bw - profile.compute_s)
                    + states_overhead_s(profile, states.streamed_chunks)
                )
                # The separable bound: gradients coexist with activations' peak or come after it.
                room = usable["device"] - states.static_device - states.grad_in_flight
                room = room if states.grad_total <= room else -1
                fits_reserve = states.reserve_device_bytes <= caps["device"]
                index = fastest_fitting(front_keys, int(room)) if fits_reserve else None
                while index is not None and index >= 0:
                    act = front[index]
                    if (
                        states.host_bytes + act.host <= usable["host"]
                        and states.nvme_bytes + act.nvme <= usable["nvme"]
                    ):
                        tie += 1
                        feasible.append((states_time + act.time, tie, choice, act))
                        break
                    index -= 1
                else:
                    least = front[0]
                    over = _overshoot(
                        states.static_device + states.grad_in_flight + max(least.device, states.grad_total),
                        states.host_bytes + least.host,
                        states.nvme_bytes + least.nvme,
                        usable,
                    )
                    over = max(over, states.reserve_device_bytes / max(caps["device"], 1))
                    if closest is None or over < closest[0]:
                        closest = (over, choice, front[0])
    best: tuple[float, int, StatesChoice, _Act, Estimate] | None = None
    fitting = 0
    for _, _, choice, act in heapq.nsmallest(MAX_EXACT, feasible):
        estimate = predict(profile, choice, act.policies)
        if not estimate.fits(caps, margin):
            if closest is None or closest[0] > 1.0:
                closest = (1.0, choice, act)
            continue
        key = (estimate.step_s, estimate.peak_bytes["device"])
        if best is None or key < (best[0], best[1]):
            best = (estimate.step_s, estimate.peak_bytes["device"], choice, act, estimate)
        fitting += 1
        if fitting >= FINALISTS:
            break
    if best is None:
        raise _no_fit(profile, caps, closest, margin)
    _, _, choice, act, estimate = best
    estimate = estimate.within(caps)
    plan = Plan(
        chunk_size=choice.packing.chunk_size,
        persistent_chunks=choice.persistent,
        buffers=choice.buffers,
        state_home=choice.homes,
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
        considered=considered * len(front),
        policies_family=act.family,
    )


def _overshoot(device: float, host: float, nvme: float, usable: Mapping[str, float]) -> float:
    return max(device / max(usable["device"], 1), host / max(usable["host"], 1), nvme / max(usable["nvme"], 1))


def _no_fit(
    profile: Profile, caps: Mapping[str, int], closest: tuple[float, StatesChoice, _Act] | None, margin: float
) -> NoPlanFitsError:
    """Rule 4."""
    if closest is None:
        return NoPlanFitsError({t: 0 for t in TIERS}, dict(caps), {}, ["the model has no parameters to place"])
    _, choice, act = closest
    estimate = predict(profile, choice, act.policies)
    short = estimate.shortfall(dict(caps), margin)
    advice = []
    if short["device"]:
        advice.append(
            f"raise [device] capacity by at least {format_size(short['device'])}, or use a smaller batch "
            "(activations) or a smaller model"
        )
    if short["host"]:
        advice.append(
            f"raise [host] capacity by at least {format_size(short['host'])}, or give NVMe more room so states "
            "can live there"
        )
    if short["nvme"]:
        advice.append(f"raise [nvme] capacity (or add paths) by at least {format_size(short['nvme'])}")
    return NoPlanFitsError(short, dict(caps), dict(estimate.peak_bytes), advice)


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
    reasons.append(f"activations: {family or 'keep'}")
    parts = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in estimate.parts_s.items())
    reasons.append(f"predicted step {estimate.step_s * 1000:.1f} ms = {parts}")
    dp = ", ".join(f"{k} {format_size(v)}" for k, v in estimate.device_parts.items())
    reasons.append(f"device bytes: {dp}; transient operator peak {format_size(estimate.transient_bytes)}")
    return reasons


def combine_for(profile: Profile, choice: StatesChoice, policies: Sequence[str]) -> Estimate:
    """The estimate ``search`` used for one plan (for reports and tests)."""
    return combine(profile, states_cost(profile, choice), activation_cost(profile, policies))
