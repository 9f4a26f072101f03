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
   Their costs do not depend on the states' choice except through the device room left, the
   host and NVMe bytes beside the states' and the shared NVMe link, so they are reduced once
   to a Pareto front over device, host and NVMe bytes and time (by device bytes ascending),
   and each states choice takes the fastest front entry that fits its device room and the
   host and NVMe its states leave.
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

import bisect
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tiermem.layout.activation_policy import BlockProfile, adaptive_keep
from tiermem.layout.chunks import ParamInfo, pack, size_candidates
from tiermem.layout.placement import BLOCK_POLICIES, ChunkNeeds, Plan, Prediction, normalize_chunk_size
from tiermem.planner.costmodel import (
    FRAGMENTATION_MARGIN,
    TIERS,
    Estimate,
    Packing,
    StatesChoice,
    StatesCost,
    activation_cost,
    activation_overhead_s,
    combine,
    fastest_fitting,
    predict,
    states_cost,
    states_overhead_s,
)
from tiermem.planner.errors import NoPlanFitsError, format_size_up
from tiermem.planner.profile import Profile
from tiermem.errors import PlanError
from tiermem.units import format_size

MAX_SIZES = 12
"""Rule 1: chunk sizes tried at most (spread over the candidates)."""
FINALISTS = 24
"""Rule 3."""
MAX_EXACT = 2000
"""Rule 3: full predictions at most (each costs O(blocks + chunks))."""

GALLOP_TRIES = 8
"""Rule 5: candidate capacities tried before widening the raise."""
IN_TURN_TRIES = 3
"""Rule 5: of those, the first tried in turn before galloping."""
WIDEN_TRIES = 10
"""Rule 5: doublings of the raise tried past the candidates before giving up on one tier."""
NARROW_TRIES = 8
"""Rule 5: bisection steps between a raise that failed and one that fits."""


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
    """Entries no other beats on device, host and NVMe bytes and time at once, by device bytes
    ascending (rule 2). Not on device and time alone: an entry offloading to the host beats one
    offloading to NVMe there, yet only the NVMe one fits a small host (measured: a 200M GPT at
    10% device and host found no plan while the mechanism's own rule ran it)."""
    ordered = sorted(acts, key=lambda a: (a.device, a.time, a.host, a.nvme))
    if not ordered:
        return []
    points = np.array([(a.device, a.host, a.nvme, a.time) for a in ordered], dtype=np.float64)
    keep = np.ones(len(ordered), dtype=bool)
    for i, point in enumerate(points):
        # Beaten: another entry no worse anywhere and better somewhere (duplicates keep the first).
        no_worse = np.all(points <= point, axis=1)
        better = np.any(points < point, axis=1)
        beaten = no_worse & (better | (np.arange(len(points)) < i))
        beaten[i] = False
        keep[i] = not beaten.any()
    return [act for act, kept in zip(ordered, keep, strict=True) if kept]


@dataclass(frozen=True)
class _Row:
    """One states choice the scan evaluated at some capacities (rule 4 reads them back)."""

    key: tuple[int, int, int, int]  # packing index, persistent, buffers, host_end
    choice: StatesChoice
    states: StatesCost
    time: float
    #: device bytes left for activations under the separable bound; -1: the gradients do not fit
    room: float
    fits_reserve: bool


@dataclass
class _Scan:
    caps: Mapping[str, int]
    rows: list[_Row]
    #: (separable time, tie, row, front index): one per row whose fastest room-fitting entry
    #: (walking down to the first whose host and NVMe bytes fit) exists
    feasible: list[tuple[float, int, _Row, int]]
    closest: tuple[float, StatesChoice, _Act] | None


