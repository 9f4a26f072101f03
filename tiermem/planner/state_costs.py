"""The cost model's model-state part: where a chunk packing's chunks live (a persistent prefix,
streamed buffers, host then NVMe homes) and what that costs in bytes per tier and in time.
Pure. Rules 1, 5 and 7-10 of NOTE [ Cost model ] (in :mod:`tiermem.planner.costmodel`, which
adds the activations' part and re-exports every name here)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiermem.layout.placement import STAGED_HOMES, ChunkNeeds, gradients_at_once, streamed_reserve
from tiermem.planner.profile import Profile


class Packing:
    """One chunk size's chunks in execution order, with prefix sums so a (persistent,
    buffers, homes) choice costs O(log chunks) to evaluate."""

    def __init__(
        self,
        chunk_size: int,
        needs: Sequence[ChunkNeeds],
        min_buffers: int,
        shared: Sequence[int],
        stages: Sequence[int] | None = None,
        grads_stream: bool = False,
        grad_home: str = "host",
        staged_homes: int = STAGED_HOMES,
        visits: Sequence[int] = (),
        block_visits: Sequence[Sequence[int]] = (),
        lookups: Sequence[int] = (),
        grads_via_host: bool = True,
    ) -> None:
        """``visits``: the chunks in the order forward first uses their parameters, a repeat of
        the one before left out (NOTE [ Cost model ] rule 8; empty: each chunk used in one run).
        ``block_visits``: the same split by where forward uses them: before the first block, in
        each block, after the last (the head); a recomputed block's forward runs its own again in
        backward (rule 9; empty: unknown, recompute fetches nothing again). ``lookups``: the
        chunks only what runs before the first block uses (embeddings: rule 9)"""
        self.chunk_size = chunk_size
        #: NVMe homes (and stored gradients) the host stages at once for the step (NOTE
        #: [ Default placement rule ] rule 3): with one, the step's NVMe I/O does not overlap it
        self.staged_homes = staged_homes
        #: NVMe chunks' gradients only pass through the host (NOTE [ Default placement rule ] 3)
        self.grads_stream = grads_stream
        #: where NVMe chunks' gradients wait for the step (rule 3 there; NOTE [ Stored gradients ])
        self.grad_home = "host" if grads_stream else grad_home
        #: streamed gradients pass through the host on their way to their step (not on the CPU
        #: device, where the step reads them in place: NOTE [ Declared steps ] rule 8)
        self.grads_via_host = grads_via_host
        self.needs = tuple(needs)
        #: per chunk, the backward stage its gradient chunk appears at (rule 1); unknown: the first
        self.stages = tuple(stages) if stages is not None else (1 << 30,) * len(needs)
        self.min_buffers = min_buffers
        #: chunks holding tied parameters (their gradients stay on the device all backward)
        self.shared = tuple(sorted(set(shared)))
        acc = itertools.accumulate
        self._nbytes = [0, *acc(n.nbytes for n in needs)]
        self._device = [0, *acc(n.device_bytes for n in needs)]
        self._home = [0, *acc(n.home_bytes for n in needs)]
        # a frozen chunk's NVMe home is read for forward and backward only, never staged to step
        self._staged = [0, *acc(n.home_bytes if n.trainable else 0 for n in needs)]
        self._grad = [0, *acc(n.grad_bytes for n in needs)]
        # NOTE [ Default placement rule ] rule 6: an NVMe chunk that steps in slices keeps its
        # gradients on NVMe (its bytes here), staging a slice's at a time
        self._sliced_grad = [0, *acc(n.grad_bytes if n.sliced(chunk_size) else 0 for n in needs)]
        # and steps in slices of the chunk size: each slice past the first costs what one more
        # streamed chunk's step does (NOTE [ Cost model ] rule 7: its calls and waits)
        self._extra_slices = [0, *acc(-(-n.nbytes // chunk_size) - 1 if n.sliced(chunk_size) else 0 for n in needs)]
        self._hostuse = [0, *acc(n.home_bytes + n.grad_bytes for n in needs)]
        # the step's time follows the parameter bytes it updates, with state or without (SGD
        # without momentum); its I/O follows the real state bytes, through home_bytes
        self._optim = [0, *acc(n.nbytes if n.trainable else 0 for n in needs)]
        # what stepping an NVMe home stages on the host at once: its home and gradients, or a
        # slice's for a chunk that steps in slices (NOTE [ Default placement rule ] rule 6)
        suffix = [0] * (len(needs) + 1)
        sliced_suffix = [0] * (len(needs) + 1)
        for i in range(len(needs) - 1, -1, -1):
            sliced = needs[i].sliced(chunk_size)
            suffix[i] = max(suffix[i + 1], 0 if sliced else needs[i].staged_home_bytes(chunk_size))
            sliced_suffix[i] = max(sliced_suffix[i + 1], needs[i].staged_home_bytes(chunk_size) if sliced else 0)
        #: the largest home staged whole for a step from each chunk on (trainable ones only), and
        #: the largest slice's home of those that step in slices
        self._max_staged_from = suffix
        self._max_slice_staged_from = sliced_suffix
        self._max_whole_grad_from = [0] * (len(needs) + 1)
        self._max_sliced_grad_from = [0] * (len(needs) + 1)
        for i in range(len(needs) - 1, -1, -1):
            staged = needs[i].staged_grad_bytes(chunk_size)
            sliced = needs[i].sliced(chunk_size)
            self._max_whole_grad_from[i] = max(self._max_whole_grad_from[i + 1], 0 if sliced else staged)
            self._max_sliced_grad_from[i] = max(self._max_sliced_grad_from[i + 1], staged if sliced else 0)
        # NOTE [ Chunk layout rules ] rule 4: chunks above the chunk size (outliers' own) take
        # pool slots of their own bytes, the others the largest of theirs (NOTE [ Spare chunk
        # storage ] rule 1)
        self.oversized = tuple((i, n.nbytes) for i, n in enumerate(needs) if n.nbytes > chunk_size)
        self._max_regular_from = [0] * (len(needs) + 1)
        self._regular_from = [0] * (len(needs) + 1)
        # the largest gradient among chunks of untied parameters (one is filled at a time)
        self._max_untied_grad_from = [0] * (len(needs) + 1)
        shared_set = set(self.shared)
        for i in range(len(needs) - 1, -1, -1):
            regular = needs[i].nbytes <= chunk_size
            self._max_regular_from[i] = max(self._max_regular_from[i + 1], needs[i].nbytes if regular else 0)
            self._regular_from[i] = self._regular_from[i + 1] + regular
            untied = needs[i].grad_bytes if i not in shared_set else 0
            self._max_untied_grad_from[i] = max(self._max_untied_grad_from[i + 1], untied)
        # NOTE [ Cost model ] rule 8: chunks used in more than one run of the forward (a LoRA
        # adapters' chunk, used in every block between its base's chunks)
        self.visits = tuple(visits)
        self.block_visits = tuple(tuple(runs) for runs in block_visits)
        #: rule 9: chunks only embeddings use, which backward never fetches
        self.lookups = frozenset(lookups)
        self._lookup_bytes = [0, *acc(n.nbytes if i in self.lookups else 0 for i, n in enumerate(needs))]
        self._lookup_count = [0, *acc(int(i in self.lookups) for i in range(len(needs)))]
        self._runs: dict[int, tuple[int, ...]] = {}
        self._fetches: dict[tuple[int, int, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    @property
    def chunks(self) -> int:
        return len(self.needs)

    @staticmethod
    def _sum(prefix: list[int], start: int, stop: int) -> int:
        return prefix[stop] - prefix[start] if stop > start else 0

    def streamed_oversized(self, persistent: int) -> list[int]:
        """The bytes of the streamed chunks larger than the chunk size, largest first."""
        return sorted((nbytes for i, nbytes in self.oversized if i >= persistent), reverse=True)

    def pool_bytes(self, persistent: int, buffers: int) -> int:
        """Rule 1: the device pool's parameter bytes at most: the ``buffers`` largest streamed
        chunks' slots (each outlier's own bytes; every other one the largest other's)."""
        large = self.streamed_oversized(persistent)[:buffers]
        regular = min(buffers - len(large), self._regular_from[persistent])
        return sum(large) + regular * self._max_regular_from[persistent]

    def grads_in_flight(self, persistent: int) -> int:
        """Rule 1: streamed gradient chunks of untied parameters on the device at once: the
        largest one (filled, then written back). Streamed tied ones stay from their stage on, as
        persistent ones do (``states_cost``)."""
        return self._max_untied_grad_from[persistent]

    def runs(self, persistent: int) -> tuple[int, ...]:
        """Rule 8: the streamed chunks (from ``persistent`` on) in forward's order of use, a
        repeat of the one before left out."""
        if persistent not in self._runs:
            used = [c for c in self.visits if c >= persistent]
            self._runs[persistent] = tuple(c for i, c in enumerate(used) if i == 0 or used[i - 1] != c)
        return self._runs[persistent]

    def revisits(self, persistent: int) -> bool:
        """Rule 8: a streamed chunk is used in more than one run of the forward (once the
        persistent ones are left out: with the adapters' chunk on the device, its base's chunks
        are used in one run each)."""
        runs = self.runs(persistent)
        return len(set(runs)) < len(runs)

    def refetches_in_recompute(self, persistent: int, recomputed: Sequence[int]) -> bool:
        """Rule 9: a recomputed block uses a streamed chunk (its recompute fetches it again)."""
        if not self.block_visits:
            return False
        return any(c >= persistent for block in recomputed for c in self.block_visits[block + 1])

    def recompute_slots(self, persistent: int, buffers: int, recomputed: Sequence[int]) -> int:
        """Rule 9: the pool slots past ``buffers`` a recomputed block's forward takes inside
        backward, beside the chunks backward holds: one module's span plus one, at most the
        block's own streamed chunks (the floor NOTE [ Default placement rule ] rule 4 keeps)."""
        if not self.block_visits:
            return 0
        need = 0
        for block in recomputed:
            span = len({c for c in self.block_visits[block + 1] if c >= persistent})
            need = max(need, min(self.min_buffers + 1, span))
        return max(0, need - buffers)

    def fetches(
        self, persistent: int, buffers: int, recomputed: Sequence[int] = ()
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Rules 8 and 9: how often forward and backward fetch each chunk (0 for persistent ones),
        from the pool's least-recently-used eviction over the runs of ``visits``: in forward with
        one slot more than ``buffers`` (the module using the revisited chunk keeps it pinned while
        the module inside it fetches its own: one demand over the buffers, NOTE [ Model-state
        rules ] rule 3 in ``states/manager.py``), in backward with ``buffers`` from what forward
        left, prefetching the chunk before each one it uses. Backward walks the blocks in
        reverse (with ``block_visits``; what runs before the first block, embeddings, fetches
        nothing for it); a block in ``recomputed`` runs its forward again first: its last chunk
        held, its chunks in forward's order, prefetching nothing (rule 9)."""
        recomputed = tuple(sorted(recomputed)) if self.block_visits else ()
        key = (persistent, buffers, recomputed)
        if key not in self._fetches:
            runs = self.runs(persistent)
            forward, resident = _lru(runs, buffers + 1, [], self.chunks)
            # backward prefetches the streamed chunk before each one it uses (an embeddings' one
            # too: the pool does not know backward never uses it)
            first, held = persistent, resident[-buffers:]
            if not self.block_visits:
                backward, _ = _lru(runs[::-1], buffers, held, self.chunks, -1, -1, first)
            else:
                backward, again = [0] * self.chunks, set(recomputed)
                # what runs before the first block (embeddings) fetches nothing for backward
                for position in range(len(self.block_visits) - 1, 0, -1):
                    used = [c for c in self.block_visits[position] if c >= persistent]
                    if used and position - 1 in again:
                        # backward holds the block's last chunk while the recompute runs forward
                        for segment, pinned, ahead in (([used[-1]], -1, -1), (used, used[-1], 0)):
                            fetched, held = _lru(segment, buffers, held, self.chunks, pinned, ahead, first)
                            backward = [x + y for x, y in zip(backward, fetched, strict=True)]
                    fetched, held = _lru(used[::-1], buffers, held, self.chunks, -1, -1, first)
                    backward = [x + y for x, y in zip(backward, fetched, strict=True)]
            self._fetches[key] = (tuple(forward), tuple(backward))
        return self._fetches[key]

    def host_bytes(self, persistent: int, host_end: int) -> int:
        """Host tier bytes when chunks ``persistent..host_end-1`` live on the host and the
        rest on NVMe (the rule of ``placement._check_fits``: homes and gradients, the NVMe
        chunks' gradients (``passing`` at once: two when they stream, ``staged_homes`` when they
        wait on NVMe), and room to stage ``staged_homes`` trainable NVMe homes; rule 6 there: two
        slices of a chunk that steps in slices, and of its gradients, which wait on NVMe)."""
        n = self.chunks
        staged = self.staged_homes
        passing = gradients_at_once(self.grads_stream, self.grad_home, staged, self.grads_via_host)
        sliced_grads = STAGED_HOMES * self._max_sliced_grad_from[host_end]
        if passing is not None:
            nvme_grads = max(passing * self._max_whole_grad_from[host_end], sliced_grads)
        else:
            waiting = self._sum(self._grad, host_end, n) - self._sum(self._sliced_grad, host_end, n)
            nvme_grads = waiting + sliced_grads
        staging = max(staged * self._max_staged_from[host_end], STAGED_HOMES * self._max_slice_staged_from[host_end])
        return self._sum(self._hostuse, persistent, host_end) + nvme_grads + staging

    def host_end(self, persistent: int, host_budget: int) -> int:
        """The most streamed chunks (a prefix, in order) whose homes fit ``host_budget``."""
        lo, hi = persistent, self.chunks
        if self.host_bytes(persistent, hi) <= host_budget:
            return hi
        # Binary search: host_bytes grows with host_end (a home costs more than staging it), except
        # where a sliced chunk moving to the host drops its two slices' staging; there the search may
        # keep a home on NVMe that would fit on the host, never put one on the host that does not fit.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.host_bytes(persistent, mid) <= host_budget:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _lru(
    runs: Sequence[int],
    slots: int,
    resident: list[int],
    chunks: int,
    pinned: int = -1,
    prefetch: int = 0,
    first: int = 0,
) -> tuple[list[int], list[int]]:
    """Fetches per chunk of a least-recently-used pool of ``slots`` over ``runs`` (starting with
    ``resident``, most recent last), and what it holds at the end. ``pinned`` is never evicted
    (a demand past the slots then takes one more, as the pool's does). ``prefetch`` (+1, -1):
    each use also fetches the next chunk in that direction (from ``first`` on) when a slot is
    free or one behind it can go; it keeps the use it had (least recent when new), as the pool's
    prefetch does."""
    held = list(resident)
    fetched = [0] * chunks
    for chunk in runs:
        if chunk in held:
            held.remove(chunk)
        else:
            fetched[chunk] += 1
            while len(held) >= slots and any(c != pinned for c in held):
                held.remove(next(c for c in held if c != pinned))
        held.append(chunk)
        ahead = chunk + prefetch
        if prefetch and first <= ahead < chunks and ahead not in held:
            behind = [c for c in held if c != pinned and c != chunk and (c - chunk) * prefetch < 0]
            if len(held) >= slots and behind:
                held.remove(behind[0])
            if len(held) < slots:
                fetched[ahead] += 1
                held.insert(0, ahead)
    return fetched, held


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
        return (
            ("device",) * self.persistent
            + ("host",) * (self.host_end - self.persistent)
            + ("nvme",) * (n - self.host_end)
        )


