"""Reading a timeline trace (NOTE [ Timeline trace ] in :mod:`tiermem.tracing`): the per-step
summary of ``tiermem trace summary`` and the picture of ``tiermem trace plot``.

A step is a ``step`` span of the training loop (``tiermem train`` records one per optimizer
step); in a trace of a user's loop, which has none, a step ends where an ``optimizer step`` span
ends. Within a step:

- **waits** are the waits (``wait`` spans) of the threads that run the step's phases (the
  training thread, and autograd's own threads on CUDA), each counted once where waits nest,
  grouped by cause (the span's name without its chunk number);
- **compute** is the step's time minus its waits;
- **phases** are the time of each ``phase`` span in the step, by name (``tiermem train``'s
  ``forward pass``, ``backward pass``, ``optimizer.step``; a user's loop has none unless it marks
  them with :func:`tiermem.tracing.traced`);
- a **link**'s busy time is the union of the moves over it, its bandwidth the bytes those moves
  carried in the step (pro rata where a move crosses the step's edge) over that busy time;
- the **overlap ratio** is the share of the time any link was busy that no wait covered: moves
  hidden behind compute (1.0: every move overlapped);
- a phase's **storage busy** time is the part of it in which some move read or wrote storage (a
  link with an ``nvme`` end): where it nears the phase's length, the disk bounds that phase, and
  only moving bytes out of it (or fewer bytes) makes it shorter;
- a phase's **storage bytes** are the bytes read from and written to storage in it (pro rata where
  a move crosses the phase's edge): at the disk's measured rates, their disk time against the
  phase's length says how near the disk's own speed a busy disk ran.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepSummary", "Trace", "load", "plot", "summarize"]

Interval = tuple[float, float]
#: Span kinds that say a thread runs the training step (its waits stall the step).
_STEP_WORK = frozenset({"step", "phase", "forward", "backward", "optimizer"})
#: The storage tier, as links name it (``"nvme->host"``).
_STORAGE = "nvme"


@dataclass
class Trace:
    """The events of one trace file, by kind; times in seconds since the recording started."""

    spans: dict[int, list[dict[str, Any]]]  # tid -> complete events of that thread (process 1)
    thread_names: dict[int, str]
    transfers: list[dict[str, Any]]  # complete events of the links' tracks (process 2)
    counters: dict[str, list[tuple[float, float]]]  # counter name -> (time, value)
    info: dict[str, Any]
    #: (time, tid) of each forward pass an activation offloader began (rule 7 of NOTE [ Timeline trace ])
    passes: list[tuple[float, int]] = field(default_factory=list)

    def link_bytes(self) -> dict[str, int]:
        """Bytes each link carried over the whole trace (what ``rt.stats()`` counts over the span)."""
        totals: dict[str, int] = defaultdict(int)
        for event in self.transfers:
            totals[event["args"]["link"]] += event["args"]["bytes"]
        return dict(totals)


def _parse(text: str) -> dict[str, Any]:
    """The JSON, or, for a file whose recording never stopped (a killed run), what was written."""
    try:
        return json.loads(text)  # type: ignore[no-any-return]
    except json.JSONDecodeError:
        cut = text.rstrip().rstrip(",")
        return json.loads(cut + "\n]}")  # type: ignore[no-any-return]


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a Chrome trace written by :class:`tiermem.tracing.Recorder`."""
    with open(path, encoding="utf-8") as f:
        data = _parse(f.read())
    spans: dict[int, list[dict[str, Any]]] = defaultdict(list)
    names: dict[int, str] = {}
    transfers: list[dict[str, Any]] = []
    counters: dict[str, list[tuple[float, float]]] = defaultdict(list)
    passes: list[tuple[float, int]] = []
    for event in data.get("traceEvents", []):
        ph, pid = event.get("ph"), event.get("pid")
        if ph == "M" and event.get("name") == "thread_name" and pid == 1:
            names[event["tid"]] = event["args"]["name"]
        elif ph == "i" and pid == 1 and event.get("cat") == "pass":
            passes.append((event["ts"] / 1e6, event["tid"]))
        elif ph == "X":
            event = {**event, "ts": event["ts"] / 1e6, "dur": event["dur"] / 1e6}
            (transfers.append(event) if pid == 2 else spans[event["tid"]].append(event))
        elif ph == "C":
            for key, value in event.get("args", {}).items():
                label = event["name"] if key == "bytes" else f"{event['name']} {key}"
                counters[label].append((event["ts"] / 1e6, float(value)))
    for events in spans.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
    transfers.sort(key=lambda e: e["ts"])
    for series in counters.values():
        series.sort()
    return Trace(dict(spans), names, transfers, dict(counters), data.get("tiermem", {}), sorted(passes))


