"""The plain loop overlaps (issue 33 item 1): an undeclared loop stages the first NVMe homes of
the step while backward runs (NOTE [ Declared steps ] rule 11) and reads each stored gradient once
per step even when the user clips first (NOTE [ Stored gradients ] rule 6), bitwise like plain
PyTorch and within the host's capacity."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import (
    OPTIMIZERS,
    assert_bitwise,
    batch,
    config,
    make_model,
    param_groups,
    reference,
    state_bytes,
    train,
)
from tests.test_states_declared import plain_loop
from tests.test_states_stored_grads import _states, _within_capacities
from tiermem.registry import ObjectState
from tiermem.states import chunk_step
from tiermem.states.chunk_step import ChunkStep
from tiermem.states.stored_grads import StoredGradient

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

NVME_HOMES = {"state_home": "nvme"}
STORED = {"state_home": "nvme", "grad_home": "nvme"}


def _stepped_at_step(settings: dict) -> dict:
    """``settings`` where every chunk steps at ``optimizer.step()``: rules 10 and 12 are about the
    step phase, which an undeclared loop's backward would otherwise run ahead (NOTE [ Speculative
    steps ]; tests/test_states_speculative.py)."""
    return {**settings, "model_states": {"speculative_steps": "off"}}


def _off_nvme(home) -> bool:
    """A home staged on the host, or on its way there."""
    return home.state is ObjectState.MOVING or home.tier != "nvme"


def test_backward_stages_the_first_homes_of_the_step(tmp_path):
    """Rule 10: after the first step (which re-packs) every backward of a plain loop stages the
    first ``staged_homes`` NVMe homes of the step; once backward ended they are on the host (or
    on their way) and no other NVMe home is, and training stays bitwise."""
    want = reference("adamw", steps=4)
    model = make_model()
    with tiermem.Runtime(_stepped_at_step(config(tmp_path, int(state_bytes("adamw", model) * 0.1)))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=NVME_HOMES)
        stepper = _states(rt).stepper
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        got, off_nvme = [], []
        for step in range(4):
            tokens, targets = batch(step, 0)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            got.append(loss.detach())
            chunks = _states(rt).store.chunks
            off_nvme.append([c.index for c in chunks if c.home_tier == "nvme" and _off_nvme(c.home)])
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        first = stepper._first_to_step()
        assert len(first) == rt.plan.staged_homes == 2
        assert off_nvme[0] == []  # the first step re-packs: nothing staged before it
        # a home is staged when the host has room beside what the re-pack left there: every one later
        assert all(set(seen) <= set(first) for seen in off_nvme[1:])
        assert off_nvme[2:] == [first] * 2
        assert stepper.homes_staged_in_backward == sum(map(len, off_nvme))
        _within_capacities(rt)
    assert_bitwise(got, want[0][: len(got)])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])


def _clipped_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, norm_type: float, foreach: bool | None, on_step=None
) -> list[torch.Tensor]:
    """A plain loop that clips by hand: losses and the norms ``clip_grad_norm_`` returned."""
    seen = []
    for step in range(steps):
        tokens, targets = batch(step, 0)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        seen.append(loss.detach())
        seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type, foreach=foreach))
        optimizer.step()
        if on_step is not None:
            on_step()
        optimizer.zero_grad()
    return seen


@pytest.mark.parametrize(
    ("norm_type", "foreach"), [(2.0, None), (1.0, None), (float("inf"), None), (2.0, False), (3.0, True)]
)
def test_clipping_by_hand_reads_each_stored_gradient_once_per_step(tmp_path, norm_type, foreach):
    """NOTE [ Stored gradients ] rule 6: from the second step on, ``clip_grad_norm_`` over
    gradients stored on NVMe stages nothing (its per-gradient norms were kept as the gradients
    landed, its scaling is deferred) and writes nothing back; the step stages each chunk's
    gradients once. Norms and training are bitwise plain PyTorch's, for torch's foreach and
    per-tensor paths and several norm types."""
    plain = make_model()
    want = _clipped_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), 4, norm_type, foreach)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        assert rt.plan.grad_home == "nvme"
        stash = _states(rt).gradients.stash
        counts = []

        def count() -> None:
            chunks = _states(rt).store.chunks
            stored = [c for c in chunks if stash.stored(c)]
            grads = sum(1 for c in stored for s in c.layout.slots if _states(rt).store.has_grad[s.index])
            counts.append((stash.stagings, stash.write_backs, stash.norms_kept, len(stored), grads))

        got = _clipped_loop(model, optimizer, 4, norm_type, foreach, on_step=count)
        _within_capacities(rt)
    for (stagings, write_backs, kept, _, _), (after, written, kept_after, stored, grads) in itertools.pairwise(counts):
        assert stored > 0
        assert after - stagings == stored  # the step's read, and nothing else
        assert written == write_backs  # scaling wrote nothing back
        assert kept_after - kept == grads  # every norm answered from the kept ones
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_deferred_scaling_is_what_every_later_reader_sees(tmp_path):
    """Rule 6b: gradients scaled by clipping read back scaled (by hand, after the step), stay
    scaled when the next backward accumulates into them, and a second clipping sees the scaled
    norms; all bitwise plain PyTorch."""

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        seen = []
        for step in range(3):
            for micro in range(2):
                tokens, targets = batch(step, micro)
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                loss.backward()
                seen.append(loss.detach())
                seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
            weight = model.blocks[1].fc.weight
            seen.append(weight.grad.detach().clone())
            optimizer.step()
            seen.append(weight.grad.clone())
            optimizer.zero_grad(set_to_none=step % 2 == 0)
        return seen

    plain = make_model()
    want = run(plain, OPTIMIZERS["adamw"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        got = run(model, optimizer)
        stash = _states(rt).gradients.stash
        assert stash.scales_deferred > 0 and stash.norms_kept > 0
        _within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


@pytest.mark.parametrize(("dtype", "norm_type"), [(torch.bfloat16, 2.0), (torch.float16, float("inf"))])
def test_clipping_half_precision_stored_gradients_is_bitwise(tmp_path, dtype, norm_type):
    """Rule 6 on bf16/fp16 working gradients (``param_dtype=``): the kept norms and the deferred
    scaling give plain PyTorch's master-weights loop that clips its working gradients, bitwise."""

    def loop(model: nn.Module, step_fn) -> list[torch.Tensor]:
        seen = []
        for step in range(3):
            tokens, targets = batch(step)
            loss = nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
            loss.backward()
            seen.append(loss.detach())
            seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type))
            step_fn()
        return seen

    plain = make_model()
    masters = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in plain.parameters()]
    by_id = {id(p): m for p, m in zip(plain.parameters(), masters, strict=True)}
    plain_opt = OPTIMIZERS["adamw"]([{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in param_groups(plain)])
    plain.to(dtype)

    def master_step() -> None:
        for p, m in zip(plain.parameters(), masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        plain_opt.step()
        with torch.no_grad():
            for p, m in zip(plain.parameters(), masters, strict=True):
                p.copy_(m)
        plain.zero_grad()

    want = loop(plain, master_step)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED, param_dtype=dtype)
        assert rt.plan.grad_home == "nvme"

        def managed_step() -> None:
            optimizer.step()
            optimizer.zero_grad()

        got = loop(model, managed_step)
        stash = _states(rt).gradients.stash
        assert stash.norms_kept > 0 and stash.scales_deferred > 0 and stash.write_backs == 0
        _within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [m.detach() for m in masters])


