"""The cost model: a candidate plan's step time and its peak bytes on every tier. Pure.

# NOTE [ Cost model ]
1. Device bytes (what the device tier accounts, NOTE [ Model-state rules ] rule 6):
   persistent chunks (parameters and optimizer states), ``buffers`` streamed chunks'
   parameters, gradient chunks, and the saved activations the offloader manages (rule 4).
   Gradients (``zero_grad(set_to_none=True)``, the default, drops them between steps) are
   allocated during backward, as activations are freed: a persistent chunk's gradient chunk
   appears when backward reaches the block that first used its last parameter (NOTE
   [ Profile fields ] rule 4); streamed chunks' gradients stay on the device only until their
   write-back lands (one being filled, plus the chunks of shared, tied parameters, whose
   gradients complete only at the end of backward). The device peak is the largest sum
   over that backward timeline and the end of forward.
2. Activations on the device: the part outside blocks, kept blocks, offloaded blocks whose
   write has not landed yet (the offloader keeps a tensor readable at its source until its
   write lands) and, in backward, the block being fetched back plus the prefetch window
   ahead of it (NOTE [ Prefetch window ]: a quarter of the largest block, up to ``LOOKAHEAD``
   blocks once reads stall; prefetches only take room that is free: the offloader drops
   one that does not fit). A
   recomputed block's checkpoint keeps only its input until the block's backward; the
   offloader registers that input like a kept tensor (measured: 4 x 1 MiB on the device tier
   at the end of forward on the 4x256 GPT, all blocks recomputed), so it counts on the device
   from the block's forward to its backward (in ``ram_bytes`` instead when below
   ``min_bytes``, as are saved tensors below it). The block's other tensors never reach the
   tier (checkpoint's own hooks hold them, in forward only while an operator runs, in
   backward while it recomputes): the device peak counts none of them.
3. The transient operator peak (memory inside and between operators, unmanaged) is predicted
   separately: the largest ``transient_bytes`` of a block, or of the part outside blocks.
4. Fragmentation margin: a plan fits when every tier's predicted peak times
   ``1 + FRAGMENTATION_MARGIN`` is within its capacity. The tiers account exact bytes with
   page-rounded chunks, so the margin covers the model's approximations (in-flight timing,
   gradient chunks), not allocator fragmentation; on CUDA the caching allocator adds its own.
5. Time on the CPU device (TRAPS 7): compute, recompute, every device<->host copy, the
   staging copy of every NVMe byte and the optimizer step run on the same cores, so they
   add up; NVMe transfers themselves (DMA) overlap compute and only their excess over the
   compute they can hide behind is added (a stall). On CUDA, copies overlap compute too, and
   only offloaded chunks' optimizer step counts (on the CPU; persistent ones step on the GPU).
6. NVMe activation I/O follows NOTE [ Adaptive keep ]: writes queue in forward order;
   backward prefetches ``LOOKAHEAD`` blocks ahead, reads queue; backward waits when a read
   lands after it needs the block. Chunk reads from NVMe homes share that link, spread over
   the pass that needs them (the pool fetches a few chunks ahead of compute, not all at the
   pass's start): activation I/O gets the link's time the chunk reads leave over the pass,
   and at least ``1 - PREFETCH_SHARE`` of it once chunk reads saturate the link (the
   scheduler's rule 4 caps prefetch so write-backs always find room; an approximation: the
   cap is on bytes in flight, not link time, and demand fetches are not capped). Queuing the whole
   pass's chunk reads ahead of the first activation write instead kept several blocks'
   writes pending at forward's end in the model, ~190 MiB at the 200M GPT of issue 5, that
   the measured device peak never showed, and refused plans that fit.
7. A managed step's own work (NOTE [ Profile fields ] rule 6, measured by NOTE [ Overhead
   calibration ]) runs on the training thread and adds up with the rest: per parameter
   (hooks, per-parameter optimizer calls), per saved tensor the offloader registers (blocks
   kept, offloaded to host or NVMe, and outside blocks; a recomputed block registers none),
   per saved tensor offloaded (its move out and back, beyond the bytes), per saved tensor of
   a recomputed block (checkpoint's hooks, beyond the recompute itself), and per streamed
   chunk (its moves through the scheduler, beyond the bytes). With equal bytes, fewer and
   larger streamed chunks are faster; persistent chunks cost nothing per chunk.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiermem.layout.activation_policy import PREFETCH_START
from tiermem.layout.placement import ChunkNeeds, reserve_bytes
from tiermem.layout.shares import PREFETCH_SHARE
from tiermem.planner.profile import Profile

FRAGMENTATION_MARGIN = 0.05
"""Rule 4: headroom on every tier's predicted peak."""
LOOKAHEAD = 2
"""Blocks the offloader prefetches ahead of backward (``ActivationOffloader.lookahead``)."""
POLICIES = ("keep", "recompute", "host", "nvme")
TIERS = ("device", "host", "nvme")


class Packing:
    """One chunk size's chunks in execution order, with prefix sums so a (persistent,
    buffers, homes) choice costs O(log chunks) to evaluate."""

    def __init__(
        self,
        chunk_size: int,
        needs: Sequence[ChunkNeeds],
        min_buffers: int,
        shared_chunks: int,
        stages: Sequence[int] | None = None,
        grads_stream: bool = False,
    ) -> None:
        self.chunk_size = chunk_size
        #: NVMe chunks' gradients only pass through the host (NOTE [ Default placement rule ] 3)
        self.grads_stream = grads_stream
        self.needs = tuple(needs)
        #: per chunk, the backward stage its gradient chunk appears at (rule 1); unknown: the first
        self.stages = tuple(stages) if stages is not None else (1 << 30,) * len(needs)
        self.min_buffers = min_buffers
        #: chunks holding tied parameters (their gradients stay on the device all backward)
        self.shared_chunks = shared_chunks
        acc = itertools.accumulate
        self._nbytes = [0, *acc(n.nbytes for n in needs)]
        self._device = [0, *acc(n.device_bytes for n in needs)]
        self._home = [0, *acc(n.home_bytes for n in needs)]
        self._grad = [0, *acc(n.grad_bytes for n in needs)]
        self._hostuse = [0, *acc(n.home_bytes + n.grad_bytes for n in needs)]
        self._optim = [0, *acc(n.nbytes if n.sections and n.trainable else 0 for n in needs)]
        suffix = [0] * (len(needs) + 1)
        for i in range(len(needs) - 1, -1, -1):
            suffix[i] = max(suffix[i + 1], needs[i].home_bytes)
        self._max_home_from = suffix
        self._max_grad_from = [0] * (len(needs) + 1)
        for i in range(len(needs) - 1, -1, -1):
            self._max_grad_from[i] = max(self._max_grad_from[i + 1], needs[i].grad_bytes)
        self._max_nbytes_from = [0] * (len(needs) + 1)
        for i in range(len(needs) - 1, -1, -1):
            self._max_nbytes_from[i] = max(self._max_nbytes_from[i + 1], needs[i].nbytes)

    @property
    def chunks(self) -> int:
        return len(self.needs)

    @staticmethod
    def _sum(prefix: list[int], start: int, stop: int) -> int:
        return prefix[stop] - prefix[start] if stop > start else 0

    def host_bytes(self, persistent: int, host_end: int) -> int:
        """Host tier bytes when chunks ``persistent..host_end-1`` live on the host and the
        rest on NVMe (the rule of ``placement._check_fits``: homes and gradients, the NVMe
        chunks' gradients (two at once when they stream), and room to stage two NVMe homes)."""
        n = self.chunks
        nvme_grads = 2 * self._max_grad_from[host_end] if self.grads_stream else self._sum(self._grad, host_end, n)
        return self._sum(self._hostuse, persistent, host_end) + nvme_grads + 2 * self._max_home_from[host_end]

    def host_end(self, persistent: int, host_budget: int) -> int:
        """The most streamed chunks (a prefix, in order) whose homes fit ``host_budget``."""
        lo, hi = persistent, self.chunks
        if self.host_bytes(persistent, hi) <= host_budget:
            return hi
        # host_bytes grows with host_end (a home costs more than staging it): binary search.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.host_bytes(persistent, mid) <= host_budget:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass(frozen=True)