# -- intervals -----------------------------------------------------------------------------------
def _union(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def _minus(a: list[Interval], b: list[Interval]) -> float:
    """Length of the union ``a`` not covered by the union ``b`` (both sorted, disjoint)."""
    return _length(a) - sum(_length(_clip(b, s, e)) for s, e in a)


def _end(event: dict[str, Any]) -> float:
    return float(event["ts"] + event["dur"])


# -- the summary -----------------------------------------------------------------------------------
@dataclass
class LinkSummary:
    busy_s: float
    bytes: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second while busy (0.0 when idle)."""
        return self.bytes / self.busy_s if self.busy_s > 0 else 0.0


@dataclass
class StepSummary:
    """One step of a trace (see the module docstring)."""

    index: int
    start: float
    end: float
    waits: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    links: dict[str, LinkSummary] = field(default_factory=dict)
    overlap: float | None = None  # None: no link was busy
    #: per phase (as ``phases``), the seconds some move to or from storage was in flight in it
    storage_busy: dict[str, float] = field(default_factory=dict)
    #: per phase, the bytes read from storage and written to it in the phase
    storage_read: dict[str, float] = field(default_factory=dict)
    storage_written: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def wait_s(self) -> float:
        return sum(self.waits.values())

    @property
    def compute_s(self) -> float:
        return self.seconds - self.wait_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.index,
            "seconds": self.seconds,
            "compute_s": self.compute_s,
            "wait_s": self.wait_s,
            "waits": dict(self.waits),
            "phases": dict(self.phases),
            "links": {
                name: {
                    "busy_s": link.busy_s,
                    "busy_fraction": link.busy_s / self.seconds if self.seconds else 0.0,
                    "bytes": round(link.bytes),
                    "bytes_per_s": link.bandwidth,
                }
                for name, link in self.links.items()
            },
            "overlap": self.overlap,
            "storage_busy": dict(self.storage_busy),
            "storage_read": {name: round(b) for name, b in self.storage_read.items()},
            "storage_written": {name: round(b) for name, b in self.storage_written.items()},
        }


def _step_threads(trace: Trace) -> list[int]:
    passes = {tid for _, tid in trace.passes}
    return [
        tid for tid, events in trace.spans.items() if tid in passes or any(e.get("cat") in _STEP_WORK for e in events)
    ]


def step_intervals(trace: Trace) -> list[Interval]:
    """The steps (rule 7 of NOTE [ Timeline trace ]): ``step`` spans, else the stretches ending where
    each ``optimizer step`` ends (but those the planner runs while it profiles), else those
    beginning where each of an activation offloader's forward passes begins."""
    steps = [(e["ts"], _end(e)) for events in trace.spans.values() for e in events if e.get("cat") == "step"]
    if steps:
        return sorted(steps)
    every = [e for events in trace.spans.values() for e in events]
    profiling = [(e["ts"], _end(e)) for e in every if e.get("cat") == "profile"]  # the planner's own steps
    ends = sorted(
        _end(e)
        for e in every
        if e.get("cat") == "optimizer" and not any(s <= e["ts"] and _end(e) <= t for s, t in profiling)
    )
    if not ends and trace.passes:
        starts = [ts for ts, _ in trace.passes]
        last = max((_end(e) for e in every + trace.transfers), default=starts[-1])
        return list(zip(starts, [*starts[1:], max(last, starts[-1])], strict=True))
    first = min((e["ts"] for events in trace.spans.values() for e in events), default=0.0)
    return [(ends[i - 1] if i else first, end) for i, end in enumerate(ends)]


def _top_level_waits(trace: Trace) -> list[tuple[str, float, float]]:
    """Waits of the threads running the step, those inside another wait of the same thread left out."""
    waits = []
    for tid in _step_threads(trace):
        outer_end = float("-inf")
        for event in trace.spans[tid]:
            if event.get("cat") != "wait":
                continue
            start, end = event["ts"], _end(event)
            if start >= outer_end:
                waits.append((re.sub(r" \d+$", "", event["name"]), start, end))
                outer_end = end
    return waits


def summarize(trace: Trace) -> list[StepSummary]:
    """One :class:`StepSummary` per step of ``trace``."""
    waits = _top_level_waits(trace)
    phases = [
        (e["name"], e["ts"], _end(e))
        for tid in _step_threads(trace)
        for e in trace.spans[tid]
        if e.get("cat") == "phase"
    ]
    by_link: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in trace.transfers:
        by_link[event["args"]["link"]].append(event)
    out = []
    for index, (lo, hi) in enumerate(step_intervals(trace), start=1):
        step = StepSummary(index, lo, hi)
        wait_spans = []
        for cause, start, end in waits:
            clipped = _clip([(start, end)], lo, hi)
            if clipped:
                step.waits[cause] = step.waits.get(cause, 0.0) + _length(clipped)
                wait_spans += clipped
        busy_all: list[Interval] = []
        storage: list[Interval] = []
        storage_moves: list[tuple[float, float, int, bool]] = []  # this step's: (start, end, bytes, read)
        for link, events in sorted(by_link.items()):
            spans, carried = [], 0.0
            on_storage, reads = _STORAGE in link.split("->"), link.startswith(_STORAGE + "->")
            for event in events:
                start, end = event["ts"], _end(event)
                inside = _clip([(start, end)], lo, hi)
                if not inside and not (lo <= start <= hi and end == start):
                    continue
                share = 1.0 if end == start else _length(inside) / (end - start)
                carried += event["args"]["bytes"] * share
                spans += inside
                if on_storage:
                    storage_moves.append((start, end, event["args"]["bytes"], reads))
            if spans or carried:
                busy = _union(spans)
                step.links[link] = LinkSummary(_length(busy), carried)
                busy_all += busy
                if on_storage:
                    storage += busy
        storage = _union(storage)
        for name, start, end in phases:
            for p_lo, p_hi in _clip([(start, end)], lo, hi):
                step.phases[name] = step.phases.get(name, 0.0) + (p_hi - p_lo)
                step.storage_busy[name] = step.storage_busy.get(name, 0.0) + _length(_clip(storage, p_lo, p_hi))
                read, written = _storage_bytes(storage_moves, p_lo, p_hi)
                step.storage_read[name] = step.storage_read.get(name, 0.0) + read
                step.storage_written[name] = step.storage_written.get(name, 0.0) + written
        moving = _union(busy_all)
        if _length(moving) > 0:
            step.overlap = _minus(moving, _union(wait_spans)) / _length(moving)
        out.append(step)
    return out


def _storage_bytes(moves: list[tuple[float, float, int, bool]], lo: float, hi: float) -> tuple[float, float]:
    """Bytes read from and written to storage in [lo, hi): each move's ``(start, end, bytes,
    read)`` pro rata to the part of it inside, an instant move where it happened."""
    read = written = 0.0
    for start, end, nbytes, is_read in moves:
        if end == start:
            share = 1.0 if lo <= start < hi else 0.0
        else:
            share = _length(_clip([(start, end)], lo, hi)) / (end - start)
        if is_read:
            read += nbytes * share
        else:
            written += nbytes * share
    return read, written


# -- the picture ------------------------------------------------------------------------------------
_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer": "#8172b2",
    "chunk_step": "#937860",
    "fetch": "#64b5cd",
    "phase": "#cccccc",
    "step": "#eeeeee",
    "repack": "#da8bc3",
    "wait": "#c44e52",
}


