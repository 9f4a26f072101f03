"""The cost model's activation part: one per-block activation policy's device timeline
(forward's end, then backward block by block), its host and NVMe bytes and the NVMe link's
queues. Pure. Rules 2, 6 and 7 of NOTE [ Cost model ] (in :mod:`tiermem.planner.costmodel`,
which adds the model states' part and re-exports every name here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiermem.layout.shares import PREFETCH_SHARE
from tiermem.planner.profile import Profile

LOOKAHEAD = 2
"""Blocks the offloader prefetches ahead of backward (``ActivationOffloader.lookahead``)."""


@dataclass(frozen=True)
class ActivationCost:
    """What one per-block activation policy costs (rules 2 and 6): device bytes over the
    step's timeline, host and NVMe bytes, and time."""

    #: the largest of the three below
    device_peak: int
    #: the same, without opportunistic prefetches (rule 2)
    device_demand: int
    #: at the end of forward (outside blocks included)
    forward_peak: int
    #: when the head's backward is done (kept blocks, writes in flight)
    head_live: int
    #: per block, when its backward starts (kept blocks up to it, blocks fetched back)
    stage_live: tuple[int, ...]
    #: the same without what prefetching adds (the least each stage needs)
    stage_demand: tuple[int, ...]
    host_bytes: int
    nvme_bytes: int
    #: plain (unmanaged) RAM: recomputed blocks' inputs, tensors below min_bytes
    ram_bytes: int
    recompute_s: float
    memcpy_bytes: int
    nvme_bytes_moved: int
    stall_s: float
    #: saved tensors the offloader registers, and those it moves out and back (rule 7)
    registered: int = 0
    offloaded: int = 0
    #: saved tensors (in the profile's forward) of recomputed blocks
    recomputed: int = 0
    #: ``forward_peak`` and ``head_live`` without earlier blocks' writes in flight, which
    #: forward and backward wait for when the device is full (rule 2)
    forward_demand: int = 0
    head_demand: int = 0
    #: bytes a step moves per link (NOTE [ Cost model ] rule 10): offloaded blocks out and back
    links: Mapping[str, int] = field(default_factory=dict)


def link_share(busy_s: float, pass_s: float) -> float:
    """Rule 6: the share of the NVMe link that activation I/O gets during a pass of
    ``pass_s`` compute seconds whose chunk reads keep the link busy ``busy_s`` seconds."""
    if busy_s <= 0:
        return 1.0
    if pass_s <= 0:
        return 1 - PREFETCH_SHARE
    return max(1 - busy_s / pass_s, 1 - PREFETCH_SHARE)


@dataclass
class _Forward:
    """Forward's walk (rules 2 and 6): its totals, and what backward starts from."""

    #: the compute clock at forward's end (the head's forward included)
    end: float
    #: when the NVMe write queue drains, and when each block's write lands (0: none)
    write_free: float
    write_end: list[float]
    #: kept blocks' (and recomputed blocks' registered inputs') bytes on the device
    kept: int
    #: offloaded blocks' bytes whose write has not landed at forward's end
    pending_bytes: int
    #: the device peak at forward's end (outside blocks included)
    peak: int
    #: the same without earlier blocks' writes in flight: forward waits for them to land when
    #: the device is full (NOTE [ Activation fallbacks ] rules 4, 5), so only a block's own
    #: bytes must fit beside what stays (rule 2)
    demand: int
    recompute: float
    host: int
    nvme: int
    ram: int
    memcpy: int


