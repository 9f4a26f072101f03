"""Declared loops (NOTE [ Declared steps ]): with ``grad_accumulation_steps=`` / ``clip_grad_norm=``
given to ``rt.manage``, the runtime clips and steps offloaded chunks during the last backward of
each window, and training stays bitwise plain PyTorch on the CPU."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable
from typing import Any

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
    state_bytes,
    train_autocast,
)
from tiermem.registry import ObjectState
from tiermem.states import StatesUsageError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def plain_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    micro_batches: int,
    clip: float | None,
    *,
    edit_grads_at: int | None = None,
) -> list[torch.Tensor]:
    """The loop users write; ``clip`` is applied by hand (plain) or declared (managed: None here)."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    out = []
    for step in range(steps):
        for micro in range(micro_batches):
            tokens, targets = batch(step, micro)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) / micro_batches
            loss.backward()
            out.append(loss.detach())
        if clip is not None:
            out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        if edit_grads_at is not None and step >= edit_grads_at:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return out


def step_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, before: Callable[[int], object]
) -> list[torch.Tensor]:
    """A step a batch, no scheduler; ``before(step)`` runs before each step's forward."""
    out = []
    for step in range(steps):
        before(step)
        tokens, targets = batch(step, 0)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.detach())
    return out


def manage_streaming(rt: tiermem.Runtime, model: nn.Module, **kwargs: Any) -> tuple[nn.Module, Any]:
    """AdamW with param groups, a step every backward, gradients freed as chunks step."""
    return rt.manage(
        model, OPTIMIZERS["adamw"](param_groups(model)), grad_accumulation_steps=1, keep_gradients=False, **kwargs
    )


def managed(rt: tiermem.Runtime) -> Any:
    return rt._model_states[-1]


@pytest.mark.parametrize("home", ["host", "nvme"])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_overlapped_step_is_bitwise(tmp_path, home, micro_batches):
    """Offloaded chunks step during the window's last backward, and the result is PyTorch's."""
    steps = 4
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, micro_batches, None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model,
            OPTIMIZERS["adamw"](param_groups(model)),
            plan={"state_home": home},
            grad_accumulation_steps=micro_batches,
        )
        got = plain_loop(model, optimizer, steps, micro_batches, None)
        assert any(c["home"] == home for c in managed(rt).describe()["chunks"])
        stats = rt.stats().as_dict()["model_states"]
        # The first window shows the gradients are left alone; every later one steps early.
        assert stats["early_chunk_steps"] > 0
        assert stats["early_chunk_steps"] + stats["chunk_steps"] > steps
        assert stats["models"] == 1 and stats["chunks"] > stats["persistent_chunks"]
        assert stats["peak_resident_bytes"]["device"] <= rt.stats().as_dict()["tiers"]["device"]["capacity"]
        assert stats["resident_bytes"][home] > 0
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_declared_clipping_is_pytorchs_norm(tmp_path, micro_batches):
    clip = 0.5
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["sgd"](param_groups(plain)), 3, micro_batches, clip)
    norms = want[micro_batches :: micro_batches + 1]
    want_losses = [t for i, t in enumerate(want) if i % (micro_batches + 1) != micro_batches]
    model = make_model()
    got_norms = []
    with tiermem.Runtime(config(tmp_path, int(state_bytes("sgd", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["sgd"](param_groups(model)), grad_accumulation_steps=micro_batches, clip_grad_norm=clip
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        got_losses = []
        for step in range(3):
            for micro in range(micro_batches):
                tokens, targets = batch(step, micro)
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) / micro_batches
                loss.backward()
                got_losses.append(loss.detach())
            optimizer.step()
            got_norms.append(optimizer.grad_norm)
            optimizer.zero_grad()
            scheduler.step()
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] == 0  # the norm needs every gradient
    assert_bitwise(got_losses, want_losses)
    assert_bitwise(got_norms, norms)
    assert max(float(n) for n in norms) > clip  # the test clips for real
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_gradients_edited_after_early_steps_is_an_error(tmp_path):
    """GradScaler.unscale_ or hand edits after the runtime stepped with the gradients: a clear
    error, never a silently different step."""
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adam"](param_groups(model)), grad_accumulation_steps=1)
        with pytest.raises(StatesUsageError, match=r"gradients changed between backward and optimizer\.step"):
            plain_loop(model, optimizer, 3, 1, None, edit_grads_at=1)


@pytest.mark.parametrize("edit", ["data", "foreach_clip"])
def test_unseen_edits_of_stored_gradients_after_early_steps_are_an_error(tmp_path, edit):
    """Edits of gradients stored on NVMe that move no version counter of ``p.grad`` (a write
    through ``.data``; torch's foreach clip, whose scaling the stash defers): counted by
    ``GradientWrites``, so the guard still raises rather than keep a step made without them."""

    def edit_grads(model: nn.Module) -> None:
        if edit == "data":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.mul_(0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type=3.0, foreach=True)

    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model,
            OPTIMIZERS["adam"](param_groups(model)),
            plan={"state_home": "nvme", "grad_home": "nvme"},
            grad_accumulation_steps=1,
        )
        with pytest.raises(StatesUsageError, match=r"gradients changed between backward and optimizer\.step"):
            for step in range(3):
                tokens, targets = batch(step, 0)
                nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
                if step >= 1:
                    edit_grads(model)
                optimizer.step()
                optimizer.zero_grad()
        assert managed(rt).early_chunk_steps > 0


@pytest.mark.parametrize("keep_gradients", [True, False])
def test_a_state_load_between_steps_is_what_the_next_step_starts_from(tmp_path, keep_gradients):
    """``load_state_dict`` between steps leaves the loaded chunks' device copies newer than their
    homes until released: those chunks step at optimizer.step(), not early from the old home
    (which trained on silently wrong values before); bitwise plain PyTorch."""
    other = make_model(seed=7).state_dict()

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return step_loop(model, optimizer, 5, lambda step: model.load_state_dict(other) if step == 2 else None)

    plain = make_model()
    want = run(plain, OPTIMIZERS["adamw"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model,
            OPTIMIZERS["adamw"](param_groups(model)),
            plan={"state_home": "nvme"},
            grad_accumulation_steps=1,
            keep_gradients=keep_gradients,
        )
        got = run(model, optimizer)
        assert managed(rt).early_chunk_steps > 0
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_gradients_edited_from_the_start_turn_early_steps_off(tmp_path):
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adam"](param_groups(plain)), 3, 2, None, edit_grads_at=0)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adam"](param_groups(model)), grad_accumulation_steps=2)
        got = plain_loop(model, optimizer, 3, 2, None, edit_grads_at=0)
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] == 0
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"grad_accumulation_steps": 0}, ValueError),
        ({"grad_accumulation_steps": 1.5}, TypeError),
        ({"clip_grad_norm": -1.0}, ValueError),
        ({"clip_grad_norm": float("nan")}, ValueError),
        ({"clip_grad_norm": "1"}, TypeError),
    ],
)
def test_bad_declarations_are_refused(tmp_path, kwargs, error):
    model = make_model()
    rt = tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model))))
    with rt, pytest.raises(error, match="tiermem manage"):
        rt.manage(model, torch.optim.Adam, lr=1e-3, **kwargs)


