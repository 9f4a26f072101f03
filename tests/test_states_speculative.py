"""Speculative steps (NOTE [ Speculative steps ] in ``tiermem.states.speculation``): an undeclared
loop's backward steps NVMe chunks into copies of their homes, and ``optimizer.step()`` keeps them
only when the loop did nothing between backward and the step that would change it; either way
training is bitwise plain PyTorch's on the CPU."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import OPTIMIZERS, assert_bitwise, batch, config, make_model, param_groups, state_bytes
from tests.test_states_declared import step_loop
from tiermem.states import stored_grads
from tiermem.states.errors import StatesMemoryError
from tiermem.states.gradients import Gradients
from tiermem.states.hostgrad import HostGradient
from tiermem.states.speculation import Shadows
from tiermem.states.stepping import Stepper

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

#: what a loop does between backward and optimizer.step() at a given step (model, optimizer, step)
Between = Callable[[nn.Module, torch.optim.Optimizer, int], Any]


def loop(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, between: Between | None) -> list[Any]:
    """An undeclared loop, with ``between`` run after each backward; losses and what it returned."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    out: list[Any] = []
    for step in range(steps):
        tokens, targets = batch(step, 0)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        out.append(loss.detach())
        if between is not None:
            seen = between(model, optimizer, step)
            if isinstance(seen, list):
                out.extend(seen)
            elif seen is not None:
                out.append(seen)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return out


#: NVMe homes whose gradients wait on NVMe too: every write to them reaches the runtime
STORED = {"state_home": "nvme", "grad_home": "nvme"}
#: NVMe homes whose gradients wait on the host, as HostGradients on the CPU device too
#: (NOTE [ Host gradients ] rule 1): every write to them reaches the runtime as well
ON_HOST = {"state_home": "nvme", "grad_home": "host"}


def run_both(
    tmp_path, steps: int, between: Between | None, plan: dict[str, str] = STORED, nvme: int | None = None
) -> dict[str, Any]:
    """The loop under plain PyTorch and under tiermem (``plan``; an NVMe capacity of ``nvme``
    bytes where given), compared bitwise; tiermem's model-state statistics."""
    plain = make_model()
    plain_optimizer = OPTIMIZERS["adamw"](param_groups(plain))
    want = loop(plain, plain_optimizer, steps, between)
    model = make_model()
    settings = config(tmp_path, int(state_bytes("adamw", model) * 0.1))
    if nvme is not None:
        settings["nvme"]["capacity"] = nvme
    with tiermem.Runtime(settings) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=plan)
        got = loop(model, optimizer, steps, between)
        stats = rt.stats().as_dict()["model_states"]
        state = optimizer.state_dict()
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert_bitwise(optimizer_values(state), optimizer_values(plain_optimizer.state_dict()))
    assert list(tmp_path.iterdir()) == []
    return stats