class _Space:
    """The candidates of rules 1 and 2, which do not depend on the capacities, with the states
    costs and full predictions computed so far: rule 4 scans again at raised capacities and
    reuses them."""

    def __init__(
        self,
        profile: Profile,
        *,
        chunk_sizes: Sequence[int] | None,
        margin: float,
        block_policy: str | Sequence[str] | None,
        grads_stream: bool,
    ) -> None:
        self.profile = profile
        self.margin = margin
        self.front = pareto(activation_candidates(profile, block_policy))
        self.front_keys = [(a.device, a.time, i) for i, a in enumerate(self.front)]
        self._front_devices = [a.device for a in self.front]
        # Rule 2: a row takes the fastest entry within its room whose host and NVMe bytes fit.
        by_time = sorted(range(len(self.front)), key=lambda i: (self.front[i].time, self.front[i].device))
        self._by_time = np.array(by_time, dtype=np.int64)
        self._by_time_bytes = np.array(
            [(self.front[i].device, self.front[i].host, self.front[i].nvme) for i in by_time], dtype=np.float64
        ).reshape(-1, 3)
        self.packings = packings(profile, chunk_sizes, grads_stream)
        self._memcpy_bw = profile.memcpy_bw or math.inf
        self._read_bw = profile.links.get("nvme->device") or math.inf
        self._compute_s = profile.compute_s
        self._states: dict[tuple[int, int, int, int], tuple[StatesChoice, StatesCost, float]] = {}
        self._exact: dict[tuple[tuple[int, int, int, int], int], Estimate] = {}
        self._pareto: list[tuple[tuple[int, int], ...]] | None = None
        self._host_steps: dict[int, tuple[list[int], list[int]]] = {}
        self._choices: dict[int, list[tuple[tuple[int, int, int, int], StatesChoice, StatesCost, float]]] = {}

    def states(self, key: tuple[int, int, int, int]) -> tuple[StatesChoice, StatesCost, float]:
        """A states choice, its cost and its separable time (memoised)."""
        hit = self._states.get(key)
        if hit is None:
            k, persistent, buffers, host_end = key
            profile = self.profile
            choice = StatesChoice(self.packings[k], persistent, buffers, host_end)
            states = states_cost(profile, choice, timeline=False)
            memcpy_bw = self._memcpy_bw
            nvme_reads = states.nvme_read_forward + states.nvme_read_backward
            time = (
                states.optimizer_s
                + states.memcpy_bytes / memcpy_bw
                + (nvme_reads + states.nvme_step_bytes) * (1 / memcpy_bw if profile.cpu else 0.0)
                + max(0.0, nvme_reads / self._read_bw - self._compute_s)
                + states_overhead_s(profile, states.streamed_chunks)
            )
            hit = self._states[key] = (choice, states, time)
        return hit

    def exact(self, row: _Row, index: int) -> Estimate:
        """Rule 3's full prediction of a row with front entry ``index`` (memoised)."""
        estimate = self._exact.get((row.key, index))
        if estimate is None:
            estimate = predict(self.profile, row.choice, self.front[index].policies)
            self._exact[(row.key, index)] = estimate
        return estimate

    def choices(self, host_usable: int) -> list[tuple[tuple[int, int, int, int], StatesChoice, StatesCost, float]]:
        """Rule 1 at a host budget: every states choice (its key, cost and separable time);
        memoised, since only the host budget moves host_end."""
        hit = self._choices.get(host_usable)
        if hit is None:
            hit = []
            for k, packing in enumerate(self.packings):
                n = packing.chunks
                for persistent in range(n + 1):
                    streamed = n - persistent
                    low = min(packing.min_buffers, streamed)
                    options = {low, min(packing.min_buffers + 1, streamed), streamed} if streamed else {0}
                    host_end = packing.host_end(persistent, host_usable) if streamed else n
                    for buffers in sorted(options):
                        key = (k, persistent, buffers, host_end)
                        hit.append((key, *self.states(key)))
            self._choices[host_usable] = hit
        return hit

    def scan(self, caps: Mapping[str, int]) -> _Scan:
        """Rules 1 and 2 at ``caps``: every states choice, and the front entry each can take."""
        usable = {t: caps[t] / (1 + self.margin) for t in TIERS}
        front = self.front
        rows: list[_Row] = []
        feasible: list[tuple[float, int, _Row, int]] = []
        closest: tuple[float, StatesChoice, _Act] | None = None
        for key, choice, states, states_time in self.choices(int(usable["host"])):
            # The separable bound: gradients coexist with activations' peak or come after it.
            room = usable["device"] - states.static_device - states.grad_in_flight
            room = room if states.grad_total <= room else -1
            fits_reserve = states.reserve_device_bytes <= caps["device"]
            row = _Row(key, choice, states, states_time, room, fits_reserve)
            rows.append(row)
            index = self._fastest_fitting(room, usable, states) if fits_reserve else -1
            if index >= 0:
                feasible.append((states_time + front[index].time, len(feasible), row, index))
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
                    closest = (over, choice, least)
        return _Scan(caps, rows, feasible, closest)

    def _fastest_fitting(self, room: float, usable: Mapping[str, float], states: StatesCost) -> int:
        """The front index of the fastest entry within ``room`` whose host and NVMe bytes fit
        beside ``states``'; -1 when none does."""
        if not len(self._by_time):
            return -1
        limits = np.array(
            [int(room), usable["host"] - states.host_bytes, usable["nvme"] - states.nvme_bytes], dtype=np.float64
        )
        fitting = np.all(self._by_time_bytes <= limits, axis=1)
        first = int(np.argmax(fitting))
        return int(self._by_time[first]) if fitting[first] else -1

    def pick(
        self, scan: _Scan, caps: Mapping[str, int], enough: int = FINALISTS
    ) -> tuple[tuple[float, int, _Row, int, Estimate] | None, list[tuple[_Row, int, Estimate]]]:
        """Rule 3: the fastest of the first ``enough`` feasible candidates that fit in full, and
        the candidates that did not fit before it stopped."""
        best: tuple[float, int, _Row, int, Estimate] | None = None
        failed: list[tuple[_Row, int, Estimate]] = []
        fitting = 0
        for _, _, row, index in heapq.nsmallest(MAX_EXACT, scan.feasible):
            estimate = self.exact(row, index)
            if not estimate.fits(caps, self.margin):
                failed.append((row, index, estimate))
                continue
            key = (estimate.step_s, estimate.peak_bytes["device"])
            if best is None or key < (best[0], best[1]):
                best = (estimate.step_s, estimate.peak_bytes["device"], row, index, estimate)
            fitting += 1
            if fitting >= enough:
                break
        return best, failed

    def fits(self, caps: Mapping[str, int]) -> tuple[bool, _Scan, list[tuple[_Row, int, Estimate]]]:
        """Whether ``search`` at ``caps`` returns a plan (the same scan and pick, stopping at
        the first fit)."""
        scan = self.scan(caps)
        best, failed = self.pick(scan, caps, enough=1)
        return best is not None, scan, failed

    def least_host_end(self, packing: Packing, persistent: int, nvme_room: float, host: int) -> int | None:
        """The least host_end at which the streamed chunks' NVMe homes fit ``nvme_room`` and the
        host capacity that makes the scan take it holds ``host`` more bytes (None: none)."""
        if nvme_room < 0:
            return None
        n = packing.chunks
        if persistent == n:
            return n
        homes = packing._home
        end = bisect.bisect_left(homes, homes[n] - nvme_room, persistent, n + 1)
        steps = self._host_steps.get(id(packing))
        if steps is None:
            # host_bytes(p, h + 1) - host_bytes(p, h) does not depend on p, and its suffix maxima
            bytes_at = [packing.host_bytes(0, h) for h in range(n + 1)]
            increments = [bytes_at[h + 1] - bytes_at[h] for h in range(n)]
            suffix = [0] * (n + 1)
            for h in range(n - 1, -1, -1):
                suffix[h] = max(suffix[h + 1], increments[h])
            steps = self._host_steps[id(packing)] = (increments, suffix)
        increments, suffix = steps
        if suffix[end] <= host:
            return n
        while increments[end] <= host:
            end += 1
        return end

    def front_pareto(self) -> list[tuple[tuple[int, int], ...]]:
        """Per front prefix ``0..i``: the (NVMe bytes, host bytes) pairs no other entry of the
        prefix beats on both."""
        if self._pareto is None:
            result: list[tuple[tuple[int, int], ...]] = []
            current: list[tuple[int, int]] = []
            for act in self.front:
                point = (act.nvme, act.host)
                if not any(n <= point[0] and h <= point[1] for n, h in current):
                    current = [(n, h) for n, h in current if not (point[0] <= n and point[1] <= h)] + [point]
                result.append(tuple(current))
            self._pareto = result
        return self._pareto


