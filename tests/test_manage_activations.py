"""rt.manage applies the activation policy itself (issue 22 item 1, NOTE [ Managed activations ]):
bitwise plain PyTorch with activations on NVMe or the host and no context in the loop, the plan's
policy under "auto", opting out, no-grad forwards left alone, exceptions and interrupted forwards
leaving no hooks, rt.offload_activations on a managed model holding it (never two sets of hooks),
and the planner's predicted device peak holding for the loop rt.manage alone runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import OPTIMIZERS, assert_bitwise, make_model, param_groups, reference, state_bytes, train
from tiermem.activations.managed import ActivationCaptureError, ActivationPolicyError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def config(tmp_path: Any, device: int = 64 << 20, policy: str = "auto") -> dict[str, Any]:
    return {
        "device": {"capacity": device, "device": "cpu"},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
        "activations": {"min_bytes": "1KiB", "policy": policy},  # the tiny model's tensors are 4-16 KiB
    }


def top_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def written(rt: tiermem.Runtime) -> dict[str, int]:
    return dict(rt.stats().activations.bytes_written)


@pytest.mark.parametrize("policy", ["nvme", "host", {0: "recompute", "blocks.1": "nvme", 2: "host"}])
def test_manage_alone_applies_a_fixed_policy_bitwise(tmp_path, policy):
    want_losses, want_params = reference("adamw")
    model = make_model()
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan={"persistent_chunks": 0}, activations=policy
        )
        losses = train(model, optimizer, range(3))  # no context anywhere in the loop
        assert top_hooks() is None  # nothing left pushed on this thread
        tiers = written(rt)
    params = [p.detach().clone() for p in model.parameters()]  # restored on leaving the runtime
    assert_bitwise(losses, want_losses)
    assert_bitwise(params, want_params)
    offloaded = {"nvme"} if policy == "nvme" else {"host"} if policy == "host" else {"nvme", "host"}
    assert all(tiers.get(tier, 0) > 0 for tier in offloaded), tiers
    assert all(tiers.get(tier, 0) == 0 for tier in {"nvme", "host"} - offloaded), tiers
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("policy", ["keep", "nvme"])
def test_a_parameter_changed_between_forward_and_backward_is_pytorchs_error(tmp_path, policy):
    """NOTE [ Activation offload rules ] rules 3 and 5 under ``rt.manage``'s own hooks: a managed
    parameter changed in place after the forward that saved it fails backward as in plain
    PyTorch, not with a gradient of the changed weight (TRAPS 1)."""

    def step(model: nn.Module) -> None:
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(tokens).float().square().mean()
        with torch.no_grad():
            model.blocks[1].fc.weight.mul_(0.5)
        loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(make_model())
    model = make_model()
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, _ = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), activations=policy)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
            step(model)
    assert "expected version" in str(ours.value)


def test_auto_applies_the_plans_block_policy_and_none_opts_out(tmp_path):
    blocks = ["host"] * 7 + ["keep"]
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model()
        plan = {"persistent_chunks": 0, "block_policy": blocks}  # a hand plan that carries a block policy
        model, optimizer = rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)
        train(model, optimizer, range(1))
        assert written(rt).get("host", 0) > 0 and written(rt).get("nvme", 0) == 0
        other = make_model(seed=1)
        other, other_optimizer = rt.manage(other, torch.optim.SGD(other.parameters(), lr=0.1), activations=None)
        before = rt.stats().activations.captured_bytes
        train(other, other_optimizer, range(1))
        assert rt.stats().activations.captured_bytes == before  # opted out: nothing captured


def test_auto_without_a_planned_policy_is_the_configurations(tmp_path):
    with tiermem.Runtime(config(tmp_path, policy="host")) as rt:
        model = make_model()
        model, optimizer = rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), plan={"persistent_chunks": 0})
        train(model, optimizer, range(1))
        assert written(rt).get("host", 0) > 0 and written(rt).get("nvme", 0) == 0


def test_no_grad_forwards_are_not_captured_and_eval_works(tmp_path):
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model()
        model, optimizer = rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), activations="nvme")
        tokens, _ = next(iter([torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))])), None
        model.eval()
        with torch.no_grad():
            out = model(tokens)
        assert rt.stats().activations.captured_bytes == 0 and top_hooks() is None
        model.train()
        train(model, optimizer, range(1))
        assert rt.stats().activations.captured_bytes > 0
        assert out.shape == (2, 16, 64)


def test_offload_activations_on_a_managed_model_holds_it_with_one_set_of_hooks(tmp_path):
    want_losses, _ = reference("sgd", steps=2)
    model = make_model()
    seen: list[Any] = []
    model.blocks[3].register_forward_pre_hook(lambda _m, _a: seen.append(top_hooks()))
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["sgd"](param_groups(model)), plan={"persistent_chunks": 0}, activations="nvme"
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        losses = []
        for step in range(2):
            # The same policy: the managed offloader, widened to the loss; another: the context's own.
            with rt.offload_activations(model, policy=None if step == 0 else "keep") as offloader:
                tokens, targets = __import__("tests.test_states", fromlist=["batch"]).batch(step)
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                assert top_hooks()[0] == offloader.hooks.pack  # the context's, pushed once
                loss.backward()
            losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            assert top_hooks() is None
        assert offloader.requested == "keep"
        with pytest.raises(ActivationCaptureError, match="already open"), rt.offload_activations(model):  # noqa: SIM117
            with rt.offload_activations(model):
                pass
    assert_bitwise(losses, want_losses)
    assert len(seen) == 2 and seen[0][0] != seen[1][0]  # a different offloader in each step, one at a time


def test_an_exception_in_forward_leaves_no_hooks_and_training_goes_on(tmp_path):
    model = make_model()
    block = model.blocks[2]
    hooks_before = (len(block._forward_pre_hooks), len(block._forward_hooks))

    def fail(_module: nn.Module, _args: Any) -> None:
        raise ValueError("boom")

    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer = rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), activations="nvme")
        handle = model.blocks[4].register_forward_pre_hook(fail)
        with pytest.raises(ValueError, match="boom"):
            train(model, optimizer, range(1))
        assert top_hooks() is None
        assert (len(block._forward_pre_hooks), len(block._forward_hooks)) == hooks_before
        handle.remove()
        optimizer.zero_grad()
        train(model, optimizer, range(2))
        activations = rt.stats().activations  # writes started: landed, or forwarded when backward came first
        assert (written(rt).get("nvme", 0) > 0 or activations.forwarded > 0) and top_hooks() is None


def test_an_interrupted_forward_is_closed_at_the_next_step(tmp_path):
    # KeyboardInterrupt bypasses torch's always_call forward hooks (NOTE [ Managed activations ] rule 6).
    model = make_model()
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer = rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), activations="nvme")
        train(model, optimizer, range(1))  # planned as its forward started (its profiling step runs the hooks too)

        def interrupt(_module: nn.Module, _args: Any) -> None:
            raise KeyboardInterrupt

        handle = model.blocks[4].register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            train(model, optimizer, range(1))
        handle.remove()
        assert top_hooks() is not None  # torch ran no always_call hook
        optimizer.zero_grad()
        assert top_hooks() is None
        train(model, optimizer, range(1))
        assert top_hooks() is None


def test_checkpointed_blocks_and_nested_root_calls_are_captured_once(tmp_path):
    class Twice(nn.Module):
        """Calls the managed root inside its own forward (a nested forward)."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()
            self.blocks = self.inner.blocks

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.inner(tokens)

    def checkpointed(model: nn.Module) -> None:
        for block in model.blocks:
            forward = block.forward
            block.forward = lambda x, f=forward: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)

    plain = make_model()
    checkpointed(plain)
    want_losses = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), range(2))
    model = make_model()
    checkpointed(model)
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer = rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), activations="nvme")
        losses = train(model, optimizer, range(2))
        assert top_hooks() is None
    assert_bitwise(losses, want_losses)


def test_bad_activations_are_refused_clearly(tmp_path):
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model()
        with pytest.raises(ActivationPolicyError, match=r"activations='disk'.*not one of"):
            rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), activations="disk")
        with pytest.raises(ActivationPolicyError, match=r"takes 'auto', a policy name"):
            rt.manage(model, torch.optim.SGD(model.parameters(), lr=0.1), activations=3)
        with pytest.raises(ActivationPolicyError, match="fix two activation policies"):
            rt.manage(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                plan={"block_policy": "host"},
                sample=(torch.zeros(2, 16, dtype=torch.long),),
                activations="nvme",
            )
        mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        with pytest.raises(ActivationPolicyError, match=r"no nn\.ModuleList of identical layers"):
            rt.manage(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), activations="nvme")
        rt.manage(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1))  # auto: nothing to apply to, no error
        mlp(torch.ones(2, 8)).sum().backward()


class WithLoss(nn.Module):
    """The loss inside forward, as Hugging Face models compute it given labels: what the profile
    of a tuple sample counts is what the managed forward captures (NOTE [ Managed activations ] rule 3)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.gpt = make_model(layers=layers)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.gpt(tokens).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("fraction", [0.4, 0.6])
def test_the_plans_predicted_device_peak_holds_for_manage_alone(tmp_path, fraction):
    from tests.test_states import batch

    model = WithLoss(layers=6)
    with tiermem.Runtime(config(tmp_path, device=int(state_bytes("adamw", model) * fraction))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3, sample=batch(99))
        predicted = rt.plan.predicted.peak_bytes["device"]
        rt.tiers["device"].reset_peak()
        for step in range(3):  # no context: rt.manage alone
            model(*batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        measured = rt.stats().tiers["device"].peak_bytes
        assert rt.stats().activations.captured_bytes > 0
    assert abs(measured - predicted) <= 0.10 * predicted, (measured, predicted)
