"""Staging memory for storage I/O: page-aligned bounce buffers and raw-memory views.

Used by the NVMe tier (:mod:`tiermem.tiers.nvme_store`, :mod:`tiermem.tiers.nvme_engine`)
where a segment cannot go straight between the caller's memory and the file: O_DIRECT
padding, CUDA tensors, checksum records wider than the request
(NOTE [ NVMe tier layout and I/O ] rule 3).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

import torch

from tiermem.tiers.base import ALIGNMENT

__all__ = ["BounceBuffer", "BouncePool", "is_aligned", "memview"]


def memview(address: int, nbytes: int) -> memoryview:
    """A byte memoryview over raw memory. The caller keeps the memory alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def is_aligned(*values: int) -> bool:
    """True when every value (address, length, offset) is a multiple of ``ALIGNMENT``
    (non-negative values: OR-ing them keeps every low bit any of them has)."""
    acc = 0
    for v in values:
        acc |= v
    return acc % ALIGNMENT == 0


class BounceBuffer:
    """A page-aligned host buffer of ``size`` bytes for staging (O_DIRECT padding, CUDA tensors, checksums).

    ``pinned``: page-locked, for staging CUDA tensors: a copy between the device and pageable
    memory goes through a driver buffer of its own, one more copy and no overlap."""

    __slots__ = ("address", "size", "tensor")

    def __init__(self, size: int, *, pinned: bool = False) -> None:
        raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8, pin_memory=pinned)
        start = (-raw.data_ptr()) % ALIGNMENT
        self.tensor = raw[start : start + size]
        self.address = self.tensor.data_ptr()
        self.size = size

    def view(self, nbytes: int, start: int = 0) -> memoryview:
        return memview(self.address + start, nbytes)


class BouncePool:
    """Bounce buffers made on first need, at most ``limit`` (one per worker), then reused;
    page-locked ones when ``pinned`` (made only when a CUDA tensor needs staging)."""

    def __init__(self, size: int, limit: int, *, pinned: bool = False) -> None:
        self._pinned = pinned
        self._size = size
        self._limit = limit
        self._free: list[BounceBuffer] = []
        self._made = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def get(self) -> Iterator[BounceBuffer]:
        """Borrow a buffer for the ``with`` block, waiting while all ``limit`` are lent out."""
        with self._cond:
            while not self._free and self._made >= self._limit:
                self._cond.wait()
            if self._free:
                bounce = self._free.pop()
            else:
                self._made += 1
                bounce = None
        if bounce is None:
            try:
                bounce = BounceBuffer(self._size, pinned=self._pinned)
            except BaseException:
                with self._cond:
                    self._made -= 1
                    self._cond.notify()
                raise
        try:
            yield bounce
        finally:
            with self._cond:
                self._free.append(bounce)
                self._cond.notify()

    def clear(self) -> None:
        """Drop the buffers not lent out (they are made again on the next need)."""
        with self._cond:
            self._made -= len(self._free)
            self._free.clear()
