"""tiermem: device memory, pinned host memory and NVMe as tiers of one store for PyTorch.

Exports are lazy (PEP 562) so that ``import tiermem.tiers`` or ``import tiermem.errors``
does not import the core (and torch-heavy modules) and create import cycles.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Large CPU tensors on page boundaries, backed by huge pages (TRAPS 5, 22). Unless the user
# chose (``THP_MEM_ALLOC_ENABLE=0`` opts out), ask torch's CPU allocator to align tensors of
# 2 MiB and more to pages and madvise them MADV_HUGEPAGE. Without it a large tensor starts
# 64 bytes into glibc's mmap, so every NVMe read into a chunk buffer or a saved activation
# goes through a bounce buffer instead of O_DIRECT straight into it, and a chunk buffer
# refilled each step faults in every 4 KiB page again (measured on a 63M GPT with NVMe
# homes: ~190k page faults a step and 30% of NVMe segments staged, against ~12k and none
# with it). torch reads the variable once, at its first allocation of 2 MiB or more, so
# this takes effect when tiermem is imported before the model is built; it changes where
# memory lies, never what is computed.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
    "checkpoint",
    "distributed",
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


#: Subpackages the README reaches as ``tiermem.<name>`` after a plain ``import tiermem``
#: (``tiermem.checkpoint.storage_reader``, ``except tiermem.distributed.PeerFailureError``),
#: imported when first named: DCP and torch.distributed only when asked.
_SUBMODULES = ("checkpoint", "distributed", "errors", "integrations")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"tiermem.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiermem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own globals, as Python's default ``dir`` lists them, plus the lazy exports
    and subpackages: ``__getattr__`` alone leaves them out until first used, so tab completion
    and ``dir(tiermem)`` would not offer ``Runtime`` or ``Config``. Imports nothing."""
    return sorted({*globals(), *__all__, *_EXPORTS, *_SUBMODULES})
