"""``rt.manage(plan="auto")`` without ``sample=`` plans from the first real step (NOTE
[ Model-state rules ] rule 9): the first ``optimizer.step()`` profiles the first forward's
arguments and re-packs under the planner's plan, and training stays bitwise plain PyTorch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import (
    OPTIMIZERS,
    assert_bitwise,
    config,
    make_model,
    param_groups,
    reference,
    state_bytes,
    train,
)
from tiermem.planner.errors import ProfileError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


@pytest.mark.parametrize("fraction", [1.0, 0.1])
def test_auto_plans_at_the_first_step_and_training_stays_bitwise(tmp_path, fraction):
    model = make_model()
    capacity = int(state_bytes("adamw", model) * fraction)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        _, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        assert rt.plan is not None and rt.plan.predicted.step_s is None  # the default rule, so far
        losses = train(model, optimizer, range(1))
        planned = rt.plan
        assert planned.predicted.step_s is not None and planned.predicted.step_s > 0
        assert planned.block_policy is not None  # the offloader's auto policy follows it from now on
        losses += train(model, optimizer, range(1, 3))
        stats = rt.stats().as_dict()
        assert rt.plan == planned  # planned once
    want_losses, want_params = reference("adamw")
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_params)
    device = stats["tiers"]["device"]
    assert device["peak_bytes"] <= device["capacity"] == capacity
    if fraction < 1.0:
        assert planned.persistent_chunks < planned.chunks  # the plan streams what does not fit
    assert list(tmp_path.iterdir()) == []


def test_a_forward_with_keyword_arguments_is_profiled_with_them(tmp_path):
    class Keyworded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()

        def forward(self, *, tokens: torch.Tensor, scale: float) -> torch.Tensor:
            return self.inner(tokens) * scale

    torch.manual_seed(0)
    model = Keyworded()
    with tiermem.Runtime(config(tmp_path, 1 << 30)) as rt:
        _, optimizer = rt.manage(model, torch.optim.SGD, lr=0.1)
        model(tokens=torch.randint(0, 64, (2, 16)), scale=0.5).square().mean().backward()
        optimizer.step()
        assert rt.plan.predicted.step_s is not None


def test_a_failing_planner_keeps_the_default_placement_and_stays_exact(tmp_path, monkeypatch, caplog):
    import tiermem.planner.auto

    def refuse(*_args, **_kwargs):
        raise ProfileError("tiermem planner: refused for the test")

    monkeypatch.setattr(tiermem.planner.auto, "plan_model", refuse)
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.5)
    with caplog.at_level(logging.WARNING, logger="tiermem.states"), tiermem.Runtime(config(tmp_path, capacity)) as rt:
        _, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        losses = train(model, optimizer, range(3))
        assert rt.plan.predicted.step_s is None
    assert "planning from the first step failed" in caplog.text and "refused for the test" in caplog.text
    want_losses, want_params = reference("adamw")
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_params)


def test_a_step_inside_offload_activations_plans_at_a_later_step_outside(tmp_path):
    model = make_model()
    with tiermem.Runtime(config(tmp_path, 1 << 30)) as rt:
        _, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        with rt.offload_activations(model, policy="keep"):
            losses = train(model, optimizer, range(1))
        assert rt.plan.predicted.step_s is None  # the offloader's hooks were pushed: not yet
        losses += train(model, optimizer, range(1, 3))
        assert rt.plan.predicted.step_s is not None
    want_losses, want_params = reference("adamw")
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_params)


def test_no_room_for_a_plain_copy_keeps_the_default_placement(tmp_path, monkeypatch, caplog):
    import tiermem.states.core

    monkeypatch.setattr(tiermem.states.core, "memory_available", lambda _device: 1 << 10)
    model = make_model()
    with caplog.at_level(logging.WARNING, logger="tiermem.states"), tiermem.Runtime(config(tmp_path, 1 << 30)) as rt:
        _, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        train(model, optimizer, range(1))
        assert rt.plan.predicted.step_s is None
        monkeypatch.undo()  # so that closing can restore ordinary parameters
    assert "does not fit in free memory" in caplog.text


def test_a_fixed_activation_policy_is_kept_by_the_first_step_plan(tmp_path):
    model = make_model()
    with tiermem.Runtime(config(tmp_path, 1 << 30)) as rt:
        _, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"block_policy": "recompute"})
        losses = train(model, optimizer, range(3))
        assert rt.plan.predicted.step_s is not None
        assert rt.plan.block_policy == ("recompute",) * len(model.blocks)
    want_losses, want_params = reference("adamw")
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_params)