def test_autocast_bf16_over_managed_parameters_is_bitwise(tmp_path):
    """Mixed precision the PyTorch way (fp32 parameters, bf16 compute under autocast) on managed
    states, declared loop included."""

    plain = make_model()
    want = train_autocast(plain, OPTIMIZERS["adamw"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"}, grad_accumulation_steps=1
        )
        got = train_autocast(model, optimizer)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_reentrant_checkpoint_ending_our_backward_early_never_steps_early(tmp_path):
    """Everything after the embeddings in one reentrant checkpoint: its nested backward runs
    our hooks first and ends before the embeddings get their gradients (NOTE [ Declared
    steps ] rule 2). Stepping a chunk then would miss gradients still to come."""
    from tests.test_states import GPT

    class Checkpointed(GPT):
        def rest(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
            return torch.utils.checkpoint.checkpoint(self.rest, x, use_reentrant=True)

    def build() -> GPT:
        torch.manual_seed(0)
        model = Checkpointed(head_first=True)  # untied head: the embeddings get gradients only outside
        return model

    plain = build()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), 4, 1, None)
    model = build()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "host"}, grad_accumulation_steps=1
        )
        got = plain_loop(model, optimizer, 4, 1, None)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_fp16_autocast_with_grad_scaler_is_bitwise(tmp_path):
    """fp16 compute with torch.amp.GradScaler over managed fp32 parameters (the loop undeclared:
    the scaler unscales .grad between backward and step), including skipped steps: the first
    scale (2**18) overflows fp16 gradients, the next steps run unscaled and clipped."""

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18)
        out = []
        for step in range(4):
            tokens, targets = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            out += [loss.detach(), torch.tensor(scaler.get_scale())]
        return out

    plain = make_model()
    want = run(plain, OPTIMIZERS["adam"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adam"](param_groups(model)), plan={"state_home": "nvme"})
        got = run(model, optimizer)
    norms = [float(n) for n in want[0::3]]
    assert not math.isfinite(norms[0]) and float(want[2]) < 2.0**18  # the scaler backed off: a step was skipped
    assert any(math.isfinite(n) and n > 1.0 for n in norms)  # and later steps ran, unscaled and clipped
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_gradients_freed_as_chunks_step_when_asked(tmp_path):
    """keep_gradients=False: the same training, and offloaded chunks that stepped during backward
    hold no gradient afterwards (rule 6)."""
    steps = 4
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"})
        got = plain_loop(model, optimizer, steps - 1, 1, None)
        tokens, targets = batch(steps - 1)  # the last step by hand (its LR already set by the loop's StepLR)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        got.append(loss.detach())
        freed = [p for p in model.parameters() if p.requires_grad and p.grad is None]
        assert freed  # offloaded chunks stepped and dropped their gradients
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] > 0
        optimizer.step()
        optimizer.zero_grad()
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    with tiermem.Runtime(config(tmp_path, 1 << 20)) as rt, pytest.raises(ValueError, match="keep_gradients"):
        rt.manage(make_model(), torch.optim.Adam, lr=1e-3, keep_gradients=False)


@pytest.mark.parametrize("host_fraction", [0.1, 0.2])
def test_streaming_gradients_fit_a_small_host(tmp_path, host_fraction):
    """keep_gradients=False with a step every backward: NVMe chunks' gradients only pass
    through the host (placement rule 3), so a host of a tenth of the state bytes suffices
    where keeping every gradient there until optimizer.step() does not (those wait on NVMe
    instead, grad_home "nvme"); training is exact."""
    steps = 3
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    model = make_model()
    total = state_bytes("adamw", model)
    cfg = config(tmp_path, int(total * 0.1), host=int(total * host_fraction))
    with tiermem.Runtime(cfg) as rt:
        other = make_model()
        rt.manage(other, OPTIMIZERS["adamw"](param_groups(other)), grad_accumulation_steps=1)
        assert rt.plan.grad_home == "nvme"
    with tiermem.Runtime(cfg) as rt:
        model, optimizer = manage_streaming(rt, model)
        assert rt.plan.grad_home == "host"
        assert any(c["home"] == "nvme" for c in managed(rt).describe()["chunks"])
        got = plain_loop(model, optimizer, steps, 1, None)
        stats = rt.stats().as_dict()
        assert stats["model_states"]["early_chunk_steps"] > 0
        assert stats["tiers"]["host"]["peak_bytes"] <= int(total * host_fraction)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_the_next_nvme_home_is_read_while_the_last_is_written_back(tmp_path, monkeypatch):
    """Early steps' home prefetch (NOTE [ Declared steps ] rule 3, placement rule 3): a home
    is prefetched when its chunk's backward begins even while the previous chunk's home is
    still being written back, but never while another home waits for its step, so the host
    never stages more than the plan's ``staged_homes`` (the planner's: three here, NOTE
    [ Early-step staging ]); training stays exact."""
    from tiermem.states.stepping import Stepper

    seen: list[tuple[int, int]] = []  # (homes waiting for their step, homes off NVMe) at each prefetch
    original = Stepper.backward_entered

    def recorded(self, chunk):
        before = chunk.home.state if chunk.home is not None else None
        original(self, chunk)
        if chunk.home is not None and chunk.home.state is not before:
            waiting, off = self._homes_off_nvme()
            seen.append((waiting, off))

    monkeypatch.setattr(Stepper, "backward_entered", recorded)
    _slow_nvme_writes(monkeypatch)
    steps = 3
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        model, optimizer = manage_streaming(rt, model)
        nvme_chunks = sum(c["home"] == "nvme" for c in managed(rt).describe()["chunks"])
        assert nvme_chunks >= 3
        got = plain_loop(model, optimizer, steps, 1, None)
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] > 0
        assert rt.stats().as_dict()["tiers"]["host"]["peak_bytes"] <= int(total * 0.2)
        depth = rt.plan.staged_homes
    assert seen, "no NVMe home was prefetched"
    assert all(waiting == 1 and off <= depth for waiting, off in seen)  # the one just prefetched
    # Some prefetch went out while another home was still off NVMe (being written back).
    assert any(off == 2 for _waiting, off in seen)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_a_chunks_home_read_queues_ahead_of_the_next_chunks_prefetch(tmp_path, monkeypatch):
    """NOTE [ Declared steps ] rule 3: as a chunk's backward begins, its NVMe home is read for its
    step before the next chunk's parameters are prefetched, so the read is not queued behind
    that fill (the step needs its home before the next chunk's backward needs its parameters);
    training stays exact."""
    from tiermem.registry import Priority
    from tiermem.states.pool import ChunkPool
    from tiermem.states.stepping import Stepper

    events: list[tuple[str, int, int]] = []  # (home read | parameter prefetch, chunk, step), in order
    step = [0]
    entered, fetch = Stepper.backward_entered, ChunkPool.fetch

    def staged(self, chunk):
        before = chunk.home.state if chunk.home is not None else None
        entered(self, chunk)
        if chunk.home is not None and before is not ObjectState.MOVING and chunk.home.state is ObjectState.MOVING:
            events.append(("home", chunk.index, step[0]))

    def fetched(self, chunk, priority, keep, direction=0):
        resident = chunk.resident
        result = fetch(self, chunk, priority, keep, direction)
        if priority == Priority.PREFETCH and direction < 0 and not resident and chunk.resident:
            events.append(("prefetch", chunk.index, step[0]))
        return result

    monkeypatch.setattr(Stepper, "backward_entered", staged)
    monkeypatch.setattr(ChunkPool, "fetch", fetched)
    plain = make_model()
    want = step_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), 3, lambda _step: None)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.3))) as rt:
        model, optimizer = manage_streaming(rt, model)
        got = step_loop(model, optimizer, 3, lambda i: step.__setitem__(0, i))
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] > 0
    # Steps after the first (which profiles and re-packs): each home read as its chunk's backward
    # began, against the prefetch of the chunk whose backward comes next.
    pairs = [
        (at, later)
        for at, (kind, chunk, when) in enumerate(events)
        if kind == "home" and when > 0
        for later, other in enumerate(events)
        if other == ("prefetch", chunk - 1, when)
    ]
    assert len(pairs) >= 3, f"too few homes read beside the next chunk's prefetch: {events}"
    assert all(home < prefetch for home, prefetch in pairs), str(events)
    assert_bitwise(got, want)