def _forward(profile: Profile, policies: Sequence[str], write_bw: float) -> _Forward:
    """Rules 2 and 6, forward: block ends on the compute clock; NVMe writes queue behind each other."""
    blocks = profile.blocks
    outside = profile.outside
    count = len(blocks)
    clock = outside.forward_s / 2  # embeddings run before the first block
    write_free = 0.0
    ends, write_end = [0.0] * count, [0.0] * count
    kept_prefix, peak, demand, recompute, host, nvme, ram, memcpy = 0, 0, 0, 0.0, 0, 0, 0, 0
    # Writes land in issue order (one queue), so the ones still in flight are a window.
    pending: list[int] = []
    pending_bytes, landed = 0, 0
    for i, (block, policy) in enumerate(zip(blocks, policies, strict=True)):
        clock += block.forward_s
        ends[i] = clock
        ram += block.small_bytes
        if policy == "keep":
            kept_prefix += block.saved_bytes
        elif policy == "recompute":
            recompute += block.forward_s
            if block.input_bytes >= profile.min_bytes:
                kept_prefix += block.input_bytes  # the offloader registers the input (rule 2)
            else:
                ram += block.input_bytes
        elif policy == "host":
            host += block.saved_bytes
            memcpy += 2 * block.saved_bytes
        elif policy == "nvme" and write_bw > 0:
            write_free = max(write_free, ends[i] - block.forward_s) + block.saved_bytes / write_bw
            write_end[i] = write_free
            nvme += block.saved_bytes
            pending.append(i)
            pending_bytes += block.saved_bytes
        else:
            kept_prefix += block.saved_bytes  # no NVMe link measured: the bytes stay
        # The block's own tensors are all on the device until its forward ends (its writes
        # start as they are saved), plus the earlier writes that have not landed.
        # A recomputed block's tensors never reach the tier (rule 2).
        peak = max(peak, kept_prefix + pending_bytes + (block.saved_bytes if policy == "host" else 0))
        demand = max(demand, kept_prefix + (block.saved_bytes if policy in ("host", "nvme") else 0))
        while landed < len(pending) and write_end[pending[landed]] <= clock:
            pending_bytes -= blocks[pending[landed]].saved_bytes
            landed += 1
    forward_end = clock + outside.forward_s / 2
    while landed < len(pending) and write_end[pending[landed]] <= forward_end:
        pending_bytes -= blocks[pending[landed]].saved_bytes
        landed += 1
    peak = max(peak, kept_prefix + pending_bytes) + outside.saved_bytes
    demand = max(demand, kept_prefix) + outside.saved_bytes
    return _Forward(
        forward_end, write_free, write_end, kept_prefix, pending_bytes, peak, demand, recompute, host, nvme, ram, memcpy
    )


def _backward(
    profile: Profile, policies: Sequence[str], forward: _Forward, read_bw: float, write_bw: float
) -> tuple[float, int, list[int], list[int]]:
    """Rules 2 and 6, backward: the head's backward first, then blocks in reverse, reads
    issued LOOKAHEAD ahead. (stall seconds, head_live, stage_live, stage_demand)."""
    blocks = profile.blocks
    count = len(blocks)
    write_end = forward.write_end
    clock = forward.end + profile.outside.backward_s / 2
    read_free = max(forward.write_free, clock)
    stall = 0.0
    ready = [0.0] * count
    started = [0.0] * count
    live_kept = forward.kept
    head_live = forward.kept + forward.pending_bytes
    stage_live = [0] * count
    stage_demand = [0] * count
    for i in range(count - 1, -1, -1):
        issue_at = started[i + LOOKAHEAD] if i + LOOKAHEAD < count else clock
        if policies[i] == "nvme" and write_bw > 0:
            read_free = max(read_free, issue_at, write_end[i]) + blocks[i].saved_bytes / read_bw
            ready[i] = read_free
            if ready[i] > clock:
                stall += ready[i] - clock
                clock = ready[i]
        started[i] = clock
        # Prefetches are opportunistic (one that finds the device full is dropped and the block
        # is fetched on demand later): a stage must hold its own block, and holds the ones
        # prefetched behind it where there is room.
        own = blocks[i].saved_bytes if policies[i] in ("nvme", "host") else 0
        ahead = sum(blocks[j].saved_bytes for j in range(max(0, i - LOOKAHEAD), i) if policies[j] in ("nvme", "host"))
        # NOTE [ Prefetch window ]: the window starts at a quarter of the largest block and
        # grows to whole blocks (LOOKAHEAD) whenever backward waits for reads, which on a
        # loaded machine it does though the link keeps up: the peak counts the window it can
        # grow to, the demand none of it (a prefetch that finds the device full is dropped).
        stage_demand[i] = live_kept + own
        stage_live[i] = live_kept + own + ahead
        if policies[i] == "keep":
            live_kept -= blocks[i].saved_bytes
        elif policies[i] == "recompute" and blocks[i].input_bytes >= profile.min_bytes:
            live_kept -= blocks[i].input_bytes
        clock += blocks[i].backward_s + (blocks[i].forward_s if policies[i] == "recompute" else 0.0)
    return stall, head_live, stage_live, stage_demand


