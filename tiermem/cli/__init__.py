"""The ``tiermem`` command line: one entry point, one module per subcommand.

Each subcommand lives in ``tiermem/cli/<name>_cmd.py`` and exposes two functions::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...   # its options/sub-actions
    def run(args: argparse.Namespace) -> int: ...                     # the exit status

and one line in :data:`COMMANDS` below. Only the module of the command being run is
imported (``tiermem --help`` imports none), so a command that needs torch does not slow
down the others; a listed module that is not there yet is left out of the parser.

Errors tiermem raises on purpose (:class:`~tiermem.errors.TiermemError`, e.g. a ConfigError
listing every problem) are printed to stderr with exit status 1, never as a traceback;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import signal
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import NamedTuple

from tiermem.errors import TiermemError

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


class Command(NamedTuple):
    """Where a subcommand lives and the one line ``tiermem --help`` shows for it."""

    module: str
    summary: str


COMMANDS: dict[str, Command] = {
    "bench": Command("tiermem.cli.bench_cmd", "benchmark a tier's I/O bandwidth (tiermem bench io)"),
    "config": Command("tiermem.cli.config_cmd", "check a tier configuration, or show it resolved"),
    "train": Command("tiermem.cli.train_cmd", "train the built-in GPT under a tier configuration"),
    "plan": Command("tiermem.cli.plan_cmd", "show the plan the planner picks, with its predictions"),
    "rok": Command("tiermem.cli.rok_cmd", "the recompute-offload-keep curve (CSV and PNG)"),
    "checkpoint": Command("tiermem.cli.checkpoint_cmd", "inspect a checkpoint: step, tensors, format, complete"),
    "trace": Command("tiermem.cli.trace_cmd", "read a timeline trace: a per-step summary, or a PNG of it"),
}
"""Subcommand name -> module. Add a line here and a ``<name>_cmd.py`` module to add a command."""


def _available(command: Command) -> bool:
    """Whether the command's module exists, without importing (executing) it."""
    return importlib.util.find_spec(command.module) is not None


def _command_name(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the top level takes no option with a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The ``tiermem`` parser; only the subcommand named in ``argv`` gets its module imported
    and its arguments added (the others show their summary only)."""
    from tiermem import __version__

    parser = argparse.ArgumentParser(
        prog="tiermem",
        description="Device memory, host memory and NVMe as tiers of one store for PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"tiermem {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _command_name(argv)
    for name, command in COMMANDS.items():
        if not _available(command):
            continue
        sub = subparsers.add_parser(name, help=command.summary, description=command.summary)
        if name == chosen:
            importlib.import_module(command.module).add_arguments(sub)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (argparse keeps it in its subparsers action)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    return parser


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while a command runs, so its ``finally`` blocks
    (leaving ``with rt``) remove every file it made, as for Ctrl-C. A SIGTERM the process
    ignores stays ignored."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: signals cannot be handled here anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tiermem`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    try:
        args, unknown = parser.parse_known_args(args_list)
        if unknown:  # the subcommand's usage, not the top level's, is what helps here
            _subcommand_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help, --version, usage errors: keep argparse's status
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    module = importlib.import_module(COMMANDS[args.command].module)
    try:
        with sigterm_as_interrupt():
            return int(module.run(args))
    except TiermemError as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tiermem: interrupted", file=sys.stderr)
        return 130
