"""The first-step profiling step run on the chunks in place, streamed through the device budget
(issue 20 item 2): for a model whose plain copy would not fit the capacities (rule 9 of NOTE
[ Model-state rules ] in ``manager.py``; the relayout decides which way it profiles).

:class:`StreamedProfiling` owns, while it is entered, hooks of its own on the model's modules
and trainable parameters, a :class:`~tiermem.states.backward.BackwardTracker` over stand-ins
that drop gradients, and the clock of fetch waits. It may touch: chunk pins and the pool's
residency (``acquire``, ``clear``) and the parameters' ``.grad`` (set aside while it is
entered, the profiling step's dropped as they accumulate). The manager's own hooks
must be off while it is entered.

# NOTE [ Streamed first-step profiling ]
1. Why: profiling on plain parameters holds a plain copy of the model states beside the
   chunks (measured: a 34M GPT with 60% of its states on NVMe peaked above plain PyTorch's
   RSS at its first step). Streamed, the parameters stay views into their chunks (TRAPS 2) and
   the profiling step holds no more of them than training under the default placement does:
   at most ``plan.buffers`` streamed chunks on the device (one more on demand where the
   tier has the bytes), their homes where they live.
2. Residency is the manager's (rule 3): a module's forward pre-hook acquires its chunks
   (DEMAND, the next prefetched) and pins them while it runs; its backward pins and
   re-acquires them through a real ``BackwardTracker``, so tied weights, repeated calls and
   modules without trainable parameters are released when the manager would release them.
3. Nothing training depends on changes: the real ``.grad`` are set aside while it is entered
   and put back after (autograd would add the profiling step's gradients into them in
   place); the tracker's gradient and step collaborators are stand-ins, so a profiling
   gradient is dropped (``p.grad = None``) as soon as autograd accumulated it (they never
   exist together, as in a loop that steps in backward), nothing is written home, nothing
   steps, no declared-loop counter moves. Pins, ``pending`` and ``entered`` are back to what
   they were when the tracker's backward ends; the chunks' values are only read, so no
   device copy is dirty. RNG and buffers: NOTE [ Profiling step ] rule 2.
4. Fetch waits: the seconds the training thread spends in ``acquire`` (forward and backward)
   add up on the clock the profiler subtracts (NOTE [ Profiling step ] rule 8): block times
   are compute without the I/O waits. A prefetch that overlapped compute is not subtracted.
5. The profiler's operator-level byte counts must not see the pool's own tensors: fetches run
   with the profiler's dispatch modes off.
6. Capacities: the plan replaces the chunks in force, so the search is given what the tiers
   have free plus what those chunks hold (``held``, taken with the pool emptied); the pool
   is emptied again, spares included, once the passes are done (``Streaming.release``),
   before the link probes, the overhead calibration and the search read free bytes.
   Beyond the capacities the profiling holds its blocks' inputs, one block's activations
   (recomputed in backward: NOTE [ Profiling step ] rule 11), what outside the blocks saves, the
   temporaries, and the optimizer timing's synthetic sample.
7. A block recomputed in backward (NOTE [ Profiling step ] rule 14) acquires its modules'
   chunks while backward pins the module it stopped in (and the shared chunks): where the
   device's free bytes (the pool emptied) cannot hold one chunk more than that, nor the
   buffers, of the largest streamed chunk, the pass is told not to recompute.
8. The heap is trimmed as the pass streams (every 64 MiB of chunks fetched), not only between
   its phases as training's steps are (NOTE [ Returning freed memory ] rule 5): the pass runs
   once a run, so its pages faulted in again cost little, and it would otherwise set the
   process's peak. Measured on ``bench/lora.py --size 400M`` (a 1.6 GB frozen base streamed
   through 10% capacities): trimmed only between phases, the pass peaked at 944 MiB, above
   every training step's 739-814 MiB; trimmed as it streams, 756 MiB (the steps 741-813).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.hooks import RemovableHandle

from tiermem.states.backward import BackwardTracker
from tiermem.states.chunks import Chunk
from tiermem.states.facts import Lifecycle, ModelFacts
from tiermem.states.gradients import Gradients
from tiermem.states.stepping import Stepper
from tiermem.states.store import ChunkStore


class _TimedPool:
    """The store's pool, with the seconds ``acquire`` waits added to a clock (rule 4)."""

    def __init__(self, store: ChunkStore) -> None:
        self._store = store
        self.waited = 0.0

    def acquire(self, chunks: tuple[Chunk, ...], direction: int, following: int | None = None) -> None:
        start = time.perf_counter()
        try:
            with _disable_current_modes():  # rule 5: the profiler's byte counts must not see the pool
                self._store.pool.acquire(chunks, direction, following)
        finally:
            self.waited += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store.pool, name)  # the rest of the pool, untimed