class StatesChoice:
    """Where model states go: a prefix persists, ``buffers`` slots stream the rest, and the
    streamed chunks ``persistent..host_end-1`` live on the host, the others on NVMe."""

    packing: Packing
    persistent: int
    buffers: int
    host_end: int

    @property
    def homes(self) -> tuple[str, ...]:
        n = self.packing.chunks
        return ("device",) * self.persistent + ("host",) * (self.host_end - self.persistent) + (
            "nvme",
        ) * (n - self.host_end)


@dataclass(frozen=True)
class StatesCost:
    device_bytes: int
    #: device bytes ``placement`` reserves (rule 1 of its NOTE: 2 buffers per slot)
    reserve_device_bytes: int
    host_bytes: int
    nvme_bytes: int
    memcpy_bytes: int
    nvme_read_forward: int
    nvme_read_backward: int
    nvme_step_bytes: int
    #: of ``nvme_step_bytes``, those read (the rest are written back)
    nvme_step_read: int
    optimizer_s: float
    #: persistent parameters + states + buffer pool: on the device the whole step
    static_device: int = 0
    #: streamed chunks' gradient chunks on the device at once
    grad_in_flight: int = 0
    #: persistent chunks' gradient chunks, all of them
    grad_total: int = 0
    #: (stage, bytes): persistent gradient chunks and the backward stage allocating them
    grad_stages: tuple[tuple[int, int], ...] = ()
    device_parts: dict[str, int] = field(default_factory=dict)
    #: chunks that stream (rule 7)
    streamed_chunks: int = 0


def states_cost(profile: Profile, choice: StatesChoice, *, timeline: bool = True) -> StatesCost:
    """Rules 1 and 5 for the model states alone (``timeline``: also when gradients appear)."""
    pk, p, b, h = choice.packing, choice.persistent, choice.buffers, choice.host_end
    n = pk.chunks
    s = Packing._sum
    chunk = pk._max_nbytes_from[p]
    streamed_trainable = sum(1 for need in pk.needs[p:] if need.trainable)
    in_flight = min(streamed_trainable, 1 + pk.shared_chunks) if streamed_trainable else 0
    grad_total = s(pk._grad, 0, p)
    persistent_bytes = s(pk._device, 0, p) - grad_total
    pool = b * chunk
    grads = in_flight * chunk
    stages: tuple[tuple[int, int], ...] = ()
    if timeline:
        stages = tuple((pk.stages[c], pk.needs[c].grad_bytes) for c in range(p) if pk.needs[c].grad_bytes)
    # Backward starts with the last ``buffers`` streamed chunks still cached; the others are
    # fetched again (least recently used go first).
    refetch_end = max(p, n - b)
    memcpy = (
        s(pk._nbytes, p, h)  # forward fetch from host homes
        + s(pk._nbytes, p, min(h, refetch_end))  # backward refetch from host homes
    )
    if not (pk.grads_stream and profile.device == "cpu"):
        # gradient write-back of every streamed chunk; streamed gradients on the CPU device
        # are stepped where they are (NOTE [ Declared steps ] rule 8)
        memcpy += s(pk._grad, p, n)
    nvme_fwd = s(pk._nbytes, h, n)
    nvme_bwd = s(pk._nbytes, max(h, p), refetch_end)
    # Stage each NVMe home in and write it back. A loop that steps every backward steps its
    # chunks early, staging each home with the working bytes copied from the device copy
    # (NOTE [ Declared steps ] rule 7): those are a memory copy, not an NVMe read.
    known = sum(need.nbytes for need in pk.needs[max(h, p) : n] if need.trainable) if pk.grads_stream else 0
    memcpy += known
    nvme_step_read = s(pk._home, h, n) - known
    nvme_step = nvme_step_read + s(pk._home, h, n)
    return StatesCost(
        device_bytes=persistent_bytes + pool + grads + grad_total,
        # what placement checks before building (its rule 1): persistent chunks with their
        # gradients, and the pool's reserve
        reserve_device_bytes=persistent_bytes + grad_total + reserve_bytes(b, pk.chunk_size),
        host_bytes=pk.host_bytes(p, h) if p < n else 0,
        nvme_bytes=s(pk._home, h, n),
        memcpy_bytes=memcpy,
        nvme_read_forward=nvme_fwd,
        nvme_read_backward=nvme_bwd,
        nvme_step_bytes=nvme_step,
        nvme_step_read=nvme_step_read,
        # On CUDA persistent chunks step on the GPU (next to nothing here); offloaded ones on the CPU.
        optimizer_s=profile.optimizer_s_per_byte * s(pk._optim, 0 if profile.cpu else p, n),
        static_device=persistent_bytes + pool,
        grad_in_flight=grads,
        grad_total=grad_total,
        grad_stages=stages,
        device_parts={"persistent": persistent_bytes, "buffers": pool, "gradients": grads + grad_total},
        streamed_chunks=n - p,
    )


