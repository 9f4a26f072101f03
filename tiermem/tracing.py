"""The timeline recorder: where the time goes, on one clock, as a Chrome trace (Perfetto).

A leaf every layer may import (the scheduler and the tiers' callers alike): it imports nothing
else of tiermem. Off, it costs one module-level ``None`` check at each instrumentation point::

    rec = tracing.RECORDER
    if rec is not None:
        rec.transfer(...)

and, for the spans of the training and step threads, :func:`span` (one check of the recorder and
one of torch.profiler's flag, ``None`` back when both are off).

# NOTE [ Timeline trace ]
1. One clock: ``time.perf_counter`` (monotonic), the scheduler's own; ``ts`` in the file is
   microseconds since the recording started.
2. Tracks: process 1 holds one track per thread (training, autograd, step and scheduler
   threads: named after the thread); process 2 one track per link (``host->nvme``), split into
   lanes (``host->nvme #2``) where moves overlap, so every track's slices nest; counters (each
   tier's bytes in use, each link's bytes in flight) are ``"C"`` events of process 2.
3. Spans on a thread are complete (``"X"``) events written when they end; they nest because a
   thread's spans end in the reverse order they began (:func:`span` is used as a bracket).
   A span whose end never comes (an exception between begin and end) is simply not written.
4. Under ``torch.profiler.profile`` the same spans are also ``record_function`` ranges named
   ``tiermem.<name>``, on the thread that runs them, whether a recorder is on or not.
5. Bounded memory: events wait in a deque that a writer thread drains to the file every
   ``FLUSH_S``; at most ``MAX_PENDING`` wait (more are dropped and counted), and once the file
   reaches ``max_bytes`` further events are dropped and counted. The count and the span's link
   statistics at start and stop go in the file's ``"tiermem"`` entry.
6. Every time a thread blocks on tiermem's work it is inside a ``wait`` span that names what it
   waits for: a move (``Transfer.wait``: link, object, bytes), a move's end still being booked
   (``Registry.wait``), the activation write-backs in flight, a chunk step, a tier's synchronous
   write or read, the checkpoint's writer, the scheduler's answer to ``statistics()``. The span is
   opened only once the thing waited for is known not to be done, so a wait that blocks nothing
   costs no event. (``tests/test_trace.py`` measures the training thread's blocked time apart
   from the trace and finds all of it in wait spans.)
7. Steps (``tiermem trace summary``): the ``step`` spans where the loop draws them (``tiermem
   train``, the benches), else the stretches ending where each ``optimizer step`` ends (a
   managed model), else those beginning where each forward pass over an activation offloader's
   blocks begins: the offloader records an instant of category ``pass`` there on the training
   thread, so a loop that uses ``rt.offload_activations`` alone is summarized step by step (its
   last step ends with the trace).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.autograd import profiler as _profiler

__all__ = ["FLUSH_S", "MAX_PENDING", "RECORDER", "Recorder", "Span", "now", "recording", "span", "traced", "wrap"]

#: The recorder in force, or None (tracing off). Set only by :meth:`Recorder.start` / ``stop``.
RECORDER: Recorder | None = None

#: Events that may wait for the writer before new ones are dropped (NOTE [ Timeline trace ] rule 5).
MAX_PENDING = 1_000_000
#: How often the writer thread drains the pending events to the file, in seconds.
FLUSH_S = 0.1

now = time.perf_counter  # monotonic, and the scheduler's clock

_THREADS_PID, _LINKS_PID = 1, 2
#: tids of the lane tracks (links, backward per module call): above any thread's native id
_LANE_TIDS = 1 << 30


class Span:
    """One range on the calling thread, begun by :func:`span`; :meth:`end` writes it."""

    __slots__ = ("args", "cat", "name", "range", "recorder", "start")

    def __init__(self, recorder: Recorder | None, name: str, cat: str, args: dict[str, Any] | None) -> None:
        self.recorder = recorder
        self.name, self.cat, self.args = name, cat, args
        self.range: Any = None
        if _profiler._is_profiler_enabled:  # shown in the user's torch.profiler trace too
            self.range = _profiler.record_function("tiermem." + name)
            self.range.__enter__()
        self.start = now()

    def end(self, **args: Any) -> None:
        end = now()
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.recorder is not None:
            if args:
                self.args = {**(self.args or {}), **args}
            self.recorder.complete(self.name, self.cat, self.start, end, self.args)
            self.recorder = None


def span(name: str, cat: str, detail: object = None, args: dict[str, Any] | None = None) -> Span | None:
    """Begin a span named ``name`` (``"name detail"`` given a ``detail``, formatted only when on)
    on this thread when a recorder or torch.profiler is on, else None.

    ``cat`` is the kind of work (``forward``, ``backward``, ``optimizer``, ``chunk_step``,
    ``wait``, ``fetch``, ``step``, ``profile``, ``repack``); the caller ends it with
    ``span.end()`` in the same bracket (rule 3)."""
    recorder = RECORDER
    if recorder is None and not _profiler._is_profiler_enabled:
        return None
    return Span(recorder, name if detail is None else f"{name} {detail}", cat, args)


@contextlib.contextmanager
def traced(name: str, cat: str, args: dict[str, Any] | None = None) -> Iterator[None]:
    """:func:`span` as a ``with`` block (for call sites that are not hot)."""
    s = span(name, cat, None, args)
    try:
        yield
    finally:
        if s is not None:
            s.end()


def wrap(fn: Callable[[], None], name: str, cat: str, args: dict[str, Any] | None = None) -> Callable[[], None]:
    """``fn`` in a span on whichever thread calls it (a chunk step's compute on the step thread);
    ``fn`` itself when nothing records now."""
    if RECORDER is None and not _profiler._is_profiler_enabled:
        return fn

    def run() -> None:
        s = span(name, cat, None, args)
        try:
            fn()
        finally:
            if s is not None:
                s.end()

    return run


class Recorder:
    """Records events from any thread and streams them to ``path`` as Chrome trace JSON."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = 1 << 30) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.dropped = 0
        self.info: dict[str, Any] = {}  # the file's "tiermem" entry (stats at start and stop, ...)
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self._threads: dict[int, int] = {}  # thread ident -> its track's tid
        self._lanes: dict[str, list[tuple[int, float]]] = {}  # track -> each lane's tid and last end (rule 2)
        self._inflight: dict[str, int] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stopping = threading.Event()
        self._writer: threading.Thread | None = None
        self._file: Any = None
        self._written = 0
        self._first = True
        self.t0 = 0.0
        self._stopped: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Recorder:
        """Open the file and become :data:`RECORDER` (only one recorder records at a time)."""
        global RECORDER
        if RECORDER is not None:
            raise RuntimeError(f"tiermem trace: already recording to {RECORDER.path}; stop that trace first")
        try:
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by stop()
        except OSError as exc:  # a folder missing, the path a folder, no permission: said in words
            raise type(exc)(
                exc.errno,
                f"tiermem trace: cannot write the trace to {self.path}: {exc.strerror}; give a file path in an "
                "existing folder",
            ) from exc
        self._file.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        for pid, label in ((_THREADS_PID, "tiermem threads"), (_LINKS_PID, "tiermem links and tiers")):
            self._pending.append(("M", "process_name", pid, 0, {"name": label}))
        self._writer = threading.Thread(target=self._write_loop, name="tiermem-trace-writer", daemon=True)
        self._writer.start()
        self.t0 = now()  # after the writer's start-up, which is the recorder's, not the run's
        RECORDER = self
        return self

    def detach(self) -> None:
        """Stop taking events (the file stays open for :meth:`stop`): what the caller does next,
        such as reading the statistics the closing entry carries, is not recorded. Idempotent."""
        global RECORDER
        if RECORDER is self:
            RECORDER = None
        if self._stopped is None:
            self._stopped = now()

    def stop(self) -> None:
        """Stop recording, write what is pending and the closing entry, close the file. Idempotent."""
        self.detach()
        if self._writer is None:
            return
        self._stopping.set()
        self._writer.join()
        self._writer = None
        self._drain()
        info = {**self.info, "dropped_events": self.dropped, "clock": "perf_counter", "t0_s": self.t0}
        info["t1_s"] = self._stopped  # the recording's span on the clock: what happened outside it is not in the file
        self._file.write(f'\n], "tiermem": {json.dumps(info)}}}\n')
        self._file.close()

    # -- events (any thread) --------------------------------------------------------------
    def _push(self, event: tuple[Any, ...]) -> None:
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(event)

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            with self._lock:
                tid = self._threads[ident] = threading.get_native_id()
            self._push(("M", "thread_name", _THREADS_PID, tid, {"name": threading.current_thread().name}))
        return tid

    def complete(self, name: str, cat: str, start: float, end: float, args: Mapping[str, Any] | None) -> None:
        """A range ``start``..``end`` (clock seconds) on the calling thread."""
        self._push(("X", name, cat, _THREADS_PID, self._tid(), start, end, args))

    def instant(self, name: str, cat: str, args: Mapping[str, Any] | None = None) -> None:
        self._push(("i", name, cat, _THREADS_PID, self._tid(), now(), None, args))

    def counter(self, name: str, values: Mapping[str, float], at: float | None = None) -> None:
        """A counter sample (one counter track per ``name``, one series per key of ``values``)."""
        self._push(("C", name, "counter", _LINKS_PID, 0, now() if at is None else at, None, values))

    def inflight(self, link: str, delta: int) -> None:
        """``delta`` bytes more (or fewer) in flight over ``link``: its counter track."""
        with self._lock:
            value = self._inflight[link] = self._inflight.get(link, 0) + delta
        self.counter(f"in flight {link}", {"bytes": value})

    def transfer(
        self,
        link: str,
        name: str,
        queued: float,
        started: float | None,
        ended: float,
        args: dict[str, Any],
    ) -> None:
        """A move over ``link`` that waited ``started - queued`` in the queue and was served until
        ``ended`` (``started`` None: it never started, a cancel in the queue). Put on the
        link's first lane that is free since ``started`` (rule 2)."""
        begin = queued if started is None else started
        args["queued_ms"] = round(((begin if started is not None else ended) - queued) * 1e3, 3)
        args["link"] = link
        self._push(("X", name, "transfer", _LINKS_PID, self._lane(_LINKS_PID, link, begin, ended), begin, ended, args))

    def lane(self, track: str, name: str, cat: str, start: float, end: float, args: Mapping[str, Any] | None) -> None:
        """A range that need not nest with the others of ``track`` (backward per module call, which
        end in autograd's order): on the track's first lane free since ``start`` (rule 2)."""
        self._push(("X", name, cat, _THREADS_PID, self._lane(_THREADS_PID, track, start, end), start, end, args))

    def _lane(self, pid: int, track: str, begin: float, ended: float) -> int:
        """The tid of ``track``'s first lane whose last range ended by ``begin``; a new lane if none."""
        with self._lock:
            lanes = self._lanes.setdefault(track, [])
            lane = next((i for i, (_, last) in enumerate(lanes) if last <= begin), len(lanes))
            if lane < len(lanes):
                tid = lanes[lane][0]
                lanes[lane] = (tid, ended)
                return tid
            tid = _LANE_TIDS + sum(len(each) for each in self._lanes.values())
            lanes.append((tid, ended))
        self._push(("M", "thread_name", pid, tid, {"name": track if lane == 0 else f"{track} #{lane + 1}"}))
        return tid

    # -- the writer thread ---------------------------------------------------------------
    def _write_loop(self) -> None:
        while not self._stopping.wait(FLUSH_S):
            self._drain()

    def _drain(self) -> None:
        with self._write_lock:
            self._drain_locked()
            self._file.flush()  # a run killed now leaves a file tiermem trace still reads

    def _drain_locked(self) -> None:
        pending, parts = self._pending, []
        t0 = self.t0
        while pending:
            event = pending.popleft()
            if self._written >= self.max_bytes:
                self.dropped += 1
                continue
            parts.append(_chrome(event, t0))
            if len(parts) >= _BATCH:
                self._emit(parts)
                parts = []
                time.sleep(0)  # let the training and scheduler threads have the GIL between batches
        self._emit(parts)

    def _emit(self, parts: list[str]) -> None:
        if not parts:
            return
        text = ",\n".join(parts)
        if not self._first:
            text = ",\n" + text
        self._first = False
        self._file.write(text)
        self._written += len(text)


def _chrome(event: tuple[Any, ...], t0: float) -> str:
    """One pending event as Chrome trace JSON (``ts``/``dur`` in microseconds since ``t0``)."""
    if event[0] == "M":
        _, name, pid, tid, args = event
        return f'{{"name":"{name}","ph":"M","pid":{pid},"tid":{tid},"args":{_dumps(args)}}}'
    ph, name, cat, pid, tid, start, end, args = event
    key = (name, cat, ph, pid, tid)
    head = _HEADS.get(key)  # a track's events repeat a few names: their text up to "ts" is made once
    if head is None:
        head = f'{{"name":{_quote(name)},"cat":"{cat}","ph":"{ph}","pid":{pid},"tid":{tid},"ts":'
        if len(_HEADS) < _CACHED:
            _HEADS[key] = head
    if ph == "X":
        text = f'{head}{(start - t0) * 1e6:.3f},"dur":{(end - start) * 1e6:.3f}'
    elif ph == "i":
        text = f'{head}{(start - t0) * 1e6:.3f},"s":"t"'
    else:
        text = f"{head}{(start - t0) * 1e6:.3f}"
    if not args:
        return text + "}"
    if len(args) == 1:  # a counter's sample, the most common event: one number
        ((key, value),) = args.items()
        if type(value) is int:
            return f'{text},"args":{{{_quote(key)}:{value}}}}}'
    return f'{text},"args":{_args(args)}}}'


_dumps = json.JSONEncoder(separators=(",", ":")).encode
#: Strings (names, keys, labels) and event heads already written as JSON, up to ``_CACHED`` each:
#: the writer's cost an event is mostly formatting, and the same few strings come again and again.
_QUOTED: dict[str, str] = {}
_HEADS: dict[tuple[Any, ...], str] = {}
_CACHED = 1 << 14


def _quote(text: str) -> str:
    quoted = _QUOTED.get(text)
    if quoted is None:
        quoted = _dumps(text)
        if len(_QUOTED) < _CACHED:
            _QUOTED[text] = quoted
    return quoted


def _args(args: Mapping[str, Any]) -> str:
    """``args`` as a JSON object: numbers written as they are (the common case: bytes, times), strings
    through the cache, the rest by json."""
    parts = []
    for key, value in args.items():
        kind = type(value)
        if kind is int or (kind is float and value == value and abs(value) != float("inf")):
            parts.append(f"{_quote(key)}:{value}")
        elif kind is str:
            parts.append(f"{_quote(key)}:{_quote(value)}")
        else:
            parts.append(f"{_quote(key)}:{_dumps(value)}")
    return "{" + ",".join(parts) + "}"


#: Events serialised between two chances for the other threads to take the GIL.
_BATCH = 256


@contextlib.contextmanager
def recording(path: str | os.PathLike[str], *, max_bytes: int = 1 << 30) -> Iterator[Recorder]:
    """Record to ``path`` for the ``with`` block."""
    recorder = Recorder(path, max_bytes=max_bytes).start()
    try:
        yield recorder
    finally:
        recorder.stop()
