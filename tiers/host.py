"""The host tier: pinned host memory with CUDA, plain RAM without.

With CUDA the tier pins one pool of exactly ``capacity`` bytes up front and carves
allocations out of it: pinning per tensor is slow, and PyTorch's pinned allocator
rounds every request up to a power of two, so pinning "5 GiB" could lock 8 GiB. We
allocate pageable memory and register exactly that range with ``cudaHostRegister``.

Without CUDA, device and host are one RAM (TRAPS 7): allocations are plain aligned
tensors, and moving bytes device->host saves no memory.
"""

from __future__ import annotations

from typing import Any

import torch

from tiermem.errors import TierCapacityError
from tiermem.tiers.base import ALIGNMENT, Allocation
from tiermem.tiers.extents import ExtentAllocator
from tiermem.tiers.memory import MemoryTier, WorkerCopier, aligned_empty


class HostTier(MemoryTier):
    """Host RAM; a pinned pool when ``pinned`` (requires CUDA)."""

    def __init__(self, capacity: int, *, pinned: bool = False) -> None:
        super().__init__("host", capacity, torch.device("cpu"), WorkerCopier(name="tiermem-host-copy"))
        self.pinned = pinned
        self._pool: torch.Tensor | None = None
        self._extents: ExtentAllocator | None = None
        if pinned:
            if not torch.cuda.is_available():
                raise ValueError(
                    "tiermem host tier: pinned = true needs CUDA, which is not available here; "
                    'set [host] pinned = "auto" or false'
                )
            self._pool = aligned_empty(capacity - capacity % ALIGNMENT, torch.device("cpu"))
            result = torch.cuda.cudart().cudaHostRegister(self._pool.data_ptr(), self._pool.numel(), 0)
            if int(result) != 0:
                raise MemoryError(
                    f"tiermem host tier: cudaHostRegister of {self._pool.numel()} bytes failed ({result}); "
                    "lower [host] capacity or set [host] pinned = false"
                )
            self._extents = ExtentAllocator(self._pool.numel(), ALIGNMENT)

    def _allocate(self, nbytes: int, reserved: int) -> Allocation:
        if self._pool is None or self._extents is None:
            return super()._allocate(nbytes, reserved)
        with self._lock:
            start = self._extents.allocate(reserved)
        if start is None:  # enough bytes free in total, but fragmented
            raise TierCapacityError("host", reserved, self.capacity - self._extents.largest_free(), self.capacity)
        return Allocation(self, nbytes, reserved, tensor=self._pool[start : start + reserved], location=start)

    def _can_adopt(self, data: torch.Tensor) -> bool:
        # A pinned tier copies pageable bytes into its pool: adopting them would break its
        # promise that its bytes are page-locked (CUDA copies from pageable memory run
        # synchronously, through a staging buffer).
        return not (self.pinned and not data.is_pinned())

    def _free(self, allocation: Allocation) -> None:
        if self._extents is not None:
            with self._lock:
                self._extents.free(allocation.location)
        super()._free(allocation)

    def _close(self) -> None:
        super()._close()
        if self._pool is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pool.data_ptr())
            self._pool = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "pinned": self.pinned}
