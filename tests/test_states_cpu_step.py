"""NOTE [ CPU steps of offloaded chunks ]: the settings a CPU step of an offloaded chunk gets when
the model is on a CUDA device. What can run without CUDA runs here: the cleaning of flags, its
math against plain PyTorch's CPU step, the refusals, and that a CPU model is left alone; moving
CUDA tensors to the CPU is tested in tests/test_cuda.py."""

from __future__ import annotations

import copy

import pytest
import torch

from tiermem.states.cpu_step import for_cpu_step
from tiermem.states.errors import UnsupportedOptimizerError
from tiermem.states.optimizer import run_step

CUDA = torch.device("cuda", 0)  # only a name here: nothing is allocated on it


def problem(seed: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 5, generator=generator)) for _ in range(2)]
    grads = [torch.randn(4, 5, generator=generator) for _ in range(2)]
    return params, grads


def step_shadow(cls, kwargs, device, steps=3):
    """``steps`` steps of ``cls`` through run_step after for_cpu_step, as the managed step runs them."""
    params, grads = problem(0)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    group = {**cls([torch.zeros(1)], **kwargs).defaults}
    user_group = copy.copy(group)
    state: dict[torch.Tensor, dict] = {}
    for _ in range(steps):
        groups, clean_state, attributes = for_cpu_step(device, [(group, params)], state, {}, optimizer_class=cls)
        state = dict(run_step(cls, group, groups, clean_state, attributes))
    assert group == user_group  # the live group is never edited
    return params, state


def step_plain(cls, kwargs, steps=3):
    params, grads = problem(0)
    optimizer = cls(params, **kwargs)
    for _ in range(steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return params, optimizer.state


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.Adam, {"lr": 1e-2, "capturable": True}),
        (torch.optim.AdamW, {"lr": 1e-2, "capturable": True, "amsgrad": True}),
        (torch.optim.AdamW, {"lr": torch.tensor(1e-2), "capturable": True}),
        (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    ],
)
def test_a_cpu_step_of_a_cuda_model_runs_capturable_settings_as_torchs_cpu_step(cls, kwargs):
    """Rule 2: capturable=True (which torch refuses for CPU parameters) steps as torch's CPU step
    with capturable=False, bitwise; a tensor lr stays a tensor of its dtype (rule 3)."""
    got, got_state = step_shadow(cls, kwargs, CUDA)
    plain_kwargs = {**kwargs, "capturable": False} if "capturable" in kwargs else kwargs
    want, want_state = step_plain(cls, plain_kwargs)
    for p, q in zip(got, want, strict=True):
        assert torch.equal(p, q)
        for key, value in want_state[q].items():
            assert torch.equal(got_state[p][key], value), key


def test_without_cleaning_torch_refuses_capturable_on_the_cpu():
    """What rule 2 fixes: the same step with the user's settings as they are fails in torch."""
    params, grads = problem(1)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    group = {**torch.optim.Adam([torch.zeros(1)], lr=1e-2, capturable=True).defaults}
    with pytest.raises((RuntimeError, AssertionError), match="capturable"):
        run_step(torch.optim.Adam, group, [(group, params)], {}, {})


def test_a_model_on_the_cpu_is_left_as_the_user_configured_it():
    """Rule 5: on the CPU device (and for chunks stepped on the device) nothing is cleaned."""
    params, _ = problem(2)
    group = {**torch.optim.Adam([torch.zeros(1)], lr=1e-2, capturable=True).defaults}
    groups = [(group, params)]
    state = {params[0]: {"step": torch.tensor(3.0)}}
    got_groups, got_state, _ = for_cpu_step(torch.device("cpu"), groups, state, {}, optimizer_class=torch.optim.Adam)
    assert got_groups is groups and got_state is state and got_groups[0][0]["capturable"] is True


def test_fused_without_cpu_kernels_is_refused_clearly():
    """Rule 4: dropping fused would change the math, so a torch without fused CPU kernels refuses."""
    params, _ = problem(3)
    group = {**torch.optim.AdamW([torch.zeros(1)], lr=1e-2).defaults, "fused": True}
    with pytest.raises(UnsupportedOptimizerError, match=r"AdamW\(fused=True\) on cuda:0.*torch .* no fused CPU"):
        for_cpu_step(CUDA, [(group, params)], {}, {}, optimizer_class=torch.optim.AdamW, fused_supported=lambda: False)
    groups, _, _ = for_cpu_step(
        CUDA, [(group, params)], {}, {}, optimizer_class=torch.optim.AdamW, fused_supported=lambda: True
    )
    assert groups[0][0]["fused"] is True