def activation_cost(
    profile: Profile, policies: Sequence[str], chunk_reads_s: tuple[float, float] = (0.0, 0.0)
) -> ActivationCost:
    """Rules 2 and 6 for one per-block policy. ``chunk_reads_s``: the seconds the NVMe link
    spends on chunk reads during forward and during backward."""
    blocks = profile.blocks
    outside = profile.outside
    forward_s = outside.forward_s + sum(block.forward_s for block in blocks)
    backward_s = outside.backward_s + sum(
        block.backward_s + (block.forward_s if policy == "recompute" else 0.0)
        for block, policy in zip(blocks, policies, strict=True)
    )
    write_bw = (profile.links.get("device->nvme") or 0.0) * link_share(chunk_reads_s[0], forward_s)
    read_bw = (profile.links.get("nvme->device") or profile.links.get("device->nvme") or 0.0) * link_share(
        chunk_reads_s[1], backward_s
    )
    forward = _forward(profile, policies, write_bw)
    stall, head_live, stage_live, stage_demand = _backward(profile, policies, forward, read_bw, write_bw)
    peak = forward.peak
    registered, offloaded, recomputed = saved_counts(profile, policies)
    return ActivationCost(
        device_peak=max([peak, head_live, *stage_live]),
        device_demand=max([forward.demand, forward.kept, *stage_demand]),
        forward_peak=peak,
        head_live=head_live,
        stage_live=tuple(stage_live),
        stage_demand=tuple(stage_demand),
        host_bytes=forward.host,
        nvme_bytes=forward.nvme,
        ram_bytes=forward.ram + outside.small_bytes,
        recompute_s=forward.recompute,
        memcpy_bytes=forward.memcpy,
        nvme_bytes_moved=2 * forward.nvme,
        stall_s=stall,
        registered=registered,
        offloaded=offloaded,
        recomputed=recomputed,
        forward_demand=forward.demand,
        head_demand=forward.kept,
        links={
            "device->host": forward.host,
            "host->device": forward.host,
            "device->nvme": forward.nvme,
            "nvme->device": forward.nvme,
        },
    )


def saved_counts(profile: Profile, policies: Sequence[str]) -> tuple[int, int, int]:
    """Rule 7: (saved tensors the offloader registers, those it offloads, those of recomputed
    blocks) under ``policies``."""
    registered, offloaded, recomputed = profile.outside.saved_count, 0, 0
    offloads = ("host", "nvme") if profile.links.get("device->nvme") else ("host",)
    for block, policy in zip(profile.blocks, policies, strict=True):
        if policy == "recompute":
            recomputed += block.saved_count
        else:
            registered += block.saved_count
        if policy in offloads:
            offloaded += block.saved_count
    return registered, offloaded, recomputed


def activation_overhead_s(profile: Profile, acts: ActivationCost) -> float:
    """Rule 7, the activations' part: per registered, offloaded and recomputed saved tensor."""
    costs = profile.overheads
    return costs.saved_s * acts.registered + costs.offload_s * acts.offloaded + costs.recompute_s * acts.recomputed
