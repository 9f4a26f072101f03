"""``rt.init()`` (NOTE [ Materialising under rt.init() ]): a model built inside it has its large
parameters on file-backed pages (not anonymous RAM), bitwise the values of a plain construction,
and trains under ``rt.manage`` bitwise like plain PyTorch; nothing is left on disk."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import OPTIMIZERS, assert_bitwise, config, make_model, param_groups
from tests.test_states import train as train_steps
from tiermem.app.models.gpt import GPT, GPTConfig
from tiermem.errors import RuntimeClosedError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def anonymous_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_built_model_is_plain_and_trains_bitwise(tmp_path):
    plain = make_model()
    want = train_steps(plain, OPTIMIZERS["adamw"](param_groups(plain)), range(3))
    with tiermem.Runtime(config(tmp_path, 256 * 1024)) as rt:
        with rt.init(min_bytes=1024) as built:
            model = make_model()
        assert built.tensors > 0
        file_backed = [p for p in model.parameters() if p.is_shared()]
        assert file_backed and all(p.numel() * p.element_size() >= 1024 for p in file_backed)
        fresh = make_model()
        assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in fresh.parameters()])
        assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in fresh.parameters()]
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"})
        got = train_steps(model, optimizer, range(3))
    assert_bitwise(got, want[0] if isinstance(want, tuple) else want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_parameters_do_not_take_anonymous_memory(tmp_path):
    """A 64 MiB model built under rt.init() grows the process's anonymous memory by far less."""
    config_ = GPTConfig(n_layer=4, d_model=512, n_head=8, vocab_size=4096, seq_len=64)
    with tiermem.Runtime(config(tmp_path, 64 * 1024)) as rt:
        before = anonymous_rss()
        with rt.init():
            model = GPT(config_)
        grown = anonymous_rss() - before
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert nbytes > 48 * 2**20
        assert grown < nbytes / 4, (grown, nbytes)
        del model
    assert list(tmp_path.iterdir()) == []


def test_factories_keep_their_meaning(tmp_path):
    with tiermem.Runtime(config(tmp_path, 64 * 1024)) as rt, rt.init(min_bytes=16):
        zeros, ones = torch.zeros(64, 8), torch.ones((64, 8), dtype=torch.float64)
        full = torch.full((32, 4), 2.5)
        empty = torch.empty(16, 16, requires_grad=True)
        small = torch.zeros(2)  # below min_bytes: ordinary memory
        ints = torch.zeros(64, 64, dtype=torch.int64)  # not floating point: ordinary memory
        random = torch.randn(64, 64)  # the RNG's own path (rule 2)
        layer = nn.Linear(32, 32)
    assert zeros.is_shared() and torch.equal(zeros, torch.zeros(64, 8))
    assert ones.is_shared() and torch.equal(ones, torch.ones(64, 8, dtype=torch.float64))
    assert full.is_shared() and torch.equal(full, torch.full((32, 4), 2.5))
    assert empty.is_shared() and empty.requires_grad and empty.shape == (16, 16)
    assert not small.is_shared() and not ints.is_shared() and not random.is_shared()
    assert layer.weight.is_shared() and layer(torch.ones(2, 32)).shape == (2, 32)


def test_init_outside_the_runtime_is_a_clear_error(tmp_path):
    rt = tiermem.Runtime(config(tmp_path, 64 * 1024))
    with pytest.raises(RuntimeClosedError):
        rt.init()


def test_building_holds_about_one_tensor_resident(tmp_path):
    """Rule 5, measured the way a user does (a fresh process's ru_maxrss, file-backed pages
    included): building a 420 MB model under rt.init() grows the peak by far less than it."""
    import json
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent(
        """
        import json, resource, sys
        import torch
        import tiermem
        from tiermem.app.models.gpt import GPT, GPTConfig
        torch.set_num_threads(1)
        config = GPTConfig(n_layer=8, d_model=1024, n_head=8, vocab_size=4096, seq_len=64)
        with tiermem.Runtime({"device": {"device": "cpu"}, "nvme": {"paths": [sys.argv[1]]}}) as rt:
            torch.ones(1)  # torch's own first allocations before the baseline
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            with rt.init():
                model = GPT(config)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            largest = max(p.numel() * p.element_size() for p in model.parameters())
            print(json.dumps({"grown": peak - before, "nbytes": nbytes, "largest": largest}))
        """
    )
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["nbytes"] > 400e6
    # about one tensor's pages (the largest, 16 MiB here) plus torch's init temporaries
    assert measured["grown"] < measured["nbytes"] / 4, measured
    assert list(tmp_path.iterdir()) == []


def _gpt_steps(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    losses = []
    for step in range(2):
        tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(step))
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("roomy", [False, True])
def test_leaving_the_runtime_keeps_parameters_within_the_capacities(tmp_path, roomy):
    """NOTE [ Materialising under rt.init() ] rule 6: parameters larger than the memory tiers'
    capacities come back on file-backed pages (RAM otherwise), with plain PyTorch's values."""
    config_ = GPTConfig(n_layer=8, d_model=256, n_head=4, vocab_size=512, seq_len=32)
    torch.manual_seed(0)
    plain = GPT(config_)
    want = _gpt_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    torch.manual_seed(0)
    model = GPT(config_)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    device, host = (4 * nbytes, 4 * nbytes) if roomy else (6 << 20, 9 << 20)
    assert roomy or device + host < nbytes
    settings = config(tmp_path, device, host=host)
    settings["nvme"]["capacity"] = "256MiB"
    with tiermem.Runtime(settings) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, lr=1e-3, plan={"state_home": "nvme", "persistent_chunks": 0, "buffers": 3}
        )
        got = _gpt_steps(model, optimizer)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    large = [p for p in model.parameters() if p.numel() * p.element_size() >= 64 * 1024]
    assert large
    assert [p.is_shared() for p in large] == [not roomy] * len(large)
    assert list(tmp_path.iterdir()) == []
