"""An order one pass over the chunks recorded, kept for the next pass: what
:class:`~tiermem.states.forward_order.ForwardOrder` (the runs of chunks a forward entered) and
:class:`~tiermem.states.step_order.StepOrder` (the chunks a backward stepped early) share.

A re-pack renumbers the chunks into a new chunk list, so an order holds only for the chunk list it
was learned on: :attr:`LearnedOrder.last` is empty on any other.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from tiermem.states.chunks import Chunk
from tiermem.states.store import ChunkStore

T = TypeVar("T")


class LearnedOrder(Generic[T]):
    """The last complete pass's order (:attr:`last`) and this pass's, as it grows (``_now``)."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._last: tuple[T, ...] = ()
        #: the chunk list ``_last`` indexes (a re-pack builds a new one)
        self._learned_on: list[Chunk] | None = None
        self._now: list[T] = []

    @property
    def last(self) -> tuple[T, ...]:
        """The last learned order, of the chunks as they are now (empty after a re-pack)."""
        return self._last if self._learned_on is self.store.chunks else ()

    def _learn(self) -> None:
        """This pass's order becomes the one the next pass follows, unless it recorded nothing."""
        if self._now:
            self._last, self._learned_on = tuple(self._now), self.store.chunks
