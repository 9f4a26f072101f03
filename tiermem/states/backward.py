"""Backward: pinning a module's chunks through its backward, and routing gradients into
gradient chunks (rules 3 and 4 of NOTE [ Model-state rules ] in ``manager.py``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tiermem.errors import TierCapacityError
from tiermem.registry import ObjectState, Priority
from tiermem.states.chunks import Chunk
from tiermem.states.core import StatesBase, Use, same
from tiermem.states.errors import StatesMemoryError, StatesUsageError
from tiermem.states.hostgrad import HostGradient
from tiermem.states.optimizer import ManagedOptimizer
from tiermem.units import format_size


def _backward_reads_no_values(module: nn.Module) -> bool:
    """An ``nn.Embedding``'s backward needs only the indices (``embedding_backward``), not the
    weight: fetching its chunk there (the tied one, last in backward) would read it for nothing."""
    return type(module).forward is nn.Embedding.forward


class BackwardMixin(StatesBase):
    """The backward half of :class:`~tiermem.states.manager.ModelStates`."""

    def _track_use(self, module: nn.Module, args: Any, kwargs: Any, output: Any, first_node: int) -> None:
        """Rule 3: hooks that pin the module's chunks through its backward; ``first_node`` is
        the autograd sequence number the module's forward started at."""
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs:
            return
        use = Use(self._module_chunks[module], reads_values=not _backward_reads_no_values(module))
        seen: set[int] = set()
        # A trainable parameter accumulates after the last node that produced its gradient, the
        # node that also used its value for the input's gradient; the input's own gradient may
        # come much later (an encoder output read by every decoder layer), so waiting for it
        # would pin every such module's chunks at once. Only modules without trainable
        # parameters of their own wait for their inputs.
        trainable = any(self._trainable[i] for _, i in self._module_names[module])
        for t in () if trainable else tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                handle = t.register_hook(functools.partial(self._input_ready, use))
                use.waiting += 1
                if t.grad_fn is None:  # a leaf keeps its hooks: remove them after backward
                    self._leaf_hooks.append(handle)
        for _, i in self._module_names[module]:
            if self._trainable[i]:
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
        if trainable and (self._calls[module] > 1 or any(i in self._shared for _, i in self._module_names[module])):
            self._track_nodes(use, outputs, first_node)
        self._uses.add(use)

    def _track_nodes(self, use: Use, outputs: list[torch.Tensor], first_node: int) -> None:
        """Rule 3: also done once every autograd node this call's forward made has run.

        A tied parameter (or one of a module called again) accumulates only after its last
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
        if self._closed:
            return
        self._begin_backward()
        if use.reads_values:
            if not use.done and not use.pinned:
                use.pinned = True
                for chunk in use.chunks:
                    chunk.pins += 1
            self.pool.acquire(use.chunks, -1)
        for chunk in use.chunks:
            self._enter_backward(chunk)

    def _input_ready(self, use: Use, _grad: torch.Tensor) -> None:
        use.waiting -= 1
        if use.waiting <= 0:
            self._use_done(use)

    def _use_done(self, use: Use) -> None:
        if use.done:
            return
        use.done = True
        if use.pinned:
            use.pinned = False
            for chunk in use.chunks:
                chunk.pins -= 1

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._reconcile_grads()
        for chunk in self.chunks:
            if chunk.offloaded and chunk.trainable:
                # Gradients wait on the host; autograd must not add into those views (rule 4).
                for slot in chunk.layout.slots:
                    self.params[slot.index].grad = None
                self._retire_host_grads(chunk)  # they come back to the device to accumulate
        self._arm_early_steps()

    def _enter_backward(self, chunk: Chunk) -> None:
        if chunk.entered:
            return
        chunk.entered = True
        self._backward_entered(chunk)
        if chunk.offloaded and chunk.grad is not None:
            have = [slot for slot in chunk.layout.slots if self._has_grad[slot.index]]
            if have:
                data = self._device_grads(chunk)
                for slot in have:
                    self.params[slot.index].grad = slot.view(data)

    def _device_grads(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's gradient buffer on the device (allocated, or brought back to accumulate)."""
        handle = chunk.grad
        if handle is None:
            buffer = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
            chunk.grad = self.pool.device_room(
                lambda: self.registry.register(buffer, "device", dedup=False, kind="chunk"),
                (chunk,),
                demand=True,
                what=f"the gradients of chunk {chunk.index}",
            )
            del buffer  # only the allocation keeps it (TRAPS 14: the write-back must free it)
            return chunk.grad.tensor("device")
        if handle.tier != "device" or handle.state is ObjectState.MOVING:
            self.pool.device_room(
                lambda: handle.move_to("device", Priority.DEMAND), (chunk,), demand=True, what="gradients"
            )
            handle.wait()
        return handle.tensor("device")

    def _accumulated(self, i: int, p: torch.Tensor) -> None:
        """Rule 4, after autograd accumulated ``p.grad``."""
        if self._closed:
            return
        self._begin_backward()
        grad = p.grad
        if grad is None:
            return
        if grad.layout != torch.strided:
            raise StatesUsageError("tiermem: sparse gradients are not supported for managed parameters")
        chunk, slot = self._slots[i]
        view = slot.view(self._device_grads(chunk))
        if not same(grad, view):
            if self._has_grad[i]:
                view.add_(grad)  # what AccumulateGrad does: `variable.grad += new_grad`
            else:
                view.copy_(grad)
            p.grad = view
        if chunk.offloaded:
            # TRAPS 28: this node's stream (autograd's, on CUDA) wrote the buffer; the write-back
            # of the whole chunk, submitted later from another node's hook, must wait for it too.
            self.registry.fence("device")
        self._has_grad[i] = True
        for use in list(self._waiters.pop(i, ())):
            use.waiting -= 1
            if use.waiting <= 0:
                self._use_done(use)
        chunk.pending.discard(i)
        if chunk.offloaded and chunk.entered and not chunk.pending:
            self._gradients_complete(chunk)

    def _flush(self, chunk: Chunk) -> None:
        """Send an offloaded chunk's gradients home (rule 4)."""
        handle = chunk.grad
        if handle is None or handle.tier != "device" or handle.state is not ObjectState.RESIDENT:
            return
        for slot in chunk.layout.slots:
            self.params[slot.index].grad = None  # views would keep the device buffer alive (TRAPS 14)
        try:
            handle.move_to("host", Priority.WRITEBACK)
        except TierCapacityError:
            # Staged NVMe homes free host bytes as their write-backs land (early steps).
            self._wait_home_moves()
            try:
                handle.move_to("host", Priority.WRITEBACK)
            except TierCapacityError as exc:
                raise StatesMemoryError(
                    f"tiermem model states: chunk {chunk.index}'s gradients ({format_size(exc.requested)}) go to the "
                    f"host until the optimizer steps, but {format_size(exc.used)} of {format_size(exc.capacity)} "
                    "are in use; raise [host] capacity (a plan made for streaming gradients, keep_gradients=False, "
                    "needs every chunk to step as its backward ends: a nested reentrant backward or accumulation "
                    "keeps them all)"
                ) from exc

    def _end_backward(self) -> None:
        """Autograd's final callback: unpin, send every gradient home, expose it."""
        try:
            for use in list(self._uses):
                self._use_done(use)
            self._uses = weakref.WeakSet()
            self._waiters.clear()
            for handle in self._leaf_hooks:
                handle.remove()
            self._leaf_hooks.clear()
            for chunk in self.chunks:
                if chunk.offloaded:
                    self._flush(chunk)
            for chunk in self.chunks:
                if chunk.grad is not None:
                    chunk.grad.wait()
            self._expose_grads()
            # Complete: every parameter used with grad got its gradient (NOTE [ Declared steps ] rule 2).
            self._backward_ended(complete=not any(chunk.pending for chunk in self.chunks))
        finally:
            for chunk in self.chunks:
                chunk.entered = False
                chunk.pending.clear()
            self._in_backward = False

    def _settle_backward(self) -> None:
        """Finish a backward whose final callback never ran (it raised half-way)."""
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            self._end_backward()

    def _grad_bytes(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's gradient buffer where it is resident now (host or device)."""
        assert chunk.grad is not None
        chunk.grad.wait()
        return chunk.grad.tensor(chunk.grad.tier)

    def _expose_grads(self) -> None:
        """``p.grad`` views the real gradient wherever it lives (rule 4, TRAPS 4)."""
        for chunk in self.chunks:
            data = self._grad_bytes(chunk) if chunk.grad is not None else None
            for slot in chunk.layout.slots:
                has = self._has_grad[slot.index] and data is not None
                self.params[slot.index].grad = self._exposed(chunk, slot.view(data)) if has else None  # type: ignore[arg-type]

    def _exposed(self, chunk: Chunk, view: torch.Tensor) -> torch.Tensor:
        """What ``p.grad`` is for ``view``, a gradient in ``chunk``'s buffer: the view itself, or a
        :class:`HostGradient` standing for it on the device (NOTE [ Host gradients ] rule 1)."""
        assert chunk.grad is not None
        on_host = chunk.grad.tier == "host" and (self.device.type != "cpu" or self.proxy_host_gradients)
        if not on_host:
            return view
        lease = self._grad_leases.setdefault(chunk.index, [True])
        return HostGradient(view, self.device, lease)

    def _retire_host_grads(self, chunk: Chunk | None = None) -> None:
        """NOTE [ Host gradients ] rule 5: ``chunk``'s (every chunk's) host gradient bytes move or
        are freed; HostGradients of them refuse ops from now on."""
        for index in [chunk.index] if chunk is not None else list(self._grad_leases):
            lease = self._grad_leases.pop(index, None)
            if lease is not None:
                lease[0] = False

    def _drop_grads(self, chunk: Chunk) -> None:
        """Free ``chunk``'s gradient buffer (no parameter of it has a gradient any more)."""
        assert chunk.grad is not None
        self._retire_host_grads(chunk)
        chunk.grad.free()
        chunk.grad = None

    @staticmethod
    def _is_exposed(grad: torch.Tensor, view: torch.Tensor) -> bool:
        """``grad`` is what :meth:`_exposed` made of ``view`` (or the view itself)."""
        if isinstance(grad, HostGradient):
            return same(grad.host, view)
        return same(grad, view)

    def _reconcile_grads(self) -> None:
        """Rule 4: take in what user code did to ``p.grad`` since we exposed it."""
        for chunk in self.chunks:
            if not chunk.trainable:
                continue
            data: torch.Tensor | None = None
            for slot in chunk.layout.slots:
                i = slot.index
                p = self.params[i]
                grad = p.grad
                if not self._has_grad[i] and grad is None:
                    continue
                if self._has_grad[i] and grad is None:
                    self._has_grad[i] = False  # model.zero_grad() or `p.grad = None`
                    continue
                if data is None:
                    data = self._grad_bytes(chunk) if chunk.grad is not None else self._new_grads(chunk)
                view = slot.view(data)
                if not self._is_exposed(grad, view):
                    view.copy_(grad)  # a HostGradient of another view copies through its own bytes
                    p.grad = self._exposed(chunk, view)
                self._has_grad[i] = True
            if chunk.grad is not None and not any(self._has_grad[s.index] for s in chunk.layout.slots):
                self._drop_grads(chunk)

    def _new_grads(self, chunk: Chunk) -> torch.Tensor:
        tier = "host" if chunk.offloaded else "device"
        buffer = torch.zeros(chunk.nbytes, dtype=torch.uint8, device="cpu" if chunk.offloaded else self.device)
        chunk.grad = self._register(buffer, tier)
        return chunk.grad.tensor(tier)

    def zero_grad(self, optimizer: ManagedOptimizer, set_to_none: bool) -> None:
        self._check_usable()
        self._settle_backward()
        if self._in_backward:
            raise StatesUsageError("tiermem: optimizer.zero_grad() was called during backward")
        self._reconcile_grads()
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = self._index[id(p)]
                if not self._has_grad[i] or p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    self._has_grad[i] = False
                elif isinstance(p.grad, HostGradient):
                    p.grad.host.zero_()  # in place on the host: no round trip through the device
                else:  # what torch.optim.Optimizer.zero_grad does
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
        for chunk in self.chunks:
            if chunk.grad is not None and not any(self._has_grad[s.index] for s in chunk.layout.slots):
                self._drop_grads(chunk)
