"""Byte sizes: parse ``"512MiB"``/``"8GiB"``/ints, format back, and the I/O alignment (``ALIGNMENT``).

A leaf module (no tiermem imports) so tiers, schedulers and the core share it.
"""

from __future__ import annotations

import math
import re

#: The I/O page: every tier allocation is reserved (and, in memory tiers, aligned) in multiples
#: of it, which is what O_DIRECT needs (the tiers, the chunk layout and the planner share it).
ALIGNMENT = 4096

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Return ``value`` as a number of bytes.

    Accepts a non-negative int, or a string such as ``"4096"``, ``"1MiB"``, ``"1.5 GiB"``,
    ``"10GB"`` (SI) — units are case-insensitive. Raises ``ValueError`` naming the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got the boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size (int bytes or a string like '512MiB'), got {value!r}")
    match = _SIZE_RE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a size; write bytes as an int or a string like '512MiB', '8GiB', '10GB'"
        )
    number, unit = match.groups()
    nbytes = float(number) * _UNITS[unit.lower()]
    if nbytes != int(nbytes):
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(nbytes)


def format_size(nbytes: int | float) -> str:
    """Format bytes with a binary unit, e.g. ``1048576 -> '1MiB'``, ``1536 -> '1.5KiB'``."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            text = f"{n:.2f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_size_up(nbytes: int | float) -> str:
    """Like ``format_size``, but rounded up in its last shown digit (``format_size`` rounds to
    nearest), so that the size shown is never below ``nbytes``: for a capacity to raise to."""
    whole = math.ceil(nbytes)
    for power, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB")):
        if abs(whole) < 1024 ** (power + 1) or unit == "TiB":
            break
    hundredths = -(-whole * 100 // 1024**power)
    text = f"{hundredths // 100}.{hundredths % 100:02d}".rstrip("0").rstrip(".")
    return f"{text}{unit}"


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple
