"""Storage backends of the NVMe tier: ``posix`` (always), ``aio`` (Linux AIO through a kernel
submission queue, where the kernel and filesystem allow it) and ``kvikio`` (optional).

The kvikio and aio modules are not imported here: importing kvikio must stay free of side
effects (TRAPS 13), and :func:`select_backend` probes each only when asked.
"""

from tiermem.tiers.backends.base import BACKEND_NAMES, StorageBackend, select_backend
from tiermem.tiers.backends.posix import PosixBackend

__all__ = ["BACKEND_NAMES", "PosixBackend", "StorageBackend", "select_backend"]
