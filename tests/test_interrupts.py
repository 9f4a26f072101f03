"""``DeferredInterrupts``: Ctrl-C and SIGTERM held as a flag and raised at safe points (TRAPS 18)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tiermem.app.models.gpt import GPTConfig
from tiermem.app.rok import sweep
from tiermem.config import Config
from tiermem.interrupts import DeferredInterrupts
from tiermem.registry import Registry
from tiermem.runtime import Runtime

# The tests send SIGINT and SIGTERM to themselves: they need the dispositions an interactive
# Python has, whatever the suite started with (a background job starts with SIGINT ignored).
pytestmark = pytest.mark.usefixtures("interrupt_signals")


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


# -- RuntimeInterruptGuard: Ctrl-C in a user's own loop (TRAPS 18, 25) ------------------------------
def _runtime(tmp_path: Path) -> Runtime:
    return Runtime({"nvme": {"paths": [str(tmp_path)]}})


def _interrupted_soon() -> None:
    """Sleep in short steps (user code, where a held signal is delivered) for up to 5 s."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.001)


def _raised_inside(caught: pytest.ExceptionInfo[KeyboardInterrupt], *files: str) -> bool:
    return any(Path(entry.path).name in files for entry in caught.traceback)


def test_ctrl_c_in_a_runtime_wait_is_held_until_the_wait_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands while the main thread is inside the runtime (here a wait on an
    NVMe write) is raised once the call returned to user code, not inside it."""
    returned: list[bool] = []
    original = Registry.wait

    def signalled_wait(self: Registry, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs here: Handle.wait is below us
        result = original(self, *args, **kwargs)
        returned.append(True)
        return result

    with _runtime(tmp_path) as rt:
        handle = rt.store(torch.arange(1 << 16, dtype=torch.float32), "nvme")
        monkeypatch.setattr(Registry, "wait", signalled_wait)
        with pytest.raises(KeyboardInterrupt) as caught:
            handle.wait()
            _interrupted_soon()
        monkeypatch.undo()
        assert returned == [True]
        assert not _raised_inside(caught, "registry.py")
        assert torch.equal(handle.tensor(), torch.arange(1 << 16, dtype=torch.float32))
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_in_a_finalizer_is_not_lost(tmp_path: Path) -> None:
    """Python drops a KeyboardInterrupt raised in ``__del__`` (autograd releases saved
    activations there): inside a runtime it is delivered once the finalizer is over."""
    with _runtime(tmp_path), pytest.raises(KeyboardInterrupt):
        SignalledInDel(signal.SIGINT)
        _interrupted_soon()


def test_a_second_ctrl_c_while_one_is_held_interrupts_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The way out of a wait that never ends: the second signal is not held."""
    original = Registry.wait

    def signalled_twice(self: Registry, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("the second Ctrl-C was held too")
        return original(self, *args, **kwargs)

    with _runtime(tmp_path) as rt:
        handle = rt.store(torch.zeros(1 << 16), "nvme")
        monkeypatch.setattr(Registry, "wait", signalled_twice)
        with pytest.raises(KeyboardInterrupt) as caught:
            handle.wait()
        monkeypatch.undo()
        assert _raised_inside(caught, "test_interrupts.py")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_closing_comes_after_the_files_are_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C during ``with rt``'s exit does not cut the cleanup short: every tier is
    closed (the NVMe files removed) and then the KeyboardInterrupt is raised."""
    from tiermem.tiers.host import HostTier

    original = HostTier.close

    def signalled_close(self: HostTier) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        original(self)

    monkeypatch.setattr(HostTier, "close", signalled_close)
    with pytest.raises(KeyboardInterrupt), _runtime(tmp_path) as rt:
        rt.store(torch.zeros(1 << 16), "nvme").wait()
        assert list(tmp_path.iterdir())  # the run directory exists while the runtime is open
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_in_a_users_own_wait_interrupts_it_at_once(tmp_path: Path) -> None:
    """Outside the runtime nothing changes: a Ctrl-C during the user's own lock wait (a
    thread join, a DataLoader queue) interrupts it there, as without tiermem."""
    never_set = threading.Event()
    with _runtime(tmp_path):
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            never_set.wait(10)
        timer.join()
        assert time.monotonic() - start < 5


def test_every_runtime_module_is_internal_and_the_drivers_are_not() -> None:
    """A Ctrl-C is held in every module of the runtime, new ones included (the checkpoint and
    managed objects were missed while the internals were a hand-kept list), never in a driver."""
    import tiermem.app.train
    import tiermem.checkpoint
    import tiermem.objects
    import tiermem.registry
    import tiermem.states.manager
    from tiermem.interrupts import _internal_paths

    internal = _internal_paths()
    for module in (tiermem.checkpoint, tiermem.objects, tiermem.registry, tiermem.states.manager):
        assert module.__file__ is not None and module.__file__.startswith(internal), module.__name__
    assert tiermem.app.train.__file__ is not None and not tiermem.app.train.__file__.startswith(internal)


def test_an_ignored_signal_stays_ignored(tmp_path: Path) -> None:
    """A process started with SIGINT and SIGTERM ignored (a background job of a non-interactive
    shell ignores SIGINT, so that a Ctrl-C meant for the foreground job does not stop it) keeps
    them ignored: neither a runtime, nor DeferredInterrupts (``tiermem train``, the sweeps), nor
    the CLI's SIGTERM handler turns them back on, and none stops the work."""
    from tiermem.cli import sigterm_as_interrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    with _runtime(tmp_path), sigterm_as_interrupt(), DeferredInterrupts() as stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            assert signal.getsignal(sig) == signal.SIG_IGN
            os.kill(os.getpid(), sig)
        for _ in range(20):  # a handler would have run by now (the main thread runs it)
            time.sleep(0.005)
        stop.check()
    assert not stop.requested
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in (signal.SIGINT, signal.SIGTERM))


@pytest.mark.parametrize("close_order", ["opened", "reverse"])
def test_runtimes_closed_in_any_order_leave_the_original_handler(tmp_path: Path, close_order: str) -> None:
    """Two runtimes open at once, closed in the order they opened (not nested) or the reverse:
    the process ends with the handlers it had before either, not a closed runtime's."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = _runtime(tmp_path / "a").start(), _runtime(tmp_path / "b").start()
    for rt in (first, second) if close_order == "opened" else (second, first):
        rt.close()
    assert {sig: signal.getsignal(sig) for sig in before} == before
