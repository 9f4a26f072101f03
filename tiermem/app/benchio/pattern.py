"""The data ``tiermem bench io`` writes, and the check ``--verify`` makes on what it reads.

A seeded random 1 MiB tile repeated, with every 4 KiB page stamped with its index: a
verified read catches flipped bits and misplaced pages alike, and expected bytes can be
regenerated chunk by chunk instead of keeping a second copy of ``--size`` bytes.
"""

from __future__ import annotations

import torch

from tiermem.tiers.base import ALIGNMENT

__all__ = ["fill_pattern", "first_mismatch"]

_TILE = 1 << 20
#: Patterns are generated and compared this many bytes at a time (bounded extra memory).
_CHUNK = 64 << 20
_SEED = 20240613

_tiles: dict[str, torch.Tensor] = {}


def _tile(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _tiles:
        gen = torch.Generator().manual_seed(_SEED)
        _tiles[key] = torch.randint(0, 256, (_TILE,), dtype=torch.uint8, generator=gen).to(device)
    return _tiles[key]


def _pattern_into(out: torch.Tensor, start: int) -> None:
    """Write bytes ``[start, start + out.numel())`` of the pattern into ``out``.
    ``start`` is a multiple of the tile size (callers walk in whole chunks)."""
    tile = _tile(out.device)
    n = out.numel()
    whole = n - n % _TILE
    if whole:
        out[:whole].view(-1, _TILE).copy_(tile.expand(whole // _TILE, _TILE))
    if n > whole:
        out[whole:].copy_(tile[: n - whole])
    pages = n // ALIGNMENT
    if pages:
        index = torch.arange(start // ALIGNMENT, start // ALIGNMENT + pages, dtype=torch.int64, device=out.device)
        out[: pages * ALIGNMENT].view(pages, ALIGNMENT)[:, :8].copy_(index.view(torch.uint8).view(pages, 8))


def fill_pattern(buffer: torch.Tensor) -> None:
    """Fill ``buffer`` (1-D uint8) with the benchmark's data pattern."""
    for start in range(0, buffer.numel(), _CHUNK):
        _pattern_into(buffer[start : start + _CHUNK], start)


def first_mismatch(buffer: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``None`` when ``buffer`` holds the pattern, else (offset, expected, got, bytes that differ)."""
    expected = torch.empty(min(_CHUNK, buffer.numel()), dtype=torch.uint8, device=buffer.device)
    found: tuple[int, int, int] | None = None
    differing = 0
    for start in range(0, buffer.numel(), _CHUNK):
        got = buffer[start : start + _CHUNK]
        want = expected[: got.numel()]
        _pattern_into(want, start)
        if torch.equal(got, want):
            continue
        diff = got != want
        differing += int(diff.sum())
        if found is None:
            at = int(diff.nonzero()[0, 0])
            found = (start + at, int(want[at]), int(got[at]))
    return None if found is None else (*found, differing)
