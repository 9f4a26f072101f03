"""The device tier: the compute device, within a byte budget.

With CUDA: device memory on ``cuda:N`` and a dedicated copy stream. Without CUDA: the
CPU, with the capacity enforced as a budget of real RAM (every byte allocated here is
a real byte of the process), and copies still asynchronous on a worker.

Streamed chunk storage that does NVMe I/O may come from a private pool registered with cuFile
(:meth:`DeviceTier.resize_for_io`, NOTE [ Registered device pool ] in :mod:`.device_pool`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from tiermem.tiers import device_pool
from tiermem.tiers.memory import CudaStreamCopier, MemoryTier, WorkerCopier


def resolve_device(spec: str = "auto") -> torch.device:
    """``"auto"`` -> ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


class DeviceTier(MemoryTier):
    """Memory on the compute device (or the CPU standing in for it)."""

    def __init__(self, capacity: int, device: str | torch.device = "auto") -> None:
        resolved = resolve_device(device) if isinstance(device, str) else device
        if resolved.type == "cuda":
            copier: CudaStreamCopier | WorkerCopier = CudaStreamCopier(resolved)
        else:
            copier = WorkerCopier(name="tiermem-device-copy")
        super().__init__("device", capacity, resolved, copier)
        self._io_lock = threading.Lock()
        #: the I/O peer the registered pool was made for: the first one asked that registers device
        #: memory (a runtime has one NVMe tier; host-homed chunks ask too and are never it)
        self._io_peer: Any = None
        self._io_pool: device_pool.RegisteredDevicePool | None = None
        self._no_pool: bool | None = None

    @property
    def io_pool(self) -> device_pool.RegisteredDevicePool | None:
        """The registered pool chunk storage comes from, once one was made (NOTE [ Registered device pool ])."""
        return self._io_pool

    def resize_for_io(self, storage: torch.UntypedStorage, nbytes: int, io: Any) -> None:
        """Give ``storage`` (empty, on this tier's device) ``nbytes`` for a buffer refilled from and
        written to ``io`` again and again (a streamed chunk and its home tier): from the pool
        registered with ``io``'s backend where that pays and is safe (rules 1, 5), else a plain
        ``resize_``. The caller accounts the storage as before (``adopt``)."""
        if self._no_pool is None:  # decided once: the CPU device never has one (rule 1)
            self._no_pool = self.device.type != "cuda" and device_pool.pool_unavailable_reason(self.device) is not None
        if self._no_pool:
            storage.resize_(nbytes)
            return
        with self._io_lock:
            if self._io_peer is None and getattr(io, "registers_device_memory", False) and not self._closed:
                self._io_peer = io
                self._io_pool = device_pool.open_pool(self.device, io)
            pool = self._io_pool if io is self._io_peer else None
        if pool is None:
            storage.resize_(nbytes)
        else:
            pool.resize(storage, nbytes)

    def _close(self) -> None:
        with self._io_lock:
            pool, self._io_pool = self._io_pool, None
        if pool is not None:
            pool.close()  # deregistered before the pool can give memory back (rule 2d)
        super()._close()