def test_kept_norms_are_torchs_own_arithmetic_on_large_gradients(tmp_path):
    """Rule 6a, where the arithmetic shows: gradients of half a million elements, whose fp32
    2-norm torch accumulates in its own order (a norm computed another way, here in float64 and
    rounded, differs in the last bit for some of them). From the second step on every per-gradient
    norm is answered from the kept norms, and each is plain PyTorch's, bitwise."""

    def make() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Linear(2048, 256))

    other_bits = []

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        seen = []
        for step in range(3):
            x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            grads = [p.grad for p in model.parameters()]
            norms = torch._foreach_norm(grads, 2.0)  # what clip_grad_norm_ computes first
            seen.extend(norms)
            if step and not isinstance(grads[0], StoredGradient):
                other_bits.extend(
                    not torch.equal(n, torch.linalg.vector_norm(g.double()).float())
                    for n, g in zip(norms, grads, strict=True)
                )
            seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
            optimizer.step()
            optimizer.zero_grad()
        return seen

    plain = make()
    want = run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    assert any(other_bits)  # the test discriminates: another arithmetic gives other bits
    model = make()
    nbytes = 16 * sum(p.numel() for p in model.parameters())
    with tiermem.Runtime(config(tmp_path, nbytes * 3 // 4, host=nbytes // 2)) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan=STORED)
        got = run(model, optimizer)
        stash = _states(rt).gradients.stash
        assert stash.norms_kept >= 2 * 2 * 2  # two norms of the two weights in each later step, at least
        _within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_declared_clipping_stages_homes_in_the_windows_last_backward(tmp_path):
    """Rule 10 in a declared loop that clips (no early steps): the first backward of a window of
    two stages nothing (the step is a backward away), the last stages the step's first homes;
    training is bitwise the plain loop that clips by hand."""
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["sgd"](param_groups(plain)), 3, 2, 0.5)
    want_losses = [t for i, t in enumerate(want) if i % 3 != 2]
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("sgd", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model,
            OPTIMIZERS["sgd"](param_groups(model)),
            plan=NVME_HOMES,
            grad_accumulation_steps=2,
            clip_grad_norm=0.5,
        )
        stepper = _states(rt).stepper
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        got, staged = [], []
        for step in range(3):
            for micro in range(2):
                tokens, targets = batch(step, micro)
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) / 2
                loss.backward()
                got.append(loss.detach())
                chunks = _states(rt).store.chunks
                staged.append(sum(1 for c in chunks if c.home_tier == "nvme" and _off_nvme(c.home)))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        assert staged[0::2] == [0, 0, 0]  # a backward away from the step
        assert staged[1] == 0 and staged[3] > 0 and staged[5] > 0  # after the re-pack: the last backward
        assert stepper.homes_staged_in_backward == staged[3] + staged[5]
    assert_bitwise(got, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


@pytest.mark.parametrize(("grad_home", "host"), [("host", "64MiB"), ("host", "700KiB"), ("nvme", "64MiB")])
def test_the_step_reads_homes_ahead_as_deep_as_the_host_holds(tmp_path, grad_home, host):
    """Rule 12: with every NVMe chunk's gradients on the host, ``optimizer.step()`` reads each home
    it did not find staged ahead of its chunk's step, as many at once as the host tier takes:
    where the host holds them all (64 MiB) its peak holds every gradient and every home at once;
    where it holds a few (700 KiB) the reads wait for write-backs and the peak stays within the
    capacity. Gradients stored on NVMe need the host's room to be staged: none is read ahead then.
    Training is bitwise plain PyTorch's either way."""
    want = reference("adamw", steps=3)
    model = make_model()
    with tiermem.Runtime(_stepped_at_step(config(tmp_path, int(state_bytes("adamw", model) * 0.1), host))) as rt:
        plan = {"state_home": "nvme", "grad_home": grad_home}
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=plan)
        assert rt.plan.grad_home == grad_home and rt.plan.staged_homes == 2
        stepper = _states(rt).stepper
        stepping = [c for c in _states(rt).store.chunks if c.home_tier == "nvme" and c.trainable]
        got = train(model, optimizer, range(3))
        peak = rt.stats().as_dict()["tiers"]["host"]["peak_bytes"]
        everything = sum(c.nbytes + c.home_bytes for c in stepping)
        if grad_home == "nvme":
            assert stepper.homes_read_ahead == 0
        else:  # every home but those staged in backward is read ahead (the first step stages none)
            assert stepper.homes_read_ahead == 3 * len(stepping) - stepper.homes_staged_in_backward
            if host == "64MiB":
                assert peak >= everything  # one step read one home ahead before: three at most
            else:
                assert peak < everything
        _within_capacities(rt)
    assert_bitwise(got, want[0])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])


