"""What the ``tiermem`` commands do when the reader of their output goes away."""

from __future__ import annotations

import contextlib
import os
import sys


def stdout_closed() -> int:
    """The reader of stdout went away (``tiermem train | head -1``): not an error of the command,
    so no traceback. Point stdout at /dev/null so the interpreter's own flush at exit does not
    fail again (Python's documentation, "Note on SIGPIPE"); the exit status is 0."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: a stdout with no file descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0
