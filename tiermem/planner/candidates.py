"""The search's candidates that do not depend on the capacities: one chunk packing per chunk
size (NOTE [ Plan search ] rule 1, in :mod:`tiermem.planner.search`) and the activation
policies reduced to their Pareto front (rule 2). Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiermem.errors import PlanError
from tiermem.layout.activation_policy import BlockProfile, adaptive_keep
from tiermem.layout.chunks import ParamInfo, outlier_candidates, pack, size_candidates
from tiermem.layout.placement import BLOCK_POLICIES, STAGED_HOMES, ChunkNeeds, normalize_chunk_size
from tiermem.planner.costmodel import Packing, activation_cost, activation_overhead_s
from tiermem.planner.profile import Profile

MAX_SIZES = 12
"""Rule 1: chunk sizes tried at most (spread over the candidates)..."""
MAX_OUTLIER_SIZES = 6
"""...and at most this many more below the largest parameter, its outliers in chunks of their own."""


@dataclass(frozen=True)
class ActivationCandidate:
    """One per-block activation policy (rule 2): its family, device, host and NVMe bytes and
    seconds beyond compute (its overheads included)."""

    policies: tuple[str, ...]
    family: str
    device: int
    host: int
    nvme: int
    time: float
    #: device bytes backward needs (its stages, without prefetches): beside the streamed
    #: gradients in flight, which forward's end never sees (NOTE [ Cost model ] rule 1)
    backward: int = 0


def packings(
    profile: Profile,
    chunk_sizes: Sequence[int] | None = None,
    grads_stream: bool = False,
    grad_homes: Sequence[str] = ("host",),
    staged_homes: Sequence[int] = (STAGED_HOMES,),
) -> list[Packing]:
    """Rule 1: one packing per chunk size, place gradients wait (``grad_homes``) and number of
    NVMe homes staged at once (``staged_homes``), in the profile's execution order
    (``grads_stream``, ``grad_homes``, ``staged_homes``: NOTE [ Default placement rule ] rule 3)."""
    infos = [ParamInfo(p.nbytes, (p.nbytes,), torch.uint8, p.trainable) for p in profile.params]
    if chunk_sizes is None:
        sizes = _thinned(outlier_candidates(infos), MAX_OUTLIER_SIZES) + _thinned(size_candidates(infos), MAX_SIZES)
    else:
        sizes = [normalize_chunk_size(s) for s in chunk_sizes]
    result = []
    for size in sizes:
        # NOTE [ Chunk layout rules ] rule 4: parameters above the size get chunks of their own
        layouts = pack(infos, profile.order, size, oversized=True)
        needs = []
        for layout in layouts:
            sections = max((profile.params[s.index].sections for s in layout.slots), default=0)
            needs.append(ChunkNeeds(layout.nbytes, layout.trainable, sections, sliceable=profile.element_wise))
        where = {slot.index: layout.index for layout in layouts for slot in layout.slots}
        span = max((len({where[i] for i in module}) for module in profile.modules if module), default=1)
        shared = {where[i] for i in profile.shared}
        # NOTE [ Cost model ] rule 8: the chunks in forward's order of first use, repeats collapsed
        used = [where[i] for i in profile.order if i in where]
        visits = [c for k, c in enumerate(used) if k == 0 or used[k - 1] != c]
        # rule 9 there: the same per place forward uses them (before the blocks, each block, the
        # head), which a recomputed block's forward runs again in backward
        block_visits: list[list[int]] = [[] for _ in range(len(profile.blocks) + 2)]
        if profile.param_block:
            for i in profile.order:
                if i in where:
                    runs = block_visits[min(max(profile.param_block[i], -1), len(profile.blocks)) + 1]
                    if not runs or runs[-1] != where[i]:
                        runs.append(where[i])
        # the chunks only what runs before the first block uses (embeddings, whose backward
        # reads no weight: NOTE [ Model-state rules ] rule 3), tied ones left out
        later = {c for runs in block_visits[1:] for c in runs} | {where[i] for i in profile.shared}
        lookups = sorted(set(block_visits[0]) - later) if profile.param_block and profile.blocks else []
        stages = None
        if profile.param_block:
            # NOTE [ Cost model ] rule 1: a gradient chunk appears at its latest-used parameter.
            stages = [max(profile.param_block[s.index] for s in layout.slots) for layout in layouts]
        # NOTE [ Default placement rule ] rule 3: gradients that wait may wait on the host or
        # on NVMe; which is faster depends on what the host holds instead
        for grad_home in ("host",) if grads_stream else grad_homes:
            for staged in staged_homes:
                result.append(
                    Packing(
                        size,
                        needs,
                        span + len(shared),
                        sorted(shared),
                        stages,
                        grads_stream,
                        grad_home,
                        staged,
                        visits,
                        block_visits if profile.param_block else (),
                        lookups,
                        grads_via_host=not profile.cpu,
                    )
                )
    return result


def _thinned(sizes: list[int], most: int) -> list[int]:
    """At most ``most`` of ``sizes`` (ascending), spread over them, the first and last kept."""
    if len(sizes) <= most:
        return sizes
    step = (len(sizes) - 1) / (most - 1)
    return sorted({sizes[round(i * step)] for i in range(most)})


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


def activation_candidates(
    profile: Profile, block_policy: str | Sequence[str] | None = None
) -> list[ActivationCandidate]:
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
        backward = max([cost.head_demand, *cost.stage_demand])
        result.append(
            ActivationCandidate(policies, family, cost.device_demand, cost.host_bytes, cost.nvme_bytes, time, backward)
        )
    return result


def pareto(acts: Sequence[ActivationCandidate]) -> list[ActivationCandidate]:
    """Entries no other beats on device, host and NVMe bytes and time at once, by device bytes
    ascending (rule 2). Not on device and time alone: an entry offloading to the host beats one
    offloading to NVMe there, yet only the NVMe one fits a small host (measured: a 200M GPT at
    10% device and host found no plan while the mechanism's own rule ran it)."""
    ordered = sorted(acts, key=lambda a: (a.device, a.time, a.host, a.nvme, a.backward))
    if not ordered:
        return []
    points = np.array([(a.device, a.host, a.nvme, a.time, a.backward) for a in ordered], dtype=np.float64)
    keep = np.ones(len(ordered), dtype=bool)
    for i, point in enumerate(points):
        # Beaten: another entry no worse anywhere and better somewhere (duplicates keep the first).
        no_worse = np.all(points <= point, axis=1)
        better = np.any(points < point, axis=1)
        beaten = no_worse & (better | (np.arange(len(points)) < i))
        beaten[i] = False
        keep[i] = not beaten.any()
    return [act for act, kept in zip(ordered, keep, strict=True) if kept]
