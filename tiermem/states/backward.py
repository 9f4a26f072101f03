"""Backward: pinning a module's chunks through its backward, and the backward pass's start and
end (rules 3 and 4 of NOTE [ Model-state rules ] in ``manager.py``).

:class:`BackwardTracker` owns the uses of the current forward (what each call's backward pins),
the autograd hooks on their tensors and nodes, and whether a backward is running. It may touch:
chunk pins and the pool's residency (``acquire``), a chunk's per-backward flags (``entered``,
``pending``), and autograd hooks. Gradients go through :class:`~tiermem.states.gradients.Gradients`
and steps through :class:`~tiermem.states.stepping.Stepper`, which it tells when a backward
starts, a chunk's backward begins, a chunk's gradients are complete and the backward ends.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from tiermem import tracing
from tiermem.states.chunks import Chunk
from tiermem.states.facts import Lifecycle, ModelFacts, Use
from tiermem.states.gradients import Gradients
from tiermem.states.stepping import Stepper
from tiermem.states.store import ChunkStore


def _backward_reads_no_values(module: nn.Module) -> bool:
    """An ``nn.Embedding``'s backward needs only the indices (``embedding_backward``), not the
    weight: fetching its chunk there (the tied one, last in backward) would read it for nothing."""
    return type(module).forward is nn.Embedding.forward


class BackwardTracker:
    """What each forward call's backward pins, and the backward pass around them."""

    def __init__(
        self, facts: ModelFacts, store: ChunkStore, gradients: Gradients, stepper: Stepper, lifecycle: Lifecycle
    ) -> None:
        self.facts = facts
        self.store = store
        self.gradients = gradients
        self.stepper = stepper
        self.lifecycle = lifecycle
        self.in_backward = False
        self._traced: tracing.Span | None = None  # the backward pass (NOTE [ Timeline trace ])
        self._uses_begun: dict[int, float] = {}  # and each use's backward, by id, while tracing
        self._uses: weakref.WeakSet[Use] = weakref.WeakSet()
        #: uses whose backward pinned their chunks, by id, held strongly: a backward that raised
        #: half-way may free the graph (and the hooks that keep ``_uses``' entries alive) before
        #: :meth:`settle` runs, and a pin outliving its use would hold a buffer for good
        self._pinned: dict[int, Use] = {}
        #: per trainable parameter index: the uses waiting for its gradient
        self._waiters: dict[int, weakref.WeakSet[Use]] = {}
        #: hooks on leaf tensors (they keep them): removed when backward ends
        self._leaf_hooks: list[RemovableHandle] = []
        #: calls of each module since the root's forward started (rule 3: a repeated call)
        self._calls: Counter[nn.Module] = Counter()

    def new_forward(self) -> None:
        """The root's forward starts: no module was called in it yet."""
        self._calls.clear()

    def call_started(self, module: nn.Module) -> None:
        """A module's forward starts with grad enabled: its trainable parameters' gradients
        are pending in their chunks until they accumulate (rule 4)."""
        for _, i in self.facts.module_names[module]:
            if self.facts.trainable[i]:
                self.store.chunk_of(i).pending.add(i)

    def remove_hooks(self) -> None:
        for handle in self._leaf_hooks:
            handle.remove()
        self._leaf_hooks.clear()

    # -- rule 3: what a call's backward pins ---------------------------------------------------
    def call_ended(self, module: nn.Module, args: Any, kwargs: Any, output: Any, first_node: int) -> None:
        """Rule 3, after a module's forward with grad: hooks that pin the module's chunks through
        its backward; ``first_node`` is the autograd sequence number its forward started at."""
        self._calls[module] += 1
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs:
            return
        names = self.facts.module_names[module]
        use = Use(self.store.module_chunks[module], reads_values=not _backward_reads_no_values(module))
        seen: set[int] = set()
        # A trainable parameter accumulates after the last node that produced its gradient, the
        # node that also used its value for the input's gradient; the input's own gradient may
        # come much later (an encoder output read by every decoder layer), so waiting for it
        # would pin every such module's chunks at once. Only modules without trainable
        # parameters of their own wait for their inputs.
        trainable = any(self.facts.trainable[i] for _, i in names)
        for t in () if trainable else tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                handle = t.register_hook(functools.partial(self._input_ready, use))
                use.waiting += 1
                if t.grad_fn is None:  # a leaf keeps its hooks: remove them after backward
                    self._leaf_hooks.append(handle)
        # Once per parameter: a compiled region owns a weight tied inside it under two names
        # (NOTE [ Compiling a managed model ] rule 1), and it accumulates once.
        for i in dict.fromkeys(i for _, i in names):
            if self.facts.trainable[i]:
                self._waiters.setdefault(i, weakref.WeakSet()).add(use)
                use.waiting += 1
        nodes: set[int] = set()
        for t in outputs:
            node = t.grad_fn
            if node is None:
                self._leaf_hooks.append(t.register_hook(functools.partial(self._output_ready, use)))
            elif id(node) not in nodes:
                nodes.add(id(node))
                node.register_prehook(functools.partial(self._backward_started, use))
        # A frozen module (a LoRA base layer) is done as soon as its own nodes ran too: its input's
        # gradient also waits for its siblings (k, v and the adapters read the same input), which
        # would keep its chunk pinned beside theirs.
        if not trainable or self._calls[module] > 1 or any(i in self.facts.shared for _, i in names):
            self._track_nodes(use, outputs, first_node)
        self._uses.add(use)

    def _track_nodes(self, use: Use, outputs: list[torch.Tensor], first_node: int) -> None:
        """Rule 3: also done once every autograd node this call's forward made has run.

        A frozen module's input gets its gradient only once every other reader of that input ran
        its backward. A tied parameter (or one of a module called again) accumulates only after its last
        use's backward, the other module's (the embedding's, for an LM head), so waiting for
        it would pin this call's chunks through the whole backward and take a streaming
        buffer from every module in between. The nodes this forward made (sequence numbers
        from ``first_node`` on, reached from the outputs) hold every tensor it saved, the
        parameter views included; once they all ran, its backward read its last value (TRAPS 26)."""
        end = torch._C._autograd._get_sequence_nr()
        seen: set[int] = set()
        stack = [t.grad_fn for t in outputs]
        nodes = []
        while stack:
            node = stack.pop()
            # AccumulateGrad nodes carry the largest sequence number: outside [first_node, end)
            if node is None or id(node) in seen or not first_node <= node._sequence_nr() < end:
                continue
            seen.add(id(node))
            nodes.append(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
        if not nodes:
            return
        use.nodes = len(nodes)
        for node in nodes:
            node.register_hook(functools.partial(self._node_ran, use))

    def _node_ran(self, use: Use, _grad_inputs: Any, _grad_outputs: Any) -> None:
        use.nodes -= 1
        if use.nodes == 0:
            self._use_done(use)

    def _output_ready(self, use: Use, grad: torch.Tensor) -> None:
        self._backward_started(use, (grad,))

    def _backward_started(self, use: Use, _grad_outputs: Any) -> None:
        if self.lifecycle.closed:
            return
        self._begin()
        if tracing.RECORDER is not None:
            self._uses_begun.setdefault(id(use), tracing.now())
        if use.reads_values:
            if not use.done and not use.pinned:
                use.pinned = True
                self._pinned[id(use)] = use
                for chunk in use.chunks:
                    chunk.pins += 1
            self.store.pool.acquire(use.chunks, 0)
        for chunk in use.chunks:
            self._enter(chunk)
        if use.reads_values:
            # After _enter: a home staged for the chunk's early step (NOTE [ Declared steps ] rule 3)
            # queues ahead of the next chunk's prefetch, as the step needs it first.
            self.store.pool.prefetch_next(use.chunks, -1)
        self.stepper.backward_progress()

    def _input_ready(self, use: Use, _grad: torch.Tensor) -> None:
        use.waiting -= 1
        if use.waiting <= 0:
            self._use_done(use)

    def _use_done(self, use: Use) -> None:
        if use.done:
            return
        use.done = True
        if (recorder := tracing.RECORDER) is not None and (begun := self._uses_begun.pop(id(use), None)) is not None:
            name = f"backward chunk {use.chunks[0].index}" if use.chunks else "backward"
            recorder.lane("backward per module call", name, "backward", begun, tracing.now(), None)
        if use.pinned:
            use.pinned = False
            self._pinned.pop(id(use), None)
            for chunk in use.chunks:
                chunk.pins -= 1

    # -- the backward pass ---------------------------------------------------------------------
    def _begin(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self._traced = tracing.span("backward", "backward")
        torch.autograd.Variable._execution_engine.queue_callback(self._end)
        # Backward begins: forward's freed heap goes back first (NOTE [ Returning freed memory ] rule 5).
        self.store.pool.trimming.boundary()
        self.gradients.reconcile()
        self.gradients.send_offloaded_back()
        self.stepper.arm_early_steps()

    def _enter(self, chunk: Chunk) -> None:
        if chunk.entered:
            return
        chunk.entered = True
        self.stepper.backward_entered(chunk)
        self.gradients.enter(chunk)

    def accumulated(self, i: int, p: torch.Tensor) -> None:
        """Rule 4, autograd's post-accumulate hook of parameter ``i``."""
        if self.lifecycle.closed:
            return
        self._begin()
        self.stepper.backward_progress()
        chunk = self.gradients.accumulate(i, p)
        if chunk is None:
            return
        for use in list(self._waiters.pop(i, ())):
            use.waiting -= 1
            if use.waiting <= 0:
                self._use_done(use)
        chunk.pending.discard(i)
        if chunk.offloaded and chunk.entered and not chunk.pending:
            self.stepper.gradients_complete(chunk)

    def _end(self) -> None:
        """Autograd's final callback: unpin, send every gradient home, expose it."""
        chunks = self.store.chunks
        try:
            for use in [*self._uses, *self._pinned.values()]:
                self._use_done(use)
            self._uses = weakref.WeakSet()
            self._waiters.clear()
            self.remove_hooks()
            for chunk in chunks:
                if chunk.offloaded:
                    self.gradients.flush(chunk)
            for chunk in chunks:
                if chunk.grad is not None:
                    chunk.grad.wait()
            self.gradients.expose()
            # Complete: every parameter used with grad got its gradient (NOTE [ Declared steps ] rule 2).
            self.stepper.backward_ended(complete=not any(chunk.pending for chunk in chunks))
        finally:
            self.stepper.abandon_queued()  # NOTE [ Declared steps ] rule 9: after an error, none ran twice
            for chunk in self.store.chunks:
                chunk.entered = False
                chunk.pending.clear()
            self.in_backward = False
            self._uses_begun.clear()
            traced, self._traced = self._traced, None
            if traced is not None:
                traced.end()

    def settle(self) -> None:
        """Finish a backward whose final callback never ran (it raised half-way)."""
        if self.in_backward and torch._C._current_graph_task_id() == -1:
            self._end()
