"""Moving, casting and freezing a managed model (issue 22 item 4; NOTE [ Moving a managed model ]):
moves that change nothing keep working, every other ``nn.Module._apply`` is refused before a
tensor changes (training then goes on bitwise plain), freezing mid-run trains bitwise like plain
PyTorch, and ``load_state_dict`` mid-run copies into the chunks."""

from __future__ import annotations

import copy
from collections.abc import Callable

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
)
from tiermem.states import StatesUsageError

STEPS = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    between: Callable[[nn.Module, int], None] = lambda model, step: None,
    *,
    set_to_none: bool = True,
) -> list[torch.Tensor]:
    """Losses of STEPS steps; ``between(model, step)`` runs before each step's forward."""
    losses = []
    for step in range(STEPS):
        between(model, step)
        tokens, targets = batch(step)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        losses.append(loss.detach())
    return losses


def plain_run(between: Callable[[nn.Module, int], None], **kwargs: bool) -> tuple[list[torch.Tensor], nn.Module]:
    model = make_model()
    return run(model, OPTIMIZERS["adamw"](param_groups(model)), between, **kwargs), model


def managed(rt: tiermem.Runtime, model: nn.Module, **kwargs: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    return rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"}, **kwargs)


def small(tmp_path, model: nn.Module) -> dict[str, object]:
    """A device budget of 10% of the model states: chunks are released between uses."""
    return config(tmp_path, int(state_bytes("adamw", model) * 0.1))


def freeze_then_unfreeze(model: nn.Module, step: int) -> None:
    """Block 3 (and the tied embedding, read by the head) frozen for steps 1-2, training again at 3."""
    if step in (1, 3):
        for p in [*model.blocks[3].parameters(), model.wte.weight]:
            p.requires_grad_(step == 3)


@pytest.mark.parametrize(("declared", "set_to_none"), [(None, True), (None, False), (1, True), (1, False)])
def test_freezing_mid_run_is_bitwise_plain(tmp_path, declared, set_to_none):
    """Rule 4: frozen parameters get no gradient and are skipped (set_to_none) or stepped on their
    zeroed gradient, as plain AdamW does; at 10% device the backward does not pin their chunks
    waiting for gradients that never come (it ran out of device memory when it did), and a
    declared loop's frozen-step backwards count complete, so offloaded chunks step during them."""
    want, plain = plain_run(freeze_then_unfreeze, set_to_none=set_to_none)
    model = make_model()
    early: dict[int, int] = {}
    with tiermem.Runtime(small(tmp_path, model)) as rt:

        def between(m: nn.Module, step: int) -> None:
            early[step] = rt.stats().as_dict()["model_states"]["early_chunk_steps"]
            freeze_then_unfreeze(m, step)

        model, optimizer = managed(rt, model, grad_accumulation_steps=declared)
        got = run(model, optimizer, between, set_to_none=set_to_none)
        device = rt.stats().as_dict()["tiers"]["device"]
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert device["peak_bytes"] <= device["capacity"]
    if declared:
        assert early[3] > early[2] > early[1]  # chunks stepped early in both frozen steps


def test_a_frozen_parameter_keeps_its_value(tmp_path):
    model = make_model()
    with tiermem.Runtime(small(tmp_path, model)) as rt:
        model, optimizer = managed(rt, model)
        run(model, optimizer, lambda m, step: m.blocks[2].fc.weight.requires_grad_(step < 1))
        after_one = model.state_dict()["blocks.2.fc.weight"].clone()
        run(model, optimizer)
        assert model.blocks[2].fc.weight.grad is None
        assert_bitwise([model.state_dict()["blocks.2.fc.weight"]], [after_one])


def test_unfreezing_a_parameter_frozen_at_manage_is_refused(tmp_path):
    model = make_model()  # blocks[0].ln1.weight is frozen
    with tiermem.Runtime(small(tmp_path, model)) as rt:
        model, optimizer = managed(rt, model)
        run(model, optimizer)
        model.blocks[0].ln1.weight.requires_grad_(True)
        with pytest.raises(StatesUsageError, match=r"'blocks\.0\.ln1\.weight' did not require grad when rt\.manage"):
            model(batch(0)[0])
        model.blocks[0].ln1.weight.requires_grad_(False)
        run(model, optimizer)  # usable again
    assert list(tmp_path.iterdir()) == []


NO_OPS: dict[str, Callable[[nn.Module], object]] = {
    "to-cpu": lambda m: m.to("cpu"),
    "to-device": lambda m: m.to(torch.device("cpu"), non_blocking=True),
    "cpu": lambda m: m.cpu(),
    "float": lambda m: m.float(),
    "to-float32": lambda m: m.to(torch.float32),
    "part-to-cpu": lambda m: m.blocks[1].to("cpu"),
    "train-eval": lambda m: m.eval().train(),
}


@pytest.mark.parametrize("future", ["default", "overwrite", "swap"])
def test_moves_that_change_nothing_keep_working(tmp_path, future, monkeypatch):
    """Rule 1: with chunks released between uses; the torch.__future__ flags would replace even
    unchanged parameters, so they are off for the call (and restored after it)."""
    if future == "overwrite":
        monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    if future == "swap":
        monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
    want, plain = plain_run(lambda m, step: None)
    model = make_model()
    parameters = list(model.parameters())

    def moves(m: nn.Module, step: int) -> None:
        for move in NO_OPS.values():
            assert move(m) is not None
        assert list(m.parameters()) == parameters  # the same Parameter objects

    with tiermem.Runtime(small(tmp_path, model)) as rt:
        model, optimizer = managed(rt, model)
        got = run(model, optimizer, moves)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert torch.__future__.get_swap_module_params_on_conversion() == (future == "swap")
    assert torch.__future__.get_overwrite_module_params_on_conversion() == (future == "overwrite")


REFUSED: dict[str, tuple[Callable[[nn.Module], object], str]] = {
    "half": (lambda m: m.half(), r"'wte\.weight' from torch\.float32 into torch\.float16.*param_dtype="),
    "bfloat16": (lambda m: m.bfloat16(), r"from torch\.float32 into torch\.bfloat16"),
    "double": (lambda m: m.double(), r"into torch\.float64"),
    "to-dtype": (lambda m: m.to(torch.float16), r"into torch\.float16"),
    "part-half": (lambda m: m.blocks[2].half(), r"'blocks\.2\.ln1\.weight' from torch\.float32 into torch\.float16"),
    "to-meta": (lambda m: m.to("meta"), r"from cpu to meta; rt\.manage keeps parameters in chunks on the device tier"),
    "cuda": (lambda m: m.cuda(), r"cannot tell what .* would do to the managed parameter 'wte\.weight'"),
    "to-empty": (lambda m: m.to_empty(device="cpu"), r"replace the managed parameter 'wte\.weight' .* with another"),
    "share-memory": (lambda m: m.share_memory(), r"cannot tell what"),
}


def test_moves_that_change_parameters_are_refused_before_anything_changes(tmp_path):
    """Rules 1, 2: each is refused with what to do instead; the model (buffers included) is left as
    it was, so training goes on bitwise plain."""
    want, plain = plain_run(lambda m, step: None)
    model = make_model()
    model.blocks[2].register_buffer("scale", torch.ones(3))  # unmanaged, in a module without own parameters
    errors = {}

    def attempts(m: nn.Module, step: int) -> None:
        for name, (move, pattern) in REFUSED.items():
            with pytest.raises(StatesUsageError, match=pattern) as error:
                move(m)
            errors[name] = str(error.value)
        assert m.blocks[2].scale.dtype == torch.float32

    with tiermem.Runtime(small(tmp_path, model)) as rt:
        model, optimizer = managed(rt, model)
        got = run(model, optimizer, attempts)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert all("leave the Runtime first" in message or "Leave the Runtime" in message for message in errors.values())
    # Leaving the Runtime removed the guards: an ordinary model again.
    assert all("_apply" not in vars(module) for module in model.modules())
    assert model.half().wte.weight.dtype == torch.float16


def test_load_state_dict_mid_run_copies_into_the_chunks(tmp_path, monkeypatch):
    """Rule 3: loading other values mid-run, with chunks released, trains on exactly as plain
    PyTorch loading them; under the swap flag the load is refused before anything is loaded."""
    other = make_model(seed=7).state_dict()

    def load(m: nn.Module, step: int) -> None:
        if step == 2:
            m.load_state_dict(other)

    want, plain = plain_run(load)
    model = make_model()
    with tiermem.Runtime(small(tmp_path, model)) as rt:
        model, optimizer = managed(rt, model)
        got = run(model, optimizer, load)
        before = copy.deepcopy(model.state_dict())
        monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
        with pytest.raises(StatesUsageError, match="swap_module_params_on_conversion"):
            model.load_state_dict(make_model(seed=8).state_dict())
        monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", False)
        assert_bitwise(list(model.state_dict().values()), list(before.values()))
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