@dataclass(frozen=True)
class StatesCost:
    """What one states choice costs (rules 1 and 5): bytes per tier, the device's timeline of
    gradient chunks, bytes moved and the optimizer's time."""

    device_bytes: int
    #: device bytes ``placement`` reserves (rule 1 of its NOTE: a parameter buffer per slot, a
    #: gradient buffer per slot of a trainable chunk)
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
    #: persistent chunks' gradient chunks, all of them, and streamed tied ones (rule 1)
    grad_total: int = 0
    #: (stage, bytes): those gradient chunks and the backward stage allocating them
    grad_stages: tuple[tuple[int, int], ...] = ()
    device_parts: dict[str, int] = field(default_factory=dict)
    #: chunks that stream, and slices of sliced steps past each one's first (rule 7)
    streamed_chunks: int = 0
    #: the step reads the next NVMe home while this one steps (two staged homes); with one
    #: staged its NVMe I/O adds to the step's time
    step_overlaps_io: bool = True
    #: of ``nvme_read_forward`` and ``nvme_read_backward``, the bytes a revisited streamed chunk
    #: makes forward and backward read again (rule 8): demand fetches, nothing to hide behind
    nvme_refetch: tuple[int, int] = (0, 0)
    #: bytes a step moves per link, ``"src->dst"`` as ``rt.stats()`` names them (rule 10)
    links: Mapping[str, int] = field(default_factory=dict)
    #: pool slots past the buffers a recomputed block's forward takes in backward (rule 9)
    recompute_bytes: int = 0


