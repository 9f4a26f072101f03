"""The order in which the last forward entered its chunks, by which a forward prefetches the chunk it
enters next when that is not the next by index: the tied embedding's chunk at an LM head
(NOTE [ Forward order ]).

:class:`ForwardOrder` only records and answers; the manager's forward hooks tell it when a forward
begins and ends and which chunks each module enters, and hand its answer to the pool
(``ChunkPool.acquire``), which fetches within the buffers of the plan as for any prefetch.

# NOTE [ Forward order ]
1. What is learned: the runs of chunks a forward's modules entered, in order (one run per change
   of the chunks a module's pre-hook fetches: each block's chunks once, then the tied chunk again
   at the head), from the root module's forward pre-hook to its forward hook. Forwards inside
   backward (a checkpointed block recomputed) are not counted: they prefetch nothing (rule 3 of
   NOTE [ Model-state rules ]); nor are calls of a submodule outside the root's forward (a CLIP
   model's ``get_text_features``), which keep the next by index. The next forward runs the same
   modules, so it enters the same runs; one that raised teaches the runs it entered. A re-pack
   renumbers the chunks: the order holds only for the chunk list it was learned on.
2. While a forward has entered the same runs as the last one so far, each new run prefetches the
   first chunk of the runs that follow it in the last forward that is streamed and not one of the
   run's own; once it differs (another branch taken, a different model call), it prefetches the
   next chunk by index, as before anything was learned. Where the learned next chunk is the next by
   index, nothing changes. Exactness never depends on it: a prefetch only starts a fill earlier,
   within the buffers and with the victims any prefetch may take (only chunks behind the run).
   Forwards that alternate between two paths (a reference model's forward with the adapters off
   between training forwards) each follow the other's order and may prefetch the wrong branch's
   chunk, a read that the next by index might have saved.
3. What it is for: nothing follows the last block's chunk by index, so the LM head of a model with
   tied embeddings fetched the embedding's chunk on demand, evicted while the blocks streamed: on
   the 0.15x-RAM headline GPT (64 MiB chunks, NVMe homes) forward waited 23-32 ms for it each step.
4. Tried, not kept: ``optimizer.step()`` filling the next forward's first two chunks as their
   homes landed (their write-backs waited for first). On the 0.15x-RAM headline's plain loop forward
   waited 12-14 ms for its first chunk against 22-23 ms, but the 2.5x-RAM headline's declared step,
   in one run against the code before it, took 48.8 s against 43.6 s with ``ru_maxrss`` 240 MiB
   higher (cause not found), and the fills after a run's last step are reads no forward uses.
"""

from __future__ import annotations

from tiermem.states.chunks import Chunk
from tiermem.states.learned_order import LearnedOrder
from tiermem.states.store import ChunkStore

Run = tuple[int, ...]


class ForwardOrder(LearnedOrder[Run]):
    """Rule 1's runs of the last forward (``last``) and this forward's, as they grow."""

    def __init__(self, store: ChunkStore) -> None:
        super().__init__(store)
        #: rule 1: whether a root forward runs (what a submodule called alone enters is not recorded)
        self._recording = False
        #: rule 2: whether this forward entered the last one's runs so far
        self._follows_last = True
        #: the answer for the run entered last (asked again by each module in it)
        self._following: int | None = None

    def began(self) -> None:
        self._now, self._recording, self._follows_last, self._following = [], True, True, None

    def ended(self) -> None:
        """Rule 1: this forward's runs are the order the next one follows."""
        self._learn()
        self._now, self._recording, self._following = [], False, None

    def entered(self, chunks: tuple[Chunk, ...]) -> int | None:
        """Rule 2: a module of this forward entered ``chunks``; the index of the chunk to prefetch
        next, or None for the next by index."""
        if not self._recording:
            return None
        run = tuple(c.index for c in chunks)
        if self._now and self._now[-1] == run:
            return self._following
        position = len(self._now)
        self._now.append(run)
        last = self.last
        self._follows_last = self._follows_last and position < len(last) and last[position] == run
        self._following = self._next_streamed(last, position + 1, run) if self._follows_last else None
        return self._following

    def _next_streamed(self, runs: tuple[Run, ...], start: int, run: Run) -> int | None:
        """Rule 2: the first streamed chunk of ``runs`` from ``start`` on that ``run`` does not hold."""
        chunks = self.store.chunks
        for position in range(start, len(runs)):
            for index in runs[position]:
                if index not in run and not chunks[index].persistent:
                    return index
        return None
