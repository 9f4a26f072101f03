"""The chunk size a model packs with under the default rule (NOTE [ Chunk layout rules ] rule 5),
and the least free bytes with which that rule fits (named when nothing does). Pure: no I/O, no
torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from tiermem.errors import PlanError, StatesMemoryError
from tiermem.layout.placement import (
    Budgets,
    ChunkNeeds,
    Plan,
    PlanRequest,
    decide,
    gradients_at_once,
    normalize_chunk_size,
    nvme_grad_bytes,
    staging_bytes,
    streamed_reserve,
)
from tiermem.units import ALIGNMENT, format_size, format_size_up

Layouts = TypeVar("Layouts")


def chunk_sizes(
    request: PlanRequest,
    largest: int,
    candidates: Callable[[], Sequence[int]],
    floor: int | None = None,
    *,
    name_of: Callable[[int], str] | None = None,
) -> list[int]:
    """The chunk sizes to try: the requested one (at least ``floor``, the largest parameter's
    bytes, or the floor below which even outliers' own chunks do not help (NOTE [ Chunk
    layout rules ] rule 4); rounded up to ``ALIGNMENT``, rule 3), else ``candidates()`` (rule 5).
    ``name_of(nbytes)``: the name of a parameter of that many bytes, for the refusal."""
    if request.chunk_size is None:
        return list(candidates())
    floor = largest if floor is None else floor
    if request.chunk_size < floor:
        named = f": {name_of(floor)!r}" if name_of is not None else ""
        outliers = (
            f" that is no outlier ({floor} bytes{named}; only parameters more than twice the largest of the "
            f"others, the largest {largest} bytes, get a chunk of their own)"
            if floor < largest
            else f" ({largest} bytes{named})"
        )
        raise PlanError(
            f"tiermem plan: chunk_size={request.chunk_size} is below the largest parameter{outliers}, and a "
            f"parameter never spans two chunks; give chunk_size >= {floor} (sizes are rounded up to "
            f'{format_size(ALIGNMENT)}), or leave it out (or "auto") for the default rule\'s size'
        )
    return [normalize_chunk_size(request.chunk_size)]


def choose_layout(
    sizes: Sequence[int],
    pack: Callable[[int], Layouts],
    needs: Callable[[Layouts], tuple[Sequence[ChunkNeeds], int]],
    waste: Callable[[Layouts, int], int],
    *,
    budgets: Budgets,
    request: PlanRequest,
    grads_stream: bool = False,
    fallback: Sequence[int] = (),
    recompute_buffers: Callable[[Layouts], int] | None = None,
    grads_via_host: bool = True,
) -> tuple[Layouts, Plan]:
    """NOTE [ Chunk layout rules ] rule 5: for each size, ``pack(size)`` the chunks and
    :func:`decide` their plan from ``needs(layouts)`` (each chunk's needs and the minimum
    buffers); of the sizes whose plan fits, those staging the most NVMe homes at once (NOTE
    [ Default placement rule ] rules 3 and 4: their step overlaps its I/O), then the one that
    ``waste`` s least, the larger on a tie (fewer, larger transfers). The ``fallback`` sizes
    (outliers in chunks of their own, rule 4) are tried the same way when none of ``sizes``
    fits. ``grads_via_host``: streamed gradients pass through the host (:func:`decide`).
    ``recompute_buffers(layouts)``: the fewest buffers a recomputed block needs (NOTE
    [ Default placement rule ] rule 4; None: no block is recomputed): sizes whose plan keeps
    them win; without a requested chunk size, a size that fits only below them is taken when
    no size keeps them (blocks then recompute only where the device has room beside the
    buffers; a block whose activations stay small never does). When none fits, raises the first
    size's error, or for the rule alone one naming the tiers short of the smallest capacities with
    which one would, and those capacities."""
    best: tuple[tuple[bool, int, int, int], Layouts, Plan] | None = None
    first_error: Exception | None = None
    smallest: Budgets | None = None
    tries = [(size, False) for size in sizes] + [(size, True) for size in fallback]
    for size, outliers in tries:
        if outliers and best is not None:
            break  # an ordinary size fits: no parameter needs a chunk of its own
        layouts = pack(size)
        chunk_needs, min_buffers = needs(layouts)
        fewest = recompute_buffers(layouts) if recompute_buffers is not None else 0
        if request == PlanRequest(order=request.order, predicted=request.predicted):  # the rule alone
            # the least with which a size fits at all: automatic sizes may fit below the
            # recomputed blocks' buffers (rule 4)
            least = smallest_budgets(chunk_needs, size, min_buffers, budgets, grads_stream, grads_via_host)
            if least is not None and (
                smallest is None or (least.device, least.host) < (smallest.device, smallest.host)
            ):
                smallest = least
        floors = (fewest, 0) if fewest and request.chunk_size is None else (fewest,)
        for floor in floors:
            try:
                plan = decide(
                    chunk_needs,
                    chunk_size=size,
                    min_buffers=min_buffers,
                    budgets=budgets,
                    request=request,
                    grads_stream=grads_stream,
                    recompute_buffers=floor,
                    grads_via_host=grads_via_host,
                )
            except (StatesMemoryError, PlanError) as exc:
                first_error = first_error or exc
                continue
            rank = (floor < fewest, -plan.staged_homes, waste(layouts, size), -size)
            if best is None or rank < best[0]:
                best = (rank, layouts, plan)
            break
    if best is None:
        assert first_error is not None
        if smallest is not None and isinstance(first_error, StatesMemoryError):
            # from None: the first size's refusal is one chunk size's story (its device reserve
            # at the default buffers, say) and may blame a tier that is not short at all; the
            # message below says which tier is, and chaining would print both
            raise StatesMemoryError(_short_of(first_error, smallest, budgets)) from None
        raise first_error
    return best[1], best[2]


_NAMES = {"device": "device", "host": "host", "nvme": "NVMe"}
_SUBJECTS = {"device": "the device", "host": "the host", "nvme": "NVMe"}


def _short_of(first_error: StatesMemoryError, smallest: Budgets, budgets: Budgets) -> str:
    """A refusal of the default rule: first the tiers with less free than ``smallest`` (the least
    with which some chunk size fits, which the last sentence lists), with both numbers and the
    raise each needs, then those smallest capacities. When no tier is short of them, the first
    size's own refusal says what it lacked."""
    tiers = [(tier, getattr(budgets, tier), getattr(smallest, tier)) for tier in ("device", "host", "nvme")]
    short = [(tier, free, least) for tier, free, least in tiers if least > free]
    if short:
        names = " and ".join(_NAMES[tier] for tier, _, _ in short)
        # exact bytes only in the last sentence: scripts read the capacities from its "(N bytes)"
        numbers = "; ".join(
            f"{_SUBJECTS[tier]} has {format_size(free)} free, below the {format_size_up(least)} of the smallest "
            "capacities that fit (below)"
            for tier, free, least in short
        )
        enough = [f"{_SUBJECTS[tier]}'s {format_size(free)}" for tier, free, least in tiers if 0 < least <= free]
        beside = f"; {' and '.join(enough)} free {'is' if len(enough) == 1 else 'are'} enough" if enough else ""
        raises = " and ".join(
            f"[{tier}] capacity by at least {format_size_up(least - free)}" for tier, free, least in short
        )
        lead = f"tiermem model states do not fit: too little {names}: {numbers}{beside}. Raise {raises}."
    else:
        lead = str(first_error)
    return (
        f"{lead} The smallest capacities with which the default placement fits: "
        f"[device] {format_size_up(smallest.device)} ({smallest.device} bytes), [host] "
        f"{format_size_up(smallest.host)} ({smallest.host} bytes) and [nvme] {format_size_up(smallest.nvme)} "
        f"({smallest.nvme} bytes) free (every chunk streamed through the fewest buffers, homes on NVMe where "
        "it has room, staged one at a time)."
    )


