"""NOTE [ Profiling step ] rule 15: the streamed profiling pass's backward stops at the cut, before
the blocks whose twins it measures, and estimates their backward from those twins."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import OPTIMIZERS, assert_bitwise, batch, config, make_model, param_groups, state_bytes, train
from tiermem.planner import profiler
from tiermem.planner.streaming import Streaming, streaming

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def _trainable_model(layers: int = 4) -> nn.Module:
    """The tests' GPT with every block trainable: its blocks are twins of one another
    (``make_model`` freezes a norm of block 0, which makes that block a class of its own)."""
    model = make_model(layers=layers)
    model.blocks[0].ln1.weight.requires_grad_(True)
    return model


class _Around(nn.Module):
    """The tests' GPT with its blocks run by ``run(blocks, x)`` rather than one after another."""

    def __init__(self, inner: nn.Module, run: Callable[[nn.ModuleList, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner = inner
        self.blocks = inner.blocks
        self.run = run

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        x = inner.wte(tokens) + inner.wpe(torch.arange(tokens.shape[1]))
        return inner.head(inner.ln(self.run(self.blocks, x)))


def _in_place(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
        x.mul_(0.5)  # a block's output scaled in place
    return x


def _reversed(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in reversed(blocks):
        x = block(x)
    return x


def _leaving_out_block_2(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for index, block in enumerate(blocks):
        if index != 2:
            x = block(x)
    return x


def _reached(model: nn.Module) -> set[int]:
    """The blocks whose parameters backward reaches, filled in as it does."""
    reached: set[int] = set()
    for index, block in enumerate(model.blocks):
        for p in block.parameters():
            p.register_hook(lambda grad, i=index: reached.add(i) or grad)
    return reached


def _measure(model: nn.Module, *, streamed: bool) -> tuple[Any, ...]:
    tokens, _ = batch(0)

    def run() -> tuple[Any, ...]:
        return profiler.measure(model, (tokens,), sections=lambda _i: 2, min_bytes=1024, device=torch.device("cpu"))

    if not streamed:
        return run()
    with streaming(Streaming(stalled=lambda: 0.0)):
        return run()


def assert_measured_as_plain(model: nn.Module, got: tuple[Any, ...], plain: tuple[Any, ...]) -> None:
    """A streamed pass's bytes per block and outside them, its parameters, order, modules, shared
    parameters and first blocks are the plain pass's; it leaves no gradient behind."""
    for mine, want in zip((*got[0], got[1]), (*plain[0], plain[1]), strict=True):
        assert (mine.saved_bytes, mine.small_bytes, mine.input_bytes, mine.saved_count) == (
            want.saved_bytes,
            want.small_bytes,
            want.input_bytes,
            want.saved_count,
        )
    assert tuple(got[2:]) == tuple(plain[2:])
    assert [p.grad for p in model.parameters()] == [None] * len(list(model.parameters()))


def test_the_cut_measures_the_last_twins_of_each_class():
    a, b, other = (lambda: nn.Linear(4, 4)), (lambda: nn.Linear(4, 8)), (lambda: nn.Linear(8, 4))
    blocks = [a() for _ in range(6)]
    assert profiler.backward_cut(blocks) == (4, {i: [4, 5] for i in range(4)})
    alternating = [f() for _ in range(3) for f in (a, b)]  # a b a b a b
    assert profiler.backward_cut(alternating) == (2, {0: [2, 4], 1: [3, 5]})
    # a class of one block is measured where it is: the cut comes before it at the latest
    assert profiler.backward_cut([a(), b(), other(), a(), a()]) == (1, {0: [3, 4]})
    assert profiler.backward_cut([b(), a(), a(), a()]) == (0, {})
    frozen = a()
    frozen.bias.requires_grad_(False)  # a block that trains less is not the others' twin
    assert profiler.backward_cut([frozen, a(), a(), a()])[0] == 0
    same = a()
    assert profiler.backward_cut([same, same, same]) == (0, {})  # one module called as three blocks


def test_streamed_backward_stops_at_the_cut_and_estimates_the_blocks_before_it():
    torch.manual_seed(0)
    model = _trainable_model(layers=4)
    plain = _measure(model, streamed=False)
    reached = _reached(model)
    blocks, outside, *rest = _measure(model, streamed=True)
    assert reached == {2, 3}  # blocks 0 and 1 neither backward nor recomputed
    measured = blocks[2:]
    ratio = sum(b.backward_s for b in measured) / sum(b.forward_s for b in measured)
    for block in blocks[:2]:
        assert block.forward_s > 0
        assert block.backward_s == pytest.approx(block.forward_s * ratio)
        assert block.transient_bytes >= min(b.transient_bytes for b in measured)
    assert_measured_as_plain(model, (blocks, outside, *rest), plain)


def test_streamed_forward_skips_the_blocks_before_the_cut_whose_first_twin_ran():
    """Rule 16: of six twin blocks (cut at 4), the streamed pass runs block 0 (the first of its
    class) and the measured blocks 4 and 5; blocks 1-3 pass their input through without
    computing or reading a parameter. Their bytes, the execution order and the blocks each
    parameter is first used in are the plain pass's; their forward times are the measured
    twins' mean."""
    torch.manual_seed(0)
    model = _trainable_model(layers=6)
    plain = _measure(model, streamed=False)
    ran: set[int] = set()  # blocks any of whose layers computed
    for index, block in enumerate(model.blocks):
        for module in block.children():
            module.register_forward_pre_hook(lambda *_, i=index: ran.add(i))
    blocks, outside, *rest = _measure(model, streamed=True)
    assert ran == {0, 4, 5}  # blocks 1-3 computed nothing and read no parameter
    twin_forward = (blocks[4].forward_s + blocks[5].forward_s) / 2
    for block in blocks[1:4]:
        assert block.forward_s == pytest.approx(twin_forward)
        assert block.transient_bytes >= min(b.transient_bytes for b in blocks[4:])
    assert outside.forward_s > 0  # the pass's forward counts the skipped blocks' stand-in seconds
    assert_measured_as_plain(model, (blocks, outside, *rest), plain)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_model_writing_block_outputs_in_place_profiles_through_the_cut(streamed):
    """Rule 15: the output backward stops at is a copy of the detached output, as a block's
    output is no leaf, so a model that scales each block's output in place profiles as it
    trains (autograd refuses an in-place write into a leaf that needs grad)."""
    torch.manual_seed(0)
    model = _Around(_trainable_model(layers=6), _in_place)
    reached = _reached(model)
    blocks, *_ = _measure(model, streamed=streamed)
    # streamed, backward stopped at the cut; on plain parameters the bytes pass runs it whole
    assert reached == ({4, 5} if streamed else set(range(6)))
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in blocks)


def test_the_timing_passes_on_plain_parameters_stop_at_the_cut_and_the_bytes_pass_does_not():
    torch.manual_seed(0)
    model = _trainable_model(layers=4)
    backwards: Counter[int] = Counter()  # per block, the passes whose backward reached it
    forwards: Counter[int] = Counter()  # per block, the passes that computed its forward
    for index, block in enumerate(model.blocks):
        block.qkv.weight.register_hook(lambda grad, i=index: backwards.update([i]) or grad)
        block.qkv.register_forward_pre_hook(lambda *_, i=index: forwards.update([i]))
    blocks, *_ = _measure(model, streamed=False)
    passes = backwards[3]
    assert passes >= 1 + profiler.MIN_TIMING_PASSES  # the bytes pass and the timing passes
    assert backwards == {0: 1, 1: 1, 2: passes, 3: passes}  # blocks 0 and 1: the bytes pass only
    # rule 16: block 1, a twin of block 0 before the cut, computes its forward in the bytes pass only
    assert forwards == {0: passes, 1: 1, 2: passes, 3: passes}
    measured = blocks[2:]
    ratio = sum(b.backward_s for b in measured) / sum(b.forward_s for b in measured)
    assert blocks[1].forward_s == pytest.approx(sum(b.forward_s for b in measured) / 2)
    for block in blocks[:2]:
        assert block.backward_s == pytest.approx(block.forward_s * ratio)


@pytest.mark.parametrize("streamed", [True, False])
def test_without_the_cut_no_forward_is_skipped(streamed):
    """Rule 16 stands in only for blocks the cut leaves out: where a block before the cut is not
    called (here block 2 of six twins), no cut is made, and the pass is measured again with
    every called block run, forward and backward."""
    torch.manual_seed(0)
    model = _Around(_trainable_model(layers=6), _leaving_out_block_2)
    reached = _reached(model)
    computed: set[int] = set()
    for index, block in enumerate(model.blocks):
        block.qkv.register_forward_pre_hook(lambda *_, i=index: computed.add(i))
    blocks, *_ = _measure(model, streamed=streamed)
    assert reached == computed == {0, 1, 3, 4, 5}
    assert all(b.forward_s > 0 and b.backward_s > 0 for i, b in enumerate(blocks) if i != 2)


def test_blocks_run_out_of_their_order_are_not_cut():
    """The cut is made only where it splits the blocks in execution order."""
    torch.manual_seed(0)
    model = _Around(_trainable_model(layers=4), _reversed)
    reached = _reached(model)
    blocks, *_ = _measure(model, streamed=True)
    assert reached == {0, 1, 2, 3}
    assert all(b.backward_s > 0 for b in blocks)


def test_a_first_step_planned_through_the_cut_trains_bitwise_within_capacities(tmp_path, monkeypatch):
    cuts = []
    real_cut = profiler.backward_cut
    monkeypatch.setattr(profiler, "backward_cut", lambda blocks: cuts.append(real_cut(blocks)) or cuts[-1])
    reference = _trainable_model(layers=8)
    want = train(reference, OPTIMIZERS["adamw"](param_groups(reference)), range(3))
    model = _trainable_model(layers=8)
    state = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, state // 4, state // 4)) as rt:
        _, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        got = train(model, optimizer, range(3))
        assert rt.plan.predicted.step_s is not None  # planned at the first step, streamed
        stats = rt.stats().as_dict()["tiers"]
    assert [cut for cut, _ in cuts] == [6]
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()])
    for tier in ("device", "host", "nvme"):
        assert stats[tier]["peak_bytes"] <= stats[tier]["capacity"]
    assert list(tmp_path.iterdir()) == []


class _ScratchBlock(nn.Module):
    """A block whose forward peak is a large scratch tensor it frees before returning: no
    gradient flows through it, so its backward peaks far lower than its forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scratch = x.detach().repeat(1, 1, 256)  # 256x the block's input, gone when forward returns
            zero = scratch.amax() * 0
        return self.lin(x) + zero


class _ScratchStack(nn.Module):
    def __init__(self, layers: int = 6, width: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(_ScratchBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_skipped_twin_takes_its_measured_twins_forward_peak():
    """Rule 16: a skipped block's transient bytes are its first measured twin's, its forward peak
    included. Here the forward peak (a scratch tensor) is the block's largest; the streamed pass's
    backward peak of a measured block comes within its saved bytes of it, so a skipped block that
    kept only that backward peak would differ from its twin by exactly those bytes."""
    torch.manual_seed(0)
    model = _ScratchStack()
    plain_blocks = _measure(model, streamed=False)[0]
    blocks = _measure(model, streamed=True)[0]
    scratch = 256 * blocks[0].input_bytes
    for i in (1, 2, 3):  # skipped: blocks 0, 4 and 5 ran (cut at 4)
        assert blocks[i].transient_bytes == blocks[4].transient_bytes, i
    for i, block in enumerate(blocks):
        assert block.transient_bytes >= scratch, (i, block.transient_bytes, scratch)
        assert block.transient_bytes == pytest.approx(plain_blocks[i].transient_bytes, rel=0.25), i


def test_a_profiling_clock_read_on_another_thread_leaves_out_the_fetch_waits():
    """The clock takes the streamed profiling in force where it is made: on CUDA backward's marks
    are read on autograd's device threads, which do not see the context variable, and their
    fetch waits would count as compute."""
    import threading

    from tiermem.planner.streaming import profiling_clock

    stalled = [0.0]
    with streaming(Streaming(stalled=lambda: stalled[0])):
        clock = profiling_clock()
    readings: list[float] = []

    def read() -> None:
        readings.append(clock())
        stalled[0] = 100.0  # a fetch wait of 100 s between the two readings
        readings.append(clock())

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert readings[1] - readings[0] < -99  # the wait taken out, though read outside the context