def optimizer_values(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every value of an optimizer's state dict, by parameter index and state name."""
    per_param = state["state"]
    return [torch.as_tensor(per_param[i][name]) for i in sorted(per_param) for name in sorted(per_param[i])]


@pytest.mark.parametrize("plan", [STORED, ON_HOST], ids=["stored gradients", "host gradients"])
def test_a_plain_loop_steps_nvme_chunks_in_backward_bitwise(tmp_path, plan):
    """From the second window on, NVMe chunks step during backward and every one is kept, their
    gradients waiting on NVMe or on the host."""
    stats = run_both(tmp_path, 4, None, plan)
    assert stats["speculative_steps_kept"] > 0
    assert stats["speculative_steps_discarded"] == 0
    assert stats["early_chunk_steps"] == 0  # nothing stepped in place


def test_an_nvme_tier_short_of_room_for_every_copy_runs_the_last_chunks_ahead(tmp_path):
    """Rule 2: with room on NVMe for copies of about half the homes (beside the homes and the
    stored gradients), the chunks backward reaches first run ahead and the rest step at
    ``optimizer.step()``: fewer kept than with room for all, but some, and bitwise."""
    roomy = run_both(tmp_path, 4, None)
    # homes (12 of the 16 state bytes a parameter) and stored gradients (4), and copies of about half the homes
    short = run_both(tmp_path, 4, None, nvme=int(state_bytes("adamw", make_model()) * 1.4))
    assert 0 < short["speculative_steps_kept"] < roomy["speculative_steps_kept"]
    assert short["speculative_steps_discarded"] == 0


def test_a_stored_gradient_short_of_nvme_room_takes_the_copies_room_back(tmp_path, monkeypatch, caplog):
    """Rule 2: copies counted by free bytes can still leave no extent for a gradient (the tier's
    free bytes in pieces); copies made beyond the room here stand in for that. The gradient's
    write-back takes their room back (they are discarded, their chunks step at
    ``optimizer.step()``), where it raised StatesMemoryError; later windows run fewer chunks
    ahead until what runs ahead fits, and the loop stays bitwise."""
    counted = Shadows.fitting_on_nvme

    def beyond_the_room(self: Shadows, chunks: list[Any], most: int | None = None) -> list[Any]:
        with monkeypatch.context() as inner:  # the room counted as unbounded; the cap still holds
            inner.setattr(type(self.store.registry), "free_bytes", lambda registry, tier: 1 << 60)
            return counted(self, chunks, most)

    monkeypatch.setattr(Shadows, "fitting_on_nvme", beyond_the_room)
    with caplog.at_level(logging.INFO, logger="tiermem.states"):
        stats = run_both(tmp_path, 6, None, nvme=int(state_bytes("adamw", make_model()) * 1.4))
    assert stats["speculative_steps_discarded"] > 0
    assert stats["early_chunk_steps"] == 0  # a chunk whose flush took the room back never steps in place
    assert "no room for a stored gradient beside the steps run ahead" in caplog.text
    # later backwards run fewer chunks ahead, so the room is not given back every window: the
    # last windows keep what ran ahead
    assert 0 < stats["speculative_nvme_reclaims"] < 4  # 4 of the 5 windows that run ahead, without that
    assert stats["speculative_steps_kept"] > stats["speculative_steps_discarded"]


def test_the_next_copy_of_a_home_is_read_while_a_step_ahead_computes(tmp_path, monkeypatch):
    """Rule 3: a shadow whose step computes on the step thread no longer waits for its step, so
    it leaves the room to the next chunk's shadow, read ahead as backward reaches that chunk (as
    a staged home whose step runs does in a declared loop). Counted as waiting until its step
    finished, about half were read only when their step asked for them (56-67 of 125 read
    ahead, idle or beside two busy cores); now 86-102."""
    monkeypatch.setenv("TIERMEM_MODEL_STATES_STEP_THREAD", "on")  # "auto" steps inline on one core
    stats = run_both(tmp_path, 6, None)
    ahead, on_demand = stats["speculative_homes_read_ahead"], stats["speculative_homes_read_on_demand"]
    assert ahead + on_demand == stats["speculative_steps_kept"]
    assert ahead > 1.5 * on_demand


def test_a_chunk_running_ahead_reads_its_gradients_from_a_copy_made_on_their_way_to_nvme(tmp_path, monkeypatch):
    """NOTE [ Stored gradients ] rule 7: a chunk that steps in the backward that stored its
    gradients reads them from a host copy staged as they went to NVMe, not back from NVMe; with
    the stash's two slots taken (a step still reading one, the next queued) the rest are read
    back as before (how many depends on how fast the steps run beside backward: unloaded, 20-22
    of the 25 chunks a window came from the copies, beside two busy loops 7-9). Every step ahead
    staged its gradients one way or the other (a copy the host needed back for another copy is
    read again from NVMe), and training is bitwise."""
    marks: list[tuple[int, int, int]] = []  # at each optimizer.step()'s start and end
    stepped = Stepper.step

    def counted(self: Stepper, optimizer: Any) -> None:
        stash = self.gradients.stash
        marks.append((stash.stagings, stash.staged_on_the_way, self.speculative_chunk_steps))
        stepped(self, optimizer)
        marks.append((stash.stagings, stash.staged_on_the_way, self.speculative_chunk_steps))

    monkeypatch.setattr(Stepper, "step", counted)
    stats = run_both(tmp_path, 4, None)
    ends, starts = marks[1::2], marks[2::2]
    windows = [tuple(b - a for a, b in zip(end, start, strict=True)) for end, start in zip(ends, starts, strict=False)]
    assert [ahead for _, _, ahead in windows] == [stats["speculative_steps_kept"] // 3] * 3 != [0] * 3
    for read_back, on_the_way, ahead in windows:  # each backward's steps ahead
        assert read_back + on_the_way >= ahead
        assert 1 <= on_the_way <= ahead
    assert stats["stored_gradients_staged_on_the_way"] == sum(w[1] for w in windows)


def test_a_gradient_whose_write_back_cannot_start_leaves_no_copy_of_it_staged(tmp_path, monkeypatch):
    """NOTE [ Stored gradients ] rule 7: where a gradient buffer's move to NVMe cannot start (no
    room, and nothing to give it back), its gradients stay on the device, where the next backward
    would add to them: the copy staged for its step is dropped with the error, so nothing can read
    it stale later. The error reaches the loop; the runtime still leaves no file behind."""
    model = make_model()
    failed: list[int] = []
    stash_of: list[Any] = []
    stored = Gradients._store_on_nvme

    def no_room_once_speculating(self: Gradients, chunk: Any, handle: Any, after: Any) -> None:
        stash_of[:] = [self.stash]
        if after is not None and not failed:  # a copy was staged on the way
            failed.append(chunk.index)
            raise StatesMemoryError("tiermem model states: no NVMe room for the gradients (test)")
        stored(self, chunk, handle, after)

    monkeypatch.setattr(Gradients, "_store_on_nvme", no_room_once_speculating)
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        with pytest.raises(StatesMemoryError, match="no NVMe room"):
            loop(model, optimizer, 3, None)
        assert len(failed) == 1
        stash = stash_of[0]
        assert not stash.staged(stash.store.chunks[failed[0]])
    assert list(tmp_path.iterdir()) == []


def test_a_failed_copy_on_the_way_is_read_back_from_nvme_instead(tmp_path, monkeypatch):
    """NOTE [ Stored gradients ] rule 7: a copy on the way that failed (an error of the copy, not
    of the gradients, which reach NVMe whole) is dropped and the step reads the gradients back
    from NVMe, as without the copy: training stays bitwise, and no error reaches the loop."""
    landed = stored_grads._Staged.landed
    stage = stored_grads.GradientStash._stage
    failed: list[int] = []
    read_back: list[int] = []  # chunks staged from NVMe right after their copy failed

    def fails_once(self: Any) -> None:
        if self.on_the_way and len(failed) < 3:
            failed.append(1)
            landed(self)
            raise OSError("tiermem test: the copy on the way failed")
        landed(self)

    def staged_from_nvme(self: Any, chunk: Any) -> Any:
        if len(read_back) < len(failed):
            read_back.append(chunk.index)
        return stage(self, chunk)

    monkeypatch.setattr(stored_grads._Staged, "landed", fails_once)
    monkeypatch.setattr(stored_grads.GradientStash, "_stage", staged_from_nvme)
    stats = run_both(tmp_path, 3, None)
    assert len(failed) == len(read_back) == 3
    assert stats["speculative_steps_kept"] > 0
    assert stats["speculative_steps_discarded"] == 0


def grad_types() -> tuple[list[set[type]], Between]:
    """What ``p.grad`` is after each backward (plain PyTorch's run first, then tiermem's), and the
    ``between`` that records it."""
    seen: list[set[type]] = []

    def record(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        seen.append({type(p.grad) for p in model.parameters() if p.grad is not None})

    return seen, record


def test_host_homes_never_run_ahead_and_their_gradients_are_plain_tensors(tmp_path):
    """Host homes step at memory speed at optimizer.step(): nothing runs ahead, and their
    gradients on the host are plain tensors (NOTE [ Host gradients ] rule 1)."""
    seen, record = grad_types()
    stats = run_both(tmp_path, 3, record, {"state_home": "host"})
    assert stats["speculative_steps_kept"] == 0 and stats["speculative_steps_discarded"] == 0
    assert set().union(*seen) == {torch.Tensor}


def test_with_speculative_steps_off_host_gradients_are_plain_tensors(tmp_path, monkeypatch):
    """``speculative_steps = "off"``: nothing runs ahead, so NVMe chunks' gradients on the host
    need not be watched, and are plain tensors as every other CPU gradient."""
    monkeypatch.setenv("TIERMEM_MODEL_STATES_SPECULATIVE_STEPS", "off")
    seen, record = grad_types()
    stats = run_both(tmp_path, 3, record, ON_HOST)
    assert stats["speculative_steps_kept"] == 0 and stats["speculative_steps_discarded"] == 0
    assert set().union(*seen) == {torch.Tensor}


def test_once_a_loop_edits_between_backward_and_step_its_host_gradients_are_plain_tensors(tmp_path):
    """NOTE [ Host gradients ] rule 1: once rule 5 turned running ahead off (an edit through
    ``.data`` at the third step), nothing needs watching: from the next backward on, the NVMe
    chunks' host gradients are plain tensors again; bitwise throughout."""
    seen, record = grad_types()

    def edit_from_third(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        record(model, optimizer, step)
        grad_data_from_third(model, optimizer, step)

    stats = run_both(tmp_path, 5, edit_from_third, ON_HOST)
    assert stats["speculative_steps_discarded"] > 0
    under_tiermem = seen[5:]  # plain PyTorch's run came first
    assert all(HostGradient in seen for seen in under_tiermem[:3])  # up to the step that edited
    assert under_tiermem[3:] == [{torch.Tensor}, {torch.Tensor}]


def test_nvme_homes_expose_their_host_gradients_as_host_gradients(tmp_path):
    """NOTE [ Host gradients ] rule 1: on the CPU device, an NVMe-homed chunk's gradient waiting on
    the host is a HostGradient, whose every write (``.data`` included) the runtime sees."""
    seen, record = grad_types()
    run_both(tmp_path, 2, record, ON_HOST)
    assert HostGradient in set().union(*seen[2:])  # tiermem's run


def clip(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def clip_from_third(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    return clip(model, optimizer, step) if step >= 2 else None


def clip_foreach_from_third(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    """torch's foreach clip: its in-place multiply moves no version counter of a stored gradient."""
    if step >= 2:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=3.0, foreach=True)
    return None


def lr_from_third(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    if step >= 2:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * 0.5
    return None


def grad_data_from_third(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    """An edit through ``.data``, which moves no version counter of ``p.grad``."""
    if step >= 2:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data.mul_(0.5)
    return None


def weights_from_third(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    if step >= 2:
        with torch.no_grad():
            next(iter(model.parameters())).mul_(0.99)
            list(model.parameters())[-1].add_(0.01)
    return None


def read_weights(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    """Reading weights and optimizer state between backward and the step sees the values before it."""
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for v in optimizer_values(optimizer.state_dict())
    ]


def test_a_loop_that_clips_never_runs_ahead(tmp_path, caplog):
    """Clipping edits gradients after backward: the first window shows it, nothing runs ahead."""
    stats = run_both(tmp_path, 4, clip)
    assert stats["speculative_steps_kept"] == 0 and stats["speculative_steps_discarded"] == 0


@pytest.mark.parametrize(
    ("between", "reason"),
    [
        (clip_from_third, "gradients"),
        (clip_foreach_from_third, "gradients"),
        (grad_data_from_third, "gradients"),
        (lr_from_third, "hyperparameters changed"),
        (weights_from_third, "written between backward"),
    ],
)
@pytest.mark.parametrize("plan", [STORED, ON_HOST], ids=["stored gradients", "host gradients"])
def test_a_change_after_backward_discards_what_ran_ahead(tmp_path, caplog, between, reason, plan):
    """A loop that starts clipping, changes the learning rate or writes weights between backward
    and the step after it ran ahead: the steps are discarded, the chunks step from their untouched
    homes, bitwise, and the model runs ahead no more (logged with the reason)."""
    with caplog.at_level(logging.INFO, logger="tiermem.states"):
        stats = run_both(tmp_path, 5, between, plan)
    assert stats["speculative_steps_discarded"] > 0
    kept = stats["speculative_steps_kept"]
    assert kept > 0  # the second window ran ahead and was kept
    assert any(reason in r.getMessage() and "Speculative steps" in r.getMessage() for r in caplog.records)


def test_reads_between_backward_and_step_see_the_values_before_it(tmp_path):
    stats = run_both(tmp_path, 4, read_weights)
    assert stats["speculative_steps_kept"] > 0 and stats["speculative_steps_discarded"] == 0


def test_accumulating_by_hand_never_runs_ahead(tmp_path):
    """Two backwards a step (accumulation the runtime was not told of): bitwise, nothing kept."""

    def accumulate(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
        tokens, targets = batch(step, 1)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.detach()

    stats = run_both(tmp_path, 4, accumulate)
    assert stats["speculative_steps_kept"] == 0


def test_a_state_load_before_forward_is_what_the_next_step_starts_from(tmp_path):
    """``load_state_dict`` between steps leaves the loaded chunks' device copies newer than their
    homes until released: that window does not run ahead (rule 2), the others do; bitwise."""
    other = make_model(seed=7).state_dict()

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return step_loop(model, optimizer, 5, lambda step: model.load_state_dict(other) if step == 2 else None)

    plain = make_model()
    want = run(plain, OPTIMIZERS["adamw"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        got = run(model, optimizer)
        stats = rt.stats().as_dict()["model_states"]
    assert stats["speculative_steps_kept"] > 0 and stats["speculative_steps_discarded"] == 0
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_a_failing_step_ahead_raises_and_leaves_no_copy(tmp_path, monkeypatch):
    """A speculative step that fails in its compute raises from backward; no shadow is left, the
    chunks' homes are untouched, and training goes on from them bitwise (a loop that drops the
    failed backward's gradients, as plain PyTorch's)."""
    from tiermem.states import chunk_step

    def run(model: nn.Module, optimizer: torch.optim.Optimizer, fail: Callable[[], None] | None) -> list[Any]:
        out = []
        for step in range(5):
            tokens, targets = batch(step, 0)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            out.append(loss.detach())
            if step == 2:
                if fail is None:
                    loss.backward()
                else:
                    with pytest.raises(RuntimeError, match="boom ahead"):
                        loss.backward()
                    fail()
                optimizer.zero_grad()  # the loop drops the failed step
                continue
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return out

    plain = make_model()
    want = run(plain, OPTIMIZERS["adamw"](param_groups(plain)), None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        states = rt._model_states[-1]
        run_step = chunk_step.run_step
        calls: list[None] = []

        def failing(*args: Any) -> Any:
            if states.stepper._speculative and states.stepper.shadows.kept > 0:
                calls.append(None)  # the third window's: the second one ran ahead and was kept
                if len(calls) == 2:
                    raise RuntimeError("boom ahead")
            return run_step(*args)

        def after_failure() -> None:
            assert not states.stepper.shadows
            monkeypatch.setattr(chunk_step, "run_step", run_step)

        monkeypatch.setattr(chunk_step, "run_step", failing)
        got = run(model, optimizer, after_failure)
        assert states.stepper.shadows.kept > 0
        # Homes and shadows on their way back to NVMe hold host bytes until they land (a loaded
        # machine's slow write-backs were caught here); no copy is left once they have.
        states.stepper.shadows.wait_host_room()
        assert rt.stats().as_dict()["tiers"]["host"]["current_bytes"] <= sum(c.nbytes for c in states.store.chunks)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_queued_speculative_steps_start_from_every_backward_hook(tmp_path, monkeypatch):
    """Rule 9 of NOTE [ Declared steps ] with speculative steps: a shadow is read only for the
    queue's head, so the queue advances wherever backward calls back (each parameter's gradient
    hook, each module's backward), not only as a chunk's backward begins or its gradients
    complete: only the last chunks' steps are left for backward's end (advanced only at those two
    points, 9-10 were). Reads and steps are made to take a few hooks each (a shadow counts as landed
    at its fourth look, a step finishes at the fourth poll after it started), so the counts do
    not depend on this machine's speed."""
    from tiermem.states import speculation, step_thread, stepping

    monkeypatch.setenv("TIERMEM_MODEL_STATES_STEP_THREAD", "on")
    looks: dict[int, int] = {}
    polls = [0]
    real_run, real_poll = step_thread.StepThread.run, step_thread.StepThread.poll

    def landed(self, chunk):
        looks[chunk.index] = looks.get(chunk.index, 0) + 1
        return looks[chunk.index] >= 4  # the step waits for the read itself where it has not landed

    def run(self, *args, **kwargs):
        polls[0] = 0
        return real_run(self, *args, **kwargs)

    def poll(self):
        polls[0] += 1
        if polls[0] >= 4:
            self.finish_all()  # waits for the compute: the fourth poll always finds it done
        return real_poll(self)

    left: list[int] = []  # per backward: the steps still queued when it ended
    real_run_queued = stepping.Stepper._run_queued

    def run_queued(self):
        left.append(len(self._queued))
        looks.clear()  # the next backward's shadows are new reads
        return real_run_queued(self)

    monkeypatch.setattr(speculation.Shadows, "landed", landed)
    monkeypatch.setattr(step_thread.StepThread, "run", run)
    monkeypatch.setattr(step_thread.StepThread, "poll", poll)
    monkeypatch.setattr(stepping.Stepper, "_run_queued", run_queued)
    stats = run_both(tmp_path, 4, None)
    assert stats["speculative_steps_kept"] > 0
    # the last chunks', whose gradients come last (their stored gradients' reads take real time)
    assert len(left) == 4 and max(left) <= 3, left