def smallest_budgets(
    needs: Sequence[ChunkNeeds],
    chunk_size: int,
    min_buffers: int,
    budgets: Budgets,
    grads_stream: bool,
    grads_via_host: bool = True,
) -> Budgets | None:
    """The least free bytes per tier with which :func:`decide`'s rule fits ``needs`` (every chunk
    streamed through the fewest buffers; homes and gradients on NVMe when ``budgets.nvme``
    holds them all, the host staging one of each at a time, else on the host), checked by
    deciding again; None when that does not fit either."""
    if not needs:
        return None
    device = streamed_reserve(needs, max(min_buffers, 1), chunk_size)
    homes = sum(n.home_bytes for n in needs)
    # gradients wait on NVMe beside the homes (grad_home "nvme") unless they stream
    stored = homes + sum(n.grad_bytes for n in needs if not grads_stream or n.sliced(chunk_size))
    if stored <= budgets.nvme:
        # one trainable home staged at a time (NOTE [ Default placement rule ] rule 3), with one chunk's
        # stored gradients, or the two streamed ones passing through; two slices of a sliced one (rule 6)
        passing = gradients_at_once(grads_stream, "nvme", 1, grads_via_host)
        host = nvme_grad_bytes(needs, passing, chunk_size) + staging_bytes(needs, chunk_size, staged=1)
        least = Budgets(device=device, host=host, nvme=stored)
    else:
        least = Budgets(device=device, host=sum(n.home_bytes + n.grad_bytes for n in needs), nvme=0)
    try:
        decide(
            needs,
            chunk_size=chunk_size,
            min_buffers=min_buffers,
            budgets=least,
            request=PlanRequest(),
            grads_stream=grads_stream,
            grads_via_host=grads_via_host,
        )
    except (StatesMemoryError, PlanError):
        return None
    return least
