"""The chunk-size chooser (NOTE [ Chunk layout rules ] rule 5) that ``rt.manage`` and
first-step planning pack with: pure, so it is checked here on made-up layouts."""

from __future__ import annotations

import pytest

from tiermem.errors import PlanError, StatesMemoryError
from tiermem.layout.choose import choose_layout, chunk_sizes
from tiermem.layout.chunks import ParamInfo, pack, size_candidates, waste
from tiermem.layout.placement import Budgets, ChunkNeeds, PlanRequest

ROOMY = Budgets(device=1 << 40, host=1 << 40, nvme=1 << 40)


def _choose(sizes, lost, budgets=ROOMY, request=None):
    """Layouts are the sizes themselves; ``lost[size]`` is each one's waste."""
    return choose_layout(
        sizes,
        lambda size: size,
        lambda size: ([ChunkNeeds(size, True, 2)] * 4, 1),
        lambda layouts, size: lost[size],
        budgets=budgets,
        request=request or PlanRequest(),
    )


def test_the_least_waste_wins_and_the_larger_size_on_a_tie():
    layouts, plan = _choose([4096, 8192, 12288], {4096: 10, 8192: 3, 12288: 7})
    assert layouts == 8192 and plan.chunk_size == 8192
    layouts, plan = _choose([4096, 8192, 12288], {4096: 3, 8192: 3, 12288: 7})
    assert layouts == 8192 and plan.chunk_size == 8192


def test_sizes_whose_plan_does_not_fit_are_skipped_and_the_first_error_raised_when_none_fits():
    # 4 chunks, each 4 * size on the device when persistent; a device of 80 KiB, no host:
    # only sizes whose whole model fits on the device can be planned.
    small = Budgets(device=80 << 10, host=0, nvme=0)
    layouts, _ = _choose([2048, 4096, 8192], {2048: 0, 4096: 5, 8192: 0}, budgets=small)
    assert layouts == 2048  # 8192 wasted nothing too, but does not fit
    with pytest.raises(StatesMemoryError, match="do not fit"):
        _choose([8192, 16384], {8192: 0, 16384: 0}, budgets=small)
    with pytest.raises(PlanError, match="persistent_chunks=9"):
        _choose([4096], {4096: 0}, request=PlanRequest(persistent_chunks=9))


def test_chunk_sizes_take_the_request_rounded_up_or_the_candidates():
    params = [ParamInfo(5000, (1250,), None, True), ParamInfo(300, (75,), None, True)]  # type: ignore[arg-type]
    assert chunk_sizes(PlanRequest(), 5000, lambda: size_candidates(params)) == size_candidates(params)
    assert chunk_sizes(PlanRequest(chunk_size=10000), 5000, lambda: [1]) == [12288]
    with pytest.raises(PlanError, match="below the largest parameter"):
        chunk_sizes(PlanRequest(chunk_size=4096), 5000, lambda: [1])


def test_on_real_packings_the_chooser_agrees_with_the_rule():
    """Against a brute force over the same candidates: least waste, larger on ties."""
    params = [ParamInfo(n, (n // 4,), None, True) for n in (40000, 12000, 12000, 700, 65536, 3000)]  # type: ignore[arg-type]
    order = list(range(len(params)))
    sizes = size_candidates(params)
    layouts, plan = choose_layout(
        sizes,
        lambda size: pack(params, order, size),
        lambda layouts: ([ChunkNeeds(c.nbytes, c.trainable, 2) for c in layouts], 1),
        waste,
        budgets=ROOMY,
        request=PlanRequest(),
    )
    want = min(sizes, key=lambda size: (waste(pack(params, order, size), size), -size))
    assert plan.chunk_size == want and layouts == pack(params, order, want)


def test_streamed_gradients_take_host_room_only_where_they_pass_through_it():
    """NOTE [ Default placement rule ] rule 3: a loop whose gradients stream budgets two NVMe
    chunks' gradients on the host where they pass through it on their way to the step (a CUDA
    device), and none on the CPU device, where each step reads them in the chunk's device
    gradient buffer (``grads_via_host=False``): a host with room for the two staged homes alone
    takes the plan there, and refuses it, naming those gradients, where they pass through; the
    default rule's least capacities follow the same budget."""
    from tiermem.layout.choose import smallest_budgets
    from tiermem.layout.placement import decide

    mib = 1 << 20
    needs = [ChunkNeeds(8 * mib, True, 2) for _ in range(6)]
    staging = 2 * needs[0].home_bytes
    budgets = Budgets(device=64 * mib, host=staging, nvme=1 << 30)
    request = PlanRequest(persistent_chunks=0, state_home="nvme", staged_homes=2)
    common = {"chunk_size": 8 * mib, "min_buffers": 1, "budgets": budgets, "request": request, "grads_stream": True}
    plan = decide(needs, **common, grads_via_host=False)
    assert plan.staged_homes == 2 and set(plan.state_home) == {"nvme"} and plan.grad_home == "host"
    with pytest.raises(StatesMemoryError, match="two NVMe chunks' gradients passing through"):
        decide(needs, **common, grads_via_host=True)
    on_cpu = smallest_budgets(needs, 8 * mib, 1, budgets, True, grads_via_host=False)
    through = smallest_budgets(needs, 8 * mib, 1, budgets, True, grads_via_host=True)
    assert on_cpu is not None and through is not None
    assert through.host - on_cpu.host == 2 * needs[0].grad_bytes
