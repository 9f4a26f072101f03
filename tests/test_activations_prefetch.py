"""Backward's prefetch window (NOTE [ Prefetch window ]): offloaded tensors come back a few
operators ahead of need, not whole blocks ahead, and the window grows only when backward
waited for reads. Gradients stay bitwise those of plain PyTorch."""

from __future__ import annotations

import contextlib
import threading
import types

import pytest
import torch

import tiermem
from tests.test_activations import Decoder, _assert_identical, _step
from tests.test_activations_fallbacks import _config, _synchronous_write_backs
from tiermem.activations.prefetch import Prefetcher
from tiermem.layout.activation_policy import PREFETCH_START, WAIT_TOLERANCE, next_prefetch_window
from tiermem.registry import Handle, ObjectState
from tiermem.tiers.backends.posix import PosixBackend


def test_the_window_doubles_only_when_backward_waited_and_stops_at_its_cap():
    backward_s = 10.0
    waited = 2 * WAIT_TOLERANCE * backward_s
    assert next_prefetch_window(100, waited, backward_s, cap=1000) == 200
    assert next_prefetch_window(800, waited, backward_s, cap=1000) == 1000
    assert next_prefetch_window(100, WAIT_TOLERANCE * backward_s / 2, backward_s, cap=1000) == 100
    assert next_prefetch_window(100, 0.0, 0.0, cap=1000) == 100  # no backward measured


def _ahead_after_each_prefetch(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bytes prefetched and not unpacked, the largest such object) after every prefetch round."""
    seen: list[tuple[int, int]] = []
    original = Prefetcher.before

    def prefetch(self, group):
        original(self, group)
        objects = [obj.nbytes for ref, *_ in self.prefetched.values() if (obj := ref()) is not None]
        seen.append((self.ahead_bytes(), max(objects, default=0)))

    monkeypatch.setattr(Prefetcher, "before", prefetch)
    return seen


@pytest.mark.parametrize("policy", ["nvme", "host"])
def test_prefetch_keeps_within_the_window(tmp_path, monkeypatch, policy):
    """Every write lands before backward (so each block must be read back); after every
    unpack, what was prefetched ahead is at most the window plus the one object that crossed
    it, where whole blocks ahead (the bound before the window) hold several times more."""
    _synchronous_write_backs(monkeypatch)
    seen = _ahead_after_each_prefetch(monkeypatch)
    # Backward of a toy model is as fast as a read: the window would grow (tested below).
    monkeypatch.setattr("tiermem.activations.prefetch.next_prefetch_window", lambda window, *_: window)
    torch.manual_seed(0)
    model = Decoder(layers=6)
    want = _step(model, contextlib.nullcontext())
    with tiermem.Runtime(_config(tmp_path, "64MiB")) as rt:
        offloader = rt.offload_activations(model, policy=policy)
        _assert_identical(_step(model, offloader), want)  # measures the blocks
        seen.clear()
        _assert_identical(_step(model, offloader), want)
        largest_block = max(offloader.history.block_bytes.values())
        window = offloader.history.prefetch_window
        assert window == int(PREFETCH_START * largest_block)
        largest_object = max(largest for _, largest in seen)
        bounded = max(ahead for ahead, _ in seen)
        assert 0 < bounded <= window + largest_object
        # The same step with whole blocks ahead: what the window saves.
        monkeypatch.setattr(Prefetcher, "window", lambda self: self.cap())
        seen.clear()
        _assert_identical(_step(model, offloader), want)
        assert max(ahead for ahead, _ in seen) > window + largest_object
    assert list(tmp_path.iterdir()) == []


class _ReadsHeldUntilWaited:
    """The drive of :func:`test_the_window_grows_after_a_backward_that_waited_for_reads`: a read
    is held (its ``pread`` blocks) until backward waits for an object still moving from NVMe;
    that wait then takes one second of a virtual clock, which nothing else advances (compute
    takes no time on it). So a backward provably waits for reads, and waits for nearly all of
    its duration, however loaded the machine is."""

    HOLD_LIMIT_S = 30.0  # a read held this long means nothing waits for it: the test fails

    def __init__(self) -> None:
        self.now = 0.0
        self.held = False  # the runtime's start probes the drive: reads pass until armed
        self.waits = 0
        self.stuck = 0
        self.cond = threading.Condition()

    def perf_counter(self) -> float:
        return self.now

    def pread_allowed(self) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: not self.held, self.HOLD_LIMIT_S):
                self.stuck += 1

    def set_held(self, held: bool) -> None:
        with self.cond:
            self.held = held
            self.cond.notify_all()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        drive = self

        class HeldReads(PosixBackend):
            def pread(self, handle, buffer, offset):
                drive.pread_allowed()
                return super().pread(handle, buffer, offset)

        original_tensor = Handle.tensor

        def tensor(handle: Handle, tier: str = "device") -> torch.Tensor:
            obj = handle.obj
            if not (drive.held and obj.state is ObjectState.MOVING and obj.tier == "nvme"):
                return original_tensor(handle, tier)
            drive.now += 1.0  # the virtual drive time this wait takes
            drive.waits += 1
            drive.set_held(False)
            try:
                return original_tensor(handle, tier)
            finally:
                drive.set_held(True)

        clock = types.SimpleNamespace(perf_counter=self.perf_counter)
        monkeypatch.setattr("tiermem.tiers.nvme.select_backend", lambda name, probe_dir: (HeldReads(), "test"))
        monkeypatch.setattr(Handle, "tensor", tensor)
        monkeypatch.setattr("tiermem.activations.hooks.time", clock)
        monkeypatch.setattr("tiermem.activations.prefetch.time", clock)


@pytest.mark.parametrize("contexts", ["one per step", "one for all steps"])
def test_the_window_grows_after_a_backward_that_waited_for_reads(tmp_path, monkeypatch, contexts):
    """A drive slower than backward: every read is held until backward waits for it (on a
    virtual clock, the waits are all of backward's time), so the next backward prefetches
    twice as far ahead, up to the block-wise cap; also when one context stays open over every
    step (the window is settled at each new forward). Deterministic: no sleep, no wall clock."""
    _synchronous_write_backs(monkeypatch)
    drive = _ReadsHeldUntilWaited()
    drive.install(monkeypatch)
    torch.manual_seed(0)
    model = Decoder(layers=4)
    want = _step(model, contextlib.nullcontext())
    with tiermem.Runtime(_config(tmp_path, "64MiB")) as rt:
        offloader = rt.offload_activations(model, policy="nvme")
        drive.set_held(True)
        idle = contextlib.nullcontext()
        outer, each = (idle, offloader) if contexts == "one per step" else (offloader, idle)
        windows = []
        with outer:
            for _ in range(4):
                waits = drive.waits
                _assert_identical(_step(model, each), want)
                assert drive.waits > waits  # this backward waited for reads
                windows.append(offloader.history.prefetch_window)
        windows.append(offloader.history.prefetch_window)
        drive.set_held(False)
        cap = offloader.prefetcher.cap()
        start = int(PREFETCH_START * max(offloader.history.block_bytes.values()))
    assert drive.stuck == 0
    # Settled after each backward (one per step), or at the next forward and the context's end.
    settled = [1, 2, 3, 4, 4] if contexts == "one per step" else [0, 1, 2, 3, 4]
    assert windows == [min(cap, start << n) for n in settled]
    assert windows[0] < windows[2] <= cap
    assert list(tmp_path.iterdir()) == []
