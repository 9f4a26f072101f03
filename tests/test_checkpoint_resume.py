"""Resume after SIGKILL (issue 19, item 4) and saves killed at random moments (item 3), each in a
process of its own: this module's ``CHILDREN`` (``train``, ``save-loop``), forked by
tests/forked_children.py, are the children.

- A child trains N steps, saves, trains on and is SIGKILLed mid-step; this (new) process builds
  the model (plainly, or under ``rt.init()``), manages it, loads and trains M more: the losses and
  the parameters and AdamW states are bitwise those of N+M uninterrupted steps. Variants: states
  homed on NVMe (plain PyTorch is the reference), host homes with every host gradient behind a
  HostGradient and clipped by hand (``ModelStates.proxy_host_gradients``, NOTE [ Host gradients ]
  rule 7; plain PyTorch is the reference), and ``param_dtype=torch.bfloat16`` (an uninterrupted
  tiermem run is the reference: plain PyTorch has no fp32 masters).
- tests/test_checkpoint_crash.py kills a save loop at random and checks the files verify and the
  last checkpoint loads. Here each kill lands inside a save (timed from the child's "saving"
  line), the first trial's inside the very first save (no previous checkpoint: the path must stay
  absent), and each trial checks what the checkpoint holds: the step it names (the last save
  reported, or the next one if the kill came after its commit) and bitwise that step's weights,
  then that the next save leaves no temporary sibling.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.forked_children import ForkServer
from tiermem.checkpoint import files
from tiermem.states import ModelStates
from tiermem.states.hostgrad import HostGradient

W = 32
N, M = 3, 3
VARIANTS = ("nvme", "hostgrad", "bf16")
#: the save loop's model: 4 x 128 x 128 in 64 KiB chunks homed on NVMe (about 0.8 MiB of states)
SAVE_LOOP_PLAN = {"state_home": "nvme", "chunk_size": "64KiB", "persistent_chunks": 0}


class Net(nn.Module):
    """Dropout draws from the global RNG, which the load must restore."""

    def __init__(self, width: int = W, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.drop(torch.tanh(layer(x)))
        return x


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    """The tests run on one thread, as the children do; later tests get the thread count back
    (a kernel's reduction order depends on it: TRAPS 3's kind of difference)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def config(nvme: pathlib.Path, host: str = "1MiB") -> dict[str, Any]:
    nvme.mkdir(parents=True, exist_ok=True)
    return {
        "device": {"capacity": "1MiB", "device": "cpu"},
        "host": {"capacity": host},
        "nvme": {"paths": [str(nvme)], "capacity": "64MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
    }


def plan_of(variant: str) -> dict[str, Any]:
    return {"state_home": "host" if variant == "hostgrad" else "nvme", "chunk_size": "8KiB", "persistent_chunks": 0}


def manage_kwargs(variant: str) -> dict[str, Any]:
    return {"param_dtype": torch.bfloat16} if variant == "bf16" else {}


#: HostGradients ``train_steps`` clipped (the hostgrad variant must see them)
host_gradients_seen = [0]


def train_steps(model: nn.Module, optimizer: Any, steps: range, clip: bool) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, W, generator=torch.Generator().manual_seed(step))
        x = x.to(next(model.parameters()).dtype)  # bf16 under param_dtype
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        if clip:  # edits every .grad: HostGradient ops where the gradients wait on the host
            host_gradients_seen[0] += sum(isinstance(p.grad, HostGradient) for p in model.parameters())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def build(rt: tiermem.Runtime, variant: str, under_init: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with rt.init(min_bytes=1) if under_init else contextlib.nullcontext():
        model = Net()
    return rt.manage(model, torch.optim.AdamW, lr=1e-2, plan=plan_of(variant), **manage_kwargs(variant))


def snapshot(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    out = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        out.update({f"state.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@contextlib.contextmanager
def host_gradients(on: bool) -> Iterator[None]:
    previous = ModelStates.proxy_host_gradients
    ModelStates.proxy_host_gradients = on
    try:
        yield
    finally:
        ModelStates.proxy_host_gradients = previous


# -- the children ----------------------------------------------------------------------------------
def child_train(directory: str) -> None:
    """Each variant: N steps, save to ``directory/<variant>``; then train on until killed."""
    root = pathlib.Path(directory)
    with contextlib.ExitStack() as stack:
        for variant in VARIANTS:
            with host_gradients(variant == "hostgrad"), tiermem.Runtime(config(root / f"nvme-{variant}")) as rt:
                model, optimizer = build(rt, variant, under_init=False)
                losses = train_steps(model, optimizer, range(N), clip=variant == "hostgrad")
                rt.save(root / variant, extra={"step": N, "losses": losses})
        rt = stack.enter_context(tiermem.Runtime(config(root / "nvme-last")))
        model, optimizer = build(rt, "nvme", under_init=False)
        print("ready", flush=True)
        step = 0
        while True:  # killed in here, mid-step or mid-I/O
            train_steps(model, optimizer, range(step, step + 1), clip=False)
            step += 1


def child_save_loop(directory: str, path: str) -> None:
    """Step, say ``saving n``, save, say ``saved n``, forever: the parent kills it inside a save."""
    with tiermem.Runtime(config(pathlib.Path(directory), host="2MiB")) as rt:
        torch.manual_seed(0)
        model, optimizer = rt.manage(Net(128, 4), torch.optim.AdamW, lr=1e-2, plan=SAVE_LOOP_PLAN)
        n = 0
        while True:
            model(torch.randn(4, 128, generator=torch.Generator().manual_seed(n))).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"saving {n} {time.monotonic()}", flush=True)
            rt.save(path, extra={"n": n})
            print(f"saved {n} {time.monotonic()}", flush=True)
            n += 1


#: the children by name, for tests/forked_children.py
CHILDREN = {"train": child_train, "save-loop": child_save_loop}


def _killed(server: ForkServer, pid: int) -> list[str]:
    """SIGKILL the child ``pid``: the lines it printed that were not read yet."""
    lines, status = server.kill(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, lines  # not ended by itself
    return lines


# -- resume after SIGKILL --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer) -> pathlib.Path:
    """The checkpoints of a child that trained N steps per variant and was SIGKILLed after."""
    root = tmp_path_factory.mktemp("killed")
    pid = fork_server.start(__name__, "train", str(root))
    try:
        assert fork_server.readline() == "ready"
        time.sleep(0.2)  # inside the training that follows
    finally:
        _killed(fork_server, pid)
    return root


def uninterrupted(tmp_path: pathlib.Path, variant: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """N+M steps in one go: plain PyTorch, or tiermem where plain PyTorch is not the reference (bf16)."""
    clip = variant == "hostgrad"
    if variant == "bf16":
        with tiermem.Runtime(config(tmp_path / "nvme-reference")) as rt:
            model, optimizer = build(rt, variant, under_init=False)
            losses = train_steps(model, optimizer, range(N + M), clip)
            return losses, snapshot(model, optimizer)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_steps(model, optimizer, range(N + M), clip)
    return losses, snapshot(model, optimizer)


@pytest.mark.parametrize("under_init", [False, True], ids=["built", "rt.init"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_in_a_new_process_after_sigkill_is_bitwise(killed_run, tmp_path, variant, under_init):
    torch.set_num_threads(1)  # as the child: the same kernels' reduction order
    expected_losses, expected = uninterrupted(tmp_path, variant)
    with host_gradients(variant == "hostgrad"), tiermem.Runtime(config(tmp_path / "nvme")) as rt:
        model, optimizer = build(rt, variant, under_init)
        torch.manual_seed(1234)  # the load restores the RNG the dropout draws from
        extra = rt.load(killed_run / variant)
        assert extra["step"] == N
        homes = {c.home_tier for states in rt._model_states for c in states.chunks if not c.persistent}
        assert homes == {"host" if variant == "hostgrad" else "nvme"}
        host_gradients_seen[0] = 0
        losses = train_steps(model, optimizer, range(N, N + M), clip=variant == "hostgrad")
        assert (host_gradients_seen[0] > 0) == (variant == "hostgrad")
        assert extra["losses"] + losses == expected_losses
        assert_bitwise(snapshot(model, optimizer), expected)


# -- saves killed at random moments ----------------------------------------------------------------
def _leftovers(path: pathlib.Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def _weights_after_each_step(steps: int) -> list[dict[str, torch.Tensor]]:
    """Plain PyTorch's weights after 1..steps steps of the save loop's training."""
    torch.manual_seed(0)
    model = Net(128, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for n in range(steps):
        model(torch.randn(4, 128, generator=torch.Generator().manual_seed(n))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


def _kill_inside_a_save(
    server: ForkServer, path: pathlib.Path, nvme: pathlib.Path, saves_before: int, fraction: float
) -> list[str]:
    """Fork the save loop, kill it ``fraction`` of a save's duration after save ``saves_before``
    began; every line it printed."""
    pid = server.start(__name__, "save-loop", str(nvme), str(path))
    lines: list[str] = []
    save_s = 0.05
    try:
        while True:
            line = server.readline().split()
            assert line and line[0] != "ended", lines  # the child died by itself
            lines.append(" ".join(line))
            if line[0] == "saved":
                save_s = float(line[2]) - float(lines[-2].split()[2])
            if line[0] == "saving" and int(line[1]) == saves_before:
                break
        time.sleep(fraction * save_s * 1.2)  # inside the save, or (1 in 6) just after its commit
    finally:
        lines += _killed(server, pid)
    return lines


@pytest.mark.slow
def test_a_save_killed_inside_it_keeps_the_previous_checkpoint_exactly(tmp_path, fork_server):
    torch.set_num_threads(1)
    rng = random.Random(1919)
    reference = _weights_after_each_step(4)
    path = tmp_path / "ckpt"
    previous = None  # the step the checkpoint at path holds before each trial
    for trial in range(5):  # the commit's instants are covered exactly by tests/test_checkpoint_commit.py
        saves_before = 0 if trial == 0 else rng.randint(0, 2)
        lines = _kill_inside_a_save(fork_server, path, tmp_path / "nvme", saves_before, rng.random())
        saved = [int(line.split()[1]) for line in lines if line.startswith("saved")]
        if trial == 0 and not path.exists():
            continue  # killed inside the first save: no checkpoint at all, never a partial one
        assert files.verify(path), lines
        with tiermem.Runtime(config(tmp_path / "nvme-parent", host="2MiB")) as rt:
            torch.manual_seed(5)
            model, _ = rt.manage(Net(128, 4), torch.optim.AdamW, lr=1e-2, plan=SAVE_LOOP_PLAN)
            n = rt.load(path)["n"]
            # this trial's last reported save, or the next one (killed after its commit); a trial
            # killed inside its first save keeps the previous checkpoint (or committed save 0)
            assert n in ((saved[-1], saved[-1] + 1) if saved else (previous, 0)), (n, previous, lines)
            previous = n
            for name, value in model.state_dict().items():
                assert torch.equal(value, reference[n][name]), (trial, n, name)
            rt.save(path, extra={"n": n})  # removes what the killed save left beside it
        assert _leftovers(path) == [], (trial, lines)
