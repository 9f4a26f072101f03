"""NOTE [ Host gradients ]: ``p.grad`` of a CUDA parameter whose gradient waits on the host.

The class is device-generic, so it is tested here on the CPU: alone against plain tensors,
and inside the manager (``ModelStates.proxy_host_gradients``, rule 6), where the tests of
user-visible gradients (clipping by hand, edits, GradScaler, declared clipping) must stay
bitwise plain PyTorch with every host gradient behind a HostGradient, as on CUDA.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests import test_states, test_states_declared
from tiermem.states import StatesUsageError
from tiermem.states.gradients import Gradients
from tiermem.states.hostgrad import HostGradient
from tiermem.states.manager import ModelStates

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


@pytest.fixture(autouse=True, params=["copies", "over host bytes"])
def op_path(request, monkeypatch):
    """Every test twice: ops over transient copies (rule 2, as on CUDA) and over the host bytes
    themselves (rule 10, the CPU device's path)."""
    monkeypatch.setattr(HostGradient, "ops_over_host_bytes", request.param == "over host bytes")
    return request.param


def pair(seed: int, *shape: int) -> tuple[torch.nn.Parameter, torch.Tensor, torch.nn.Parameter]:
    """A parameter whose .grad is a HostGradient over ``host``, and a plain twin."""
    generator = torch.Generator().manual_seed(seed)
    value = torch.randn(*shape, generator=generator)
    host = torch.randn(*shape, generator=generator)
    proxied = torch.nn.Parameter(value.clone())
    proxied.grad = HostGradient(host, "cpu")
    plain = torch.nn.Parameter(value.clone())
    plain.grad = host.clone()
    return proxied, host, plain


def test_a_host_gradient_is_accepted_as_grad_and_owns_no_bytes():
    p, host, _ = pair(0, 3, 4)
    assert isinstance(p.grad, HostGradient) and p.grad.host is host
    assert p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad.device == p.device
    with pytest.raises(RuntimeError):
        p.grad.untyped_storage().data_ptr()  # a wrapper: its bytes are the host view's
    assert "HostGradient" in repr(p.grad)


def test_clip_grad_norm_gives_pytorchs_norm_and_scales_the_host_bytes():
    """Rule 2 and 3: clip_grad_norm_'s norms and scaling over HostGradients (split per tensor)."""
    pairs = [pair(seed, 5, 7) for seed in range(4)]
    got = torch.nn.utils.clip_grad_norm_([p for p, _, _ in pairs], 0.5)
    want = torch.nn.utils.clip_grad_norm_([q for _, _, q in pairs], 0.5)
    assert float(want) > 0.5  # it clips for real
    assert torch.equal(got, want)
    for p, host, q in pairs:
        assert torch.equal(host, q.grad)
        assert isinstance(p.grad, HostGradient)


def test_in_place_ops_write_back_through_views_and_out_of_place_ops_do_not():
    p, host, q = pair(1, 4, 6)
    p.grad.detach().mul_(2)  # rule 4: a view over the same host bytes
    q.grad.detach().mul_(2)
    p.grad.data.t().add_(1)
    q.grad.data.t().add_(1)
    assert torch.equal(host, q.grad)
    before = host.clone()
    total = (p.grad * 3).sum()
    assert type(total) is torch.Tensor and torch.equal(total, (q.grad * 3).sum())
    assert torch.equal(host, before)  # out of place: the gradient is unchanged
    version = p.grad._version
    p.grad.zero_()
    assert not host.any() and p.grad._version > version  # declared-step guard sees the write


def test_foreach_ops_run_one_tensor_at_a_time(monkeypatch):
    """Rule 3: the device never holds more than one gradient's copy; mixed lists work."""
    pairs = [pair(seed, 3, 3) for seed in range(3)]
    plain = torch.ones(3, 3)
    lists: list[int] = []
    dispatch = HostGradient.__torch_dispatch__.__func__  # type: ignore[attr-defined]

    def spy(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        lists.append(len(args[0]))
        return dispatch(cls, func, types, args, kwargs)

    monkeypatch.setattr(HostGradient, "__torch_dispatch__", classmethod(spy))
    found = torch.zeros(1)
    grads = [p.grad for p, _, _ in pairs]
    grads[1].host[0, 0] = float("inf")
    torch._amp_foreach_non_finite_check_and_unscale_([*grads, plain], found, torch.full((1,), 0.5))
    assert lists == [4, 1, 1, 1]  # the whole list once, then one call per HostGradient (the plain one alone)
    assert float(found) == 1.0
    assert torch.equal(pairs[0][1], pairs[0][2].grad * 0.5) and torch.equal(plain, torch.full((3, 3), 0.5))


def test_shape_ops_concatenation_and_indexing_act_on_the_gradient_as_plain_tensors_do():
    """Only foreach-style ops are split (rule 3): size, dim and index lists are arguments too."""
    p, host, q = pair(2, 3, 4)
    for f in (
        lambda g: g.view(4, 3),
        lambda g: g.reshape(2, 6),
        lambda g: g.permute(1, 0),
        lambda g: g.sum(dim=(0, 1)),
        lambda g: torch.cat([g, g]),
        lambda g: torch.stack([g, g * 2]),
    ):
        assert torch.equal(f(p.grad), f(q.grad))
    rows, cols = torch.tensor([0, 1]), torch.tensor([1, 2])
    p.grad[rows, cols] = 100.0
    q.grad[rows, cols] = 100.0
    p.grad.view(12)[0] = -1.0  # through a view
    q.grad.view(12)[0] = -1.0
    assert torch.equal(host, q.grad)


@pytest.fixture
def host_gradients(monkeypatch):
    """Rule 6: the manager exposes host gradients through HostGradients on the CPU device;
    yields the number of HostGradients it handed out (the tests check it did)."""
    monkeypatch.setattr(ModelStates, "proxy_host_gradients", True)
    made = [0]
    exposed = Gradients.exposed

    def counting(self: Gradients, chunk: Any, view: torch.Tensor) -> torch.Tensor:
        out = exposed(self, chunk, view)
        made[0] += isinstance(out, HostGradient)
        return out

    monkeypatch.setattr(Gradients, "exposed", counting)
    return made


@pytest.mark.parametrize("set_to_none", [True, False])
def test_clipping_by_hand_across_micro_batches_is_bitwise(tmp_path, host_gradients, set_to_none):
    test_states.test_clipping_and_gradient_accumulation_match(tmp_path, set_to_none)
    assert host_gradients[0] > 0


def test_gradient_edits_by_hand_are_bitwise(tmp_path, host_gradients):
    test_states.test_user_code_edits_gradients(tmp_path)
    assert host_gradients[0] > 0


def test_grad_scaler_is_bitwise(tmp_path, host_gradients):
    test_states_declared.test_fp16_autocast_with_grad_scaler_is_bitwise(tmp_path)
    assert host_gradients[0] > 0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_declared_clipping_reads_host_gradients_in_place_bitwise(tmp_path, host_gradients, micro_batches):
    test_states_declared.test_declared_clipping_is_pytorchs_norm(tmp_path, micro_batches)
    assert host_gradients[0] > 0


def test_overlapped_steps_are_bitwise(tmp_path, host_gradients):
    test_states_declared.test_overlapped_step_is_bitwise(tmp_path, "nvme", 3)
    assert host_gradients[0] > 0


def test_a_declared_trainers_logged_norm_reads_host_gradients_bitwise(tmp_path, host_gradients):
    """NOTE [ Trainer loops declared ] rule 2 in ``tiermem.integrations.hf``: the norm read
    without scaling by 1.0 is torch's over the host bytes, as on CUDA."""
    pytest.importorskip("transformers")
    from tests import test_hf_trainer

    test_hf_trainer.test_trainer_declares_its_loop_and_stays_bitwise_plain_trainer(tmp_path, 2, 0.0)
    assert host_gradients[0] > 0


def test_a_grad_kept_across_a_backward_refuses_ops_with_a_clear_error(tmp_path, host_gradients):
    """Rule 5: the next backward moves the host bytes (the pinned pool reuses them); a kept
    HostGradient and its views refuse, the fresh ``p.grad`` after backward works."""
    model = test_states.make_model()
    with tiermem.Runtime(test_states.config(tmp_path, int(test_states.state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, test_states.OPTIMIZERS["adamw"](test_states.param_groups(model)))

        def backward() -> None:
            tokens, targets = test_states.batch(0)
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()

        backward()
        kept = next(p.grad for p in model.parameters() if isinstance(p.grad, HostGradient))
        view = kept.detach()
        before = kept.sum()
        backward()  # accumulates: the host bytes went to the device and back
        for stale in (kept, view):
            with pytest.raises(StatesUsageError, match=r"Read p\.grad again"):
                stale.sum()
        fresh = next(p.grad for p in model.parameters() if isinstance(p.grad, HostGradient))
        assert torch.isfinite(fresh.sum()) and not torch.equal(fresh.sum(), before)
        optimizer.zero_grad()


# -- rule 6: metadata ops and deep copies; rule 7: clipping by hand takes plain's path -----------

METADATA_OPS = {
    "t_": lambda g: g.t_(),
    "transpose_": lambda g: g.transpose_(0, 1),
    "swapdims_": lambda g: g.swapdims_(0, 1),
    "unsqueeze_": lambda g: g.unsqueeze_(1),
    "unsqueeze_squeeze_": lambda g: g.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda g: g.as_strided_((4, 3), (1, 4)),
    "detach_": lambda g: g.detach_(),
}


@pytest.mark.parametrize("op", sorted(METADATA_OPS))
def test_in_place_metadata_ops_change_the_gradient_as_they_change_a_plain_tensor(op):
    """Rule 6: the op changes the HostGradient's shape and strides like a plain tensor's; a later
    write lands in the right host bytes; another HostGradient of the same bytes keeps its shape."""
    p, host, q = pair(3, 3, 4)
    other = p.grad.detach()  # a view: shares the bytes, not the metadata
    got, want = METADATA_OPS[op](p.grad), METADATA_OPS[op](q.grad)
    assert got is p.grad and isinstance(got, HostGradient)
    assert (got.shape, got.stride()) == (want.shape, want.stride())
    assert (got.host.shape, got.host.stride()) == (want.shape, want.stride())
    got.mul_(torch.arange(got.numel(), dtype=got.dtype).reshape(got.shape))
    want.mul_(torch.arange(want.numel(), dtype=want.dtype).reshape(want.shape))
    assert torch.equal(got.host, want) and torch.equal(got, want)
    assert host.shape == (3, 4) and other.shape == (3, 4)
    assert torch.equal(other, host)


def test_ops_that_would_rebind_or_reshape_the_bytes_raise_before_writing_back():
    """Rule 6: resize_ to another size, set_, and an out= op whose result has another shape are
    clear errors, and the host bytes are as they were."""
    p, host, _ = pair(4, 3, 4)
    before = host.clone()
    for edit in (
        lambda g: g.resize_(6, 2),
        lambda g: g.set_(torch.zeros(3)),
        lambda g: torch.sum(torch.ones(3, 4), dim=0, out=g),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's "output ... was resized", on the copy
            with pytest.raises(StatesUsageError, match=r"rule 6"):
                edit(p.grad)
        assert torch.equal(host, before) and p.grad.shape == (3, 4)
    assert p.grad.resize_(3, 4) is p.grad  # to the size it has: nothing to refuse


def test_deepcopy_copies_the_host_bytes():
    """Rule 6: a deep copy is a HostGradient over its own copy of the bytes; a tensor holding one as
    .grad and a model deep-copy as they do with plain gradients; a retired one refuses."""
    p, host, q = pair(5, 3, 4)
    copied = copy.deepcopy(p.grad)
    assert isinstance(copied, HostGradient) and torch.equal(copied, q.grad)
    copied.mul_(2.0)
    assert torch.equal(host, q.grad)  # the original's bytes are untouched
    leaf = torch.zeros(3, 4, requires_grad=True)
    leaf.grad = p.grad
    assert torch.equal(copy.deepcopy(leaf).grad, q.grad)
    model, twin = nn.Linear(4, 3), nn.Linear(4, 3)
    model.weight.grad, twin.weight.grad = p.grad, q.grad
    got, want = copy.deepcopy(model).weight.grad, copy.deepcopy(twin).weight.grad
    assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
    p.grad.lease[0] = False
    with pytest.raises(StatesUsageError, match=r"rule 5"):
        copy.deepcopy(p.grad)


def test_clip_grad_norm_by_hand_takes_the_path_plain_gradients_take(monkeypatch):
    """Rule 7: torch takes the foreach path (not the per-tensor fallback it keeps for subclasses)
    for HostGradients exactly where it takes it for plain gradients, and the result is bitwise."""
    calls: list[str] = []
    for name in ("_foreach_norm", "_foreach_mul_"):
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1]
        )
    real_norm = torch.linalg.vector_norm
    monkeypatch.setattr(
        torch.linalg, "vector_norm", lambda *a, **k: (calls.append("vector_norm"), real_norm(*a, **k))[1]
    )
    pairs = [pair(seed, 5, 7) for seed in range(3)]
    want = torch.nn.utils.clip_grad_norm_([q for _, _, q in pairs], 0.5)
    plain_calls, calls[:] = list(calls), []
    got = torch.nn.utils.clip_grad_norm_([p for p, _, _ in pairs], 0.5)
    assert calls == plain_calls and "_foreach_norm" in calls
    assert torch.equal(got, want)
    for _, host, q in pairs:
        assert torch.equal(host, q.grad)


def test_on_the_cpu_ops_run_over_the_host_bytes_and_each_write_is_counted(op_path, monkeypatch):
    """Rule 10: with the host bytes on the op's device, reads and in-place writes run over them
    with no transient copy (rule 2's write-back never runs), each write still counted; an op with
    ``out=`` takes rule 2's copy, so a shape it would change is refused before anything is written."""
    from tiermem.states.hostgrad import GradientWrites

    if op_path == "copies":
        pytest.skip("rule 10 is the CPU path; 'copies' runs rule 2 (the other tests)")
    p, host, q = pair(2, 4, 6)
    copied: list[int] = []
    write_host = HostGradient.write_host
    monkeypatch.setattr(HostGradient, "write_host", lambda self, value: (copied.append(1), write_host(self, value)))
    writes = GradientWrites.count
    assert torch.equal(torch.linalg.vector_norm(p.grad), torch.linalg.vector_norm(q.grad))
    assert GradientWrites.count == writes  # a read writes nothing
    returned = p.grad.mul_(0.5)
    q.grad.mul_(0.5)
    assert returned is p.grad  # the gradient itself, not its host bytes
    assert torch.equal(host, q.grad) and not copied
    assert GradientWrites.count == writes + 1
    p.grad.data.add_(1)  # through a view (rule 4): written where the bytes are, counted too
    q.grad.data.add_(1)
    assert torch.equal(host, q.grad) and not copied and GradientWrites.count == writes + 2
    torch.mul(p.grad, 2, out=p.grad)  # out=: rule 2's copy and write-back
    torch.mul(q.grad, 2, out=q.grad)
    assert torch.equal(host, q.grad) and copied == [1]
    before = host.clone()
    with pytest.raises(StatesUsageError, match="shape"):
        torch.mul(torch.ones(2, 2), 2, out=p.grad)
    assert torch.equal(host, before)
    copied.clear()
    other, other_host, other_plain = pair(3, 4, 6)
    got = torch.nn.utils.clip_grad_norm_([p, other], 1e-3)  # foreach norm and scaling, split per tensor (rule 3)
    want = torch.nn.utils.clip_grad_norm_([q, other_plain], 1e-3)
    assert torch.equal(got, want) and torch.equal(host, q.grad) and torch.equal(other_host, other_plain.grad)
    assert not copied  # read and scaled where they are


def test_numpy_and_tolist_give_the_values_as_a_plain_gradient_does():
    """Rule 11: logging habits (``p.grad.cpu().numpy()``, ``tolist()``, ``np.asarray``) give the
    gradient's values; the array is the caller's own and read-only, so a write raises."""
    import numpy as np

    p, _, q = pair(3, 2, 5)
    for got in (p.grad.numpy(), p.grad.cpu().numpy(), p.grad.detach().cpu().numpy(), np.asarray(p.grad)):
        assert np.array_equal(got, q.grad.numpy())
        with pytest.raises(ValueError, match="read-only"):
            got[0, 0] = 1.0
    assert p.grad.tolist() == q.grad.tolist()
    p.grad.lease[0] = False  # its bytes moved (rule 5)
    with pytest.raises(StatesUsageError, match="numpy"):
        p.grad.numpy()


def test_assigning_data_writes_the_values_where_the_gradient_is(op_path):
    """Rule 12: ``p.grad.data = t`` (torch would rebind the wrapper alone) writes ``t`` into the
    host bytes, counted as a write; another shape raises before anything is written."""
    from tiermem.states.hostgrad import GradientWrites

    p, host, q = pair(4, 3, 5)
    writes = GradientWrites.count
    p.grad.data = p.grad.data.clamp(-0.5, 0.5)
    q.grad.data = q.grad.data.clamp(-0.5, 0.5)
    assert torch.equal(host, q.grad) and torch.equal(p.grad * 1, q.grad)
    assert GradientWrites.count > writes
    before = host.clone()
    with pytest.raises(StatesUsageError, match="shape"):
        p.grad.data = torch.zeros(5, 3)
    assert torch.equal(host, before)


def test_ops_that_alias_without_saying_so_and_writes_that_fail_part_way_reach_the_gradient(op_path):
    """Rule 4: ``unsafe_split``'s pieces are HostGradient views, so a write through one lands in
    the gradient and is counted; rule 10: a write that fails part way is counted all the same."""
    from tiermem.states.hostgrad import GradientWrites

    p, host, q = pair(5, 4, 3)
    pieces, plain_pieces = torch.unsafe_split(p.grad, 2), torch.unsafe_split(q.grad, 2)
    assert all(isinstance(piece, HostGradient) for piece in pieces)
    writes = GradientWrites.count
    pieces[1].fill_(7.0)
    plain_pieces[1].fill_(7.0)
    assert torch.equal(host, q.grad) and GradientWrites.count > writes
    writes, before = GradientWrites.count, host.clone()
    with pytest.raises(RuntimeError):
        p.grad.view(-1).scatter_(0, torch.tensor([0, 1, 99]), torch.ones(3))
    if op_path == "copies":
        assert torch.equal(host, before)  # what it wrote went to the transient copy (rule 2)
    else:
        assert GradientWrites.count > writes  # some elements may be written: no step ahead is kept
