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

import os
import signal
import threading
import time
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
    installed and ``requested`` stays false. A signal the process ignores stays ignored (a
    background job of a non-interactive shell starts with SIGINT ignored, so that a Ctrl-C
    meant for the foreground job does not stop it; Python leaves it so too).
    """

    def __init__(self, *, second_interrupts: bool = True) -> None:
        self.requested = False
        self._second_interrupts = second_interrupts
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> DeferredInterrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED_SIGNALS:
                if signal.getsignal(sig) != signal.SIG_IGN:
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


def _skip_closed_guards(sig: int, handler: Any) -> Any:
    """What a guard being uninstalled restores: ``handler``, or, when that is the handler of a
    guard closed already (two runtimes closed in the order they were opened), what that guard
    replaced, and so on; so the process ends with the handler it had before any runtime."""
    guard = getattr(handler, "__self__", None)
    while isinstance(guard, RuntimeInterruptGuard) and guard._closed and sig in guard._previous:
        handler = guard._previous[sig]
        guard = getattr(handler, "__self__", None)
    return handler


class RuntimeInterruptGuard:
    """While a :class:`~tiermem.Runtime` is open: Ctrl-C where the runtime cannot be cut short.

    A user's own loop runs the runtime's hooks, waits and finalizers on the main thread,
    where a KeyboardInterrupt raised by the default handler can be lost (inside a
    ``__del__`` or a finalizer: "Exception ignored", and training goes on, TRAPS 18) or
    can leave a lock taken for good (inside ``threading``'s Python code: leaving ``with
    rt`` then waits forever, TRAPS 25). Measured before this guard: 8 of 45 Ctrl-Cs at
    random moments of an embedded loop with NVMe states and activations.

    So, for SIGINT and SIGTERM where Python handles them, this handler looks at where the
    signal landed. Outside the runtime's internals (the locks and futures they wait on are
    called from them, so they count too), ``weakref`` finalizers and ``__del__`` methods,
    it calls the handler it replaced at once (the user's code sees exactly what it would without tiermem), as it
    does when that handler is a :class:`DeferredInterrupts`'s, which only sets a flag.
    Inside them it holds the signal and sends it to the main thread again every few
    milliseconds until it lands outside: in practice at the end of the hook, step or wait
    (a backward's hooks run back to back, so usually once backward returns). A second
    signal while one is held is passed on at once, wherever it lands: the way out of a
    wait that never ends. Nothing is installed off the main thread or for a signal whose
    disposition is not a Python handler.
    """

    #: How long the guard waits before sending a held signal again.
    RETRY_SECONDS = 0.005

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._handler = self._handle  # one bound method, so uninstall can tell it is still ours
        self._held: int | None = None
        self._resent = False  # the next call of the handler is our own resend
        self._answered = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._internal: tuple[str, ...] = ()
        self._owner_pid = os.getpid()

    # -- lifecycle ----------------------------------------------------------------------------
    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._internal = _internal_paths()
        for sig in HANDLED_SIGNALS:
            previous = signal.getsignal(sig)
            if callable(previous):
                self._previous[sig] = previous
                signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Restore the replaced handlers (where ours is still installed); a signal still held
        is then passed to its handler, as if it had just arrived."""
        held, self._held = self._held, None
        self._closed = True
        self._answered.set()
        self._wake.set()
        # ``_previous`` is kept: a handler installed over ours and later restoring it still
        # reaches the replaced one through us (closed, we pass every signal on).
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) is self._handler:
                signal.signal(sig, _skip_closed_guards(sig, previous))
        previous = self._previous.get(held) if held is not None else None
        if previous is not None:
            previous(held, None)

    # -- the handler --------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        resent, self._resent = self._resent, False
        try:
            previous = self._previous[signum]
            second = self._held is not None and not resent
            # A DeferredInterrupts open below us (``tiermem.app.train``) only sets its flag: safe anywhere.
            flag_only = isinstance(getattr(previous, "__self__", None), DeferredInterrupts)
            # A forked child (a DataLoader worker) inherits the handler but not the resending thread.
            forked = os.getpid() != self._owner_pid
            if second or flag_only or forked or self._closed or not self._inside_runtime(frame):
                self._held = None
                previous(signum, frame)
                return
            if self._held is None:
                self._held = signum
                self._start_resender()
        finally:
            if resent:
                self._answered.set()

    def _inside_runtime(self, frame: FrameType | None) -> bool:
        internal = self._internal
        while frame is not None:
            code = frame.f_code
            if code.co_name == "__del__" or code.co_filename.startswith(internal):
                return True
            frame = frame.f_back
        return False

    def _start_resender(self) -> None:
        self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._resend_loop, name="tiermem-interrupts", daemon=True)
            self._thread.start()

    def _resend_loop(self) -> None:
        main = threading.main_thread().ident
        assert main is not None
        while True:
            self._wake.wait()
            time.sleep(self.RETRY_SECONDS)
            if self._closed:
                return
            held = self._held
            if held is None:
                self._wake.clear()
                if self._held is not None:  # held again between the read and the clear
                    self._wake.set()
                continue
            # One resend at a time, answered before the next: two would coalesce into one
            # call of the handler, and a user's second Ctrl-C could pass for our resend.
            self._answered.clear()
            self._resent = True
            try:
                signal.pthread_kill(main, held)
            except OSError:  # the main thread is gone: the process is ending
                return
            self._answered.wait()


#: What in the ``tiermem`` package drives the runtime instead of being part of it: a Ctrl-C in
#: these is raised at once, as in the user's own code. Everything else there is the runtime.
DRIVERS = ("__main__.py", "app", "cli", "interrupts.py")


def _internal_paths() -> tuple[str, ...]:
    """Where a KeyboardInterrupt must not be raised: the runtime's internals and ``weakref``'s
    finalizers. The internals are every module of the ``tiermem`` package except the
    :data:`DRIVERS`, listed when the guard is installed, so a new module is covered without
    being named here; the tiers and schedulers too. Not ``threading`` or ``queue`` as such: a
    user's own ``thread.join()`` or DataLoader wait stays interruptible, as without tiermem;
    the runtime's own waits have its frames below them."""
    import weakref

    import tiermem
    import tiermem.schedulers
    import tiermem.tiers

    base = os.path.dirname(tiermem.__file__)
    names = sorted(n for n in os.listdir(base) if n not in DRIVERS and (n.endswith(".py") or "." not in n))
    paths = [os.path.join(base, name) for name in names if name != "__pycache__"]
    paths += [os.path.dirname(tiermem.tiers.__file__), os.path.dirname(tiermem.schedulers.__file__)]
    paths.append(weakref.__file__)
    return tuple(p for p in paths if p)
