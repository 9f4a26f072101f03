"""Mixed precision (``rt.manage(param_dtype=)``, chunk layout rule 6): bf16/fp16 working
parameters on the device, fp32 masters and optimizer states in the homes; training is bitwise
the master-weights loop in plain PyTorch, on the CPU, with states on the device, host and NVMe."""

from __future__ import annotations

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
from tests.test_states_declared import manage_streaming
from tiermem.states import StatesUsageError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def master_weights_loop(dtype: torch.dtype, name: str, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain PyTorch: a working copy of the model in ``dtype``, AdamW/SGD over fp32 masters."""
    model = make_model()
    masters = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in model.parameters()]
    by_id = {id(p): m for p, m in zip(model.parameters(), masters, strict=True)}
    groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in param_groups(model)]
    optimizer = OPTIMIZERS[name](groups)
    model.to(dtype)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        loss = nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
        model.zero_grad()
        losses.append(loss.detach())
    return losses, [m.detach().clone() for m in masters]


def managed_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, after_step: Callable[[int], None] | None = None
) -> list[torch.Tensor]:
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        loss = nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if after_step is not None:
            after_step(step)
    return losses


@pytest.mark.parametrize(
    ("dtype", "name", "fraction", "home"),
    [
        (torch.bfloat16, "adamw", 1.0, "host"),
        (torch.bfloat16, "adamw", 0.1, "host"),
        (torch.bfloat16, "adamw", 0.1, "nvme"),
        (torch.float16, "sgd", 0.5, "nvme"),
    ],
)
def test_mixed_precision_is_the_master_weights_loop(tmp_path, dtype, name, fraction, home):
    steps = 3
    want_losses, want_masters = master_weights_loop(dtype, name, steps)
    model = make_model()
    capacity = int(state_bytes(name, model) * fraction)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS[name](param_groups(model)), plan={"state_home": home}, param_dtype=dtype
        )
        assert all(p.dtype == dtype for p in model.parameters())
        got = managed_loop(model, optimizer, steps)
        state = model.state_dict()
        assert all(v.dtype == dtype for v in state.values())
        stats = rt.stats().as_dict()
        assert stats["tiers"]["device"]["peak_bytes"] <= capacity
    assert_bitwise(got, want_losses)
    # Leaving the Runtime hands back the fp32 masters.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_bitwise([p.detach() for p in model.parameters()], want_masters)
    assert list(tmp_path.iterdir()) == []


def test_mixed_precision_state_dicts_round_trip(tmp_path):
    """Saved working parameters and fp32 optimizer states load back exactly after more training;
    the masters take the loaded (working) values."""
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adam"](param_groups(model)), param_dtype=torch.bfloat16)
        managed_loop(model, optimizer, 2)
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
        exp_avg = next(s["exp_avg"] for s in optimizer_state["state"].values())
        assert exp_avg.dtype == torch.float32  # the states are the masters'
        managed_loop(model, optimizer, 1)
        after = model.state_dict()
        assert any(not torch.equal(after[key], value) for key, value in model_state.items())
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        assert_bitwise(list(model.state_dict().values()), list(model_state.values()))
        loaded = optimizer.state_dict()["state"]
        for index, entry in optimizer_state["state"].items():
            keys = ("exp_avg", "exp_avg_sq")
            assert_bitwise([loaded[index][k] for k in keys], [entry[k] for k in keys])
    named = dict(model.named_parameters())  # after the Runtime: the fp32 masters, = the loaded working values
    assert_bitwise([p.detach() for p in named.values()], [model_state[name].float() for name in named])


def test_mixed_precision_refuses_what_it_cannot_keep_exact(tmp_path):
    with tiermem.Runtime(config(tmp_path, 1 << 20)) as rt:
        with pytest.raises(ValueError, match="param_dtype must be"):
            rt.manage(make_model(), torch.optim.Adam, lr=1e-3, param_dtype=torch.float64)
        half = make_model().to(torch.bfloat16)
        with pytest.raises(StatesUsageError, match="build the model in float32"):
            rt.manage(half, torch.optim.Adam, lr=1e-3, param_dtype=torch.bfloat16)


def test_declared_mixed_precision_steps_early_from_the_working_copy(tmp_path):
    """NOTE [ Declared steps ] rule 7 with bf16 working copies: an early step stages its NVMe
    home with the working section (the home's suffix) copied from the device copy and the
    fp32 masters and states read; training is still bitwise the master-weights loop."""
    steps = 3
    want_losses, want_masters = master_weights_loop(torch.bfloat16, "adamw", steps)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.3))) as rt:
        model, optimizer = manage_streaming(rt, model, plan={"state_home": "nvme"}, param_dtype=torch.bfloat16)
        read_after: list[int] = []
        got = managed_loop(
            model, optimizer, steps, lambda _: read_after.append(rt.stats().as_dict()["links"]["nvme->host"]["bytes"])
        )
        read = read_after[-1] - read_after[0]  # the steps after the first (which re-packs, then arms early steps)
        states = rt._model_states[-1]
        assert states.early_chunk_steps > 0
        homes = [c for c in states.chunks if c.home_tier == "nvme" and c.trainable]
        working = sum(c.nbytes for c in homes)  # each chunk's working section: bf16, half its master
        assert read == (steps - 1) * (sum(c.home_bytes for c in homes) - working)
    assert_bitwise(got, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_masters)
    assert list(tmp_path.iterdir()) == []


def test_a_spilled_re_pack_keeps_fp32_masters_in_old_nvme_homes_and_stays_exact(tmp_path, monkeypatch):
    """NOTE [ Spilled snapshots ] rule 5 with bf16 working copies: an old NVMe home taken over as
    the re-pack's snapshot is read where its fp32 masters and states lie (not its working
    section), so training after the re-pack is still bitwise the master-weights loop."""
    import tiermem.states.relayout

    adopted = []
    real_spill = tiermem.states.relayout.spill

    def spill(*args):
        spilled = real_spill(*args)
        adopted.append(len(getattr(spilled, "adopted", ())))
        return spilled

    monkeypatch.setattr(tiermem.states.relayout, "spill", spill)
    steps = 4
    want_losses, want_masters = master_weights_loop(torch.bfloat16, "adamw", steps)
    model = make_model()
    total = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, int(total * 0.1), host=int(total * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"}, param_dtype=torch.bfloat16
        )
        got = managed_loop(model, optimizer, 2)
        rt.declare(model, grad_accumulation_steps=1, keep_gradients=False)  # re-packs (declared steps rule 10)
        for step in range(2, steps):  # managed_loop's step, on the batches after the first two
            tokens, targets = batch(step)
            loss = nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            got.append(loss.detach())
    assert adopted and adopted[-1] > 0, adopted
    assert_bitwise(got, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_masters)
    assert list(tmp_path.iterdir()) == []
