"""NOTE [ Parameter access ]: a managed model's parameters read and write like a plain model's.

The op list runs in a child process (tests/access_child.py): reading a released chunk's
parameter used to kill the process with SIGSEGV, and a signal must fail the test, not the suite.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import tiermem
from tests.forked_children import ForkServer
from tiermem.states.access import GuardedParameter
from tiermem.states.errors import StatesUsageError

SMALL = {"device": {"capacity": "1MiB"}, "host": {"capacity": "64MiB"}, "nvme": {"capacity": "256MiB"}}
#: device and host well below the 8.4 MB of AdamW states: homes on NVMe
NVME = {"device": {"capacity": "1MiB"}, "host": {"capacity": "2500KiB"}, "nvme": {"capacity": "256MiB"}}


WHERE = ("released", "cached", "nvme")
#: per device: the child's exit status (minus the signal that ended it) and what it printed
_RUNS: dict[str, tuple[int, str]] = {}


def _check_child(where: str, device: str, fork_server: ForkServer) -> None:
    """One child runs the op list for every WHERE (forked from the suite's server: no interpreter
    start of its own); each test reads its own line."""
    if device not in _RUNS:
        pid = fork_server.start("tests.access_child", "every-where", ",".join(WHERE), device)
        lines, status = fork_server.wait(pid)
        _RUNS[device] = (fork_server.returncode(status), "\n".join(lines))
    returncode, out = _RUNS[device]
    assert returncode >= 0, f"the child died of signal {-returncode}:\n{out}"
    assert f"{where}: 34 reads, 15 writes, 0 failures" in out.splitlines(), out


@pytest.mark.parametrize("where", WHERE)
def test_every_op_on_a_managed_parameter_matches_plain_pytorch(where: str, fork_server: ForkServer) -> None:
    _check_child(where, "cpu", fork_server)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", WHERE)
def test_every_op_on_a_managed_parameter_matches_plain_pytorch_on_cuda(where: str, fork_server: ForkServer) -> None:
    _check_child(where, "cuda", fork_server)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(8, 256, generator=g) for _ in range(n)]


def _homes(rt: tiermem.Runtime) -> set[str]:
    (states,) = rt._model_states  # type: ignore[attr-defined]
    return {c.home_tier for c in states.chunks}


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """One training step of the tests' loss; its loss."""
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _train_with_ema(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], nn.Module]:
    ema = copy.deepcopy(model)
    losses = []
    for x in _batches(3):
        losses.append(_step(model, opt, x))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 0.1)
    return losses, ema


def test_an_ema_made_by_deepcopy_trains_bitwise_like_plain_pytorch() -> None:
    plain = _model()
    want_losses, want_ema = _train_with_ema(plain, torch.optim.AdamW(plain.parameters()))
    with tiermem.Runtime(NVME) as rt:
        # homes on NVMe by hand: the planner, timing a loaded machine, may home a chunk or two on
        # the host, and planning is not what this test checks (no profile: suite time)
        model, opt = rt.manage(_model(), torch.optim.AdamW, plan={"state_home": "nvme", "chunk_size": "256KiB"})
        assert _homes(rt) == {"nvme"}
        assert any(type(p) is GuardedParameter for p in model.parameters())
        losses, ema = _train_with_ema(model, opt)
        assert all(type(p) is nn.Parameter for p in ema.parameters())  # a plain copy
        assert not ema._forward_pre_hooks and "_apply" not in vars(ema)
        assert torch.equal(torch.stack(losses), torch.stack(want_losses))
        for got, want in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(got, want)
        for got, want in zip(ema.parameters(), want_ema.parameters(), strict=True):
            assert torch.equal(got, want)


def _edit_mid_run(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    losses = []
    for i, x in enumerate(_batches(4)):
        if i == 2:
            model.load_state_dict(state)
            with torch.no_grad():
                model[3].weight.mul_(0.5)
                nn.init.zeros_(model[5].bias)
                model[6].weight.data[0].fill_(0.25)
        losses.append(_step(model, opt, x))
    return losses


def test_load_state_dict_and_edits_mid_run_then_two_steps_match_plain_pytorch() -> None:
    state = {k: v * 0.9 for k, v in _model().state_dict().items()}
    plain = _model()
    want = _edit_mid_run(plain, torch.optim.AdamW(plain.parameters()), state)
    with tiermem.Runtime(NVME) as rt:
        model, opt = rt.manage(_model(), torch.optim.AdamW)
        got = _edit_mid_run(model, opt, state)
        assert torch.equal(torch.stack(got), torch.stack(want))
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a, b)
        saved = model.state_dict()  # what a checkpoint reads: the edited values, stepped
        for key, value in plain.state_dict().items():
            assert torch.equal(saved[key], value)


def test_pickle_and_torch_save_of_a_managed_model_give_a_plain_model() -> None:
    plain = _model()
    with tiermem.Runtime(SMALL) as rt:
        model, _ = rt.manage(_model(), torch.optim.AdamW)
        copies = [pickle.loads(pickle.dumps(model))]
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=False))
        for copied in copies:
            assert all(type(p) is nn.Parameter for p in copied.parameters())
            for a, b in zip(copied.parameters(), plain.parameters(), strict=True):
                assert torch.equal(a, b)
        x = _batches(1)[0]
        assert torch.equal(copies[0](x), plain(x))