@dataclass(frozen=True)
class ActivationCost:
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


def link_share(busy_s: float, pass_s: float) -> float:
    """Rule 6: the share of the NVMe link that activation I/O gets during a pass of
    ``pass_s`` compute seconds whose chunk reads keep the link busy ``busy_s`` seconds."""
    if busy_s <= 0:
        return 1.0
    if pass_s <= 0:
        return 1 - PREFETCH_SHARE
    return max(1 - busy_s / pass_s, 1 - PREFETCH_SHARE)


def activation_cost(
    profile: Profile, policies: Sequence[str], chunk_reads_s: tuple[float, float] = (0.0, 0.0)
) -> ActivationCost:
    """Rules 2 and 6 for one per-block policy. ``chunk_reads_s``: the seconds the NVMe link
    spends on chunk reads during forward and during backward."""
    blocks = profile.blocks
    outside = profile.outside
    count = len(blocks)
    forward_s = outside.forward_s + sum(block.forward_s for block in blocks)
    backward_s = outside.backward_s + sum(
        block.backward_s + (block.forward_s if policy == "recompute" else 0.0)
        for block, policy in zip(blocks, policies, strict=True)
    )
    write_bw = (profile.links.get("device->nvme") or 0.0) * link_share(chunk_reads_s[0], forward_s)
    read_bw = (profile.links.get("nvme->device") or profile.links.get("device->nvme") or 0.0) * link_share(
        chunk_reads_s[1], backward_s
    )
    # Forward: block ends on the compute clock; NVMe writes queue behind each other.
    clock = outside.forward_s / 2  # embeddings run before the first block
    write_free = 0.0
    ends, write_end = [0.0] * count, [0.0] * count
    kept_prefix, peak, recompute, host, nvme, ram, memcpy = 0, 0, 0.0, 0, 0, 0, 0
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
        while landed < len(pending) and write_end[pending[landed]] <= clock:
            pending_bytes -= blocks[pending[landed]].saved_bytes
            landed += 1
    forward_end = clock + outside.forward_s / 2
    while landed < len(pending) and write_end[pending[landed]] <= forward_end:
        pending_bytes -= blocks[pending[landed]].saved_bytes
        landed += 1
    peak = max(peak, kept_prefix + pending_bytes) + outside.saved_bytes
    # Backward: the head's backward first, then blocks in reverse; reads issued LOOKAHEAD ahead.
    clock = forward_end + outside.backward_s / 2
    read_free = max(write_free, clock)
    stall = 0.0
    ready = [0.0] * count
    started = [0.0] * count
    live_kept = kept_prefix
    head_live = kept_prefix + pending_bytes
    stage_live = [0] * count
    stage_demand = [0] * count
    # The offloader starts its window from the largest block it measured (any policy but recompute).
    prefetch_start = int(PREFETCH_START * max((b.saved_bytes for b in blocks), default=0))
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
        # NOTE [ Prefetch window ]: a quarter of the largest block ahead, whole blocks
        # (LOOKAHEAD) once backward has had to wait for reads.
        window = ahead if stall > 0 else min(ahead, prefetch_start)
        stage_demand[i] = live_kept + own
        stage_live[i] = live_kept + own + window
        if policies[i] == "keep":
            live_kept -= blocks[i].saved_bytes
        elif policies[i] == "recompute" and blocks[i].input_bytes >= profile.min_bytes:
            live_kept -= blocks[i].input_bytes
        clock += blocks[i].backward_s + (blocks[i].forward_s if policies[i] == "recompute" else 0.0)
    ram += outside.small_bytes
    moved = 2 * nvme
    registered, offloaded, recomputed = saved_counts(profile, policies)
    return ActivationCost(
        device_peak=max([peak, head_live, *stage_live]),
        device_demand=max([peak, head_live, *stage_demand]),
        forward_peak=peak,
        head_live=head_live,
        stage_live=tuple(stage_live),
        stage_demand=tuple(stage_demand),
        host_bytes=host,
        nvme_bytes=nvme,
        ram_bytes=ram,
        recompute_s=recompute,
        memcpy_bytes=memcpy,
        nvme_bytes_moved=moved,
        stall_s=stall,
        registered=registered,
        offloaded=offloaded,
        recomputed=recomputed,
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


def states_overhead_s(profile: Profile, streamed_chunks: int) -> float:
    """Rule 7, the model states' part: per parameter and per streamed chunk."""
    costs = profile.overheads
    return costs.param_s * len(profile.params) + costs.chunk_s * streamed_chunks


def activation_overhead_s(profile: Profile, acts: ActivationCost) -> float:
    """Rule 7, the activations' part: per registered, offloaded and recomputed saved tensor."""
    costs = profile.overheads
    return costs.saved_s * acts.registered + costs.offload_s * acts.offloaded + costs.recompute_s * acts.recomputed


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one plan."""

    step_s: float
    peak_bytes: dict[str, int]
    transient_bytes: int
    ram_bytes: int
    parts_s: dict[str, float]
    device_parts: dict[str, int]
    reserve_device_bytes: int
    #: the device peak without opportunistic prefetches: what must fit (rule 2)
    device_demand: int = 0

    def needed(self) -> dict[str, int]:
        return {**self.peak_bytes, "device": self.device_demand or self.peak_bytes["device"]}

    def fits(self, capacities: Mapping[str, int], margin: float = FRAGMENTATION_MARGIN) -> bool:
        need = self.needed()
        return all(need[t] * (1 + margin) <= capacities[t] for t in TIERS) and (
            self.reserve_device_bytes <= capacities["device"]
        )

    def within(self, capacities: Mapping[str, int]) -> Estimate:
        """The same estimate with the device peak capped at its capacity: prefetches fill the
        device only up to it (rule 2)."""
        capped = min(self.peak_bytes["device"], max(capacities["device"], self.device_demand))
        peaks = {**self.peak_bytes, "device": capped}
        return dataclasses.replace(self, peak_bytes=peaks)

    def shortfall(self, capacities: Mapping[str, int], margin: float = FRAGMENTATION_MARGIN) -> dict[str, int]:
        """Bytes each tier lacks (0 where it fits), margin included."""
        need = self.needed()
        short = {t: max(0, int(need[t] * (1 + margin)) - capacities[t]) for t in TIERS}
        short["device"] = max(short["device"], self.reserve_device_bytes - capacities["device"])
        return short


def device_peak(states: StatesCost, acts: ActivationCost, *, prefetch: bool = True) -> int:
    """Rule 1: the largest device total over forward's end and backward's stages (with the
    prefetched blocks, or only what each stage needs)."""
    count = len(acts.stage_live)
    stages = acts.stage_live if prefetch else acts.stage_demand

    def grads_by(stage: int) -> int:
        return sum(nbytes for at, nbytes in states.grad_stages if at >= stage)

    moments = [acts.forward_peak, acts.head_live + grads_by(count), states.grad_total]
    moments += [live + grads_by(i) for i, live in enumerate(stages)]
    return states.static_device + states.grad_in_flight + max(moments)


def transient_peak(profile: Profile) -> int:
    """Rule 3."""
    return max([profile.outside.transient_bytes, *(b.transient_bytes for b in profile.blocks)])


def combine(profile: Profile, states: StatesCost, acts: ActivationCost) -> Estimate:
    """Rule 5: the step time and peaks of states and activations together."""
    compute = profile.compute_s
    memcpy_bw = profile.memcpy_bw or float("inf")
    read_bw = profile.links.get("nvme->device") or profile.links.get("nvme->host") or float("inf")
    write_bw = profile.links.get("host->nvme") or profile.links.get("device->nvme") or float("inf")
    nvme_moved = states.nvme_read_forward + states.nvme_read_backward + states.nvme_step_bytes + acts.nvme_bytes_moved
    copy_s = (states.memcpy_bytes + acts.memcpy_bytes) / memcpy_bw
    staging_s = nvme_moved / memcpy_bw if profile.cpu else 0.0
    # Chunk reads from NVMe hide behind the compute of the pass that needs them, except the
    # first chunk of each pass; the optimizer's staging hides behind the step of the chunk before.
    forward = sum(b.forward_s for b in profile.blocks) + profile.outside.forward_s
    backward = compute - forward
    chunk_stall = max(0.0, states.nvme_read_forward / read_bw - forward) + max(
        0.0, states.nvme_read_backward / read_bw - backward
    )
    step_io = states.nvme_step_read / read_bw + (states.nvme_step_bytes - states.nvme_step_read) / write_bw
    step_stall = max(0.0, step_io - states.optimizer_s)
    parts = {
        "compute": compute,
        "recompute": acts.recompute_s,
        "copies": copy_s + staging_s if profile.cpu else 0.0,
        "optimizer": states.optimizer_s,
        "io_stall": acts.stall_s + chunk_stall + step_stall,
        "overhead": states_overhead_s(profile, states.streamed_chunks)
        + activation_overhead_s(profile, acts),
    }
    if not profile.cpu:  # rule 5: on CUDA, device<->host copies run on their own stream
        parts["io_stall"] += max(0.0, copy_s - compute)
    return Estimate(
        step_s=sum(parts.values()),
        peak_bytes={
            "device": device_peak(states, acts),
            "host": states.host_bytes + acts.host_bytes,
            "nvme": states.nvme_bytes + acts.nvme_bytes,
        },
        transient_bytes=transient_peak(profile),
        ram_bytes=acts.ram_bytes,
        parts_s=parts,
        device_parts={**states.device_parts, "activations": acts.device_peak},
        reserve_device_bytes=states.reserve_device_bytes,
        device_demand=device_peak(states, acts, prefetch=False),
    )


def predict(profile: Profile, choice: StatesChoice, policies: Sequence[str]) -> Estimate:
    """The full prediction for one plan (rules 1-6)."""
    states = states_cost(profile, choice)
    read_bw = profile.links.get("nvme->device") or 0.0
    busy = (states.nvme_read_forward / read_bw, states.nvme_read_backward / read_bw) if read_bw else (0.0, 0.0)
    return combine(profile, states, activation_cost(profile, policies, busy))


def fastest_fitting(front: Sequence[tuple[int, float, int]], room: int) -> int | None:
    """Index into a Pareto front sorted by device bytes (ascending; time descending) of the
    fastest entry using at most ``room`` device bytes."""
    keys = [entry[0] for entry in front]
    index = bisect.bisect_right(keys, room) - 1
    return index if index >= 0 else None
