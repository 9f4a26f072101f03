"""The plain loop overlaps (issue 33 item 1): an undeclared loop stages the first NVMe homes of
the step while backward runs (NOTE [ Declared steps ] rule 10) and reads each stored gradient once
per step even when the user clips first (NOTE [ Stored gradients ] rule 6), bitwise like plain
PyTorch and within the host's capacity."""

from __future__ import annotations

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
    reference,
    state_bytes,
    train,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

NVME_HOMES = {"state_home": "nvme"}
STORED = {"state_home": "nvme", "grad_home": "nvme"}


def _states(rt: tiermem.Runtime):
    return rt.__dict__["_model_states"][0]


def _within_capacities(rt: tiermem.Runtime) -> None:
    stats = rt.stats().as_dict()
    for tier in ("device", "host", "nvme"):
        assert stats["tiers"][tier]["peak_bytes"] <= stats["tiers"][tier]["capacity"], tier


def test_backward_stages_the_first_homes_of_the_step(tmp_path):
    """Rule 10: after the first step (which re-packs) every backward of a plain loop stages the
    first ``staged_homes`` NVMe homes of the step; once backward ended they are on the host (or
    on their way) and no other NVMe home is, and training stays bitwise."""
    want = reference("adamw", steps=4)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=NVME_HOMES)
        stepper = _states(rt).stepper
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        got, off_nvme = [], []
        for step in range(4):
            tokens, targets = batch(step, 0)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            got.append(loss.detach())
            chunks = _states(rt).store.chunks
            off_nvme.append([c.index for c in chunks if c.home_tier == "nvme" and c.home.tier != "nvme"])
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        first = stepper._first_to_step()
        assert len(first) == rt.plan.staged_homes == 2
        assert off_nvme[0] == []  # the first step re-packs: nothing staged before it
        # a home is staged when the host has room beside what the re-pack left there: every one later
        assert all(set(seen) <= set(first) for seen in off_nvme[1:])
        assert off_nvme[2:] == [first] * 2
        assert stepper.homes_staged_in_backward == sum(map(len, off_nvme))
        _within_capacities(rt)
    assert_bitwise(got, want[0][: len(got)])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])
