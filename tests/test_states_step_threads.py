"""Chunk steps on the step thread (NOTE [ Step threads ]): the compute runs there while backward goes
on, with the training thread's intra-op thread count, every AdamW flag stays bitwise plain PyTorch,
a compute's error is raised on the training thread with the home sent back, and the setting is
checked."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import (
    assert_bitwise,
    config,
    make_model,
    param_groups,
    state_bytes,
)
from tests.test_states_declared import managed, plain_loop
from tests.test_states_optimizer_flags import FLAGS, adamw
from tiermem.registry import ObjectState
from tiermem.states import chunk_step
from tiermem.states import step_thread as step_thread_module
from tiermem.states.chunk_step import ChunkStep
from tiermem.states.step_thread import AUTO_MIN_CORES, ENV_VAR, spare_core, step_thread_wanted

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


class Watch:
    """What each chunk compute saw: its thread, intra-op threads, whether the training thread was in
    backward (of ``states``, once set)."""

    def __init__(self) -> None:
        self.states: Any = None
        self.seen: list[dict[str, Any]] = []

    def of(self, rt: tiermem.Runtime) -> list[dict[str, Any]]:
        self.states = managed(rt)
        return self.seen


@pytest.fixture
def step_thread(monkeypatch: pytest.MonkeyPatch) -> Watch:
    """The step thread on, every chunk compute watched."""
    monkeypatch.setenv(ENV_VAR, "on")
    watch = Watch()
    compute = ChunkStep.compute

    def watched(self: ChunkStep) -> None:
        states = watch.states
        in_backward = states is not None and states.backward.in_backward
        watch.seen.append(
            {"thread": threading.current_thread().name, "intra_op": torch.get_num_threads(), "in_backward": in_backward}
        )
        compute(self)

    monkeypatch.setattr(ChunkStep, "compute", watched)
    return watch


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_early_steps_compute_on_the_step_thread_bitwise(tmp_path, step_thread, flag):
    """Rules 1, 5: NVMe-homed chunks step during backward on the step thread; every flag is plain."""
    plain = make_model()
    want = plain_loop(plain, adamw(param_groups(plain), flag), 3, 1, None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, adamw(param_groups(model), flag), plan={"state_home": "nvme"}, grad_accumulation_steps=1
        )
        seen = step_thread.of(rt)
        got = plain_loop(model, optimizer, 3, 1, None)
        assert managed(rt).early_chunk_steps > 0
        assert not managed(rt).stepper.steps.busy  # rule 4: none in flight after optimizer.step()
    early = [s for s in seen if s["in_backward"]]
    assert early and all(s["thread"].startswith("tiermem-step") for s in seen)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


class Wide(nn.Module):
    """Parameters above torch's grain size (32768 elements), so two intra-op threads split them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(192, 331), nn.Linear(331, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.a(x)))


def wide_loop(model: nn.Module, optimizer: torch.optim.Optimizer, threads: tuple[int, ...]) -> list[torch.Tensor]:
    """A step per entry of ``threads``, run with that many intra-op threads."""
    out = []
    for step, count in enumerate(threads):
        torch.set_num_threads(count)  # the autouse fixture restores it
        x = torch.randn(8, 192, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.detach())
    return out


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_two_intra_op_threads_on_the_step_thread_bitwise(tmp_path, step_thread, flag):
    """Rule 5: the step thread splits kernels as the training thread would, following it from one
    intra-op thread to two, in a plain loop (steps at optimizer.step()) from host homes."""
    threads = (1, 2, 2)
    torch.manual_seed(0)
    plain = Wide()
    model = Wide()
    model.load_state_dict(plain.state_dict())
    want = wide_loop(plain, adamw(plain.parameters(), flag), threads)
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    with tiermem.Runtime(config(tmp_path, 2 * nbytes + (64 << 10), host="16MiB")) as rt:
        plan = {"state_home": "host", "persistent_chunks": 0}
        model, optimizer = rt.manage(model, adamw(model.parameters(), flag), plan=plan)
        seen = step_thread.of(rt)
        got = wide_loop(model, optimizer, threads)
        assert all(c["home"] == "host" for c in managed(rt).describe()["chunks"])
    assert all(s["thread"].startswith("tiermem-step") for s in seen)
    per_step = len(seen) // len(threads)
    assert [s["intra_op"] for s in seen] == [count for count in threads for _ in range(per_step)]
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_a_compute_error_is_raised_on_the_training_thread_with_homes_sent_back(tmp_path, step_thread, monkeypatch):
    """Rule 3: the second chunk compute fails; backward raises it, and no home stays staged."""
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model,
            adamw(param_groups(model), "default"),
            plan={"state_home": "nvme"},
            grad_accumulation_steps=1,
            keep_gradients=False,
        )
        plain_loop(model, optimizer, 1, 1, None)
        run_step = chunk_step.run_step
        calls = []

        def failing(*args: Any) -> Any:
            calls.append(threading.current_thread().name)
            if len(calls) == 2:
                raise RuntimeError("boom in the step")
            return run_step(*args)

        monkeypatch.setattr(chunk_step, "run_step", failing)
        with pytest.raises(RuntimeError, match="boom in the step"):
            plain_loop(model, optimizer, 1, 1, None)
        assert calls[1].startswith("tiermem-step")
        states = managed(rt)
        states.backward.settle()
        assert not states.stepper.steps.busy
        for chunk in states.chunks:
            if chunk.home_tier == "nvme":
                chunk.home.wait()
                assert chunk.home.tier == "nvme" and chunk.home.state is ObjectState.RESIDENT
    assert list(tmp_path.iterdir()) == []


def test_the_setting_is_checked_and_auto_follows_the_cores(monkeypatch):
    """Rule 6."""
    assert step_thread_wanted("on", cores=1) and not step_thread_wanted("off", cores=64)
    assert step_thread_wanted("auto", cores=AUTO_MIN_CORES)
    assert not step_thread_wanted("auto", cores=AUTO_MIN_CORES - 1)
    monkeypatch.setenv(ENV_VAR, " ON ")
    assert step_thread_wanted(cores=1)
    monkeypatch.setenv(ENV_VAR, "")
    assert step_thread_wanted(cores=AUTO_MIN_CORES)
    monkeypatch.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"TIERMEM_MODEL_STATES_STEP_THREAD=.yes. is not a step-thread setting"):
        step_thread_wanted()


@pytest.mark.parametrize(("flag", "home", "on_step_thread"), [("fused", "host", False), ("fused", "nvme", True)])
def test_auto_steps_fused_host_homes_inline(tmp_path, step_thread, monkeypatch, flag, home, on_step_thread):
    """Rule 6: under ``auto`` (with cores to spare) fused steps over host homes stay on the training
    thread, other steps go to the step thread; both bitwise plain."""
    monkeypatch.setenv(ENV_VAR, "auto")
    monkeypatch.setattr(step_thread_module, "usable_cores", lambda: AUTO_MIN_CORES)
    plain = make_model()
    want = plain_loop(plain, adamw(param_groups(plain), flag), 2, 1, None)
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, adamw(param_groups(model), flag), plan={"state_home": home}, grad_accumulation_steps=1
        )
        seen = step_thread.of(rt)
        got = plain_loop(model, optimizer, 2, 1, None)
    threads = {s["thread"].startswith("tiermem-step") for s in seen}
    assert threads == {on_step_thread}
    assert_bitwise(got, want)


def test_a_spare_core_is_one_beyond_the_intra_op_threads():
    """Rule 6's question, with the machine's answers given."""
    assert spare_core(cores=2, threads=1) and spare_core(cores=16, threads=8)
    assert not spare_core(cores=2, threads=2) and not spare_core(cores=8, threads=16)