def search(
    profile: Profile,
    capacities: Mapping[str, int],
    *,
    chunk_sizes: Sequence[int] | None = None,
    margin: float = FRAGMENTATION_MARGIN,
    block_policy: str | Sequence[str] | None = None,
    grads_stream: bool = False,
) -> Decision:
    """The fastest plan that fits ``capacities`` (free bytes per tier). ``block_policy``: the
    activation policy the caller fixed (a name for every block, or one per block); the model
    states are searched around it. ``grads_stream``: the loop frees NVMe
    chunks' gradients as they step (NOTE [ Default placement rule ] rule 3)."""
    caps = {t: int(capacities[t]) for t in TIERS}
    space = _Space(
        profile,
        chunk_sizes=chunk_sizes,
        margin=margin,
        block_policy=block_policy,
        grads_stream=grads_stream,
    )
    scan = space.scan(caps)
    best, failed = space.pick(scan, caps)
    if best is None:
        closest = scan.closest
        if failed and (closest is None or closest[0] > 1.0):
            row, index, _ = failed[0]
            closest = (1.0, row.choice, space.front[index])
        raise _no_fit(space, caps, scan, failed, closest)
    _, _, row, index, estimate = best
    choice, act = row.choice, space.front[index]
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
        considered=len(scan.rows) * len(space.front),
        policies_family=act.family,
    )


