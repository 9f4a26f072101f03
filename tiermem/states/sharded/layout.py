"""Packing and placing the optimizer states of FSDP2 shards (pure: no torch.distributed, no I/O).

Rules 2 and 4 of NOTE [ Sharded model states ] (in :mod:`tiermem.states.sharded.manager`): every rank
packs its local shards by their *padded* shape, the shape FSDP2 pads each rank's shard to
(``ceil(size / mesh size)`` along each sharded dimension), so every rank builds the same chunks
from the same global shapes, whatever its own shard's size; and one placement rule, fed the
smallest free bytes of all ranks, decides how large chunks are and where each chunk's states
live. The chunk size shrinks to the capacities (NOTE [ Default placement rule ] rules 3 and 4;
the largest size that fits, where a single process ranks fitting sizes by waste): the default
size first, then smaller ones down to the floor,
each with two homes staged for the step, then each with one; a refusal names the smallest
per-rank capacities with which some size fits.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiermem.errors import PlanError, StatesMemoryError
from tiermem.layout.chunks import ChunkLayout, ParamInfo, outlier_candidates, pack, packing_floor, size_candidates
from tiermem.layout.placement import STAGED_HOMES, STAGING_DEPTHS, STATE_HOMES, Budgets, Plan, PlanRequest
from tiermem.units import ALIGNMENT, format_size, format_size_up, round_up

#: Default chunk size (rule 4): large enough for few, large transfers, small enough that staging
#: an NVMe chunk for its step takes little memory.
DEFAULT_CHUNK_SIZE = 64 << 20


def padded_shard_shape(global_shape: Sequence[int], shards: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Rule 2: the shape every rank's shard of a ``global_shape`` tensor is padded to; ``shards``:
    ``(tensor dim, mesh dim size)`` for each ``Shard(dim)`` placement, in mesh order."""
    shape = list(global_shape)
    for dim, size in shards:
        if not 0 <= dim < len(shape) or size < 1:
            raise ValueError(f"tiermem sharded states: cannot shard dim {dim} of {tuple(global_shape)} over {size}")
        shape[dim] = math.ceil(shape[dim] / size)
    return tuple(shape)


@dataclass(frozen=True)
class ShardSpec:
    """What packing knows of one parameter's shard on every rank."""

    padded_shape: tuple[int, ...]
    dtype: torch.dtype
    #: the optimizer keeps states for it (it requires grad and is in a param group)
    optimized: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.padded_shape) * self.dtype.itemsize


def _optimized(specs: Sequence[ShardSpec]) -> tuple[list[int], list[ParamInfo]]:
    """The indices of the shards that have optimizer states, and every shard's packing facts."""
    optimized = [i for i, s in enumerate(specs) if s.optimized and s.nbytes > 0]
    return optimized, [ParamInfo(s.nbytes, s.padded_shape, s.dtype, True) for s in specs]


def pack_shards(specs: Sequence[ShardSpec], chunk_size: int | None) -> tuple[int, list[ChunkLayout]]:
    """Rule 4: the chunk size in force and the chunks of the optimized shards, in parameter
    order; a frozen (not optimized) parameter has no state and no slot. A shard more than twice
    every other's (an embedding's: NOTE [ Chunk layout rules ] rule 4) gets a chunk of its own,
    so it does not set every chunk's size (and with it the memory that stages one)."""
    optimized, infos = _optimized(specs)
    floor = packing_floor([infos[i] for i in optimized])
    if chunk_size is None:
        total = sum(round_up(specs[i].nbytes, 64) for i in optimized)
        size = max(round_up(max(floor, 1), ALIGNMENT), min(round_up(max(total, 1), ALIGNMENT), DEFAULT_CHUNK_SIZE))
    elif chunk_size < floor:
        raise PlanError(
            f"tiermem plan: chunk_size={chunk_size} is below the largest parameter shard that does not get a chunk "
            f"of its own ({floor} bytes per rank); give at least that"
        )
    else:
        size = round_up(chunk_size, ALIGNMENT)
    return size, pack(infos, optimized, size, oversized=True)


