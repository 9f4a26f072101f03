"""Any optimizer a user brings (NOTE [ Exact optimizer step ]): every per-parameter optimizer of
torch.optim with its flags, Hugging Face's Adafactor (factored state of other shapes than the
parameter's) and a declared custom one step bitwise plain PyTorch from host and NVMe homes, in a
plain and a declared loop; a checkpoint of a non-Adam optimizer resumes bitwise; LBFGS and a
cross-parameter optimizer are refused before the first step."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import assert_bitwise, config
from tiermem.states import UnsupportedOptimizerError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

Make = Callable[[Any], torch.optim.Optimizer]


def _adafactor(**kwargs: Any) -> Make:
    def make(params: Any) -> torch.optim.Optimizer:
        from transformers.optimization import Adafactor

        return Adafactor(params, **kwargs)

    return make


class PerParameterSGD(torch.optim.Optimizer):
    """A custom optimizer keeping the contract (README, 'Your optimizer'): its own param groups
    and per-parameter state, each parameter updated from its own gradient."""

    tiermem_per_parameter = True

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["trace"] = torch.zeros_like(p)
                    state["norm"] = torch.zeros(())
                state["trace"].mul_(group["beta"]).add_(p.grad)
                state["norm"] = p.grad.norm()
                p.add_(state["trace"], alpha=-group["lr"])


class GlobalNormSGD(PerParameterSGD):
    """Declares the contract but breaks it: every update is scaled by the norm of all gradients."""

    tiermem_per_parameter = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / total, alpha=-group["lr"])


optim = torch.optim
OPTIMIZERS: dict[str, Make] = {
    "adamw": lambda p: optim.AdamW(p, lr=1e-2, amsgrad=True),
    "adam-foreach": lambda p: optim.Adam(p, lr=1e-2, foreach=True, maximize=True),
    "sgd-nesterov-fused": lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, fused=True),
    "sgd-plain": lambda p: optim.SGD(p, lr=0.05),
    "adagrad": lambda p: optim.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "adagrad-fused": lambda p: optim.Adagrad(p, lr=0.05, fused=True),
    "rmsprop": lambda p: optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "rmsprop-foreach": lambda p: optim.RMSprop(p, lr=1e-2, foreach=True, maximize=True),
    "adamax": lambda p: optim.Adamax(p, lr=1e-2, weight_decay=0.01),
    "nadam": lambda p: optim.NAdam(p, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    "nadam-foreach": lambda p: optim.NAdam(p, lr=1e-2, foreach=True),
    "radam": lambda p: optim.RAdam(p, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    "adadelta": lambda p: optim.Adadelta(p, lr=1.0, weight_decay=0.01),
    "rprop": lambda p: optim.Rprop(p, lr=1e-2),
    "rprop-foreach": lambda p: optim.Rprop(p, lr=1e-2, foreach=True, maximize=True),
    "asgd": lambda p: optim.ASGD(p, lr=1e-2, t0=1),
    "adafactor": _adafactor(lr=None, relative_step=True, scale_parameter=True, warmup_init=True),
    "adafactor-beta1": _adafactor(lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9),
    "custom": lambda p: PerParameterSGD(p, lr=0.05),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)


def loop(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    out = []
    for step in steps:
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.detach())
    return out


PLAN = {"chunk_size": 20 << 10, "persistent_chunks": 1, "buffers": 2}
#: the device holds the persistent chunk and two buffers, the other chunks have host or NVMe homes
DEVICE = 1 << 20


def manage(rt: tiermem.Runtime, model: nn.Module, make: Make, home: str, declared: bool) -> Any:
    kwargs: dict[str, Any] = {"grad_accumulation_steps": 1, "keep_gradients": False} if declared else {}
    return rt.manage(model, make(model.parameters()), plan={**PLAN, "state_home": home}, **kwargs)


def assert_same_state(got: dict[int, dict[str, Any]], want: dict[int, dict[str, Any]]) -> None:
    """Every state entry, of any shape, as plain PyTorch keeps it (bitwise, in its key order)."""
    assert list(got) == list(want)
    for i, entry in want.items():
        assert list(got[i]) == list(entry)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert_bitwise([got[i][key]], [value])
            else:
                assert got[i][key] == value


@pytest.mark.parametrize("declared", [False, True], ids=["plain", "declared"])
@pytest.mark.parametrize("home", ["host", "nvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_steps_bitwise_plain_pytorch(tmp_path, name, home, declared):
    if name.startswith("adafactor"):
        pytest.importorskip("transformers")
    plain = make_model()
    plain_optimizer = OPTIMIZERS[name](plain.parameters())
    want = loop(plain, plain_optimizer, range(3))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, DEVICE)) as rt:
        model, optimizer = manage(rt, model, OPTIMIZERS[name], home, declared)
        got = loop(model, optimizer, range(3))
        plan = rt.plan
        assert plan.persistent_chunks < plan.chunks and set(plan.state_home[plan.persistent_chunks :]) == {home}
        if declared:
            assert rt._model_states[-1].early_chunk_steps > 0
        state = optimizer.state_dict()["state"]
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert_same_state(state, plain_optimizer.state_dict()["state"])
    assert list(tmp_path.iterdir()) == []


def test_lbfgs_and_a_cross_parameter_optimizer_are_refused_before_the_first_step(tmp_path):
    class Undeclared(PerParameterSGD):
        tiermem_per_parameter = False

    with tiermem.Runtime(config(tmp_path, DEVICE)) as rt:
        model = make_model()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(UnsupportedOptimizerError, match=r"LBFGS is not supported: its step\(\) needs a closure"):
            rt.manage(model, torch.optim.LBFGS(model.parameters()))
        with pytest.raises(UnsupportedOptimizerError, match=r"SparseAdam is not supported: it needs sparse"):
            rt.manage(model, torch.optim.SparseAdam, lr=0.1)
        with pytest.raises(UnsupportedOptimizerError, match=r"reads across parameters.*clip_grad_norm="):
            rt.manage(model, GlobalNormSGD(model.parameters()))
        with pytest.raises(UnsupportedOptimizerError, match=r"declare it: `.*Undeclared.tiermem_per_parameter = True`"):
            rt.manage(model, Undeclared(model.parameters()))
        assert_bitwise([p.detach() for p in model.parameters()], before)  # nothing stepped, nothing managed
        rt.manage(model, PerParameterSGD(model.parameters()))  # the model is still free to manage


def test_the_state_layout_is_learned_from_the_optimizer():
    """Sections for state shaped like its parameter; small states (scalars, factored statistics) for the rest."""
    from tiermem.states.optimizer import learn_state

    model = make_model()
    weight, bias = model[0].weight, model[0].bias

    def layout(make: Make) -> Any:
        base = make(model.parameters())
        return learn_state(type(base), base.defaults, base.param_groups)

    rng = torch.get_rng_state()
    adamw = layout(OPTIMIZERS["adamw"])
    layout(OPTIMIZERS["custom"])  # declared: checked on samples too
    assert torch.equal(torch.get_rng_state(), rng)  # the samples leave the user's RNG alone
    assert adamw.names == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") and adamw.sections(weight) == 3
    assert layout(OPTIMIZERS["sgd-plain"]).names == ()
    asgd = layout(OPTIMIZERS["asgd"])
    assert asgd.names == ("ax",)  # eta, mu and step are 0-d: small states
    pytest.importorskip("transformers")
    adafactor = layout(OPTIMIZERS["adafactor"])
    assert adafactor.names == () and adafactor.keys[id(weight)] == adafactor.keys[id(bias)] == ()
    beta1 = layout(OPTIMIZERS["adafactor-beta1"])  # exp_avg is element-wise: a section
    assert beta1.names == ("exp_avg",) and beta1.sections(weight) == beta1.sections(bias) == 1


@pytest.mark.parametrize("fmt", ["dcp", "zarr"])
def test_a_checkpoint_of_adafactor_resumes_bitwise(tmp_path, fmt):
    """Factored row/column statistics (small states of other shapes), 0-d RMS and the unfactored
    sections of the biases go through rt.save/rt.load: 2 steps, save, 2 more in a new runtime."""
    pytest.importorskip("transformers")
    if fmt == "zarr":
        pytest.importorskip("tensorstore")
    make = OPTIMIZERS["adafactor-beta1"]
    plain = make_model()
    want = loop(plain, make(plain.parameters()), range(4))
    path = tmp_path / "ckpt"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    with tiermem.Runtime(config(nvme, DEVICE)) as rt:
        model, optimizer = manage(rt, make_model(), make, "nvme", declared=False)
        got = loop(model, optimizer, range(2))
        rt.save(path, format=fmt)
    resumed = make_model(seed=1)  # other values: the checkpoint brings them back
    with tiermem.Runtime(config(nvme, DEVICE)) as rt:
        resumed, optimizer = manage(rt, resumed, make, "nvme", declared=False)
        rt.load(path)
        got += loop(resumed, optimizer, range(2, 4))
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in resumed.parameters()], [p.detach() for p in plain.parameters()])


def test_homes_and_the_plan_hold_the_real_state_bytes(tmp_path):
    """AdamW keeps two sections a chunk, Adafactor with beta1 one (its first moment), Adafactor and
    SGD without momentum none: the NVMe homes (what placement and the planner cost) follow."""
    pytest.importorskip("transformers")
    homes: dict[str, int] = {}
    sections = {"adamw-2": 2, "adafactor-beta1": 1, "adafactor": 0, "sgd-plain": 0}
    for name in sections:
        make = OPTIMIZERS[name] if name != "adamw-2" else (lambda p: torch.optim.AdamW(p, lr=1e-2))
        with tiermem.Runtime(config(tmp_path, DEVICE)) as rt:
            manage(rt, make_model(), make, "nvme", declared=False)
            states = rt._model_states[-1]
            offloaded = [c for c in states.store.chunks if c.offloaded]
            assert offloaded
            homes[name] = sum(c.home_bytes for c in offloaded)
            assert {c.sections for c in offloaded} == {sections[name]}
    assert homes["adamw-2"] == 3 * homes["sgd-plain"] and homes["adafactor-beta1"] == 2 * homes["sgd-plain"]
    assert homes["adafactor"] == homes["sgd-plain"]


class Blocks(nn.Module):
    """make_model's layers as repeated blocks, which the first-step profile needs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("name", ["adafactor-beta1", "asgd"])
