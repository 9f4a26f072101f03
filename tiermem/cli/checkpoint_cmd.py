"""``tiermem checkpoint inspect DIR``: what a checkpoint holds and whether it is complete.

Prints the step, the run settings ``tiermem train`` saved (what ``--resume`` must be given
again), format, files, tensors (count, bytes, per section, the largest with shapes
and dtypes), whether every file matches its digest, and any save interrupted beside it, as a
table or (``--json``) one JSON object. Exit status 0 for a complete checkpoint, 1 otherwise
(so a script can test it). The logic is :mod:`tiermem.checkpoint.inspect`; this module parses
and prints.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from tiermem.cli.arguments import positive_int
from tiermem.units import format_size

if TYPE_CHECKING:  # the real import waits for run(): torch is slow to import for --help
    from tiermem.checkpoint.inspect import CheckpointReport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = actions.add_parser(
        "inspect",
        help="step, tensors, sizes, format and completeness of a checkpoint directory",
        description="Show what a checkpoint (rt.save, tiermem train --checkpoint) holds and verify every file's "
        "digest. Reads the state file with pickle: inspect only checkpoints you trust. Exit status 1 when the "
        "checkpoint is missing, damaged or incomplete.",
    )
    inspect.add_argument("path", metavar="DIR", help="the checkpoint directory")
    inspect.add_argument(
        "--largest", type=positive_int, default=5, metavar="N", help="show the N largest tensors (default: 5)"
    )
    inspect.add_argument("--json", action="store_true", help="print the report as one JSON object, nothing else")


def run(args: argparse.Namespace) -> int:
    from tiermem.checkpoint.inspect import inspect_checkpoint  # torch only when the command runs

    report = inspect_checkpoint(args.path, largest=args.largest)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        _print_report(report)
    return 0 if report.complete else 1


def _status(report: CheckpointReport) -> str:
    if report.complete:
        checked = "every file matches its digest" if report.verified else "a plain DCP checkpoint: no digests to check"
        return f"complete ({checked})"
    return f"NOT complete: {report.problem}"


def _rows(report: CheckpointReport) -> list[tuple[str, str]]:
    rows = [("path", report.path), ("status", _status(report))]
    if report.exists:
        rows.append(("format", report.format or "unknown (no manifest, no DCP metadata)"))
        rows.append(("step", "-" if report.step is None else str(report.step)))
        if report.run is not None:
            rows.append(("run settings", _settings(report.run)))
        if report.extra_keys is not None:
            rows.append(("extra", ", ".join(report.extra_keys) or "-"))
        rows.append(("files", f"{report.files} ({format_size(report.bytes_on_disk)} on disk)"))
        rows.append(("tensors", f"{report.tensors} ({format_size(report.tensor_bytes)})"))
        for name, section in report.sections.items():
            rows.append((f"  {name}", f"{section['tensors']} ({format_size(section['bytes'])})"))
    beside: list[tuple[str, list[str]]] = [
        ("interrupted save", report.interrupted),
        ("save running now", report.in_progress),
        ("old checkpoint left", report.leftover_old),
    ]
    for what, names in beside:
        for name in names:
            rows.append((what, f"{name} (beside it; the next save or load of the path handles it)"))
    return rows


#: saved setting -> the ``tiermem train`` flag that gives it
_FLAGS = {
    "n_layer": "--layers", "d_model": "--d-model", "n_head": "--heads", "vocab_size": "--vocab", "seq_len": "--seq-len",
    "batch_size": "--batch-size", "lr": "--lr", "seed": "--seed",
}  # fmt: skip


def _settings(run: dict[str, Any]) -> str:
    """``tiermem train``'s saved settings, as the flags that give them (``--resume`` checks them)."""
    model = run.get("model")
    items = [*(model.items() if isinstance(model, dict) else ()), *((k, v) for k, v in run.items() if k != "model")]
    shown = [f"{_FLAGS.get(key, key.replace('_', ' '))} {value}" for key, value in items]
    return " ".join(shown) + " (a --resume must give the same)"


def _print_report(report: CheckpointReport) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    summary = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    summary.add_column(style="bold")
    summary.add_column()
    for name, text in _rows(report):
        summary.add_row(Text(name), Text(text))  # Text: paths and messages are not rich markup
    console.print(summary)
    if not report.largest:
        return
    largest = Table(title=f"largest {len(report.largest)} tensors", title_justify="left")
    for column in ("tensor", "shape", "dtype", "bytes"):
        largest.add_column(column, justify="right" if column == "bytes" else "left")
    for info in report.largest:
        largest.add_row(Text(info.name), Text(_shape(info.shape)), info.dtype, format_size(info.bytes))
    console.print(largest)


def _shape(shape: list[Any]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ")"