def _overshoot(device: float, host: float, nvme: float, usable: Mapping[str, float]) -> float:
    return max(device / max(usable["device"], 1), host / max(usable["host"], 1), nvme / max(usable["nvme"], 1))


def _capacity_for(need: float, margin: float) -> int:
    """The least capacity that holds ``need`` bytes with the margin, both ways the search checks
    it (``need * (1 + margin) <= capacity`` and ``need <= capacity / (1 + margin)``)."""
    capacity = max(0, math.ceil(need * (1 + margin)))
    while capacity / (1 + margin) < need or need * (1 + margin) > capacity:
        capacity += 1
    return capacity


def _lower_bounds(space: _Space, rows: Sequence[_Row], caps: Mapping[str, int], tier: str) -> list[int]:
    """Rule 5 step 1: per scanned states choice, the least capacity of ``tier`` below which it
    cannot be feasible with only ``tier`` raised, whichever front entry it takes. Sorted."""
    margin, front = space.margin, space.front
    prefixes = space.front_pareto()
    usable = {t: caps[t] / (1 + margin) for t in TIERS}
    bounds: list[int] = []
    for row in rows:
        states = row.states
        if tier == "device":
            # The host and NVMe are as scanned: the first front entry whose bytes fit them.
            def fits(i: int, states: StatesCost = states) -> bool:
                return any(
                    states.host_bytes + h <= usable["host"] and states.nvme_bytes + n <= usable["nvme"]
                    for n, h in prefixes[i]
                )

            if not front or not fits(len(front) - 1):
                continue
            lo, hi = 0, len(front) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
            need = states.static_device + states.grad_in_flight + max(states.grad_total, front[lo].device)
            bounds.append(max(_capacity_for(need, margin), states.reserve_device_bytes))
            continue
        # The device is as scanned: the row takes a front entry within its room.
        index = fastest_fitting(space.front_keys, int(row.room)) if row.fits_reserve else None
        if index is None:
            continue
        if tier == "nvme":
            options = [states.nvme_bytes + n for n, h in prefixes[index] if states.host_bytes + h <= usable["host"]]
        else:
            # host_end follows the host capacity: the scan takes the longest prefix of homes
            # the host holds, so an entry with host bytes fits only in the slack that prefix
            # leaves (less than the next chunk's increment), or once every chunk is home.
            packing, persistent = row.choice.packing, row.choice.persistent
            options = []
            for nvme, host in prefixes[index]:
                end = space.least_host_end(packing, persistent, usable["nvme"] - nvme, host)
                if end is not None:
                    options.append((packing.host_bytes(persistent, end) if persistent < packing.chunks else 0) + host)
        if options:
            bounds.append(_capacity_for(min(options), margin))
    return sorted(bounds)


def _changes(space: _Space, scan: _Scan, failed: Sequence[tuple[_Row, int, Estimate]], tier: str) -> list[int]:
    """Rule 5 step 2: capacities of ``tier`` above those of ``scan`` at which its outcome can
    change. Per candidate that failed in full (only the device differs between the separable
    bound and the full prediction): the device it needs; the host at which its host_end takes
    in another chunk (fewer NVMe reads, less device) or a front entry with more host bytes
    fits; the NVMe at which one with more NVMe bytes fits. For the host, per states choice
    too: where its host_end moves, and where the first entry fits the slack it leaves."""
    margin, front = space.margin, space.front
    changes: list[int] = []
    for row, _, estimate in failed:
        states = row.states
        if tier == "device":
            changes.append(max(_capacity_for(estimate.needed()["device"], margin), estimate.reserve_device_bytes))
            continue
        entries = front[: bisect.bisect_right(space._front_devices, int(row.room))]
        if tier == "host":
            packing, persistent, host_end = row.choice.packing, row.choice.persistent, row.choice.host_end
            if persistent < packing.chunks:
                changes += (
                    _capacity_for(packing.host_bytes(persistent, end), margin)
                    for end in range(host_end + 1, packing.chunks + 1)
                )
            changes += {_capacity_for(states.host_bytes + act.host, margin) for act in entries if act.host}
        else:
            changes += {_capacity_for(states.nvme_bytes + act.nvme, margin) for act in entries if act.nvme}
    if tier == "host" and scan.rows:
        prefixes = space.front_pareto()
        nvme_usable = scan.caps["nvme"] / (1 + margin)
        for row in scan.rows:
            index = bisect.bisect_right(space._front_devices, int(row.room)) - 1 if row.fits_reserve else -1
            if index < 0:
                continue
            states, choice = row.states, row.choice
            if choice.persistent < choice.host_end < choice.packing.chunks:
                changes.append(_capacity_for(choice.packing.host_bytes(choice.persistent, choice.host_end + 1), margin))
            hosts = [h for n, h in prefixes[index] if states.nvme_bytes + n <= nvme_usable]
            if hosts:
                changes.append(_capacity_for(states.host_bytes + min(hosts), margin))
    return changes


def _raise_alone(
    space: _Space, scan: _Scan, failed: Sequence[tuple[_Row, int, Estimate]], caps: Mapping[str, int], tier: str
) -> int | None:
    """Rule 5: the least capacity of ``tier``, the others as given, at which ``search`` returns
    a plan (None when none was found)."""
    bounds = _lower_bounds(space, scan.rows, caps, tier)
    if not bounds:
        return None
    have = caps[tier]
    low = max(have, bounds[0] - 1)  # no plan fits below the least bound
    candidates = sorted({c for c in bounds + _changes(space, scan, failed, tier) if c > low})
    high = None
    stride, tries = 1, 0
    # The next candidates in turn (a failure's own needs are often the answer), then galloping:
    # the 2nd, 4th, 8th... above the last that failed.
    while candidates and tries < GALLOP_TRIES:
        probe = candidates[min(stride, len(candidates)) - 1]
        tries += 1
        ok, again, failures = space.fits({**caps, tier: probe})
        if ok:
            high = probe
            break
        low, stride = probe, stride * 2 if tries >= IN_TURN_TRIES else 1
        candidates = sorted({c for c in candidates + _changes(space, again, failures, tier) if c > low})
    widened = high is None
    if widened:
        # Past the candidates: double the raise until a plan fits.
        step = max(low - have, have // 16, 1 << 20)
        for _ in range(WIDEN_TRIES):
            probe = low + step
            if space.fits({**caps, tier: probe})[0]:
                high = probe
                break
            low, step = probe, 2 * step
        if high is None:
            return None
    # Bisect between the last failure and the fit: over the candidates between them; after
    # widening, over the interval.
    for _ in range(NARROW_TRIES):
        between = [c for c in candidates if low < c < high]
        if between:
            probe = between[len(between) // 2]
        elif widened and high - low > 1:
            probe = (low + high) // 2
        else:
            break
        if space.fits({**caps, tier: probe})[0]:
            high = probe
        else:
            low = probe
    return high


def _raise_together(space: _Space, caps: Mapping[str, int], short: Mapping[str, int]) -> dict[str, int] | None:
    """Rule 4: raises of several tiers together with which ``search`` returns a plan: the
    closest plan's shortfalls where they suffice, else those with one tier raised further by
    the least that fits (rule 5 from there; the cheapest as a fraction of the tier)."""
    raised = {t: caps[t] + short[t] for t in TIERS}
    if not any(short.values()):
        return None
    ok, scan, failed = space.fits(raised)
    if ok:
        return {t: short[t] for t in TIERS if short[t]}
    best: tuple[float, dict[str, int]] | None = None
    for tier in TIERS:
        target = _raise_alone(space, scan, failed, raised, tier)
        if target is None:
            continue
        extra = (target - raised[tier]) / max(caps[tier], 1)
        if best is None or extra < best[0]:
            best = (extra, {t: r for t, r in {**short, tier: target - caps[tier]}.items() if r})
    return None if best is None else best[1]


def _no_fit(
    space: _Space,
    caps: Mapping[str, int],
    scan: _Scan,
    failed: Sequence[tuple[_Row, int, Estimate]],
    closest: tuple[float, StatesChoice, _Act] | None,
) -> NoPlanFitsError:
    """Rules 4 and 5."""
    if closest is None:
        return NoPlanFitsError({t: 0 for t in TIERS}, dict(caps), {}, ["the model has no parameters to place"])
    _, choice, act = closest
    estimate = predict(space.profile, choice, act.policies)
    # Not Estimate.shortfall: it rounds need * (1 + margin) down, so a plan over by less than a
    # byte lacks "0" everywhere and raising by its figures leaves it over.
    need = estimate.needed()
    short = {t: max(0, _capacity_for(need[t], space.margin) - caps[t]) for t in TIERS}
    short["device"] = max(short["device"], estimate.reserve_device_bytes - caps["device"])
    targets = {t: _raise_alone(space, scan, failed, caps, t) for t in TIERS}
    alone = {t: target - caps[t] for t, target in targets.items() if target is not None}
    smaller = "use a smaller batch (activations) or a smaller model"
    together = None
    if alone:
        advice = [
            f"raise [{t}] capacity{' (or add paths)' if t == 'nvme' else ''} by at least {format_size_up(r)} "
            f"(to {format_size_up(caps[t] + r)})"
            for t, r in sorted(alone.items(), key=lambda item: (item[1] / max(caps[item[0]], 1), item[0]))
        ]
        advice.append(smaller)
    else:
        together = _raise_together(space, caps, short)
        raises = together or {t: short[t] for t in TIERS if short[t]}
        parts = [
            f"[{t}] capacity by at least {format_size_up(r)} (to {format_size_up(caps[t] + r)})"
            for t, r in raises.items()
        ]
        together_word = " together" if len(parts) > 1 else ""
        advice = [f"raise {' and '.join(parts)}{together_word}, or {smaller}" if parts else smaller]
    return NoPlanFitsError(short, dict(caps), need, advice, raise_alone=alone, raise_together=together)


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
