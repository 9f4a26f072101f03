"""The order in which a declared loop's chunks stepped early in its last backward, by which the home
of a chunk of tied weights is read before its step asks for it (NOTE [ Tied homes read ahead ]).

:class:`StepOrder` only records; the :class:`~tiermem.states.stepping.Stepper` tells it when a
backward begins and ends and which chunk steps, and reads the home (``_read_tied_ahead``) within
the room and rules of NOTE [ Declared steps ] rule 3.

# NOTE [ Tied homes read ahead ]
1. What is learned: the chunks a complete backward of a declared loop stepped early (NOTE
   [ Declared steps ] rule 3), in the order they stepped. The next window's backward runs the same
   modules, so its chunks step in the same order. A re-pack (at a step, or for a new declaration)
   renumbers the chunks: the order holds only for the chunk list it was learned on. Exactness never
   depends on it: a wrong guess only reads a home early, which then waits on the host for its step;
   the end of backward sends back any that did not step.
2. A chunk holding tied weights steps after the whole backward, since its other owner's gradient
   comes last. Its backward begins at backward's first module (an LM head), so it is never staged
   as its backward begins, which would hold the room through all of backward. Its home was read on
   demand once its gradients were complete: on the 0.15x-RAM headline GPT it waited 43 ms a step,
   then its write-back. Now its home is read as soon as every chunk that stepped before it in the
   last window has stepped in this one, no other chunk whose backward began waits for its step,
   and the room allows (``backward_progress``, from every hook of backward). There, that is the last
   block's step, and the step of the tied chunk no longer waits.
3. Tried, not kept: reading in forward the homes of the chunks that step first in backward, into
   host room the plan leaves free (the 0.15x headline holds about 0.5 of its 1.5 GiB host tier;
   backward there is disk-bound while forward leaves its disk idle for about 0.33 of 0.7 s). Whole
   homes were read at write-back priority in forward order, so forward's fills went first. Reading
   six homes stretched forward from 0.7 to 1.2-1.3 s: forward reached their chunks before the reads
   landed, and on 2 cores the copies from the host competed with compute. Two homes (4 runs
   alternated with none) gave 1.24-1.38x the disk floor against 1.23-1.35x; backward lost about as
   much as forward gained.
"""

from __future__ import annotations

from tiermem.states.learned_order import LearnedOrder


class StepOrder(LearnedOrder[int]):
    """Rule 1's order (``last``: chunk indices in the order the last complete backward with early
    steps stepped them) and this backward's, as it grows."""

    def backward_began(self) -> None:
        self._now = []

    def stepped(self, index: int) -> None:
        self._now.append(index)

    def backward_ended(self, learn: bool) -> None:
        """Rule 1: a complete backward that stepped early teaches the next window its order."""
        if learn:
            self._learn()
        self._now = []

    def stepped_before(self, index: int) -> frozenset[int]:
        """Rule 2: the chunks that stepped before ``index``, one of the last order."""
        return frozenset(self.last[: self.last.index(index)])
