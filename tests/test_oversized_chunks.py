"""A very large parameter gets a chunk of its own (issue 20 item 5, second case; NOTE [ Chunk
layout rules ] rule 4): a vocabulary's embedding, more than twice every other parameter, no
longer sets every chunk's size. The packing, the candidates, the device reserve and the waste
count each chunk's own bytes; the CPU device's buffer pool keeps spares per size (NOTE [ Spare
chunk storage ]); the planner's pool and gradients in flight are the largest streamed chunks'.
A GPT whose embedding is >2x every other parameter (the 8 x 512, vocabulary 8192 GPT of the
issue, scaled down) at a device that the embedding's chunk size left with no plan now plans,
and trains bitwise plain PyTorch, planned or under the default placement; so does a Hugging
Face GPT-2 with a large vocabulary."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tiermem
from tests.test_planner import MiB, bits, synthetic
from tiermem.app.models.data import MarkovChainData
from tiermem.app.models.gpt import GPT, GPTConfig
from tiermem.errors import PlanError, StatesMemoryError
from tiermem.layout.choose import choose_layout, chunk_sizes
from tiermem.layout.chunks import (
    ParamInfo,
    outlier_candidates,
    pack,
    packing_floor,
    size_candidates,
    waste,
)
from tiermem.layout.placement import Budgets, ChunkNeeds, PlanRequest, decide, reserve_bytes
from tiermem.planner.candidates import packings
from tiermem.planner.costmodel import StatesChoice, states_cost
from tiermem.planner.profile import ParamStats

KiB = 1 << 10


def infos(*sizes: int) -> list[ParamInfo]:
    return [ParamInfo(n, (n // 4,), torch.float32, True) for n in sizes]


# -- the packing rule (pure) ---------------------------------------------------------------------


def test_outliers_are_the_few_largest_parameters_more_than_twice_the_rest():
    assert packing_floor(infos(16 * MiB, MiB, MiB, 4 * KiB)) == MiB  # a tied embedding
    assert packing_floor(infos(16 * MiB, 16 * MiB, MiB, MiB)) == MiB  # untied embedding and head
    assert packing_floor(infos(16 * MiB, 8 * MiB, 4 * MiB)) == 16 * MiB  # a scale, no outlier
    assert packing_floor(infos(*[16 * MiB] * 5, MiB)) == 16 * MiB  # five are not outliers: blocks
    assert packing_floor(infos(2 * MiB, MiB)) == 2 * MiB  # exactly twice is not more than twice
    assert outlier_candidates(infos(16 * MiB, 8 * MiB, 4 * MiB)) == []
    below = outlier_candidates(infos(16 * MiB, MiB, MiB))
    assert below[0] == MiB and all(MiB <= size < 16 * MiB for size in below)
    assert min(size_candidates(infos(16 * MiB, MiB, MiB))) == 16 * MiB  # the ordinary ones unchanged


def test_pack_gives_an_outlier_a_chunk_of_its_own_sized_to_it():
    params = infos(100_000, 40_000, 5_000_000, 40_000, 40_000, 30_000)
    with pytest.raises(ValueError, match="below the largest parameter"):
        pack(params, range(6), 128 * KiB)
    layouts = pack(params, range(6), 128 * KiB, oversized=True)
    assert [[s.index for s in layout.slots] for layout in layouts] == [[0], [1], [2], [3, 4, 5]]
    # parameter 1 did not fit beside 0; the outlier closed that open chunk and sits alone at offset 0
    own = layouts[2]
    assert own.slots[0].offset == 0 and own.used == 5_000_000 and own.nbytes == 5_001_216  # 4096-rounded
    assert all(layout.nbytes <= 128 * KiB for layout in layouts if layout is not own)
    # every chunk takes at least a slot of the size; the outlier's its own bytes
    assert waste(layouts, 128 * KiB) == 3 * 128 * KiB + own.nbytes - sum(n.nbytes for n in params)
    # at or above the largest parameter, oversized packs as before
    assert pack(params, range(6), 5_001_216, oversized=True) == pack(params, range(6), 5_001_216)


def test_the_device_reserve_counts_the_largest_streamed_chunks_own_bytes():
    assert reserve_bytes(3, MiB) == 6 * MiB
    assert reserve_bytes(3, MiB, [16 * MiB]) == 2 * (16 + 1 + 1) * MiB
    assert reserve_bytes(2, MiB, [4 * MiB, 16 * MiB, 8 * MiB]) == 2 * (16 + 8) * MiB
    needs = [ChunkNeeds(16 * MiB, True, 2)] + [ChunkNeeds(MiB, True, 2)] * 8
    roomy = Budgets(device=1 << 40, host=1 << 40, nvme=1 << 40)
    plan = decide(needs, chunk_size=MiB, min_buffers=2, budgets=roomy, request=PlanRequest(persistent_chunks=0))
    assert plan.buffers == 3
    tight = Budgets(device=2 * (16 + 2) * MiB - 1, host=1 << 40, nvme=1 << 40)
    with pytest.raises(StatesMemoryError, match=r"3 streaming buffers of 1MiB \(1 of them sized to a parameter"):
        decide(needs, chunk_size=MiB, min_buffers=2, budgets=tight, request=PlanRequest(persistent_chunks=0, buffers=3))


def test_a_requested_chunk_size_may_leave_outliers_alone_but_not_other_parameters():
    assert chunk_sizes(PlanRequest(chunk_size=MiB), 16 * MiB, lambda: [], MiB) == [MiB]
    with pytest.raises(PlanError, match=r"below the largest parameter that is no outlier \(1048576 bytes"):
        chunk_sizes(PlanRequest(chunk_size=512 * KiB), 16 * MiB, lambda: [], MiB)


def test_a_hand_chunk_size_below_the_largest_parameter_is_refused_naming_it_and_the_fix(tmp_path):
    """README "Errors": ``plan=`` a chunk_size below the largest parameter is a PlanError that names
    chunk_size, the parameter (its bytes and name) and what to give instead; with an embedding
    that is an outlier (rule 4), the largest parameter that is no outlier."""

    def refusal(*modules: torch.nn.Module, chunk_size: str) -> str:
        with tiermem.Runtime(settings(tmp_path, 64 * MiB, 64 * MiB)) as rt, pytest.raises(PlanError) as info:
            rt.manage(torch.nn.Sequential(*modules), torch.optim.AdamW, lr=1e-3, plan={"chunk_size": chunk_size})
        return str(info.value)

    linears = [torch.nn.Linear(256, 256) for _ in range(5)]  # five: none is an outlier
    message = refusal(*linears, chunk_size="1KiB")
    assert message.startswith("tiermem plan: chunk_size=1024 is below the largest parameter (262144 bytes: '0.weight')")
    assert "give chunk_size >= 262144" in message and 'leave it out (or "auto")' in message
    message = refusal(torch.nn.Embedding(2048, 256), *linears, chunk_size="128KiB")
    assert "below the largest parameter that is no outlier (262144 bytes: '1.weight'; " in message
    assert "the largest 2097152 bytes" in message and "give chunk_size >= 262144" in message
    assert list(tmp_path.iterdir()) == []


def test_the_default_rule_leaves_outliers_alone_only_when_no_ordinary_size_fits():
    params = infos(4 * MiB, *[256 * KiB] * 16)
    order = list(range(len(params)))

    def choose(device: int):
        return choose_layout(
            size_candidates(params),
            lambda size: pack(params, order, size, oversized=True),
            lambda layouts: ([ChunkNeeds(c.nbytes, c.trainable, 2) for c in layouts], 2),
            waste,
            budgets=Budgets(device=device, host=1 << 40, nvme=1 << 40),
            request=PlanRequest(),
            fallback=outlier_candidates(params),
        )

    layouts, plan = choose(64 * MiB)  # every chunk at least the embedding fits: as before
    assert plan.chunk_size >= 4 * MiB
    # two buffers of the embedding's size do not fit 12 MiB; its own chunk beside small ones does
    layouts, plan = choose(12 * MiB)
    assert plan.chunk_size < 4 * MiB and layouts[0].nbytes == 4 * MiB and len(layouts[0].slots) == 1
    with pytest.raises(StatesMemoryError, match="smallest capacities"):
        choose(4 * MiB)


def test_the_planners_pool_and_gradients_in_flight_are_the_largest_streamed_chunks():
    base = synthetic(8, saved=MiB)
    profile = dataclasses.replace(base, params=(ParamStats(16 * MiB), *base.params[1:]), shared=(0,))
    ordinary = min(size for size in (p.chunk_size for p in packings(profile)) if size >= 16 * MiB)
    assert any(p.chunk_size < 16 * MiB for p in packings(profile))  # outlier sizes are searched
    (packing,) = packings(profile, [2 * MiB])
    assert packing.needs[0].nbytes == 16 * MiB and packing.oversized == ((0, 16 * MiB),)
    n = packing.chunks
    streamed = states_cost(profile, StatesChoice(packing, 0, 3, n))
    regular = packing.needs[1].nbytes
    assert streamed.device_parts["buffers"] == 16 * MiB + 2 * regular
    assert streamed.grad_in_flight == regular  # the one filled
    assert streamed.grad_total == 16 * MiB  # the tied chunk's, from its stage on (NOTE [ Cost model ] rule 1)
    assert streamed.reserve_device_bytes == 2 * (16 * MiB + 2 * 2 * MiB)
    persistent = states_cost(profile, StatesChoice(packing, 1, 3, n))  # the outlier stays on the device
    assert persistent.device_parts["buffers"] == 3 * regular and persistent.grad_in_flight == regular
    (big,) = packings(profile, [ordinary])  # no outlier: every slot the largest chunk's, as before
    assert big.oversized == () and big.needs[0].nbytes == ordinary
    assert states_cost(profile, StatesChoice(big, 0, 2, big.chunks)).device_parts["buffers"] == 2 * ordinary


# -- training ---------------------------------------------------------------------------------------

#: the issue's 8 x 512 GPT with vocabulary 8192 scaled down: the tied embedding (1 MiB) is four
#: times a block's largest weight and about 3.5% of the state bytes, as there
CONFIG = GPTConfig(n_layer=8, d_model=128, n_head=2, vocab_size=2048, seq_len=32)
FRACTION = 0.12


def steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = MarkovChainData(CONFIG.vocab_size, CONFIG.seq_len, seed=0)
    return [data.batch(2, torch.device("cpu")) for _ in range(3)]


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches) -> list[torch.Tensor]:
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def plain() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = gpt()
    losses = run(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps())
    return losses, [p.detach().clone() for p in model.parameters()]


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def settings(tmp_path, device: int, state: int) -> dict:
    return {
        "device": {"device": "cpu", "capacity": device},
        "host": {"capacity": state},
        "nvme": {"paths": [str(tmp_path)], "capacity": 4 * state},
        "activations": {"min_bytes": "16KiB"},
    }


@pytest.fixture
def one_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def the_case() -> tuple[int, int, int]:
    """The state bytes, the device and the embedding's bytes, with the device below what the
    ordinary rule needs at the least: two buffers (a parameter and a gradient each) of a chunk
    holding the embedding."""
    model = gpt()
    state = 16 * model.num_parameters()
    embedding = model.wte.weight.nbytes
    device = int(state * FRACTION)
    assert embedding > 2 * max(p.nbytes for p in model.parameters() if p is not model.wte.weight)
    assert 2 * 2 * embedding > device
    return state, device, embedding


@pytest.mark.parametrize("sample", [True, False], ids=["planned", "default placement"])
def test_a_gpt_whose_embedding_set_every_chunk_size_now_fits_a_tight_device(tmp_path, one_thread, sample):
    want_losses, want_params = plain()
    state, device, embedding = the_case()
    batches = steps()
    with tiermem.Runtime(settings(tmp_path, device, state)) as rt:
        extra = {"sample": batches[0]} if sample else {}
        model, optimizer = rt.manage(gpt(), torch.optim.AdamW, lr=1e-3, **extra)
        plan, tier = rt.plan, rt.tiers["device"]
        chunks = rt._model_states[-1].chunks
        assert plan.chunk_size < embedding and plan.persistent_chunks == 0
        (own,) = [c for c in chunks if c.nbytes > plan.chunk_size]
        assert own.nbytes == embedding and [s.index for s in own.layout.slots] == [0]  # wte alone
        tier.reset_peak()
        losses = run(model, optimizer, batches)
        peak = tier.statistics().peak_bytes
    assert peak <= device
    if sample:
        assert plan.predicted.step_s is not None
        # The prediction counts the streamed gradient being filled (NOTE [ Cost model ] rule
        # 1): a fresh gradient buffer waits for the earlier write-backs, also on a loaded machine
        predicted = plan.predicted.peak_bytes["device"] * (1 + plan.predicted.fragmentation_margin)
        assert peak <= predicted
    assert bitwise(losses, want_losses) and bitwise(list(model.parameters()), want_params)
    assert list(tmp_path.glob("tiermem-*")) == []


def test_the_pool_keeps_spares_per_size_within_the_reserve(tmp_path, one_thread):
    """NOTE [ Spare chunk storage ]: the embedding's chunk holds its own bytes and every other
    streamed chunk the largest other's; spares are kept per size, accounted, never more than
    the buffers, and the pool never holds more than the plan reserves for it."""
    want_losses, want_params = plain()
    state, _, embedding = the_case()
    plan = {"chunk_size": "320KiB", "persistent_chunks": 0, "buffers": 3, "state_home": "host"}
    batches = steps()
    with tiermem.Runtime(settings(tmp_path, state, 2 * state)) as rt:
        model, optimizer = rt.manage(gpt(), torch.optim.AdamW, lr=1e-3, plan=plan)
        states = rt._model_states[-1]
        losses = run(model, optimizer, batches[:2])  # the first step re-packs in execution order
        pool, device = states.pool, rt.registry.tiers["device"]
        streamed = [c for c in states.chunks if not c.persistent]
        sizes = {pool.slot_of(c) for c in streamed}
        assert sizes == {pool.slot_bytes, embedding} and pool.slot_bytes <= 320 * KiB
        spares = [s.tensor.untyped_storage().nbytes() for s in pool._spares]
        assert 0 < len(spares) <= pool.buffers and set(spares) <= sizes
        held = sum(c.dev.obj.home.reserved for c in states.chunks if c.dev is not None)
        assert device.statistics().current_bytes == held + sum(spares)
        slots = sorted((pool.slot_of(c) for c in streamed), reverse=True)
        assert held + sum(spares) <= sum(slots[: pool.buffers])  # reserve_bytes' parameter half
        losses += run(model, optimizer, batches[2:])
        assert all(c.data.untyped_storage().nbytes() in (0, pool.slot_of(c)) for c in streamed)
    assert bitwise(losses, want_losses) and bitwise(list(model.parameters()), want_params)


def test_hf_gpt2_with_a_large_vocabulary_fits_a_device_its_embedding_filled(tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=8, n_embd=64, n_head=2, vocab_size=4096, n_positions=32, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 4096, (2, 16), generator=generator) for _ in range(3)]

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for batch in ids:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses

    reference = gpt2()
    want_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))
    model = gpt2()
    state = 16 * sum(p.numel() for p in model.parameters())
    embedding = model.transformer.wte.weight.nbytes
    device = state // 4
    assert 2 * 2 * embedding > device  # two buffers of the embedding's chunk: refused before
    with tiermem.Runtime(settings(tmp_path, device, state)) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3)
        assert rt.plan.chunk_size < embedding
        losses = train(model, optimizer)
        assert rt.tiers["device"].statistics().peak_bytes <= device
    assert bitwise(losses, want_losses)
    assert bitwise(list(model.parameters()), [p.detach() for p in reference.parameters()])
    assert list(tmp_path.glob("tiermem-*")) == []
