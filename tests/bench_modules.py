"""The benchmark scripts of bench/ as modules, imported as the scripts import each other (the
folder on ``sys.path``), for tests that call their functions rather than run them."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


@contextlib.contextmanager
def bench_on_path() -> Iterator[None]:
    """bench/ on ``sys.path``, as for a script run from there (the scripts import their neighbours)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


@contextlib.contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    with bench_on_path():
        yield importlib.import_module(name)
