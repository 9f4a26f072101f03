"""``torch.compile`` of a managed model refused where it cannot be sound (issue 22 item 3; NOTE
[ Compiling a managed model ] rules 2, 3): the whole model, ``block.compile()`` and a block compiled
after ``rt.manage``, before any compiled code reads a chunk, also when dynamo would reuse a graph
compiled for an unmanaged model (TRAPS 34); each error points to regional compilation, which works
(tests/test_compile_regional.py). Dynamo's "eager" backend: the refusal is dynamo's business, not
inductor's, and it needs no C++ compile."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import OPTIMIZERS, batch, config, make_model, param_groups, state_bytes
from tiermem.states import StatesUsageError

#: dynamo reads .grad of the fake tensors it traces with (torch 2.13): warned as an error otherwise
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def loss_of(model: nn.Module, step: int = 0) -> torch.Tensor:
    tokens, targets = batch(step)
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def managed(tmp_path, model: nn.Module, rt: tiermem.Runtime) -> tuple[nn.Module, torch.optim.Optimizer]:
    return rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "host"}, activations=None)


def small(tmp_path, model: nn.Module) -> dict[str, object]:
    return config(tmp_path, int(state_bytes("adamw", model) * 0.3))


@pytest.mark.parametrize("how", ["method", "wrapper-after-manage"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "graph-compiled-before"])
def test_blocks_compiled_where_hooks_would_be_captured_are_refused_before_compiled_code_runs(tmp_path, how, warm):
    """``block.compile()`` (it compiles the block's hooks too) and ``torch.compile(block)`` put back
    after ``rt.manage`` (the manager's hooks are inside the wrapper already); with ``warm``, an
    unmanaged model of the same classes ran compiled first, so dynamo has a graph without tiermem's
    hooks that it would reuse (it read a released chunk's empty storage)."""
    if warm:
        plain = make_model(layers=2)
        for block in plain.blocks:
            block.compile(backend="eager")
        loss_of(plain)
    model = make_model(layers=2)
    with tiermem.Runtime(small(tmp_path, model)) as rt:
        model, _optimizer = managed(tmp_path, model, rt)
        for i, block in enumerate(model.blocks):
            if how == "method":
                block.compile(backend="eager")
            else:
                model.blocks[i] = torch.compile(block, backend="eager")
        if how == "method":
            match = re.escape("blocks.0.compile() compiled part of") + r".* compiles the module's hooks too"
        else:
            match = re.escape("torch.compile(blocks.0) was put into the model after rt.manage()")
        with pytest.raises(StatesUsageError, match=match + r".*model.blocks\[i\] = torch.compile\(model.blocks\[i\]\)"):
            loss_of(model)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "graph-compiled-before"])
def test_whole_model_compilation_is_refused(tmp_path, warm):
    """With ``warm``, the same model ran compiled before rt.manage: its graph would skip the hooks
    rt.manage adds (TRAPS 34); rt.manage drops it, so the next call traces them and refuses."""
    model = make_model(layers=2)
    compiled = torch.compile(model, backend="eager")
    if warm:
        loss_of(compiled)
    with tiermem.Runtime(small(tmp_path, model)) as rt:
        model, optimizer = managed(tmp_path, model, rt)
        with pytest.raises(StatesUsageError, match=r"torch.compile of a whole model .* compile each repeated block"):
            loss_of(compiled)
        loss_of(model).backward()  # the model itself still runs eagerly
        optimizer.step()
    assert list(tmp_path.iterdir()) == []
