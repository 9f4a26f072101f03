"""Each AdamW implementation flag (the single-tensor default, ``foreach=True``, ``fused=True``) stays
bitwise plain PyTorch with the same flag when chunks step early, during backward, from host and
NVMe homes (NOTE [ Exact optimizer step ] rule 2, NOTE [ Declared steps ] rule 3). The plain loop
with these flags is covered in ``test_states.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tiermem
from tests.test_states import (
    assert_bitwise,
    config,
    make_model,
    param_groups,
    state_bytes,
)
from tests.test_states_declared import managed, plain_loop

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

FLAGS: dict[str, dict[str, Any]] = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def adamw(groups: Any, flag: str) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95), **FLAGS[flag])


@pytest.mark.parametrize("home", ["host", "nvme"])
@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_each_flag_steps_early_bitwise_plain(tmp_path, flag, home):
    plain = make_model()
    plain_optimizer = adamw(param_groups(plain), flag)
    want = plain_loop(plain, plain_optimizer, 3, 1, None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model,
            adamw(param_groups(model), flag),
            plan={"state_home": home},
            grad_accumulation_steps=1,
            keep_gradients=False,
        )
        for key in ("foreach", "fused"):  # the user's choice reaches torch's step
            assert optimizer.param_groups[0][key] == plain_optimizer.param_groups[0][key]
        got = plain_loop(model, optimizer, 3, 1, None)
        assert managed(rt).early_chunk_steps > 0
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []
