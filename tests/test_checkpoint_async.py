"""Asynchronous checkpoints (issue 19 item 5): ``rt.save(path, blocking=False)`` holds the states
of the call while training goes on, bitwise a blocking save's (states on NVMe, and a declared
loop whose chunks step during backward); errors surface at ``wait()`` and at ``rt.close()``;
closing waits for the save; the copies stay within their bound; a process killed during an
async save leaves the previous checkpoint loadable. (NOTE [ Asynchronous saves ])"""

from __future__ import annotations

import copy
import os
import pathlib
import signal
import threading
import time
from typing import Any

import pytest
import torch

import tiermem
from tests.test_checkpoint import assert_bitwise, config, manage, snapshot, train
from tiermem.checkpoint import background
from tiermem.checkpoint.dcp_planners import StreamingSavePlanner
from tiermem.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


class Gate:
    """Holds the writer thread at its first chunk tensor until opened (or for ``delay`` per tensor)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> None:
        self.opened = threading.Event()
        self.tensors = 0
        gate = self

        class Gated(StreamingSavePlanner):
            def resolve_data(self, write_item: Any) -> Any:
                if self._source(write_item.index.fqn) is not None:
                    gate.opened.wait(5)  # a failing test must not hang
                    gate.tensors += 1
                    time.sleep(delay)
                return super().resolve_data(write_item)

        monkeypatch.setattr(background, "StreamingSavePlanner", Gated)


def loaded(tmp_path: pathlib.Path, path: pathlib.Path, **kwargs: Any) -> Any:
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, _ = manage(rt, seed=1, **kwargs)
        rt.load(path)
        return snapshot(model, optimizer)


def no_leftovers(directory: pathlib.Path) -> None:
    assert not [p.name for p in directory.iterdir() if ".tiermem-" in p.name]


LOOPS = pytest.mark.parametrize(
    "declared", [{}, {"grad_accumulation_steps": 1, "keep_gradients": False}], ids=["undeclared", "early-steps"]
)


@LOOPS
def test_an_async_save_while_training_goes_on_equals_a_blocking_save(tmp_path, monkeypatch, declared):
    gate = Gate(monkeypatch)
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt, **declared)
        train(model, optimizer, schedule, range(2))
        rt.save(tmp_path / "blocking", extra={"step": 2})
        extra = {"step": 2, "data": [1, 2]}
        pending = rt.save(tmp_path / "async", extra=extra, blocking=False)
        extra["data"].append(3)  # pickled at the call: later changes do not leak in
        model_states = rt._model_states[0]
        early = model_states.early_chunk_steps
        assert not pending.done()  # the writer waits at the gate: every step below overlaps it
        x = torch.randn(4, 64)
        loss = (model(x) - x).pow(2).mean()
        gate.opened.set()  # (a step would wait for the gated writer once copies fill their bound)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        train(model, optimizer, schedule, range(3, 5))
        if declared:
            assert model_states.early_chunk_steps > early  # chunks stepped in backward while pending
        pending.wait()
        pending.wait()  # once done, done
        assert pending.done() and pending.peak_bytes <= pending.bound_bytes
        live = snapshot(model, optimizer)
    blocking = loaded(tmp_path, tmp_path / "blocking", **declared)
    saved = loaded(tmp_path, tmp_path / "async", **declared)
    assert_bitwise(saved, blocking)
    assert not torch.equal(saved[0]["layers.0.weight"], live[0]["layers.0.weight"])  # training went on
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt, seed=1, **declared)
        assert rt.load(tmp_path / "async") == {"step": 2, "data": [1, 2]}
    no_leftovers(tmp_path)


def test_copies_stay_within_their_bound_and_a_step_waits_for_the_writer(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, delay=0.005)
    torch.manual_seed(0)
    deep = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(12)))  # a chunk per layer
    with tiermem.Runtime(config(tmp_path)) as rt:
        plan = {"state_home": "nvme", "chunk_size": "64KiB"}
        model, optimizer = rt.manage(deep, torch.optim.AdamW, lr=1e-3, plan=plan)
        states = rt._model_states[0]
        assert len(states.chunks) >= 12
        x = torch.randn(4, 128)

        def step() -> None:
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        saved = sum(c.home_bytes for c in states.chunks)
        pending = rt.save(tmp_path / "ckpt", blocking=False)
        assert pending.bound_bytes <= 3 * max(c.home_bytes for c in states.chunks) < saved / 3  # a few chunks
        assert 0 < pending.peak_bytes <= pending.bound_bytes  # the first copies, made at the call
        gate.opened.set()
        started = time.perf_counter()
        step()  # every chunk steps: each is copied first, within the bound, so the step waits for the writer
        assert time.perf_counter() - started > 0.005 * 24  # it waited for (2 tensors x) 12 - 3 chunks at least
        pending.wait()
        assert pending.peak_bytes <= pending.bound_bytes
        assert rt.registry.peak_resident_bytes("checkpoint", "host") <= pending.bound_bytes
        assert rt.registry.resident_bytes("checkpoint", "host") == 0  # every buffer freed
    no_leftovers(tmp_path)


def test_an_error_in_the_background_is_raised_at_wait_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(1))
        rt.save(tmp_path / "ckpt")
        before = snapshot(model, optimizer)

        def broken(directory: pathlib.Path, format: str) -> Any:
            raise OSError(28, "No space left on device (test)")

        monkeypatch.setattr(background, "_writer", broken)
        pending = rt.save(tmp_path / "ckpt", blocking=False)
        train(model, optimizer, schedule, range(1, 3))  # training goes on past the failed save
        with pytest.raises(CheckpointError, match=r"asynchronous save to .*ckpt failed.*No space left"):
            pending.wait()
        pending.wait()  # reported once
        assert rt.registry.resident_bytes("checkpoint", "host") == 0
        # Not waited for: the next close raises it, after closing.
        pending = rt.save(tmp_path / "ckpt", blocking=False)
        with pytest.raises(CheckpointError, match="No space left"):
            rt.close()
        assert not rt.running
    assert_bitwise(loaded(tmp_path, tmp_path / "ckpt"), before)
    no_leftovers(tmp_path)


def test_close_and_load_wait_for_a_pending_save(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    threading.Timer(0.3, gate.opened.set).start()
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        expected = snapshot(model, optimizer)
        pending = rt.save(tmp_path / "ckpt", blocking=False)
    assert pending.done()
    assert_bitwise(loaded(tmp_path, tmp_path / "ckpt"), expected)
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        gate.opened.clear()
        threading.Timer(0.3, gate.opened.set).start()
        rt.save(tmp_path / "ckpt2", blocking=False)
        rt.load(tmp_path / "ckpt")  # waits for the save first (it reads the chunks the save copies)
        assert (tmp_path / "ckpt2" / "tiermem-manifest.json").exists()
    no_leftovers(tmp_path)


def child_saves_then_trains(nvme: str, path: str) -> None:
    """A blocking save at step 2, then an async save whose writer is slow while training goes on."""
    directory = pathlib.Path(nvme)
    torch.set_num_threads(1)
    with tiermem.Runtime(config(directory)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        rt.save(path)
        original = StreamingSavePlanner.resolve_data

        def slow(self: StreamingSavePlanner, item: Any) -> Any:
            time.sleep(0.05)
            return original(self, item)

        background.StreamingSavePlanner = type("Slow", (StreamingSavePlanner,), {"resolve_data": slow})  # type: ignore[misc]
        rt.save(path, blocking=False)
        print("saving", flush=True)
        train(model, optimizer, schedule, range(2, 100))


#: the children by name, for tests/forked_children.py
CHILDREN = {"saves-then-trains": child_saves_then_trains}


def test_a_process_killed_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, fork_server):
    (tmp_path / "child").mkdir()
    path = tmp_path / "ckpt"
    # a process of its own, forked from the suite's server (no new interpreter: suite time)
    pid = fork_server.start(__name__, "saves-then-trains", str(tmp_path / "child"), str(path))
    try:
        assert fork_server.readline() == "saving"
        time.sleep(0.3)  # the writer is in its data file now
        assert [p for p in tmp_path.iterdir() if ".tiermem-tmp-" in p.name]
    finally:
        lines, status = fork_server.kill(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, lines  # not ended by itself
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        expected = snapshot(model, optimizer)
    assert_bitwise(loaded(tmp_path, path), expected)
    with tiermem.Runtime(config(tmp_path)) as rt:  # the next save removes the killed one's sibling
        manage(rt)
        rt.save(path, blocking=False).wait()
    no_leftovers(tmp_path)


def test_a_save_reserves_the_staging_room_each_plan_keeps_and_no_more(tmp_path):
    """A save's copies leave free the host room each managed model's plan keeps to stage its NVMe
    homes for the step: ``staged_homes`` trainable homes (so a one-home plan reserves one, where
    two were reserved whatever the plan said), and nothing for a frozen model, which never steps."""
    torch.manual_seed(0)
    deep = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(6)))
    teacher = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(6))).requires_grad_(False)
    with tiermem.Runtime(config(tmp_path)) as rt:
        for staged in (1, 2):
            plan = {"state_home": "nvme", "chunk_size": "64KiB", "staged_homes": staged}
            rt.manage(copy.deepcopy(deep), torch.optim.AdamW, lr=1e-3, plan=plan)
        rt.manage(teacher, plan={"state_home": "nvme", "chunk_size": "64KiB"})
        rooms = [states.checkpoint_io("save").staging_room() for states in rt._model_states]
        largest = [max(c.home_bytes for c in states.chunks if c.home_tier == "nvme") for states in rt._model_states]
        pending = rt.save(tmp_path / "ckpt", blocking=False)
        reserve = pending._capture._host_reserve
        pending.wait()
    assert rooms == [largest[0], 2 * largest[1], 0]
    assert reserve == sum(rooms)
    no_leftovers(tmp_path)
