"""Regional ``torch.compile`` under ``rt.manage`` (issue 22 item 3; NOTE [ Compiling a managed
model ] rule 1): blocks compiled with ``torch.compile(block)`` and put back before ``rt.manage``
train bitwise like plain PyTorch with the same blocks compiled, with states on the host or NVMe and
the managed activation policy in force. Inductor (it needs the C++ compiler): its results are not
eager's, so matching them shows the compiled graphs themselves ran, the same ones as plain's."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import tiermem
from tests.test_states import OPTIMIZERS, batch, config, make_model, param_groups, reference, state_bytes

#: dynamo reads .grad of the fake tensors it traces with (torch 2.13): warned as an error otherwise
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def compiled_model() -> nn.Module:
    """The test GPT with each block compiled and put back, as torchtitan does."""
    model = make_model(layers=2)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="inductor")
    return model


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[float], list[torch.Tensor]]:
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # state_dict: a managed model's released parameters are read from their homes (rule 1)
    return losses, [value.clone() for value in model.state_dict().values()]


@functools.cache
def compiled_reference() -> tuple[list[float], list[torch.Tensor], int]:
    """Plain PyTorch, the same blocks compiled: losses, final state, graphs dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    model = compiled_model()
    losses, state = train(model, OPTIMIZERS["adamw"](param_groups(model)))
    return losses, state, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    ("home", "activations", "warm"),
    [
        ("host", None, False),
        ("nvme", "nvme", False),
        ("host", {0: "recompute", 1: "host"}, False),
        ("nvme", None, True),
    ],
    ids=["host-states", "nvme-states-nvme-activations", "recompute-and-host-activations", "plain-graphs-reused"],
)
def test_regional_compilation_trains_bitwise_like_compiled_plain_pytorch(
    tmp_path, home: str, activations: Any, warm: bool
):
    """``warm``: dynamo still holds the graphs it compiled for the plain model's blocks and runs
    them for the managed ones (it does not guard on module hooks: TRAPS 34); tiermem's hooks are
    outside them, on the wrappers, so that is right."""
    losses, state, graphs = compiled_reference()
    eager_losses, _ = reference("adamw", steps=STEPS)
    assert losses != [loss.item() for loss in eager_losses]  # inductor's results are not eager's
    torch._dynamo.reset()
    if warm:
        compiled_model()(batch(0)[0])  # plain blocks, compiled: dynamo keeps their graphs
    model = compiled_model()
    counters.clear()
    settings = config(tmp_path, int(state_bytes("adamw", model) * 0.6))
    settings["activations"] = {"min_bytes": "1KiB"}  # the tiny model's tensors are 4-16 KiB
    with tiermem.Runtime(settings) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": home}, activations=activations
        )
        got_losses, got_state = train(model, optimizer)
        streamed = [c for c in rt.__dict__["_model_states"][0].describe()["chunks"] if not c["persistent"]]
        captured, written = rt.stats().activations.captured_bytes, rt.stats().activations.bytes_written
    assert got_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(state, got_state, strict=True))
    # the graphs plain PyTorch compiled, no more: no hook of tiermem's was traced into a block
    assert counters["stats"]["unique_graphs"] == (0 if warm else graphs)
    assert streamed and all(c["home"] == home for c in streamed)
    assert (captured > 0) == (activations is not None)
    if activations is not None:  # saved tensors of the compiled blocks went to their tiers
        assert written.get("nvme" if activations == "nvme" else "host", 0) > 0
    assert list(tmp_path.iterdir()) == []