def test_writes_that_cannot_be_honoured_raise_and_change_nothing() -> None:
    with tiermem.Runtime(SMALL) as rt:
        model, _ = rt.manage(_model(), torch.optim.AdamW)
        p = model[7].weight
        before = p.detach().clone()
        with pytest.raises(StatesUsageError, match="shape"), torch.no_grad():
            p.data = torch.zeros(3)
        with pytest.raises(RuntimeError, match="leaf Variable"):
            p.add_(1)  # grad mode: as plain PyTorch refuses
        array = p.detach().numpy()
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1.0  # a copy: a write through it would be lost, so it fails
        assert torch.equal(p, before)


def test_a_view_kept_across_a_repack_refuses_instead_of_reading_other_bytes(tmp_path, monkeypatch) -> None:
    # a cache of its own: with the suite's, another test's profile of this model would plan at
    # rt.manage (NOTE [ Profile cache ] rule 6) and leave no re-pack to test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with tiermem.Runtime(SMALL) as rt:
        model, opt = rt.manage(_model(), torch.optim.AdamW)
        view = model[0].weight.data
        assert torch.equal(view, model[0].weight)
        model(_batches(1)[0]).sum().backward()
        opt.step()  # the first step re-packs in execution order (rule 2 of NOTE [ Model-state rules ])
        repacked = all(  # the view's storage is no chunk's any more
            view.untyped_storage()._cdata != c.data.untyped_storage()._cdata
            for c in rt._model_states[0].chunks  # type: ignore[attr-defined]
        )
        assert repacked
        with pytest.raises(StatesUsageError, match="re-packed"):
            view.sum()
        fresh = model[0].weight.data
        assert torch.equal(fresh.clone(), model[0].weight.detach().clone())


def test_a_write_after_an_early_step_in_a_declared_loop_raises() -> None:
    with tiermem.Runtime(SMALL) as rt:
        model, opt = rt.manage(_model(), torch.optim.AdamW, grad_accumulation_steps=1)
        for x in _batches(2):  # early steps start in the second window
            model(x).square().mean().backward()
            if rt.stats().as_dict()["model_states"]["early_chunk_steps"]:
                break
            opt.step()
            opt.zero_grad()
        assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] > 0
        with pytest.raises(StatesUsageError, match="already stepped"), torch.no_grad():
            model[0].weight.mul_(2)
        opt.step()
        with torch.no_grad():
            model[0].weight.mul_(2)  # after the step: fine


def test_leaving_the_runtime_makes_parameters_plain_again() -> None:
    with tiermem.Runtime(SMALL) as rt:
        model, _ = rt.manage(_model(), torch.optim.AdamW)
        want = [p.detach().clone() for p in model.parameters()]
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(p, w)


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_step(model, opt, x) for x in batches]


def test_deepcopy_and_torch_save_of_a_managed_optimizer_give_a_plain_one_with_its_states() -> None:
    """NOTE [ Exact optimizer step ] rule 7: copied mid-run with the model, the copies are a plain
    model and a plain AdamW with the true states, and they train on bitwise as plain PyTorch's copies."""
    batches = _batches(4)
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters())
    _train(plain, plain_opt, batches[:2])
    want_model, want_opt = copy.deepcopy((plain, plain_opt))
    want = _train(want_model, want_opt, batches[2:])
    with tiermem.Runtime(NVME) as rt:
        model, opt = rt.manage(_model(), torch.optim.AdamW, plan={"state_home": "nvme", "chunk_size": "256KiB"})
        _train(model, opt, batches[:2])
        copied_model, copied_opt = copy.deepcopy((model, opt))
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    assert type(copied_opt) is torch.optim.AdamW and type(loaded) is torch.optim.AdamW
    params = list(copied_model.parameters())
    assert [p for group in copied_opt.param_groups for p in group["params"]] == params  # the copied model's
    for got in (copied_opt, loaded):
        assert len(got.state) == len(plain_opt.state) == len(params)
        for state, want_state in zip(got.state.values(), plain_opt.state.values(), strict=True):
            assert state.keys() == want_state.keys()
            assert all(torch.equal(state[k], want_state[k]) for k in state)
    got = _train(copied_model, copied_opt, batches[2:])
    assert torch.equal(torch.stack(got), torch.stack(want))
    for a, b in zip(copied_model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_optimizer_handed_to_manage_refuses_to_step_and_its_scheduler_drives_the_managed_one() -> None:
    """NOTE [ Exact optimizer step ] rule 8: stepped out of habit, the optimizer rt.manage replaced
    would rebuild its states in RAM and train apart; it refuses, an LR scheduler made on it before
    rt.manage sets the managed optimizer's learning rate (also after a load_state_dict), bitwise as
    in plain PyTorch, and the optimizer is itself again at the close."""
    batches = _batches(4)
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain_opt, 1, gamma=0.5)
    model = _model()
    original = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(original, 1, gamma=0.5)  # wraps the instance's step
    wrapped = original.step
    with tiermem.Runtime(SMALL) as rt:
        model, opt = rt.manage(model, original)
        for i, x in enumerate(batches):
            for m, o, sched in ((model, opt, scheduler), (plain, plain_opt, plain_scheduler)):
                _step(m, o, x)
                with warnings.catch_warnings():  # torch: the scheduler never saw its optimizer step
                    warnings.simplefilter("ignore", UserWarning)
                    sched.step()
            if i == 1:
                opt.load_state_dict(opt.state_dict())
        assert opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"] == 0.01 * 0.5**4
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a, b)
        model(batches[0]).sum().backward()
        with pytest.raises(StatesUsageError, match=r"step the optimizer rt\.manage\(\) returned"):
            original.step()
        assert not original.state
    assert original.step == wrapped  # the scheduler's wrapper again