def _watch_host_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[tuple[int, bool]], Callable[[nn.Module, torch.optim.Optimizer], list[torch.Tensor]]]:
    """The host blocks asked for, as (bytes, whether a kept one served it), and a 3-step loop that
    counts them from its second step (the first profiles, plans and re-packs)."""
    from tiermem.tiers.memory import MemoryTier

    served: list[tuple[int, bool]] = []
    take = MemoryTier._take_spare

    def recorded(self, reserved):
        block = take(self, reserved)
        if self.name == "host":
            served.append((reserved, block is not None))
        return block

    monkeypatch.setattr(MemoryTier, "_take_spare", recorded)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return step_loop(model, optimizer, 3, lambda step: served.clear() if step == 1 else None)

    return served, train


def test_staged_homes_of_several_sizes_take_turns_in_kept_host_blocks(tmp_path, monkeypatch):
    """NOTE [ Spare tier blocks ] rule 6: every NVMe home staged whole on the host takes a block of
    the largest such home's bytes (the room the plan keeps per staged home), so a block one home
    leaves serves the next whatever its size: after the first step every home takes a block of
    that one size, most of them kept ones. Blocks of each home's own size were kept per size, and
    a host with room for one block beside the homes in flight then made each home's afresh."""
    served, train = _watch_host_blocks(monkeypatch)
    plain = make_model()
    want = train(plain, OPTIMIZERS["adamw"](param_groups(plain)))
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        # blocks split into chunks of 16, 8 and 4 KiB: NVMe homes of three sizes
        model, optimizer = manage_streaming(rt, model, plan={"chunk_size": 16 << 10, "state_home": "nvme"})
        got = train(model, optimizer)
        store = managed(rt).store
        staged = [c for c in store.chunks if c.home_tier == "nvme" and c.trainable and c.slice_span is None]
        sizes = {c.home_bytes for c in staged}
        room = rt.registry.reserved_size("host", max(sizes))
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] > 0
        assert rt.stats().as_dict()["tiers"]["host"]["peak_bytes"] <= int(total * 0.2)
    assert len(sizes) > 1, sizes  # homes of several sizes take turns
    assert store.staged_home_room == max(sizes)
    homes = [(n, kept) for n, kept in served if n >= min(sizes)]
    assert homes, served
    assert {n for n, _ in homes} == {room}, homes  # one size of block for every home
    assert sum(kept for _, kept in homes) > len(homes) / 2, homes  # mostly blocks kept (room allowing)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_a_home_written_back_before_its_step_finished_leaves_its_block_to_the_next(tmp_path, monkeypatch):
    """NOTE [ Step threads ] rule 7 with NOTE [ Spare tier blocks ] rule 3: a staged home's write-back
    starts as its step's compute ends and may land before the training thread finishes that step
    (here always: each finish waits for it first). The step's views into the home end with its
    compute, so the host keeps the home's block and the next home takes it; with the views held
    until the finish, every home's block was let go and made afresh (1.7-1.9 GiB of fresh pages a
    step against 0.44-0.50 on the 210M HF GPT-2 of bench/hf_states.py). Training stays bitwise."""
    from tiermem.states.stepping import Stepper

    finish = Stepper._finish_chunk_step

    def landed_first(self, chunk, job, staged, ok):
        if staged:
            chunk.home.wait()  # its write-back, handed to the scheduler with the step, landed
        finish(self, chunk, job, staged, ok)

    monkeypatch.setattr(Stepper, "_finish_chunk_step", landed_first)
    served, train = _watch_host_blocks(monkeypatch)
    plain = make_model()
    want = train(plain, OPTIMIZERS["adamw"](param_groups(plain)))
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"})
        got = train(model, optimizer)
        states = managed(rt)
        assert states.stepper.steps.threaded, "the steps computed inline: nothing to test"
        room = rt.registry.reserved_size("host", states.store.staged_home_room)
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] > 0
    homes = [kept for n, kept in served if n == room]
    assert len(homes) >= 4, served
    assert sum(homes) > len(homes) / 2, homes  # mostly kept blocks: each home leaves its block to the next
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def _slow_nvme_writes(monkeypatch: pytest.MonkeyPatch, delay: float = 0.02) -> None:
    """Every NVMe write lands ``delay`` late, so a home's write-back is still in flight when the
    next chunk's backward begins (on a fast disk it may land first: nothing to test)."""
    from tiermem.tiers.nvme import NvmeTier

    write = NvmeTier.write

    def slow_write(self, allocation, offset, src):
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def later() -> None:
            time.sleep(delay)
            inner = write(self, allocation, offset, src)
            inner.add_done_callback(
                lambda f: done.set_exception(f.exception()) if f.exception() else done.set_result(None)
            )

        threading.Thread(target=later, daemon=True).start()
        return done

    monkeypatch.setattr(NvmeTier, "write", slow_write)


