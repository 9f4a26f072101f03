"""Backward's prefetch window (NOTE [ Prefetch window ]): offloaded tensors come back a few
operators ahead of need, not whole blocks ahead, and the window grows only when backward
waited for reads. Gradients stay bitwise those of plain PyTorch."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import tiermem
from tests.test_activations import Decoder, _assert_identical, _step
from tests.test_activations_fallbacks import _config, _synchronous_write_backs
from tiermem.activations.prefetch import Prefetcher
from tiermem.layout.activation_policy import PREFETCH_START, WAIT_TOLERANCE, next_prefetch_window
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
        largest_block = max(offloader.memory.block_bytes.values())
        window = offloader.memory.prefetch_window
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


@pytest.mark.parametrize("contexts", ["one per step", "one for all steps"])
def test_the_window_grows_after_a_backward_that_waited_for_reads(tmp_path, monkeypatch, contexts):
    """A drive slower than backward (each NVMe read here takes 20 ms): backward waits, so
    the next backward prefetches twice as far ahead, up to the block-wise cap; also when
    one context stays open over every step (the window is settled at each new forward)."""
    _synchronous_write_backs(monkeypatch)

    class SlowReads(PosixBackend):
        def pread(self, handle, buffer, offset):
            time.sleep(0.02)
            return super().pread(handle, buffer, offset)

    monkeypatch.setattr("tiermem.tiers.nvme.select_backend", lambda name, probe_dir: (SlowReads(), "test"))
    torch.manual_seed(0)
    model = Decoder(layers=4)
    want = _step(model, contextlib.nullcontext())
    with tiermem.Runtime(_config(tmp_path, "64MiB")) as rt:
        offloader = rt.offload_activations(model, policy="nvme")
        idle = contextlib.nullcontext()
        outer, each = (idle, offloader) if contexts == "one per step" else (offloader, idle)
        windows = []
        with outer:
            _assert_identical(_step(model, each), want)
            for _ in range(3):
                _assert_identical(_step(model, each), want)
                windows.append(offloader.memory.prefetch_window)
        windows.append(offloader.memory.prefetch_window)
        assert windows[0] is not None and windows == sorted(windows)
        assert windows[2] > windows[0]  # grown between steps, before any context closed
        assert windows[-1] <= offloader.prefetcher.cap()
    assert list(tmp_path.iterdir()) == []
