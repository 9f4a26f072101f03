"""tiermem: device memory, pinned host memory and NVMe as tiers of one store for PyTorch.

Exports are lazy (PEP 562) so that ``import tiermem.tiers`` or ``import tiermem.errors``
does not import the core (and torch-heavy modules) and create import cycles.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Runtime": "tiermem.runtime",
    "Config": "tiermem.config",
    "Stats": "tiermem.stats",
    "Handle": "tiermem.registry",
    "Priority": "tiermem.schedulers.base",
    "parse_size": "tiermem.units",
    "format_size": "tiermem.units",
}

__all__ = [
    "Config",
    "Handle",
    "Priority",
    "Runtime",
    "Stats",
    "__version__",
    "errors",
    "format_size",
    "parse_size",
]

if TYPE_CHECKING:  # pragma: no cover
    from tiermem.config import Config
    from tiermem.registry import Handle
    from tiermem.runtime import Runtime
    from tiermem.schedulers.base import Priority
    from tiermem.stats import Stats
    from tiermem.units import format_size, parse_size


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("tiermem.errors")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiermem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
