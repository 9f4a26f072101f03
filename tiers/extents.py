"""A first-fit extent allocator over a linear range of bytes.

Used wherever a tier carves allocations out of one preallocated space: the pinned
host pool (sized once, never pinned per tensor) and the NVMe tier's logical space
(preallocated files rather than a file per tensor, TRAPS 5). Pure bookkeeping: no
I/O, no locks (callers hold their own).
"""

from __future__ import annotations

import bisect

from tiermem.errors import internal_error
from tiermem.units import round_up


class ExtentAllocator:
    """Hands out ``alignment``-aligned extents of ``[0, size)``; merges neighbours on free."""

    def __init__(self, size: int, alignment: int) -> None:
        if size < 0 or alignment <= 0:
            raise internal_error(f"bad extent space size={size} alignment={alignment}")
        self.size = size - size % alignment
        self.alignment = alignment
        # Free extents as two parallel sorted lists (starts, lengths): bisect keeps them ordered.
        self._starts: list[int] = [0] if self.size else []
        self._lengths: list[int] = [self.size] if self.size else []
        self._used: dict[int, int] = {}

    @property
    def high_water(self) -> int:
        """The end of the highest extent in use: storage tiers back files up to it.

        Free extents are coalesced and sorted, so everything above the last free extent's
        start is free exactly when that extent reaches the end of the space.
        """
        if self._starts and self._starts[-1] + self._lengths[-1] == self.size:
            return self._starts[-1]
        return self.size

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    def allocate(self, nbytes: int) -> int | None:
        """Start of a free extent of ``round_up(nbytes, alignment)`` bytes, or None if none fits.

        First fit: the lowest free address, so the used space stays compact and files
        grow only when they must.
        """
        length = round_up(max(nbytes, 1), self.alignment)
        for index, free_length in enumerate(self._lengths):
            if free_length >= length:
                start = self._starts[index]
                if free_length == length:
                    del self._starts[index], self._lengths[index]
                else:
                    self._starts[index] = start + length
                    self._lengths[index] = free_length - length
                self._used[start] = length
                return start
        return None

    def free(self, start: int) -> None:
        length = self._used.pop(start, None)
        if length is None:
            raise internal_error(f"extent at {start} freed but not allocated")
        index = bisect.bisect_left(self._starts, start)
        # Merge with the following free extent.
        if index < len(self._starts) and self._starts[index] == start + length:
            length += self._lengths[index]
            del self._starts[index], self._lengths[index]
        # Merge with the preceding free extent.
        if index > 0 and self._starts[index - 1] + self._lengths[index - 1] == start:
            self._lengths[index - 1] += length
        else:
            self._starts.insert(index, start)
            self._lengths.insert(index, length)