@pytest.mark.parametrize("where", ["prepare", "compute"])
def test_homes_read_ahead_go_back_when_a_step_fails(tmp_path, monkeypatch, where):
    """Rule 12: a chunk step that fails, before it computes (its preparation, on this thread) or
    in its compute (on the step thread, raised when the step finishes), ends ``optimizer.step()``
    with its error, and every home read ahead for the steps that will not run goes back to NVMe as
    it was, none left holding host room."""
    model = make_model()
    with tiermem.Runtime(_stepped_at_step(config(tmp_path, int(state_bytes("adamw", model) * 0.1)))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=NVME_HOMES)
        train(model, optimizer, range(1))  # the first step re-packs
        calls = []
        if where == "prepare":
            prepare = ChunkStep.prepare.__func__

            def failing_prepare(cls, *args):
                calls.append(None)
                if len(calls) == 3:
                    raise RuntimeError("boom in the step")
                return prepare(cls, *args)

            monkeypatch.setattr(ChunkStep, "prepare", classmethod(failing_prepare))
        else:
            run_step = chunk_step.run_step

            def failing_compute(*args):
                calls.append(None)
                if len(calls) == 3:
                    raise RuntimeError("boom in the step")
                return run_step(*args)

            monkeypatch.setattr(chunk_step, "run_step", failing_compute)
        stepper = _states(rt).stepper
        with pytest.raises(RuntimeError, match="boom in the step"):
            train(model, optimizer, range(1, 2))
        assert stepper.homes_read_ahead > 3  # homes beyond the failing chunk's were read ahead
        for chunk in _states(rt).store.chunks:
            if chunk.home_tier == "nvme":
                chunk.home.wait()
                assert chunk.home.tier == "nvme" and chunk.home.state is ObjectState.RESIDENT
        assert rt.stats().as_dict()["tiers"]["host"]["current_bytes"] <= sum(
            c.nbytes for c in _states(rt).store.chunks
        )  # the gradients, which wait for a step that failed, and no home