def test_loaded_state_of_any_shape_goes_through_the_first_step_re_pack(tmp_path, name):
    """A state dict loaded into the managed optimizer (factored statistics, 0-d tensors and
    sections), then plan="auto" plans at the first step and re-packs the chunks from a snapshot
    of it: training goes on bitwise."""
    if name.startswith("adafactor"):
        pytest.importorskip("transformers")
    plain = Blocks()
    plain_optimizer = OPTIMIZERS[name](plain.parameters())
    loop(plain, plain_optimizer, range(1))
    weights, saved = copy.deepcopy(plain.state_dict()), copy.deepcopy(plain_optimizer.state_dict())
    want = loop(plain, plain_optimizer, range(1, 3))
    with tiermem.Runtime(config(tmp_path, 96 << 10, host="256KiB")) as rt:
        model = Blocks()
        model.load_state_dict(weights)
        model, optimizer = rt.manage(model, OPTIMIZERS[name](model.parameters()))
        optimizer.load_state_dict(saved)
        got = loop(model, optimizer, range(1, 3))
        assert rt.plan.predicted.step_s is not None  # planned at the first step
        assert rt.plan.persistent_chunks < rt.plan.chunks
        state = optimizer.state_dict()["state"]
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert_same_state(state, plain_optimizer.state_dict()["state"])