def _watch_stagings(monkeypatch: pytest.MonkeyPatch) -> tuple[set[int], list[bool]]:
    """Chunks whose home a test saw read ahead (it adds them), and at each one's next staging by its
    step whether the home was off NVMe already (moving, or landed on the host)."""
    from tiermem.states.homes import Homes

    read: set[int] = set()
    found: list[bool] = []
    stage = Homes.stage

    def counted_stage(self, chunk, known=None):
        if chunk.index in read:
            read.discard(chunk.index)
            found.append(chunk.home.state is ObjectState.MOVING or chunk.home.tier != "nvme")
        stage(self, chunk, known)

    monkeypatch.setattr(Homes, "stage", counted_stage)
    return read, found


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes 50 ms: a chunk's backward outlasts a home's write-back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return grad


def test_a_home_refused_room_is_read_once_a_write_back_lands_before_its_step(tmp_path, monkeypatch):
    """NOTE [ Declared steps ] rule 3: a chunk whose backward begins while the room is taken by the
    last homes' write-backs (NVMe writes 20 ms late here) gets its home read by a later hook of the
    same backward, once one landed (each block's backward takes 50 ms between its MLP and its
    attention), not on demand by its step: every home read so was off NVMe when its step staged
    it, the room (STAGED_HOMES homes) is never exceeded, nor the host; training stays bitwise."""
    from tests import test_states
    from tiermem.layout.placement import STAGED_HOMES
    from tiermem.states.stepping import Stepper

    steps = 3
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)

    def slow_block(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).split(test_states.D, dim=-1)
        x = _SlowBackward.apply(x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))

    monkeypatch.setattr(test_states.Block, "forward", slow_block)
    _slow_nvme_writes(monkeypatch)
    room: list[int] = []  # homes off NVMe right after each read ahead of an early step
    read_late, found = _watch_stagings(monkeypatch)  # chunks whose home a later hook read
    prefetch, progress = Stepper._prefetch_home, Stepper.backward_progress

    def counted_prefetch(self, chunk, **kwargs):
        before = chunk.home.state, chunk.home.tier
        started = prefetch(self, chunk, **kwargs)
        if (chunk.home.state, chunk.home.tier) != before:
            room.append(self._homes_off_nvme()[1])
        return started

    def counted_progress(self):
        wanted, before = self._home_wanted, self.homes_read_when_room_freed
        progress(self)
        if self.homes_read_when_room_freed > before:
            read_late.add(wanted.index)

    monkeypatch.setattr(Stepper, "_prefetch_home", counted_prefetch)
    monkeypatch.setattr(Stepper, "backward_progress", counted_progress)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"})
        assert rt.plan.staged_homes == STAGED_HOMES
        got = plain_loop(model, optimizer, steps, 1, None)
        stepper = managed(rt).stepper
        assert rt.stats().as_dict()["tiers"]["host"]["peak_bytes"] <= int(total * 0.2)
    assert stepper.homes_read_when_room_freed > 0, "no home was read once the room freed"
    assert found and all(found), "a home read once the room freed was still on NVMe when its step staged it"
    assert room and max(room) <= STAGED_HOMES
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_a_plan_staging_three_homes_reads_the_third_while_two_write_backs_are_in_flight(tmp_path, monkeypatch):
    """NOTE [ Default placement rule ] rule 3: a plan may stage three homes (the planner's choice
    for a loop that steps in backward, NOTE [ Early-step staging ]); a declared loop on it reads a
    chunk's home as its backward begins while the two homes before it are still on their way back
    to NVMe (NVMe writes 20 ms late here), never holds more than three homes off NVMe nor more
    than the host's capacity, and trains bitwise as plain PyTorch does."""
    from tiermem.states.stepping import Stepper

    steps = 3
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    _slow_nvme_writes(monkeypatch)
    room: list[tuple[int, int]] = []  # (homes off NVMe, of them on their way back) after each read ahead
    prefetch = Stepper._prefetch_home

    def counted_prefetch(self, chunk, **kwargs):
        before = chunk.home.state, chunk.home.tier
        started = prefetch(self, chunk, **kwargs)
        if (chunk.home.state, chunk.home.tier) != before:
            writing = sum(c.home is not None and c.home.obj.target_tier == "nvme" for c in self.store.chunks)
            room.append((self._homes_off_nvme()[1], writing))
        return started

    monkeypatch.setattr(Stepper, "_prefetch_home", counted_prefetch)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme", "staged_homes": 3})
        assert rt.plan.staged_homes == 3
        got = plain_loop(model, optimizer, steps, 1, None)
        assert rt.stats().as_dict()["tiers"]["host"]["peak_bytes"] <= int(total * 0.2)
    assert room and max(off for off, _ in room) == 3  # the third slot held a home
    assert any(writing == 2 for _, writing in room), "no home was read beside two write-backs in flight"
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_a_tied_chunks_home_is_read_once_every_chunk_before_it_stepped(tmp_path, monkeypatch):
    """NOTE [ Tied homes read ahead ] rule 2: the chunk of the tied embedding steps after the whole
    backward. Once a window taught the order, its home is read as soon as every chunk that stepped
    before it has stepped, not first by its own step: each time it steps, its home is off NVMe
    already, and it was read after all the other chunks' steps. The room (STAGED_HOMES homes) and the
    host tier hold, and training stays bitwise. The embeddings' backward takes 50 ms here, so the
    last write-backs land before it ends whatever the machine's load (else the step may come first)."""
    from tests import test_states
    from tiermem.states.stepping import Stepper

    def slow_embeddings(self: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        x = _SlowBackward.apply(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    monkeypatch.setattr(test_states.GPT, "forward", slow_embeddings)

    # per tied read ahead: the chunks stepped then, homes waiting for their step and off NVMe
    reads: list[tuple[set[int], int, int]] = []
    read, found = _watch_stagings(monkeypatch)  # tied chunks read ahead
    prefetch = Stepper._prefetch_home

    def counted_prefetch(self, chunk, *, tied=False):
        before = chunk.home.state, chunk.home.tier  # a small read may land within the call
        started = prefetch(self, chunk, tied=tied)
        if tied and (chunk.home.state, chunk.home.tier) != before:
            assert self.facts.tied(chunk.layout)
            reads.append((set(self._stepped), *self._homes_off_nvme()))
            read.add(chunk.index)
        return started

    monkeypatch.setattr(Stepper, "_prefetch_home", counted_prefetch)
    steps = 5
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"})
        states = managed(rt)
        got = plain_loop(model, optimizer, steps, 1, None)
        others = {c.index for c in states.chunks if not states.facts.tied(c.layout) and c.trainable}
        staged_homes = states.store.staged_homes
        stats = rt.stats().as_dict()
        assert stats["tiers"]["host"]["peak_bytes"] <= int(total * 0.2)
    assert stats["model_states"]["tied_homes_read_ahead"] == len(reads) >= steps - 2  # each window once taught
    # after every other chunk's step, the one home waiting (rule 3), within the plan's room
    assert all(others <= stepped and waiting == 1 and off <= staged_homes for stepped, waiting, off in reads)
    assert found and all(found), "the tied chunk's step read its own home"
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_early_steps_read_only_optimizer_states_from_nvme(tmp_path):
    """NOTE [ Declared steps ] rule 7: an early step stages its NVMe home with the master copied
    from the chunk's device copy (its backward just used it), so per step NVMe gives the
    host the optimizer states alone (8 of Adam's 12 home bytes a parameter) and the device
    gives it the master; training stays bitwise plain PyTorch."""
    from tests.test_states_mixed import managed_loop as loop  # the same loop, with a hook after each step

    steps = 3
    plain = make_model()
    want = loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"})
        snapshots: list[tuple[dict[str, Any], int]] = []

        def snapshot(_step: int) -> None:
            snapshots.append((rt.stats().as_dict(), managed(rt).early_chunk_steps))

        got = loop(model, optimizer, steps, snapshot)
        states = managed(rt)
        (before, early_before), (after, early_after) = snapshots[0], snapshots[-1]
        early = [c for c in states.chunks if c.home_tier == "nvme" and c.trainable and not c.persistent]
        assert early and early_after - early_before == len(early) * (steps - 1)  # every such chunk, every step

        def moved(link: str) -> int:
            return after["links"].get(link, {}).get("bytes", 0) - before["links"].get(link, {}).get("bytes", 0)

        master = sum(c.nbytes for c in early) * (steps - 1)
        assert moved("nvme->host") == 2 * master  # exp_avg and exp_avg_sq; no master is read
        assert moved("device->host") >= master  # copied from the device copies instead
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_a_chunks_storage_is_emptied_only_after_a_staging_copy_from_it_ended():
    """Rule 7: a home being staged may be copying the chunk's device bytes; emptying the
    storage first would let that copy read freed memory."""
    from types import SimpleNamespace

    from tiermem.layout.chunks import ChunkLayout
    from tiermem.states.chunks import Chunk

    chunk = Chunk(ChunkLayout(0, True, (), 4096), persistent=False, home="nvme", sections=2, device=torch.device("cpu"))
    seen: list[int] = []

    def wait_known_copy() -> None:  # the copy of known bytes out of the chunk ends here
        seen.append(chunk.data.untyped_storage().nbytes())  # still there while the copy ends

    chunk.home = SimpleNamespace(wait_known_copy=wait_known_copy)  # type: ignore[assignment]
    chunk.empty_storage()
    assert seen == [4096] and chunk.data.untyped_storage().nbytes() == 0


def test_early_steps_read_gradients_in_place_on_the_cpu(tmp_path):
    """NOTE [ Declared steps ] rule 8: with keep_gradients=False on the CPU device an early
    step reads the chunk's device gradient buffer: no gradient byte crosses device->host (the
    only device->host bytes are the masters rule 7 copies into staged homes); training is exact."""
    steps = 3
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"})
        before = rt.stats().as_dict()
        got = plain_loop(model, optimizer, steps, 1, None)
        after = rt.stats().as_dict()
        stepped = after["model_states"]["early_chunk_steps"] - before["model_states"]["early_chunk_steps"]
        streamed = [c for c in managed(rt).chunks if c.offloaded and c.trainable]
    moved = after["links"]["device->host"]["bytes"] - before["links"].get("device->host", {}).get("bytes", 0)
    assert stepped == steps * len(streamed)  # every offloaded chunk stepped early
    assert 0 < moved <= steps * sum(c.nbytes for c in streamed)  # masters only: gradients would double it
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def watch_early_steps(monkeypatch: pytest.MonkeyPatch, slow_steps: int = 4) -> tuple[list[float], list[int]]:
    """NOTE [ Declared steps ] rule 9's CUDA tests (tests/test_cuda.py; the CPU test holds steps
    instead: :class:`HeldEarlySteps`): the step thread on and the first ``slow_steps`` chunk
    steps 0.2 s slow (a slow CPU optimizer: later chunks' gradients complete meanwhile). Returns
    the seconds each ``gradients_complete`` hook took and the queue's length after it."""
    from tiermem.states.chunk_step import ChunkStep
    from tiermem.states.stepping import Stepper

    monkeypatch.setenv("TIERMEM_MODEL_STATES_STEP_THREAD", "on")
    compute, complete = ChunkStep.compute, Stepper.gradients_complete
    slowed: list[int] = []
    hook_seconds: list[float] = []
    queued: list[int] = []

    def slow_compute(self: ChunkStep) -> None:
        if len(slowed) < slow_steps:
            slowed.append(1)
            time.sleep(0.2)
        compute(self)

    def timed(self: Stepper, chunk: Any) -> None:
        start = time.perf_counter()
        complete(self, chunk)
        hook_seconds.append(time.perf_counter() - start)
        queued.append(len(self._queued))

    monkeypatch.setattr(ChunkStep, "compute", slow_compute)
    monkeypatch.setattr(Stepper, "gradients_complete", timed)
    return hook_seconds, queued


class HeldEarlySteps:
    """NOTE [ Declared steps ] rule 9's never-waits test, without timing: every chunk step that
    computes during a backward stepping early is held on the step thread until ``RELEASE_AFTER``
    more of backward's hooks (``backward_entered``, ``gradients_complete``) have returned, or
    backward's final callback begins (it waits for steps, as rule 9 lets it). A hook that waits
    for a step in flight can then never return before that step is let go: it stays until the
    hold's time-out (``HOLD_S``), which only a wait reaches. Each hook records the held steps in
    flight when it began and which of them had been let go by its return."""

    RELEASE_AFTER = 2
    HOLD_S = 5.0

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tiermem.states.backward import BackwardTracker
        from tiermem.states.chunk_step import ChunkStep
        from tiermem.states.stepping import Stepper

        monkeypatch.setenv("TIERMEM_MODEL_STATES_STEP_THREAD", "on")
        self.lock = threading.Lock()
        self.early = False  # inside a backward that steps chunks early
        self.returned = 0  # hooks returned so far
        self.holds: list[dict[str, Any]] = []  # per held step: its event, when it began, let go, timed out
        #: per hook: its name, its seconds, the held steps in flight at its start, those let go by its return
        self.hooks: list[tuple[str, float, int, int]] = []
        self.queued: list[int] = []
        compute, arm, end = ChunkStep.compute, Stepper.arm_early_steps, BackwardTracker._end

        def held_compute(step: ChunkStep) -> None:
            hold = {"event": threading.Event(), "since": self.returned, "let_go": False, "timed_out": False}
            with self.lock:  # atomic with backward's end, which lets every hold go
                held = self.early and threading.current_thread() is not threading.main_thread()
                if held:
                    self.holds.append(hold)
            if held:
                timed_out = not hold["event"].wait(self.HOLD_S)
                with self.lock:
                    hold["let_go"], hold["timed_out"] = True, timed_out
            compute(step)

        def armed(stepper: Stepper) -> None:
            arm(stepper)
            with self.lock:
                self.early = stepper._early

        def backward_ends(tracker: BackwardTracker) -> None:  # autograd's final callback: may wait
            self._let_go(everything=True)
            end(tracker)

        monkeypatch.setattr(ChunkStep, "compute", held_compute)
        monkeypatch.setattr(Stepper, "arm_early_steps", armed)
        monkeypatch.setattr(BackwardTracker, "_end", backward_ends)
        for name in ("backward_entered", "gradients_complete"):
            monkeypatch.setattr(Stepper, name, self._timed(name, getattr(Stepper, name)))

    def _timed(self, name: str, hook: Any) -> Any:
        def timed(stepper: Any, chunk: Any) -> None:
            with self.lock:
                in_flight = [hold for hold in self.holds if not hold["let_go"]]
            start = time.perf_counter()
            hook(stepper, chunk)
            seconds = time.perf_counter() - start
            with self.lock:
                let_go = sum(hold["let_go"] for hold in in_flight)  # only by the time-out, while we ran
            self.hooks.append((name, seconds, len(in_flight), let_go))
            if name == "gradients_complete":
                self.queued.append(len(stepper._queued))
            self.returned += 1
            self._let_go()

        return timed

    def _let_go(self, everything: bool = False) -> None:
        with self.lock:
            if everything:  # backward ends: no step computing from now on is held
                self.early = False
            for hold in self.holds:
                if not hold["let_go"] and (everything or self.returned - hold["since"] >= self.RELEASE_AFTER):
                    hold["let_go"] = True
                    hold["event"].set()


@pytest.mark.parametrize("grad_home", ["host", "nvme"])
def test_backward_never_waits_for_an_early_step(tmp_path, monkeypatch, grad_home):
    """NOTE [ Declared steps ] rule 9: with kept gradients, a chunk whose gradients complete while
    another chunk's step computes is queued and started by a later hook, so no hook of backward
    waits for a step (on CUDA they run on autograd's device thread), also with gradients stored
    on NVMe (NOTE [ Stored gradients ]); training stays bitwise. The steps computing during
    backward are held until later hooks returned (:class:`HeldEarlySteps`): each hook that began
    while one was held returned while it still was, however loaded the machine."""
    held = HeldEarlySteps(monkeypatch)
    steps = 3
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    model = make_model()
    total = state_bytes("adamw", model)
    host = int(total * (0.6 if grad_home == "host" else 0.3))  # room for every gradient, or too little
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=host)) as rt:
        plan = {"state_home": "nvme", "grad_home": grad_home}
        model, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan=plan, grad_accumulation_steps=1
        )
        got = plain_loop(model, optimizer, steps, 1, None)
        assert rt.plan.grad_home == grad_home
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] >= 2
    assert held.holds, "no early step computed during a backward"
    overlapping = {
        name: [h for h in held.hooks if h[0] == name and h[2]] for name in ("backward_entered", "gradients_complete")
    }
    for name, hooks in overlapping.items():
        assert hooks, f"no {name} hook ran while an early step computed"
        waited = [seconds for _, seconds, _, let_go in hooks if let_go]
        assert not waited, f"{name} waited {max(waited):.2f}s for an early step computing when it began"
    assert not [hold for hold in held.holds if hold["timed_out"]], "a held step was let go by its time-out only"
    assert max(held.queued) >= 1, "no early step was ever queued behind one computing"
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_queued_steps_after_a_step_error_are_left_to_the_optimizer_step_once(tmp_path, monkeypatch):
    """NOTE [ Declared steps ] rule 9: a step's error ends backward with steps still queued; those
    chunks no longer count as stepped, no home stays staged, and no chunk steps twice in a window:
    the next one steps every chunk exactly once (stale queue entries once stepped them again)."""
    from tiermem.registry import ObjectState
    from tiermem.states import chunk_step
    from tiermem.states.stepping import Stepper

    monkeypatch.setenv("TIERMEM_MODEL_STATES_STEP_THREAD", "on")
    run_step = chunk_step.run_step
    calls: list[int] = []

    def slow_then_failing(*args):
        calls.append(1)
        time.sleep(0.3)  # the rest of backward ends meanwhile, every later chunk queued
        if len(calls) == 1:
            raise RuntimeError("boom in the step")
        return run_step(*args)

    # each chunk step handed over, and None when an optimizer.step() returned: windows between
    stepped: list[int | None] = []
    run_chunk_step, stepper_step = Stepper._run_chunk_step, Stepper.step
    queue_lengths: list[int] = []

    def recorded(self, chunk, *args, **kwargs):
        queue_lengths.append(len(self._queued))
        run_chunk_step(self, chunk, *args, **kwargs)
        stepped.append(chunk.index)

    def window_ended(self, optimizer):
        stepper_step(self, optimizer)
        stepped.append(None)

    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.3))) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"}, grad_accumulation_steps=1
        )
        plain_loop(model, optimizer, 1, 1, None)  # the first window: no early steps yet
        monkeypatch.setattr(chunk_step, "run_step", slow_then_failing)
        monkeypatch.setattr(Stepper, "_run_chunk_step", recorded)
        monkeypatch.setattr(Stepper, "step", window_ended)
        tokens, targets = batch(1, 0)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        with pytest.raises(RuntimeError, match="boom in the step"):
            loss.backward()
        states = managed(rt)
        states.backward.settle()
        assert not states.stepper._queued
        assert states.stepper._stepped <= set(stepped)  # the queued ones are not marked stepped
        for chunk in states.chunks:
            if chunk.home_tier == "nvme":
                chunk.home.wait()
                assert chunk.home.tier == "nvme" and chunk.home.state is ObjectState.RESIDENT
        monkeypatch.setattr(chunk_step, "run_step", run_step)
        optimizer.step()
        optimizer.zero_grad()
        trainable = {c.index for c in states.chunks if c.trainable}
        plain_loop(model, optimizer, 1, 1, None)  # trains on
    failed, after = stepped[: stepped.index(None)], stepped[stepped.index(None) + 1 : -1]
    assert len(failed) == len(set(failed)), "a chunk was stepped twice in the failed window"
    assert sorted(after) == sorted(trainable), "the next window did not step every chunk exactly once"
    assert max(queue_lengths) >= 1  # steps were queued when the error came
    assert list(tmp_path.iterdir()) == []