def shard_chunk_sizes(specs: Sequence[ShardSpec], chunk_size: int | None) -> list[int]:
    """Rule 4: the chunk sizes to try, largest first: the requested one alone; else the default
    (:func:`pack_shards`), then the smaller sizes of NOTE [ Chunk layout rules ] rule 5's scale
    down to the floor below which not even outliers' own chunks help."""
    default, _ = pack_shards(specs, chunk_size)
    if chunk_size is not None:
        return [default]
    optimized, infos = _optimized(specs)
    shards = [infos[i] for i in optimized]
    smaller = {size for size in size_candidates(shards) + outlier_candidates(shards) if size < default}
    return [default, *sorted(smaller, reverse=True)]


def size_shards(
    specs: Sequence[ShardSpec], sections: int, budgets: Budgets, request: PlanRequest, staging: str
) -> Plan:
    """Rule 4: the plan of the largest chunk size whose states fit ``budgets`` (every rank's
    least) with two homes staged for the step, else with one (the request's ``staged_homes``
    alone when it gives one); a hand plan's ``chunk_size`` is the only size tried. Every rank
    then packs at the plan's ``chunk_size``. When no size fits, the refusal of the smallest
    size names the smallest per-rank capacities with which one does."""
    sizes = shard_chunk_sizes(specs, request.chunk_size)
    depths = STAGING_DEPTHS if request.staged_homes is None else (request.staged_homes,)
    first: StatesMemoryError | None = None
    for depth in depths:
        for size in sizes:
            homes = [layout.nbytes * sections for layout in pack_shards(specs, size)[1]]
            try:
                return decide_homes(homes, budgets, request, size, staging, depth)
            except StatesMemoryError as exc:
                first = first or exc
    homes = [layout.nbytes * sections for layout in pack_shards(specs, sizes[-1])[1]]
    least = {"device": 0, "host": 0, "nvme": sum(homes)}
    least[staging] += max(homes, default=0)  # every home on NVMe, one staged at a time
    assert first is not None
    # from None: the message carries the first refusal's text; chained, a traceback prints it twice
    raise StatesMemoryError(
        f"{first} No chunk size fits; the smallest per-rank capacities with which one does: "
        + ", ".join(f"[{tier}] {format_size_up(least[tier])}" for tier in STATE_HOMES if least[tier])
        + f" free (chunks of {format_size(sizes[-1])}, every state home on NVMe, staged one at a time)."
    ) from None


def signature(chunk_size: int, layouts: Sequence[ChunkLayout], sections: int) -> str:
    """Rule 2: a digest of the packing every rank must share (which shard sits where)."""
    text = repr(
        (
            chunk_size,
            sections,
            [[(s.index, s.offset, s.nbytes, s.shape, str(s.dtype)) for s in c.slots] for c in layouts],
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()


def budgets_of_all(budgets: Sequence[Budgets]) -> Budgets:
    """Rule 4: the plan must fit every rank, so it sees the smallest free bytes of each tier."""
    return Budgets(min(b.device for b in budgets), min(b.host for b in budgets), min(b.nvme for b in budgets))


def decide_homes(
    home_bytes: Sequence[int],
    budgets: Budgets,
    request: PlanRequest,
    chunk_size: int,
    staging: str,
    staged: int = STAGED_HOMES,
) -> Plan:
    """Rule 4: where each chunk's states live. A hand plan's ``state_home`` (one home for all, or
    one per chunk, device-homed chunks first) and ``persistent_chunks`` (how many first chunks
    keep theirs on the device) are honoured; ``buffers`` has no meaning here (parameters are
    FSDP2's). Otherwise: a prefix on the device while it fits in half the device's free bytes,
    then the host while it fits (keeping room to stage ``staged`` NVMe homes), then NVMe.
    ``staging``: the memory tier an NVMe (or, for a device step, a host) home is staged on."""
    if request.buffers not in (None, 0):
        raise PlanError(
            f"tiermem plan: buffers={request.buffers} has no meaning for an FSDP2-sharded model: FSDP2 owns the "
            "parameters and gathers them itself; leave buffers out"
        )
    if request.block_policy is not None:
        raise PlanError(
            "tiermem plan: block_policy is not planned for FSDP2-sharded models yet; give "
            "rt.offload_activations(model, policy=...) the policy instead"
        )
    total = len(home_bytes)
    homes = _requested_homes(total, request)
    if homes is None:
        homes = _default_homes(home_bytes, budgets, request.persistent_chunks, staging, staged)
    check_fits(home_bytes, homes, budgets, staging, staged)
    persistent = next((i for i, h in enumerate(homes) if h != "device"), total)
    return Plan(
        chunk_size=chunk_size,
        persistent_chunks=persistent,
        buffers=0,
        state_home=tuple(homes),
        # a plan that stages no home says the default
        staged_homes=staged if _staging_need(home_bytes, homes, staging, 1) else STAGED_HOMES,
    )


def _requested_homes(total: int, request: PlanRequest) -> list[str] | None:
    wanted, persistent = request.state_home, request.persistent_chunks
    if persistent is not None and persistent > total:
        raise PlanError(
            f"tiermem plan: persistent_chunks={persistent} but the optimizer states pack into {total} chunks"
        )
    if isinstance(wanted, tuple):
        if len(wanted) != total:
            raise PlanError(f"tiermem plan: state_home lists {len(wanted)} chunks but the states pack into {total}")
        first_off = next((i for i, h in enumerate(wanted) if h != "device"), total)
        if any(h == "device" for h in wanted[first_off:]) or persistent not in (None, first_off):
            raise PlanError(
                f"tiermem plan: state_home {list(wanted)} with persistent_chunks={persistent}: the chunks homed on "
                "the 'device' come first and number persistent_chunks"
            )
        return list(wanted)
    if isinstance(wanted, str):
        keep = persistent or 0
        return ["device"] * keep + [wanted] * (total - keep)
    return None


def _default_homes(
    home_bytes: Sequence[int], budgets: Budgets, persistent: int | None, staging: str, staged: int
) -> list[str]:
    homes: list[str] = []
    device_free = budgets.device // 2
    for need in home_bytes:
        on_device = (
            len(homes) < persistent
            if persistent is not None
            else need <= device_free and (not homes or homes[-1] == "device")
        )
        if on_device:
            homes.append("device")
            device_free -= need
        else:
            homes.append("")
    host_free = budgets.host
    for i, need in enumerate(home_bytes):
        if homes[i] == "":
            if need <= host_free:
                homes[i], host_free = "host", host_free - need
            else:
                homes[i] = "nvme"
    # Give back host homes (last first) until the staging tier can stage the NVMe homes.
    for i in reversed(range(len(homes))):
        if _staging_need(home_bytes, homes, "host", staged) <= host_free or staging != "host":
            break
        if homes[i] == "host":
            homes[i], host_free = "nvme", host_free + home_bytes[i]
    return homes


def _staging_need(home_bytes: Sequence[int], homes: Sequence[str], staging: str, staged: int) -> int:
    """Bytes the staging tier needs to step ``staged`` homes at once that do not live on it."""
    away = [b for b, h in zip(home_bytes, homes, strict=True) if h != staging and (h == "nvme" or staging == "device")]
    return staged * max(away, default=0)


def check_fits(
    home_bytes: Sequence[int], homes: Sequence[str], budgets: Budgets, staging: str, staged: int = STAGED_HOMES
) -> None:
    """Rule 4: the plan fits the smallest free bytes of every rank, or a StatesMemoryError says why."""
    bad = [h for h in homes if h not in STATE_HOMES]
    if bad:
        raise PlanError(f"tiermem plan: state_home must be one of {'|'.join(STATE_HOMES)}, got {bad}")
    need = {tier: sum(b for b, h in zip(home_bytes, homes, strict=True) if h == tier) for tier in STATE_HOMES}
    need[staging] += _staging_need(home_bytes, homes, staging, staged)
    free = {"device": budgets.device, "host": budgets.host, "nvme": budgets.nvme}
    problems = [
        f"the {tier} needs {format_size(need[tier])} but has {format_size(free[tier])} free on the fullest rank"
        for tier in STATE_HOMES
        if need[tier] > free[tier]
    ]
    if problems:
        raise StatesMemoryError(
            "tiermem sharded model states do not fit: "
            + "; ".join(problems)
            + f" (optimizer states of {len(homes)} chunks, {staged} staged for the step). Raise the tier "
            "capacities (they are per rank), give plan= a smaller chunk_size, or move states to 'nvme'."
        )
