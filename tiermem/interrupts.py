"""Ctrl-C and SIGTERM turned into a KeyboardInterrupt at a safe point (TRAPS 18).

Python runs a signal handler in the main thread between two bytecodes, wherever that
is. A KeyboardInterrupt raised inside a ``__del__`` (autograd releasing a saved
activation does that all through forward and backward) is printed as "Exception
ignored" and dropped: the run goes on as if the user had never pressed Ctrl-C. One
raised in the middle of a move or a cleanup can leave files behind. So long-running
commands hold the signal as a flag while work is half-done and raise at points where
nothing is: :meth:`DeferredInterrupts.check`, and the end of the context.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredInterrupts:
    """While open, SIGINT and SIGTERM set :attr:`requested` instead of interrupting.

    ``check()`` raises KeyboardInterrupt if one came; so does leaving the context without
    an exception of its own. With ``second_interrupts=True`` a second signal raises at
    once, wherever it lands: the user's way out of a step that hangs. With ``False`` every
    signal is held to the end: for cleanup that must not be cut short (files would be
    left behind). Outside the main thread, where Python never runs handlers, nothing is
    installed and ``requested`` stays false.
    """

    def __init__(self, *, second_interrupts: bool = True) -> None:
        self.requested = False
        self._second_interrupts = second_interrupts
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> DeferredInterrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
        if exc_type is None:
            self.check()

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        if self.requested and self._second_interrupts:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        """Raise KeyboardInterrupt if a signal asked to stop; call it where nothing is half-done."""
        if self.requested:
            raise KeyboardInterrupt