def states_cost(
    profile: Profile, choice: StatesChoice, *, timeline: bool = True, policies: Sequence[str] = ()
) -> StatesCost:
    """Rules 1 and 5 for the model states alone (``timeline``: also when gradients appear;
    ``policies``: the blocks' activation policies, whose recomputed blocks fetch their streamed
    chunks again in backward, rule 9; empty: none recomputed)."""
    pk, p, b, h = choice.packing, choice.persistent, choice.buffers, choice.host_end
    n = pk.chunks
    s = Packing._sum
    persistent_grads = s(pk._grad, 0, p)
    persistent_bytes = s(pk._device, 0, p) - persistent_grads
    pool = pk.pool_bytes(p, b)
    # Rule 1: one untied streamed gradient chunk in flight at a time; a streamed chunk of tied
    # parameters keeps its gradient from when backward reaches it to backward's end, as a
    # persistent chunk does (its tied weight's gradient accumulates once, when its last use is done)
    grads = pk.grads_in_flight(p)
    kept = [c for c in range(p) if pk.needs[c].grad_bytes] + [c for c in pk.shared if c >= p]
    grad_total = sum(pk.needs[c].grad_bytes for c in kept)
    stages: tuple[tuple[int, int], ...] = ()
    if timeline:
        stages = tuple((pk.stages[c], pk.needs[c].grad_bytes) for c in kept if pk.needs[c].grad_bytes)
    # Backward starts with the last ``buffers`` streamed chunks still cached; the others are
    # fetched again (least recently used go first).
    refetch_end = max(p, n - b)
    # but the chunks only embeddings use, which backward never fetches (rule 9)
    lookup_end = min(h, refetch_end)
    # forward's fetch and backward's refetch from host homes
    host_reads = s(pk._nbytes, p, h) + s(pk._nbytes, p, lookup_end) - s(pk._lookup_bytes, p, lookup_end)
    # Gradients waiting on NVMe (NOTE [ Stored gradients ]) are written there from the device
    # and read back to step: NVMe bytes, not memory copies.
    stored = s(pk._grad if pk.grad_home == "nvme" else pk._sliced_grad, max(h, p), n)
    grad_writes = 0
    if not (pk.grads_stream and profile.device == "cpu"):
        # gradient write-back of every streamed chunk; streamed gradients on the CPU device
        # are stepped where they are (NOTE [ Declared steps ] rule 8)
        grad_writes = s(pk._grad, p, n) - stored
    nvme_fwd = s(pk._nbytes, h, n)
    nvme_bwd = s(pk._nbytes, max(h, p), refetch_end) - s(pk._lookup_bytes, max(h, p), refetch_end)
    refetch = (0, 0)
    standard = fetches = (n - p) + (refetch_end - p) - s(pk._lookup_count, p, refetch_end)
    recomputed = [i for i, policy in enumerate(policies) if policy == "recompute"]
    if pk.revisits(p) or pk.refetches_in_recompute(p, recomputed):
        # Rules 8 and 9: a revisited chunk streams, or a recomputed block's forward runs again in
        # backward: those chunks and the ones they evict are fetched again
        forward, backward = pk.fetches(p, b, recomputed)
        sizes = [need.nbytes for need in pk.needs]
        host_reads = sum((forward[c] + backward[c]) * sizes[c] for c in range(p, h))
        read = (
            sum(forward[c] * sizes[c] for c in range(h, n)),
            sum(backward[c] * sizes[c] for c in range(max(h, p), n)),
        )
        refetch = (max(0, read[0] - nvme_fwd), max(0, read[1] - nvme_bwd))
        nvme_fwd, nvme_bwd = read
        fetches = sum(forward) + sum(backward)
    memcpy = host_reads + grad_writes
    # Rule 9: a recomputed block's forward fetches beside what backward holds; past the buffers,
    # a demand takes a slot more (one of the largest regular chunk's bytes each)
    recompute_slots = pk.recompute_slots(p, b, recomputed) * pk._max_regular_from[p]
    # Stage each NVMe home in and write it back. A loop that steps every backward steps its
    # chunks early, staging each home with the working bytes copied from the device copy
    # (NOTE [ Declared steps ] rule 7): those are a memory copy, not an NVMe read.
    # Chunks that step in slices step at optimizer.step(), reading all from NVMe (NOTE [ Sliced steps ]).
    early = [need for need in pk.needs[max(h, p) : n] if need.trainable and not need.sliced(pk.chunk_size)]
    known = sum(need.nbytes for need in early) if pk.grads_stream else 0
    memcpy += known
    nvme_step_read = s(pk._staged, h, n) - known + stored
    nvme_step = nvme_step_read + s(pk._staged, h, n) + stored
    # Rule 10: what each link carries, as the tiers count it (a chunk's fetch from its home
    # straight to the device, the step's staging between NVMe and the host)
    links = {
        "host->device": host_reads,
        "device->host": grad_writes + known,
        "nvme->device": nvme_fwd + nvme_bwd,
        "device->nvme": stored,
        "nvme->host": nvme_step_read,
        "host->nvme": s(pk._staged, h, n),
    }
    return StatesCost(
        device_bytes=persistent_bytes + pool + grads + grad_total,
        # what placement checks before building (its rule 1): persistent chunks with their
        # gradients, and the pool's reserve
        reserve_device_bytes=persistent_bytes + persistent_grads + streamed_reserve(pk.needs[p:], b, pk.chunk_size),
        host_bytes=pk.host_bytes(p, h) if p < n else 0,
        nvme_bytes=s(pk._home, h, n) + stored,
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
        device_parts={
            "persistent": persistent_bytes,
            "buffers": pool,
            "gradients": grads + grad_total,
            **({"recompute slots": recompute_slots} if recompute_slots else {}),
        },
        # and the fetches past one a pass and the backward refetch of the standard count (rule 8)
        streamed_chunks=n - p + s(pk._extra_slices, max(h, p), n) + fetches - standard,
        step_overlaps_io=pk.staged_homes > 1,
        nvme_refetch=refetch,
        links=links,
        recompute_bytes=recompute_slots,
    )


def states_overhead_s(profile: Profile, streamed_chunks: int) -> float:
    """Rule 7, the model states' part: per parameter and per streamed chunk."""
    costs = profile.overheads
    return costs.param_s * len(profile.params) + costs.chunk_s * streamed_chunks
