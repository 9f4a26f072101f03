"""``DeferredInterrupts``: Ctrl-C and SIGTERM held as a flag and raised at safe points (TRAPS 18)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tiermem.config import Config
from tiermem.interrupts import DeferredInterrupts
from tiermem.models.gpt import GPTConfig
from tiermem.rok import sweep


class SignalledInDel:
    """Sends ``sig`` to this process from inside ``__del__``, where Python drops a raised
    KeyboardInterrupt: as autograd does when it releases a saved activation."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig = sig

    def __del__(self) -> None:
        os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_in_a_del_is_held_until_check(sig: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt), DeferredInterrupts() as stop:
        SignalledInDel(sig)  # released at once: the handler runs inside __del__
        assert stop.requested
        reached = True  # the signal did not interrupt the work in progress
        stop.check()
        pytest.fail("check() did not raise")
    assert reached
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored


def test_leaving_the_context_raises_a_held_signal() -> None:
    with pytest.raises(KeyboardInterrupt), DeferredInterrupts():
        os.kill(os.getpid(), signal.SIGINT)


def test_no_signal_no_interrupt() -> None:
    with DeferredInterrupts() as stop:
        stop.check()
    assert not stop.requested


def test_a_second_signal_interrupts_at_once() -> None:
    """The way out of a step that hangs: the second Ctrl-C raises where it lands."""
    with pytest.raises(KeyboardInterrupt), DeferredInterrupts() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("the second signal did not interrupt")


def test_cleanup_holds_every_signal_to_the_end() -> None:
    finished = False
    with pytest.raises(KeyboardInterrupt), DeferredInterrupts(second_interrupts=False):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        finished = True
    assert finished


def test_an_exception_of_its_own_is_not_replaced_by_the_held_signal() -> None:
    with pytest.raises(ValueError), DeferredInterrupts():
        os.kill(os.getpid(), signal.SIGINT)
        raise ValueError("the work's own error")


def test_outside_the_main_thread_nothing_is_installed() -> None:
    seen: list[object] = []

    def worker() -> None:
        with DeferredInterrupts() as stop:
            seen.append(signal.getsignal(signal.SIGINT))
            stop.check()

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [before]


def test_rok_sweep_stops_between_steps(tmp_path) -> None:
    """A Ctrl-C during the sweep that lands in a __del__ still stops it: no further points,
    and the run's files removed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    config = Config.coerce(
        {"device": {"device": "cpu"}, "nvme": {"paths": [str(disk)]}, "activations": {"min_bytes": "4KiB"}}
    )
    model = GPTConfig(n_layer=2, d_model=32, n_head=2, vocab_size=64, seq_len=32)
    points: list[object] = []

    def on_point(point: object) -> None:
        points.append(point)
        SignalledInDel(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        sweep(config, model, [1, 2], policies=("keep", "nvme"), steps=1, on_point=on_point)
    assert len(points) == 1
    assert list(disk.iterdir()) == []
