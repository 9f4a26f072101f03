"""The link probes of the instrumented step (NOTE [ Profiling step ] rule 5, in
:mod:`tiermem.planner.profiler`): bytes/s of every link between the tiers, moved through the
registry as training moves them, and of each NVMe path on its own, straight through the NVMe
tier's I/O. The profile cache's revalidation (NOTE [ Profile cache ] rule 2) reuses them.

The aggregate links go through the registry (its moves and read-only queries). The NVMe
tier's own paths, stripe unit and direct ``allocate``/``write``/``read``/``free`` have no
registry operation: :func:`_nvme_tier` is the one place that reaches the tier itself, for
:func:`nvme_paths`, :func:`path_probe_plan`, :func:`nvme_io_seconds` and
:func:`probe_nvme_paths`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from tiermem.registry import Priority, Registry
from tiermem.tiers.memory import aligned_empty
from tiermem.units import ALIGNMENT

PROBE_BYTES = 32 << 20
"""Bytes moved per link probe (less where a tier has less free)."""
MIN_PROBE_BYTES = 64 << 10
"""The smallest probe still measured. A small device budget (a tight ``tiermem train``) leaves
room for small probes only; they underrate bandwidth (per-move latency weighs more), which
errs on the slow side, while no measurement at all would make the cost model treat NVMe as
absent and host copies as free."""

LINKS = (
    ("device", "host"),
    ("host", "device"),
    ("device", "nvme"),
    ("nvme", "device"),
    ("host", "nvme"),
    ("nvme", "host"),
)


def probe_size(registry: Registry, nbytes: int = PROBE_BYTES, tiers: Iterable[str] | None = None) -> int:
    """The probe's bytes: ``nbytes``, or a quarter of the least free of ``tiers`` (default:
    every tier), page-rounded."""
    names = registry.tier_names if tiers is None else [name for name in tiers if registry.has_tier(name)]
    free = [registry.free_bytes(name) for name in names]
    size = min([nbytes, *(f // 4 for f in free)])
    return size - size % ALIGNMENT


def move_seconds(registry: Registry, src: str, dst: str, nbytes: int) -> float:
    """Seconds of one registry move of ``nbytes`` from tier ``src`` to ``dst`` (the bytes
    start on the device and are staged at ``src`` first, untimed); freed after."""
    tensor = torch.ones(nbytes, dtype=torch.uint8, device=registry.device)
    handle = registry.register(tensor, "device", dedup=False, kind="probe")
    try:
        if src != "device":
            handle.move_to(src, Priority.DEMAND)
            handle.wait()
        start = time.perf_counter()
        handle.move_to(dst, Priority.DEMAND)
        handle.wait()
        return time.perf_counter() - start
    finally:
        handle.free()


def probe_links(registry: Registry, size: int) -> dict[str, float]:
    """Rule 5: bytes/s of each link, moving ``size`` bytes through the real tiers (best of
    three: the first touches fault pages in), or fewer where the tiers the link passes through
    (the device, where the probe's bytes start, and its two ends) have less room: a host full of
    the chunks' homes (streamed profiling at a small host) leaves the NVMe links between the
    device and NVMe measurable, without which the cost model would take every NVMe read as free.
    Where the NVMe tier stripes over several paths, also each path's own write and read
    bandwidth (:func:`probe_nvme_paths`), under the keys of :func:`nvme_path_links`; with one
    path those are the aggregate ``host->nvme`` and ``nvme->host`` (not probed twice). The cost
    model reads only the aggregate keys."""
    result: dict[str, float] = {}
    for src, dst in LINKS:
        if not (registry.has_tier(src) and registry.has_tier(dst)):
            continue
        nbytes = probe_size(registry, size, ("device", src, dst))
        if nbytes < MIN_PROBE_BYTES:
            continue  # too little room to measure anything meaningful
        fastest = min(move_seconds(registry, src, dst, nbytes) for _ in range(3))
        result[f"{src}->{dst}"] = nbytes / max(fastest, 1e-9)
    paths = nvme_paths(registry)
    if len(paths) == 1 and result.get("host->nvme") and result.get("nvme->host"):
        write, read = nvme_path_links(paths[0])
        result[write], result[read] = result["host->nvme"], result["nvme->host"]
    elif len(paths) > 1:
        result.update(probe_nvme_paths(registry, probe_size(registry, size)))
    return result


PATH_PROBE_ROUNDS = 3
"""Rounds of each path's probe (best counts, as for the aggregate links)."""


def nvme_path_links(path: str) -> tuple[str, str]:
    """The profile's link keys of one NVMe path (one of ``[nvme] paths``, as the tier
    resolved it): ``("host->nvme[PATH]", "nvme[PATH]->host")``, write then read."""
    return f"host->nvme[{path}]", f"nvme[{path}]->host"


def _nvme_tier(registry: Registry) -> Any:
    """The NVMe tier itself, or None: its paths, stripe unit and direct I/O have no registry
    operation (the per-path probes read and write its files on purpose)."""
    return registry.tiers.get("nvme")


def nvme_paths(registry: Registry) -> list[str]:
    """The NVMe tier's paths (one per stripe); empty without an NVMe tier that has paths."""
    tier = _nvme_tier(registry)
    return [str(p) for p in getattr(tier, "paths", None) or ()]


def path_probe_plan(registry: Registry, size: int) -> tuple[int, int]:
    """``(span, per_path)``: the NVMe bytes :func:`probe_nvme_paths` allocates to probe each
    path with ``per_path`` bytes (at most ``size``, fewer where the tier has less than twice
    ``span`` free). ``per_path`` is what any placement of the span guarantees every path
    (whole stripe units, NOTE [ NVMe tier layout and I/O ] rule 1); below
    :data:`MIN_PROBE_BYTES` no path is probed."""
    tier = _nvme_tier(registry)
    stripes = len(nvme_paths(registry))
    block = int(getattr(tier, "block_size", 0) or 0)
    if tier is None or stripes < 1 or block <= 0:
        return 0, 0
    free = registry.free_bytes("nvme")
    span = min(stripes * (size + block), free // 2)
    span -= span % ALIGNMENT
    # A span starting anywhere covers at least span // block - 1 whole units; every path owns
    # one in ``stripes`` consecutive units.
    guaranteed = max((span // block - 1) // stripes, 0) * block
    per_path = min(size, guaranteed)
    return span, per_path - per_path % ALIGNMENT


def _stripe_pieces(start: int, span: int, block: int, stripes: int, path: int, limit: int) -> list[tuple[int, int]]:
    """``(offset, length)`` within an NVMe allocation at logical ``start`` of the bytes that
    live on path ``path`` (NOTE [ NVMe tier layout and I/O ] rule 1: logical unit ``u`` is in
    file ``u % stripes``), the first ``limit`` of them."""
    pieces: list[tuple[int, int]] = []
    position, end, taken = start, start + span, 0
    while position < end and taken < limit:
        unit, within = divmod(position, block)
        step = min(block - within, end - position)
        if unit % stripes == path:
            length = min(step, limit - taken)
            pieces.append((position - start, length))
            taken += length
        position += step
    return pieces


def _timed_io(
    io: Callable[[Any, int, torch.Tensor], Future[None]],
    allocation: Any,
    pieces: Sequence[tuple[int, int]],
    buffer: torch.Tensor,
) -> float:
    """Seconds to carry out every piece at once (the tier keeps ``queue_depth`` in flight)."""
    start = time.perf_counter()
    futures: list[Future[None]] = []
    at = 0
    try:
        for offset, length in pieces:
            futures.append(io(allocation, offset, buffer[at : at + length]))
            at += length
    finally:
        concurrent.futures.wait(futures)  # never leave I/O in flight on a buffer about to go
    elapsed = time.perf_counter() - start
    for future in futures:
        future.result()
    return elapsed


def nvme_io_seconds(registry: Registry, nbytes: int) -> tuple[float, float] | None:
    """Seconds of one write of ``nbytes`` to the NVMe tier, from a page-aligned host buffer,
    and of reading them back, straight through the tier's ``write``/``read`` (as
    :func:`probe_nvme_paths`); the allocation is freed. None without an NVMe tier or room."""
    tier = _nvme_tier(registry)
    if tier is None or nbytes <= 0:
        return None
    nbytes += -nbytes % ALIGNMENT
    try:
        allocation = tier.allocate(nbytes)
    except MemoryError:
        return None
    try:
        buffer = aligned_empty(nbytes, torch.device("cpu"))
        buffer.fill_(1)
        write = _timed_io(tier.write, allocation, [(0, nbytes)], buffer)
        read = _timed_io(tier.read, allocation, [(0, nbytes)], buffer)
    finally:
        tier.free(allocation)
    return write, read


def probe_nvme_paths(registry: Registry, size: int) -> dict[str, float]:
    """Bytes/s of writing and of reading each NVMe path on its own (keys of
    :func:`nvme_path_links`), best of :data:`PATH_PROBE_ROUNDS`; empty where the tier has too
    little room (:func:`path_probe_plan`).

    Through the tier's own I/O (its ``write``/``read``, backend, O_DIRECT, queue depth), as
    ``tiermem bench io`` raw mode does: one allocation spans every path, and each path's probe
    moves only the stripe units that live on it, between them and a page-aligned host buffer,
    all at once. Timed as the aggregate links are (the I/O completes; no ``fdatasync``), so a
    path's numbers compare with the aggregate ``host->nvme`` / ``nvme->host``. The probe's
    bytes are in the tier's own files and the allocation is freed: nothing is left behind."""
    paths = nvme_paths(registry)
    span, per_path = path_probe_plan(registry, size)
    if len(paths) < 1 or per_path < MIN_PROBE_BYTES:
        return {}
    tier = _nvme_tier(registry)
    block = int(tier.block_size)
    try:
        allocation = tier.allocate(span)
    except MemoryError:  # fragmented, or taken since the plan: no per-path numbers this time
        return {}
    result: dict[str, float] = {}
    try:
        buffer = aligned_empty(per_path, torch.device("cpu"))
        buffer.fill_(1)  # fault the pages in before any clock runs
        pieces = [_stripe_pieces(allocation.location, span, block, len(paths), i, per_path) for i in range(len(paths))]
        for _ in range(PATH_PROBE_ROUNDS):
            for path, own in zip(paths, pieces, strict=True):
                write, read = nvme_path_links(path)
                seconds = _timed_io(tier.write, allocation, own, buffer)
                result[write] = max(result.get(write, 0.0), per_path / max(seconds, 1e-9))
                seconds = _timed_io(tier.read, allocation, own, buffer)
                result[read] = max(result.get(read, 0.0), per_path / max(seconds, 1e-9))
    finally:
        tier.free(allocation)
    return result
