"""``tiermem trace summary FILE`` / ``tiermem trace plot FILE [-o PNG]``: read a timeline trace
(``tiermem train --trace FILE``, ``rt.trace(path)``, ``[trace] path``, ``TIERMEM_TRACE``).

``summary`` prints per step: time, compute, waits by cause, each link's busy fraction and
bandwidth, and the overlap ratio (the share of link-busy time no wait covered); ``plot`` draws
the timeline of some steps with matplotlib. The logic is :mod:`tiermem.app.trace_report`; this
module parses and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tiermem.cli.output import stdout_closed
from tiermem.units import format_size


def _step_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition(":")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step or a range such as 2:4") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: steps count from 1, the first one no later than the last")
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    summary = actions.add_parser(
        "summary",
        help="per step: compute, waits by cause, each link's busy fraction and bandwidth, overlap",
        description="Summarise a tiermem timeline trace step by step.",
    )
    summary.add_argument("path", metavar="FILE", help="a trace written by tiermem (Chrome trace JSON)")
    summary.add_argument("--json", action="store_true", help="print the summary as one JSON object, nothing else")
    plot = actions.add_parser(
        "plot",
        help="draw the timeline (threads, links, waits, tier bytes) to a PNG",
        description="Draw a tiermem timeline trace with matplotlib: a lane per thread and per link, waits in red, "
        "each tier's bytes in use below.",
    )
    plot.add_argument("path", metavar="FILE", help="a trace written by tiermem (Chrome trace JSON)")
    plot.add_argument("-o", "--output", metavar="PNG", help="the picture to write (default: FILE with .png)")
    plot.add_argument("--steps", type=_step_range, metavar="A[:B]", help="only steps A to B (default: all)")


def run(args: argparse.Namespace) -> int:
    from tiermem.app import trace_report

    try:
        trace = trace_report.load(args.path)
    except (OSError, ValueError) as exc:
        print(f"tiermem trace: cannot read {args.path}: {exc}", file=sys.stderr)
        return 1
    if args.action == "plot":
        out = args.output or os.path.splitext(args.path)[0] + ".png"
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder):
            print(f"tiermem trace plot: cannot write {out}: no such directory {folder}", file=sys.stderr)
            return 1
        try:
            written = trace_report.plot(trace, out, args.steps)
        except ValueError as exc:  # steps the trace does not have
            print(f"tiermem trace plot: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"tiermem trace plot: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(written)
        return 0
    try:
        steps = trace_report.summarize(trace)
        if args.json:
            print(json.dumps({"steps": [s.as_dict() for s in steps], "link_bytes": trace.link_bytes(), **trace.info}))
        else:
            _print_summary(steps, trace)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``tiermem trace summary FILE | head``)
        return stdout_closed()
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms"


def _phase(step: Any, name: str, seconds: float) -> str:
    """A phase's time, and the share of it that storage was busy with the bytes it moved (when it
    was at all)."""
    busy = step.storage_busy.get(name, 0.0)
    if not busy or not seconds:
        return f"{name} {_ms(seconds)}"
    read, written = step.storage_read.get(name, 0.0), step.storage_written.get(name, 0.0)
    return (
        f"{name} {_ms(seconds)} (storage busy {busy / seconds:.0%}: "
        f"{format_size(round(read))} read, {format_size(round(written))} written)"
    )


def _print_summary(steps: list[Any], trace: Any) -> None:
    if not steps:
        print("no steps in this trace (no step or optimizer-step spans)")
    for step in steps:
        waits = ", ".join(f"{cause} {_ms(s)}" for cause, s in sorted(step.waits.items(), key=lambda kv: -kv[1]))
        overlap = "-" if step.overlap is None else f"{step.overlap:.2f}"
        print(
            f"step {step.index}: {_ms(step.seconds)}  compute {_ms(step.compute_s)}  wait {_ms(step.wait_s)}"
            f"  overlap {overlap}"
        )
        if step.phases:
            print("  phases: " + ", ".join(_phase(step, name, s) for name, s in step.phases.items()))
        if waits:
            print(f"  waits: {waits}")
        for name, link in sorted(step.links.items()):
            share = link.busy_s / step.seconds if step.seconds else 0.0
            rate = f"{format_size(link.bandwidth)}/s" if link.busy_s else "-"
            print(f"  {name:<14} busy {share:6.1%}  {format_size(int(link.bytes)):>10}  {rate}")
    dropped = trace.info.get("dropped_events", 0)
    if dropped:
        print(
            f"note: {dropped} events were dropped while recording ([trace] max_size reached); the last steps lack them"
        )