def plot(trace: Trace, out: str | os.PathLike[str], steps: tuple[int, int] | None = None) -> str:
    """Draw steps ``steps`` (first, last; 1-based, inclusive; default all) of ``trace`` to a PNG:
    one lane per thread (waits in red over the thread's work), one per link (each move, bytes
    in the lane's label), and each tier's bytes in use below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intervals = step_intervals(trace)
    all_events = [e for events in trace.spans.values() for e in events] + trace.transfers
    if steps is not None and intervals:
        if steps[0] > len(intervals):
            raise ValueError(
                f"steps {steps[0]}:{steps[1]} begin past the trace's last step: it has {len(intervals)} "
                f"(give steps 1 to {len(intervals)})"
            )
        first, last = max(1, steps[0]), min(len(intervals), steps[1])  # a range past the end ends at the last
        lo, hi = intervals[first - 1][0], intervals[last - 1][1]
    elif all_events:
        lo, hi = min(e["ts"] for e in all_events), max(_end(e) for e in all_events)
    else:
        lo, hi = 0.0, 1.0
    lanes: list[tuple[str, list[tuple[float, float, str]]]] = []
    for tid, events in sorted(trace.spans.items()):
        bars = [(e["ts"], e["dur"], e.get("cat", "")) for e in events if _clip([(e["ts"], _end(e))], lo, hi)]
        bars.sort(key=lambda bar: bar[2] == "wait")  # waits drawn last, over the work
        if bars:
            lanes.append((trace.thread_names.get(tid, str(tid)), bars))
    by_link: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in trace.transfers:
        if _clip([(event["ts"], _end(event))], lo, hi):
            by_link[event["args"]["link"]].append(event)
    for link, events in sorted(by_link.items()):
        total = sum(e["args"]["bytes"] for e in events)
        lanes.append((f"{link} ({total / 2**20:.1f} MiB)", [(e["ts"], e["dur"], "transfer") for e in events]))
    tiers = {name: series for name, series in trace.counters.items() if name.endswith("bytes in use")}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 1.5 + 0.45 * len(lanes) + 2), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for row, (_, bars) in enumerate(lanes):
        for start, dur, cat in bars:
            colour = _COLOURS.get(cat, "#dd8452")
            height = 0.8 if cat not in ("step", "phase") else 0.95
            alpha = 0.5 if cat == "transfer" else 0.9
            top.broken_barh(
                [((start - lo) * 1e3, max(dur * 1e3, 1e-3))], (row - height / 2, height), color=colour, alpha=alpha
            )
    for start, _ in intervals:
        if lo <= start <= hi:
            top.axvline((start - lo) * 1e3, color="black", lw=0.5, ls=":")
    top.set_yticks(range(len(lanes)), [name for name, _ in lanes])
    top.invert_yaxis()
    top.set_title("tiermem timeline (red: waits; one lane per thread and per link)")
    for name, series in sorted(tiers.items()):
        points = [(t, v) for t, v in series if lo <= t <= hi]
        if points:
            bottom.step([(t - lo) * 1e3 for t, _ in points], [v / 2**20 for _, v in points], where="post", label=name)
    bottom.set_ylabel("MiB")
    bottom.set_xlabel("ms")
    if tiers:
        bottom.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return os.fspath(out)