def test_declaring_later_re_plans_where_gradients_start_streaming(tmp_path):
    """NOTE [ Declared steps ] rule 10: ``rt.declare`` after ``rt.manage`` takes effect from
    then on; declaring a loop whose gradients stream re-packs under the placement for it (NVMe
    chunks' gradients pass through the host: grad_home "host") and training stays exact."""
    steps = 3
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, 1, None)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        assert rt.plan.grad_home == "nvme"  # undeclared: every gradient waits for the step
        loop = rt.declare(model, grad_accumulation_steps=1, keep_gradients=False)
        assert rt.plan.grad_home == "host" and (loop.grad_accumulation_steps, loop.clip_grad_norm) == (1, None)
        got = plain_loop(model, optimizer, steps, 1, None)
        stats = rt.stats().as_dict()
        assert stats["model_states"]["early_chunk_steps"] > 0
        assert stats["tiers"]["host"]["peak_bytes"] <= int(total * 0.1)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_a_redeclaration_that_re_packs_forgets_the_order_of_early_steps(tmp_path):
    """NOTE [ Tied homes read ahead ] rule 1: the order of early steps a backward taught holds only
    for the chunks it was learned on. A declaration that changes whether gradients stream re-packs
    the chunks (rule 10 of NOTE [ Declared steps ]), and the order is gone with them; a later
    window learns it again, and training stays exact."""
    steps = 6
    plain = make_model()
    want = step_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), steps, lambda step: None)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.2))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"})
        states = managed(rt)
        seen: list[tuple[int, ...]] = []

        def redeclare(step: int) -> None:
            if step == 3:
                learned, chunks = states.stepper.order.last, states.store.chunks
                assert learned, "no order learned: nothing to test"
                rt.declare(model, grad_accumulation_steps=1, keep_gradients=True)  # gradients stop streaming
                assert states.store.chunks is not chunks, "the declaration did not re-pack: nothing to test"
            seen.append(states.stepper.order.last)

        got = step_loop(model, optimizer, steps, redeclare)
    assert seen[3] == (), seen  # forgotten with the chunks it named
    assert seen[-1], seen  # learned again on the new chunks
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_declaring_after_early_steps_of_the_window_is_refused(tmp_path):
    """Rule 10: chunks stepped early under the declaration in force keep it until the step;
    a change of streaming waits for the gradients to be stepped and zeroed."""
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), grad_accumulation_steps=1)
        plain_loop(model, optimizer, 1, 1, None)  # the first window steps at optimizer.step()
        tokens, targets = batch(1)
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        assert rt.stats().model_states.early_chunk_steps > 0
        with pytest.raises(StatesUsageError, match=r"already stepped during this window's backward"):
            rt.declare(model, grad_accumulation_steps=1, clip_grad_norm=1.0)
        optimizer.step()  # under the declaration in force
        with pytest.raises(StatesUsageError, match=r"changes where gradients wait"):
            rt.declare(model, grad_accumulation_steps=1, keep_gradients=False)
        optimizer.zero_grad()
        assert rt.declare(model, grad_accumulation_steps=2).grad_accumulation_steps == 2
        with pytest.raises(StatesUsageError, match="not managed by this Runtime"):
            rt.declare(make_model(), grad_accumulation_steps=1)


