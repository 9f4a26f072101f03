"""Command-line argument types the benchmark scripts share. Imported by the scripts beside it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def directory(value: str) -> str:
    """A directory that exists, for the options that say where a benchmark's files go (``--path``,
    ``--nvme-path``, ``--dir``). A missing one is named at the command line, as ``tiermem bench io
    --path`` names it, not met as a traceback once the run has started."""
    if not os.path.exists(value):
        raise argparse.ArgumentTypeError(f"{value}: no such directory (make it first, or leave the option out)")
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value}: not a directory")
    return value


def directory_path(value: str) -> Path:
    """:func:`directory`, as a :class:`~pathlib.Path`."""
    return Path(directory(value))
