"""Checksums of NVMe-tier bytes: xxh3-64 records of logical byte ranges, kept per stripe unit.

The tier records one :class:`ChecksumRecord` per written range and verifies reads against
the records covering them (NOTE [ NVMe tier layout and I/O ] rule 4, in
:mod:`tiermem.tiers.nvme`). This module only keeps the records; it does no I/O.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import xxhash

__all__ = ["ChecksumIndex", "ChecksumRecord", "digest_of"]


def digest_of(view: memoryview) -> int:
    """The xxh3-64 digest of ``view``'s bytes, as an int."""
    return xxhash.xxh3_64_intdigest(view)


class ChecksumRecord(NamedTuple):
    """The checksum of bytes ``[start, start + length)`` of the logical space."""

    start: int
    length: int
    digest: int

    @property
    def end(self) -> int:
        return self.start + self.length


class ChecksumIndex:
    """Checksum records, grouped by stripe unit of ``unit`` bytes.

    A record never crosses a stripe unit (NOTE [ NVMe tier layout and I/O ] rule 2), so
    :meth:`overlapping` looks only in the unit holding ``lo``. Thread-safe.
    """

    def __init__(self, unit: int) -> None:
        self._unit = unit
        self._units: dict[int, dict[int, ChecksumRecord]] = {}
        self._lock = threading.Lock()

    def overlapping(self, lo: int, hi: int) -> list[ChecksumRecord]:
        with self._lock:
            records = self._units.get(lo // self._unit, {})
            return sorted(r for r in records.values() if r.start < hi and r.end > lo)

    def record(self, start: int, length: int, digest: int) -> None:
        """Record a checksum, replacing every record it overlaps (their bytes changed)."""
        with self._lock:
            records = self._units.setdefault(start // self._unit, {})
            for r in [r for r in records.values() if r.start < start + length and r.end > start]:
                del records[r.start]
            records[start] = ChecksumRecord(start, length, digest)

    def discard(self, lo: int, hi: int) -> None:
        """Drop records overlapping ``[lo, hi)`` (after a failed write, or a free)."""
        with self._lock:
            for unit in range(lo // self._unit, (hi - 1) // self._unit + 1):
                records = self._units.get(unit)
                if not records:
                    continue
                for r in [r for r in records.values() if r.start < hi and r.end > lo]:
                    del records[r.start]
                if not records:
                    del self._units[unit]

    def count(self) -> int:
        with self._lock:
            return sum(len(records) for records in self._units.values())