def test_the_declared_clip_at_the_loops_call_is_the_steps_and_a_later_backward_is_refused(tmp_path):
    """Rule 10: ``DeclaredLoop.clip_grad_norm_()`` (what a trainer's clip call runs) clips once,
    bitwise ``clip_grad_norm_``, and ``optimizer.step()`` does not clip again; a backward between
    that call and the step (gradients the clip never saw) is refused at the step."""
    clip = 0.05
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), 2, 1, clip)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        loop = rt.declare(model, grad_accumulation_steps=1, clip_grad_norm=clip)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        got = []
        for step in range(2):
            tokens, targets = batch(step, 0)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            got += [loss.detach(), loop.clip_grad_norm_()]
            assert loop.clip_grad_norm_() is got[-1]  # once a window
            optimizer.step()
            assert optimizer.grad_norm is got[-1]
            optimizer.zero_grad()
            scheduler.step()
        assert_bitwise(got, want)
        assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
        tokens, targets = batch(2, 0)
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        loop.clip_grad_norm_()
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        with pytest.raises(StatesUsageError, match="a backward ran after the declared clip"):
            optimizer.step()


def test_more_backwards_than_declared_is_refused_once_chunks_stepped_early(tmp_path):
    """Rule 4: a loop that accumulates more backwards than it declared (an integration's
    declaration one step per backward, the loop accumulating by hand) never steps silently
    without the later gradients: early steps turn off where none ran, and the step raises
    where some did."""
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), grad_accumulation_steps=1)
        plain_loop(model, optimizer, 1, 1, None)  # the first window: no early steps yet
        for micro in range(2):
            tokens, targets = batch(1, micro)
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        assert rt.stats().model_states.early_chunk_steps > 0  # in the first backward of the window
        with pytest.raises(StatesUsageError, match=r"2 backwards before optimizer.step.*stepped early in backward 1"):
            optimizer.step()
    plain = make_model()
    want = plain_loop(plain, OPTIMIZERS["adamw"](param_groups(plain)), 3, 2, None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), grad_accumulation_steps=1)
        got = plain_loop(model, optimizer, 3, 2, None)  # the first window shows it: early steps never run
        assert rt.stats().model_states.early_chunk_steps == 0
    assert_bitwise(got, want)
