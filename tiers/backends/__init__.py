"""Storage backends of the NVMe tier: ``posix`` (always) and ``kvikio`` (optional).

The kvikio module is not imported here: importing it must stay free of side effects
(TRAPS 13), and :func:`select_backend` probes it only when asked.
"""

from tiermem.tiers.backends.base import BACKEND_NAMES, StorageBackend, select_backend
from tiermem.tiers.backends.posix import PosixBackend

__all__ = ["BACKEND_NAMES", "PosixBackend", "StorageBackend", "select_backend"]