def test_auto_steps_a_cpu_model_inline_while_its_compute_takes_every_core(tmp_path, step_thread, monkeypatch):
    """Rule 6: under ``auto`` a CPU model's chunks step inline while torch's intra-op threads take
    every usable core, and on the step thread once a core is spare, asked at each step; bitwise
    plain PyTorch with the same threads."""
    monkeypatch.setenv(ENV_VAR, "auto")
    monkeypatch.setattr(step_thread_module, "usable_cores", lambda: AUTO_MIN_CORES)
    threads_by_step = [AUTO_MIN_CORES, 1, AUTO_MIN_CORES]

    def loop(model: nn.Module, optimizer: Any, watch: Watch | None = None) -> list[Any]:
        got = []
        for threads in threads_by_step:
            torch.set_num_threads(threads)
            if watch is not None:
                watch.seen.append({"step_threads": threads})
            got += plain_loop(model, optimizer, 1, 1, None)
        return got + [p.detach().clone() for p in model.parameters()]

    plain = make_model()
    want = loop(plain, adamw(param_groups(plain), "default"))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, adamw(param_groups(model), "default"), plan={"state_home": "nvme"}, grad_accumulation_steps=1
        )
        seen = step_thread.of(rt)
        got = loop(model, optimizer, step_thread)
    on_thread_by_step: list[set[bool]] = []
    for entry in seen:
        if "step_threads" in entry:
            on_thread_by_step.append(set())
        else:
            on_thread_by_step[-1].add(entry["thread"].startswith("tiermem-step"))
    assert on_thread_by_step == [{False}, {True}, {False}]
    assert_bitwise(got, want)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward runs ``during(...)`` first: a long module backward with no hook in it."""

    during: Any = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _SlowBackward.during is not None:
            _SlowBackward.during()
        return grad


class TwoStages(nn.Module):
    """``head`` steps first in backward; ``body``'s backward is one long call (``_SlowBackward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_SlowBackward.apply(self.body(x)))


def test_a_stepped_home_is_written_back_as_its_compute_ends(tmp_path, monkeypatch):
    """Rule 7: the write-back of a home stepped on the step thread starts when the compute ends,
    not at the next hook. The head's step computes for 0.3 s; the body's backward (one call, no
    hook inside, entered while that step still computes) waits up to 5 s for the head's home to
    land on NVMe. Submitted at the finish (the next hook: after the body), it never would."""
    monkeypatch.setenv(ENV_VAR, "on")
    compute = ChunkStep.compute

    def slow(self: ChunkStep) -> None:
        time.sleep(0.3)
        compute(self)

    monkeypatch.setattr(ChunkStep, "compute", slow)
    torch.manual_seed(0)
    plain = TwoStages()
    model = TwoStages()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with tiermem.Runtime(config(tmp_path, 256 << 10)) as rt:
        model, optimizer = rt.manage(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            plan={"state_home": "nvme", "persistent_chunks": 0, "chunk_size": 17 << 10},
            grad_accumulation_steps=1,
            keep_gradients=False,
        )
        states = managed(rt)
        chunks = states.store.chunks
        names = states.facts.param_names
        head = next(c for c in chunks if any(n.startswith("head.") for n in names([s.index for s in c.layout.slots])))
        assert not any(n.startswith("body.") for n in names([s.index for s in head.layout.slots]))
        landed: list[bool] = []

        def watch() -> None:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if head.index in states.stepper._stepped and head.home.tier == "nvme":
                    landed.append(head.home.state is ObjectState.RESIDENT)
                    return
                time.sleep(0.01)
            landed.append(False)

        try:
            for step in range(3):
                for m, opt in ((plain, plain_optimizer), (model, optimizer)):
                    _SlowBackward.during = watch if m is model and step == 2 else None
                    loss = m(x).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        finally:
            _SlowBackward.during = None
        assert states.early_chunk_steps > 0
    assert landed == [True]
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []
