"""When no plan fits: the least raise of one tier alone with which the search finds a plan,
or raises of several together, checked by scanning again (NOTE [ Plan search ] rules 4 and
5, in :mod:`tiermem.planner.search`). Pure."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

from tiermem.planner.candidates import ActivationCandidate
from tiermem.planner.costmodel import TIERS, Estimate, StatesChoice, StatesCost, fastest_fitting, predict
from tiermem.planner.errors import NoPlanFitsError, format_size_up
from tiermem.planner.scan import Row, Scan, Space

GALLOP_TRIES = 8
"""Rule 5: candidate capacities tried before widening the raise."""
IN_TURN_TRIES = 3
"""Rule 5: of those, the first tried in turn before galloping."""
WIDEN_TRIES = 10
"""Rule 5: doublings of the raise tried past the candidates before giving up on one tier."""
NARROW_TRIES = 8
"""Rule 5: bisection steps between a raise that failed and one that fits."""


def capacity_for(need: float, margin: float) -> int:
    """The least capacity that holds ``need`` bytes with the margin, both ways the search checks
    it (``need * (1 + margin) <= capacity`` and ``need <= capacity / (1 + margin)``)."""
    capacity = max(0, math.ceil(need * (1 + margin)))
    while capacity / (1 + margin) < need or need * (1 + margin) > capacity:
        capacity += 1
    return capacity


def _lower_bounds(space: Space, rows: Sequence[Row], caps: Mapping[str, int], tier: str) -> list[int]:
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
            # Any entry from ``lo`` on fits the host and NVMe; forward's end holds no gradient
            # (NOTE [ Cost model ] rule 1), so the least need is over all of them.
            need = states.static_device + min(
                max(act.device, states.grad_in_flight + max(states.grad_total, act.backward)) for act in front[lo:]
            )
            bounds.append(max(capacity_for(need, margin), states.reserve_device_bytes))
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
            bounds.append(capacity_for(min(options), margin))
    return sorted(bounds)


def _changes(space: Space, scan: Scan, failed: Sequence[tuple[Row, int, Estimate]], tier: str) -> list[int]:
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
            changes.append(max(capacity_for(estimate.needed()["device"], margin), estimate.reserve_device_bytes))
            continue
        entries = front[: bisect.bisect_right(space.front_devices, int(row.room))]
        if tier == "host":
            packing, persistent, host_end = row.choice.packing, row.choice.persistent, row.choice.host_end
            if persistent < packing.chunks:
                changes += (
                    capacity_for(packing.host_bytes(persistent, end), margin)
                    for end in range(host_end + 1, packing.chunks + 1)
                )
            changes += {capacity_for(states.host_bytes + act.host, margin) for act in entries if act.host}
        else:
            changes += {capacity_for(states.nvme_bytes + act.nvme, margin) for act in entries if act.nvme}
    if tier == "host" and scan.rows:
        prefixes = space.front_pareto()
        nvme_usable = scan.caps["nvme"] / (1 + margin)
        for row in scan.rows:
            index = bisect.bisect_right(space.front_devices, int(row.room)) - 1 if row.fits_reserve else -1
            if index < 0:
                continue
            states, choice = row.states, row.choice
            if choice.persistent < choice.host_end < choice.packing.chunks:
                changes.append(capacity_for(choice.packing.host_bytes(choice.persistent, choice.host_end + 1), margin))
            hosts = [h for n, h in prefixes[index] if states.nvme_bytes + n <= nvme_usable]
            if hosts:
                changes.append(capacity_for(states.host_bytes + min(hosts), margin))
    return changes


def _raise_alone(
    space: Space, scan: Scan, failed: Sequence[tuple[Row, int, Estimate]], caps: Mapping[str, int], tier: str
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


def _raise_together(space: Space, caps: Mapping[str, int], short: Mapping[str, int]) -> dict[str, int] | None:
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


def no_fit(
    space: Space,
    caps: Mapping[str, int],
    scan: Scan,
    failed: Sequence[tuple[Row, int, Estimate]],
    closest: tuple[float, StatesChoice, ActivationCandidate] | None,
) -> NoPlanFitsError:
    """Rules 4 and 5."""
    if closest is None:
        return NoPlanFitsError({t: 0 for t in TIERS}, dict(caps), {}, ["the model has no parameters to place"])
    _, choice, act = closest
    estimate = predict(space.profile, choice, act.policies)
    # Not Estimate.shortfall: it rounds need * (1 + margin) down, so a plan over by less than a
    # byte lacks "0" everywhere and raising by its figures leaves it over.
    need = estimate.needed()
    short = {t: max(0, capacity_for(need[t], space.margin) - caps[t]) for t in TIERS}
    short["device"] = max(short["device"], estimate.reserve_device_bytes - caps["device"])
    targets = {t: _raise_alone(space, scan, failed, caps, t) for t in TIERS}
    alone = {t: target - caps[t] for t, target in targets.items() if target is not None}
    smaller = "use a smaller batch (activations) or a smaller model"
    together = None
    if alone:
        advice = [
            f"raise [{t}] capacity{' (or add paths)' if t == 'nvme' else ''} by at least {format_size_up(r)} "
            f"(to {format_size_up(caps[t] + r)}: {caps[t] + r} bytes)"
            for t, r in sorted(alone.items(), key=lambda item: (item[1] / max(caps[item[0]], 1), item[0]))
        ]
        advice.append(smaller)
    else:
        together = _raise_together(space, caps, short)
        raises = together or {t: short[t] for t in TIERS if short[t]}
        parts = [
            f"[{t}] capacity by at least {format_size_up(r)} (to {format_size_up(caps[t] + r)}: {caps[t] + r} bytes)"
            for t, r in raises.items()
        ]
        together_word = " together" if len(parts) > 1 else ""
        advice = [f"raise {' and '.join(parts)}{together_word}, or {smaller}" if parts else smaller]
    return NoPlanFitsError(short, dict(caps), need, advice, raise_alone=alone, raise_together=together)