def test_a_sharded_model_takes_only_element_wise_optimizers():
    """FSDP2 ranks step local shards: Adafactor or a declared optimizer would see a shard."""
    from tiermem.states.optimizer import require_element_wise

    for cls in (torch.optim.AdamW, torch.optim.Rprop, torch.optim.ASGD):
        require_element_wise(cls)
    with pytest.raises(UnsupportedOptimizerError, match=r"PerParameterSGD on an FSDP2-sharded model.*a shard"):
        require_element_wise(PerParameterSGD)


@pytest.mark.parametrize("name", ["adafactor-beta1", "rprop", "nadam"])
def test_mixed_precision_steps_fp32_masters_with_any_optimizer(tmp_path, name):
    """rt.manage(param_dtype=torch.bfloat16): the optimizer steps the fp32 masters (the state
    learned in fp32), as a master-weights loop over a bf16 working copy does."""
    if name.startswith("adafactor"):
        pytest.importorskip("transformers")
    model = make_model()
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    optimizer = OPTIMIZERS[name](masters)
    model.to(torch.bfloat16)
    want = []
    for step in range(3):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
        model.zero_grad()
        want.append(loss.detach())
    with tiermem.Runtime(config(tmp_path, DEVICE)) as rt:
        managed = make_model()
        managed, managed_optimizer = rt.manage(
            managed,
            OPTIMIZERS[name](managed.parameters()),
            plan={**PLAN, "state_home": "nvme"},
            param_dtype=torch.bfloat16,
        )
        got = []
        for step in range(3):
            x, y = batch(step)
            loss = nn.functional.mse_loss(managed(x.bfloat16()).float(), y)
            loss.backward()
            managed_optimizer.step()
            managed_optimizer.zero_grad()
            got.append(loss.detach())
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in managed.parameters()], [m.detach() for m in masters])


def test_a_misspelt_keyword_of_manage_is_named_not_blamed_on_the_optimizer(tmp_path):
    """Keyword arguments rt.manage does not take go to the optimizer class; one that looks like a
    keyword of rt.manage is named as such, and the list of those matches rt.manage's signature."""
    from tiermem.states.optimizer import MANAGE_KEYWORDS

    keywords = [
        p.name for p in inspect.signature(tiermem.Runtime.manage).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]
    assert sorted(MANAGE_KEYWORDS) == sorted(["plan", *keywords])
    with tiermem.Runtime(config(tmp_path, device="1MiB")) as rt:
        with pytest.raises(TypeError, match=r"Did you mean rt\.manage's grad_accumulation_steps="):
            rt.manage(nn.Linear(4, 4), torch.optim.AdamW, lr=1e-3, grad_accum_steps=2)
        with pytest.raises(TypeError, match="unexpected keyword argument 'betaz'") as refused:
            rt.manage(nn.Linear(4, 4), torch.optim.AdamW, betaz=(0.9, 0.99))  # the optimizer's own error
        assert "rt.manage's" not in str(refused.value)