class _TimedStore:
    """What the tracker reads of the store, its pool timed."""

    def __init__(self, store: ChunkStore, pool: _TimedPool) -> None:
        self._store = store
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class _DroppedGradients:
    """Rule 3: the gradient collaborator of the profiling step's tracker."""

    def __init__(self, store: ChunkStore) -> None:
        self._store = store

    def accumulate(self, i: int, p: torch.Tensor) -> Chunk:
        p.grad = None
        return self._store.chunk_of(i)

    def reconcile(self) -> None: ...

    def send_offloaded_back(self) -> None: ...

    def enter(self, chunk: Chunk) -> None: ...

    def flush(self, chunk: Chunk) -> None: ...

    def expose(self) -> None: ...


class _NoSteps:
    """Rule 3: the step collaborator of the profiling step's tracker."""

    def arm_early_steps(self) -> None: ...

    def backward_entered(self, chunk: Chunk) -> None: ...

    def backward_progress(self) -> None: ...

    def gradients_complete(self, chunk: Chunk) -> None: ...

    def backward_ended(self, complete: bool) -> None: ...

    def abandon_queued(self) -> None: ...


class StreamedProfiling:
    """``with StreamedProfiling(store, facts, held):`` the model runs with its chunks streamed
    (rules 2-5) and the profiler is told so (NOTE [ Profiling step ] rule 8)."""

    def __init__(self, store: ChunkStore, facts: ModelFacts, held: Mapping[str, int]) -> None:
        self.store = store
        self.facts = facts
        self.pool = _TimedPool(store)
        trainable = [p.requires_grad for p in facts.params]
        self.tracker = BackwardTracker(
            dataclasses.replace(facts, trainable=trainable),
            cast(ChunkStore, _TimedStore(store, self.pool)),
            cast(Gradients, _DroppedGradients(store)),
            cast(Stepper, _NoSteps()),
            Lifecycle(0),
        )
        self._held = dict(held)
        self._active: list[tuple[nn.Module, int]] = []
        self._hooks: list[RemovableHandle] = []
        self._context: Any = None
        self._grads: list[torch.Tensor | None] = []

    def __enter__(self) -> StreamedProfiling:
        # Rule 3: autograd would add the profiling step's gradients into the real ones in place.
        self._grads = [p.grad for p in self.facts.params]
        for p in self.facts.params:
            p.grad = None
        model = self.facts.model
        self._hooks.append(model.register_forward_pre_hook(self._root_started))
        for module in self.facts.module_names:
            self._hooks.append(module.register_forward_pre_hook(self._started))
            self._hooks.append(module.register_forward_hook(self._ended, with_kwargs=True, always_call=True))
        for i, p in enumerate(self.facts.params):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self.tracker.accumulated, i)))
        from tiermem.planner.streaming import Streaming, streaming  # the planner only when it plans

        info = Streaming(
            stalled=lambda: self.pool.waited,
            held=self._held,
            release=self.store.pool.clear,
            recompute=self._recompute_fits(),
        )
        self._context = streaming(info)
        self._context.__enter__()
        self.store.pool.trimming.eager = True  # the heap trimmed as the pass streams (rule 8)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.tracker.settle()
            self.tracker.remove_hooks()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            for module, _ in self._active:  # a forward that raised half-way: its pins go
                for chunk in self.store.module_chunks[module]:
                    chunk.pins -= 1
            self._active.clear()
            self._context.__exit__(*exc)
            self.store.pool.trimming.eager = False
            self.store.pool.clear()
            for p, grad in zip(self.facts.params, self._grads, strict=True):
                p.grad = grad

    def _recompute_fits(self) -> bool:
        """Rule 7: whether the device holds a recomputed block's chunk beside those its backward
        pins: the buffers, and at least one chunk more than a module's span and the shared chunks
        (the floor of NOTE [ Default placement rule ] rule 4), of the largest streamed chunk."""
        pool = self.store.pool
        streamed = [c for c in self.store.chunks if not c.persistent]
        if not streamed:
            return True
        pinned = self.facts.min_buffers([c.layout for c in self.store.chunks])
        need = max(pool.buffers, pinned + 1) * max(pool.slot_of(c) for c in streamed)
        return need <= pool.registry.free_bytes("device")

    def _root_started(self, _module: nn.Module, _args: Any) -> None:
        self.tracker.new_forward()

    def _started(self, module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():
            self.tracker.call_started(module)
        chunks = self.store.module_chunks[module]
        self.pool.acquire(chunks, +1)
        for chunk in chunks:
            chunk.pins += 1
        self._active.append((module, torch._C._autograd._get_sequence_nr()))

    def _ended(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._active or self._active[-1][0] is not module:
            return  # its pre-hook failed: nothing was pinned
        _, first_node = self._active.pop()
        for chunk in self.store.module_chunks[module]:
            chunk.pins -= 1
        if output is not None and torch.is_grad_enabled():
            self.tracker.call_ended(module, args, kwargs, output, first_node)
