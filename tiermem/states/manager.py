"""ModelStates: one model's parameters, gradients and optimizer states, in chunks across tiers.

:class:`ModelStates` composes collaborators that each own one job, and owns only the forward
hooks (which chunks a running module pins, rules 1 and 3), the public surface (the optimizer's
backend, ``describe``, ``close``) and the wiring:

- :class:`~tiermem.states.facts.ModelFacts` (``facts.py``): what never changes about the model;
- :class:`~tiermem.states.store.ChunkStore` (``store.py``): the chunks in force and their bytes,
  with the device buffer pool it rebuilds at every build, :class:`~tiermem.states.pool.ChunkPool`
  (``pool.py``): which streamed chunks hold device bytes (rules 1, 3, 6);
- :class:`~tiermem.states.homes.Homes` (``homes.py``): staging and reading chunk homes;
- :class:`~tiermem.states.gradients.Gradients` (``gradients.py``): gradient buffers and
  ``p.grad`` (rule 4);
- :class:`~tiermem.states.backward.BackwardTracker` (``backward.py``): pins through backward and
  the backward pass (rules 3, 4);
- :class:`~tiermem.states.stepping.Stepper` (``stepping.py``): the step (rule 5, NOTE
  [ Declared steps ]), with torch's own optimizer code (``optimizer.py``);
- :class:`~tiermem.states.stateio.StateIO` (``stateio.py``): state dicts, snapshots, restore;
- :class:`~tiermem.states.relayout.Relayout` (``relayout.py``): the layout in force, re-packs
  and first-step plans (rules 2, 9), under the plan of :mod:`tiermem.layout.placement`.

# NOTE [ Model-state rules ]
1. Every parameter (a tied one once) lives in one chunk's own storage and ``p.data`` is a view
   into it for the manager's whole life, so tied weights, optimizers and autograd's saved
   ``weight.t()`` stay attached (TRAPS 2). A non-persistent chunk is released with
   ``untyped_storage().resize_(0)`` (on the CPU device its bytes move to a spare the next
   fetch takes: NOTE [ Spare chunk storage ]) and refilled in place before use. While no
   module uses a chunk its parameters are guarded: any op on them fetches the chunk first and
   a write goes home at once (NOTE [ Parameter access ] in ``access.py``), so code between steps
   reads and writes true values; ``model.state_dict()`` serves them from the chunk's home, and
   leaving the Runtime restores ordinary tensors.
   Parameters are stored contiguous. A module's forward pre-hook fetches its own and its
   submodules' parameters; a parameter read directly by a module that does not own it is
   fetched by its guard for that op, and autograd records the op on a copy (NOTE [ Parameter
   access ] rule 5).
2. Layout order: module registration order from ``rt.manage()`` until the first complete
   forward, which records the execution order (each module's own parameters as its forward
   pre-hook runs, unused ones last); when it differs, the chunks are re-packed at the next
   ``optimizer.step()``, the first point where backward is done and no graph should hold
   views of the old chunks. A hand-written plan that no longer fits the new packing keeps
   the old layout (with a warning).
3. Residency: a module's forward pre-hook fetches the chunks of its own parameters (DEMAND)
   and prefetches the next chunk in order: the one the last forward entered next where that is
   not the next by index (NOTE [ Forward order ] in ``forward_order.py``). Not in a forward that
   runs inside backward, a checkpointed block recomputed: the next chunk is one backward just
   used, and fetching it evicted the ones backward needs next (a LoRA Llama with every block
   recomputed read 64 MB a step from NVMe, 46 MB without). Each output's ``grad_fn`` gets a
   pre-hook that fetches them again before the module's backward (not an ``nn.Embedding``'s:
   its backward reads only the indices) and prefetches the previous chunk; it runs after the
   tensor hooks on that output, so the module that consumed it has already unpinned. A chunk is
   pinned while a module using it runs forward, and from that module's
   backward start until the use is done: every own trainable parameter has accumulated, or,
   for a module without trainable parameters of its own, every input that requires grad has
   its gradient (the end of backward unpins the rest). A call whose parameter accumulates
   later than its own backward (a tied weight, whose other owner's backward comes last; a
   module called again) is also done once every autograd node its forward made has run
   (they hold what it saved): an LM head does not pin the tied chunk through all backward.
   Unpinned chunks stay cached until a fetch needs their slot (least recently used first; a
   prefetch evicts only chunks behind it); at most ``plan.buffers`` streamed chunks are
   resident at once. A frozen model's (no parameter requires grad: ``rt.manage(model)``
   without an optimizer) forward that no backward follows leaves them as spares at its end,
   so a model training beside it (a student beside its teacher) takes their room first.
4. Gradients: autograd accumulates exactly as in plain PyTorch. A post-accumulate hook copies
   a fresh gradient into the chunk's device gradient buffer, or adds it with the ``add_``
   autograd itself uses when earlier micro-batches' gradients are there, and ``p.grad``
   becomes a view of the buffer. When every used trainable parameter of an offloaded chunk
   has its gradient, the buffer moves to the host (WRITEBACK, also for NVMe-homed chunks);
   after backward ``p.grad`` views it there, so ``clip_grad_norm_`` and user code read and
   write the real gradients (TRAPS 4); on CUDA, where ``.grad`` must be on the parameter's
   device, it is a :class:`HostGradient` standing for that view (NOTE [ Host gradients ],
   TRAPS 29), and so it is on the CPU device for a chunk whose home is on NVMe (rule 1 there:
   its writes are seen, so a plain loop may step it ahead). The next backward brings them back
   to accumulate.
   Before each backward and step, ``p.grad`` is reconciled: ``None`` (``model.zero_grad()``)
   drops a gradient, another tensor is copied in.
5. Step (``stepping.py``; a declared loop steps offloaded chunks earlier, during the last
   backward of a window: NOTE [ Declared steps ]): ``optimizer.step()`` releases every
   streamed chunk (its device copy goes stale),
   then steps chunk by chunk with torch's own optimizer code on per-parameter views (NOTE
   [ Exact optimizer step ]): device-homed chunks on the device, offloaded ones on the CPU
   over their host master, NVMe homes staged through the host (DEMAND, the next one
   prefetched) and written back (WRITEBACK).
6. Accounting: every byte kept here (device copies, homes, gradient buffers) is a registry
   object of kind ``"chunk"``, so the tiers refuse anything past capacity. A device
   allocation that does not fit waits for gradient write-backs, then evicts unpinned
   chunks, then asks the device's other users for room (``Registry.reclaim(needed=...)``:
   kept activations written out, TRAPS 35), then raises :class:`StatesMemoryError`. A
   chunk's fresh gradient buffer is made beside the earlier chunks' write-backs still in flight
   only while the device's bytes stay within the peak the plan predicted (NOTE [ Cost model ]
   rule 1: backward frees activations, so there is room below the peak); past it, or with no
   prediction, the write-backs land first, so they never take the device past the prediction:
   on a loaded machine, waiting for nothing, one or two more gradient chunks stayed on the
   device (a GPT at a tight device, every block recomputed, beside three busy loops: device
   peaks 8.6% and 17.6% over the prediction). Waiting fit or not, the plain loop of the 210M HF
   GPT-2 of ``bench/hf_states.py`` (gradients on NVMe) waited 0.5-2.7 s a step for them; beside
   them 0-0.17 s, and the step's median went from 8.09 to 7.44 s (5 rounds alternated, lower in
   4 of them).
7. Threads: hooks run on the thread that runs forward and backward (autograd's CPU engine
   runs them on the caller's; on CUDA backward hooks run on autograd's device thread while
   the caller waits in ``backward()``, so they never overlap forward's); the manager is not
   meant to be driven from two threads. Forward hooks under ``torch.inference_mode()`` run
   with it off (grad still off): the chunks they fetch must be normal tensors
   (``_outside_inference_mode``).
8. CUDA: everything above holds; the device tier copies on its own stream, fenced after the
   stream that produced the bytes (TRAPS 28), host homes live in the pinned pool, and
   offloaded chunks step on the CPU (rule 5). Not yet: ``create_graph=True`` backward.
   ``model.to()``, ``.half()`` and the like work where they change nothing and are refused
   before anything changes otherwise; freezing works (NOTE [ Moving a managed model ] in
   ``moves.py``). Blocks compiled with ``torch.compile(block)`` before ``rt.manage`` are each
   one module to these rules; compiling the whole model or ``block.compile()`` raises
   :class:`StatesUsageError` (NOTE [ Compiling a managed model ] in ``compile.py``).
   Reentrant checkpointing works (its nested backward may end ours early; later gradients
   are then brought back and added, exactly).
9. Planning on the first real step (``rt.manage(plan="auto")`` without ``sample=``): the
   default placement rule is built at ``rt.manage``; the root's forward pre-hook keeps the
   arguments of the first forward with grad (detached) and, in training mode, hands them to the
   planner at once, before that forward runs (``Stepper.plan_first_step``), so the first step
   runs on the planned chunks: nothing has stepped and no gradient exists yet, so the re-pack
   moves the parameters alone (210M HF GPT-2 of ``bench/first_step.py``, 2-vCPU Intel VM, 3
   alternated pairs of fresh uncached processes: the first step 7.2-8.6 s, 1.75-1.90x a steady
   step, against 8.3-9.6 s, 2.02-2.30x, planning at the step, which re-packed homes the first
   backward had stepped on the default placement). A first forward in eval mode, without grad,
   re-run inside backward or under saved-tensor hooks leaves it to the next
   ``optimizer.step()`` (where a re-pack would run, rule 2, once backward is done and gradients
   are known) or the next training forward (``Relayout.plans_now``). The profiling step runs
   inside the forward's contexts (autocast: it measures the working dtype's activations, and
   autocast's cache of parameter casts is cleared before and after, the old chunks' casts being
   stale) and runs the model's own forward hooks like any forward: where the model's code fails
   in it (an exception other than tiermem's, or an interrupt) the error reaches the caller and
   the next training forward plans again. Where a plain copy of the model states fits in free
   memory and in what the memory tiers have free, it profiles on plain parameters (the chunks
   are snapshotted and freed, the parameters become ordinary tensors again and the manager's
   hooks are off); otherwise on the chunks in place, streamed through the device budget by the
   profiling's own hooks, which drop its gradients (NOTE [ Streamed first-step profiling ] in
   ``streamed_profile.py``), so the capacities hold from ``rt.manage`` on. Either way the
   profiling step leaves RNG, buffers and gradients as they were (NOTE [ Profiling step ]), and
   the chunks are rebuilt under the planned plan, in its execution order, before the step goes
   on, from a snapshot held in memory where it fits there and in the memory tiers' free bytes,
   else written to NVMe (NOTE [ Spilled snapshots ]); so the step and everything after it are
   exactly what they would have been. Planning is skipped (reason logged, default placement
   kept) when the step is called inside ``rt.offload_activations`` (its saved-tensor hooks
   would capture the profiling step: tried again at the next step), when the planner fails, and
   for a model with compiled blocks (NOTE [ Compiling a managed model ] rule 4 in
   ``compile.py``); the new layout is not built (logged, the old one kept) when the snapshot
   fits neither memory nor an NVMe tier. Where the profile of the model's last profiled batch
   is cached and revalidates, the plan is made from it at ``rt.manage`` and the chunks are
   built under it (NOTE [ Profile cache ] rule 6 in ``tiermem.planner.cache``); the first
   forward's arguments are checked against that batch's shapes and dtypes, and only a batch of
   other shapes plans at the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from tiermem import tracing
from tiermem.layout.placement import Plan, parse_plan
from tiermem.registry import Registry
from tiermem.states.access import ParameterAccess, internal
from tiermem.states.backward import BackwardTracker
from tiermem.states.chunks import Chunk
from tiermem.states.compile import (
    check_compiled_modules,
    collapse_regions,
    compiled_regions,
    refuse_compile,
    without_regions,
)
from tiermem.states.copies import PlainCopies
from tiermem.states.declarations import Declarations, grad_norm
from tiermem.states.errors import StatesUsageError
from tiermem.states.facts import Lifecycle, ModelFacts, Snapshot
from tiermem.states.forward_order import ForwardOrder
from tiermem.states.gradients import Gradients
from tiermem.states.homes import Homes
from tiermem.states.moves import ParameterMoves, Training
from tiermem.states.optimizer import ManagedOptimizer, Superseded
from tiermem.states.pool import ChunkPool
from tiermem.states.relayout import FirstStepPlanner, Relayout
from tiermem.states.speculation import Shadows
from tiermem.states.stateio import StateIO
from tiermem.states.step_thread import StepThread
from tiermem.states.stepping import Stepper
from tiermem.states.store import ChunkStore

if TYPE_CHECKING:
    from tiermem.activations.managed import ManagedActivations

__all__ = ["DeclaredLoop", "FirstStepPlanner", "ModelStates"]

log = logging.getLogger("tiermem.states")


def _outside_inference_mode(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a forward hook that works under ``torch.inference_mode()`` too (evaluation,
    generation): the chunks it fetches and releases are the runtime's own tensors, which must
    stay normal ones, with version counters (the registry's records) and writable outside
    inference mode (the copy threads fill them, a later step updates them); made inside,
    they would be inference tensors. Grad stays off there, as inference mode has it."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return hook(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return hook(*args, **kwargs)

    return run


#: Models under management, so one model is not managed twice.
_MANAGED: weakref.WeakKeyDictionary[nn.Module, ModelStates] = weakref.WeakKeyDictionary()


class ModelStates:
    """Carries out a :class:`Plan` for one model and its optimizer (NOTE [ Model-state rules ])."""

    #: NOTE [ Host gradients ] rule 9: expose every host gradient through a HostGradient on the
    #: CPU device too (tests); on CUDA they always are. Read when a model is managed.
    proxy_host_gradients: bool = False

    def __init__(
        self,
        registry: Registry,
        model: nn.Module,
        optimizer: Any,
        *,
        plan: Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        plan_owner: object | None = None,
        grad_accumulation_steps: int | None = None,
        clip_grad_norm: float | None = None,
        keep_gradients: bool = True,
        param_dtype: torch.dtype | None = None,
        first_step_planner: FirstStepPlanner | None = None,
        step_thread: str | None = None,
        speculative_steps: str = "auto",
        recomputed: Sequence[nn.Module] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"tiermem manage: model must be a torch.nn.Module, got {type(model).__name__}")
        if model in _MANAGED:
            raise StatesUsageError("tiermem manage: this model is already managed; call rt.manage once per model")
        self.registry = registry
        facts, base = ModelFacts.of(model, registry.device, optimizer, optimizer_kwargs, param_dtype)
        # ``recomputed``: the activation blocks that may run their forward again in backward,
        # whose chunks the placement keeps room for together (ModelFacts.min_buffers)
        blocks = tuple(frozenset(facts.index[id(p)] for p in block.parameters()) for block in recomputed)
        facts = dataclasses.replace(facts, recomputed=blocks)
        self.facts = collapse_regions(facts)  # each compiled region is hooked as one block
        #: the compiled regions rt.manage found (rule 2 there: no others may appear)
        self._regions = set(compiled_regions(model))
        first_step_planner = without_regions(first_step_planner, self._regions)  # profiles uncompiled
        request = parse_plan(plan)
        declared = Declarations.check(grad_accumulation_steps, clip_grad_norm, keep_gradients)
        facts = self.facts
        self.lifecycle = Lifecycle(sum(info.nbytes for info in facts.info))
        self.store = ChunkStore(registry, facts)
        #: where chunk steps compute (NOTE [ Step threads ]): homes, gradients and the stepper share it
        steps = StepThread.configured(step_thread, compute_on_cpu=facts.device.type == "cpu")
        self.homes = Homes(self.store, steps)
        #: NOTE [ Speculative steps ]: the stepper makes them; stored gradients wait for their write-backs
        shadows = Shadows(self.store, self.homes)
        self.gradients = Gradients(
            registry,
            facts,
            self.store,
            self.homes,
            proxy_host_gradients=self.proxy_host_gradients,
            wait_write_backs=shadows.wait_host_room,
        )
        self.stateio = StateIO(facts, self.store, self.homes, self.gradients, self.lifecycle)
        self.relayout = Relayout(
            registry,
            facts,
            store=self.store,
            homes=self.homes,
            gradients=self.gradients,
            stateio=self.stateio,
            request=request,
            planner=first_step_planner,
            plan_owner=plan_owner,
            grads_stream=declared.grads_stream,
            remove_hooks=self._remove_hooks,
            register_hooks=self._register_hooks,
        )
        #: NOTE [ Forward order ] (``forward_order.py``): the chunks the last forward entered, in order
        self.forward_order = ForwardOrder(self.store)
        #: the optimizer rt.manage returns; its step and early chunk steps both go through the stepper
        self.optimizer = ManagedOptimizer(self, base)
        self.stepper = Stepper(
            facts,
            self.store,
            self.gradients,
            self.homes,
            self.relayout,
            declared,
            steps,
            self.optimizer,
            shadows,
            speculate=speculative_steps != "off",
        )
        #: NOTE [ Moving a managed model ] rule 4: the tracker waits for parameters that train now
        self.training = Training(facts)
        tracked = dataclasses.replace(facts, trainable=self.training.now)
        self.backward = BackwardTracker(tracked, self.store, self.gradients, self.stepper, self.lifecycle)
        self.moves = ParameterMoves(facts)
        self.copies = PlainCopies(facts.model)
        self.access = ParameterAccess(facts, self.store, self.homes, self.lifecycle, self.stepper.stepped_early)
        #: modules whose forward runs, with the autograd sequence number their forward started at
        self._active: list[tuple[nn.Module, int, tracing.Span | None]] = []
        self._trace_names = {module: name or "model" for name, module in facts.model.named_modules()}
        self._hooks: list[RemovableHandle] = []
        #: the activation policy rt.manage applies (NOTE [ Managed activations ]); None: not applied
        self.activations: ManagedActivations | None = None

        snapshot = Snapshot(
            data=[p.detach() for p in facts.params],
            grads=[p.grad for p in facts.params],
            states={facts.index[id(p)]: dict(s) for p, s in base.state.items() if s},
        )
        layouts, first_plan = self.relayout.plan_layout(self.relayout.order)
        try:
            self.relayout.build(layouts, first_plan, snapshot)
        except BaseException:
            self.relayout.free()
            for p, data, grad in zip(facts.params, snapshot.data, snapshot.grads, strict=True):
                with internal():
                    p.data, p.grad = data, grad
            raise
        base.state.clear()  # its states now live in chunks
        #: NOTE [ Exact optimizer step ] rule 8: the user's own optimizer, if one was handed over
        self._superseded = Superseded(base, self.optimizer) if base is optimizer else None
        self._move_buffers()
        self._register_hooks()
        self.moves.install()
        self.copies.install()
        _MANAGED[model] = self

    def _move_buffers(self) -> None:
        """CUDA: buffers follow the parameters to the device (they are not managed); mixed
        precision casts floating ones, as ``model.to(dtype)`` would."""
        device, working = self.facts.device, self.facts.param_dtype
        for module in self.facts.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)
                if buffer is not None and working is not None and buffer.is_floating_point():
                    module._buffers[name] = module._buffers[name].to(working)  # type: ignore[union-attr]

    # -- what callers read ---------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.facts.model

    @property
    def device(self) -> torch.device:
        return self.facts.device

    @property
    def params(self) -> list[nn.Parameter]:
        return self.facts.params

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return self.facts.optimizer_class

    @property
    def state_names(self) -> tuple[str, ...]:
        return self.facts.state_names

    @property
    def plan(self) -> Plan:
        """The plan in force."""
        assert self.store.plan is not None
        return self.store.plan

    @property
    def chunks(self) -> list[Chunk]:
        return self.store.chunks

    @property
    def pool(self) -> ChunkPool:
        return self.store.pool

    @property
    def chunk_steps(self) -> int:
        """Chunk steps run at ``optimizer.step()``, cumulative."""
        return self.stepper.chunk_steps

    @property
    def early_chunk_steps(self) -> int:
        """Chunk steps run during backward (NOTE [ Declared steps ]), cumulative."""
        return self.stepper.early_chunk_steps

    def chunk_of(self, param: torch.Tensor) -> Chunk:
        """The chunk holding ``param`` now (a re-pack replaces the chunks)."""
        return self.store.chunk_of(self.facts.index[id(param)])

    # -- the managed optimizer's backend -------------------------------------------------------
    def _outside_backward(self, what: str) -> None:
        self.lifecycle.check_usable()
        self.backward.settle()
        if self.backward.in_backward:
            raise StatesUsageError(f"tiermem: optimizer.{what}() was called during backward")

    def step(self, optimizer: ManagedOptimizer) -> None:
        self._outside_backward("step")
        if self.activations is not None:
            self.activations.close_step()  # the step's saved activations are all released by now
        self.store.pool.trimming.boundary()  # the step begins: backward's freed heap goes back (as above)
        traced = tracing.span("optimizer step", "optimizer")
        try:
            self.stepper.step(optimizer)
        finally:
            if traced is not None:
                traced.end()

    def zero_grad(self, optimizer: ManagedOptimizer, set_to_none: bool) -> None:
        self._outside_backward("zero_grad")
        if self.activations is not None:
            self.activations.close_step()
        self.gradients.zero_grad(optimizer, set_to_none)

    def export_optimizer_state(self, optimizer: ManagedOptimizer) -> dict[torch.Tensor, dict[str, Any]]:
        """Per-parameter state in PyTorch's shape, as fresh CPU copies."""
        self.lifecycle.check_usable()
        self.backward.settle()
        return self.stateio.export_optimizer_state()

    def import_optimizer_state(self, optimizer: ManagedOptimizer, state: Mapping[torch.Tensor, Any]) -> None:
        self.lifecycle.check_usable()
        self.stateio.import_optimizer_state(state)

    # -- checkpoints (NOTE [ Checkpoint rules ] in tiermem.checkpoint) -------------------------
    def checkpoint_io(self, what: str) -> StateIO:
        """The state I/O a checkpoint streams through, between steps only: a forward or backward
        in progress holds chunks a save would read half-updated and a load would overwrite."""
        self.lifecycle.check_usable()
        self.backward.settle()
        if self.backward.in_backward or self._active:
            raise StatesUsageError(
                f"tiermem checkpoint: rt.{what}() was called during forward or backward; call it between steps"
            )
        return self.stateio

    def loop_position(self) -> dict[str, int] | None:
        """The declared loop's position (NOTE [ Declared steps ] rule 2); None when undeclared."""
        return None if self.stepper.declared.accumulation is None else self.stepper.loop_position()

    def restore_loop_position(self, position: Mapping[str, Any]) -> None:
        self.stepper.restore_loop_position(position)

    def declare(self, grad_accumulation_steps: Any, clip_grad_norm: Any, keep_gradients: bool) -> DeclaredLoop:
        """The loop declared from now on (NOTE [ Declared steps ] rule 10), between forward and
        backward passes. Whether gradients stream decides the placement (NOTE [ Default placement
        rule ] rule 3): a declaration that changes it re-chooses the layout and re-packs the chunks
        now, so only where no parameter holds a gradient."""
        self.lifecycle.check_usable()
        self.backward.settle()
        if self.backward.in_backward or self._active:
            raise StatesUsageError("tiermem declare: called during forward or backward; declare the loop between them")
        declared = Declarations.check(grad_accumulation_steps, clip_grad_norm, keep_gradients)
        old = self.stepper.declared
        if declared.grads_stream != old.grads_stream and any(p.grad is not None for p in self.facts.params):
            raise StatesUsageError(
                f"tiermem declare: keep_gradients={declared.keep_gradients} with grad_accumulation_steps="
                f"{declared.accumulation}, clip_grad_norm={declared.max_norm} changes where gradients wait (the "
                "placement), and parameters hold gradients now; declare it after optimizer.step() and zero_grad()"
            )
        self.stepper.redeclare(declared)
        try:
            self.relayout.restream(declared.grads_stream)
        except BaseException:
            self.stepper.redeclare(old)
            raise
        return DeclaredLoop(self)

    def clip_declared(self) -> torch.Tensor:
        """NOTE [ Declared steps ] rule 10: the declared clip, run now; the total norm."""
        self.lifecycle.check_usable()
        self.backward.settle()
        return self.stepper.clip()

    def grad_norm(self) -> torch.Tensor:
        """The total norm of the gradients, bitwise ``clip_grad_norm_(params, inf)``'s, without
        editing them (``tiermem.states.declarations.grad_norm``)."""
        self.lifecycle.check_usable()
        self.backward.settle()
        return grad_norm(self.facts.params, self.facts.device)

    def apply_activations(self, activations: ManagedActivations) -> None:
        """Apply ``activations`` from the next forward on, as long as the model is managed; its hooks
        are off with the manager's (a first-step plan's profiling step runs uncaptured)."""
        self.activations = activations
        activations.install()

    # -- forward hooks: fetch, pin and release the chunks ------------------------------------------
    def _register_hooks(self) -> None:
        model, stateio = self.facts.model, self.stateio
        root_started, root_ended = (
            _outside_inference_mode(self._root_started),
            _outside_inference_mode(self._root_ended),
        )
        started, ended = _outside_inference_mode(self._forward_started), _outside_inference_mode(self._forward_ended)
        self._hooks.append(model.register_forward_pre_hook(root_started, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(root_ended, always_call=True))
        for module in self.facts.module_names:
            self._hooks.append(module.register_forward_pre_hook(started))
            self._hooks.append(module.register_forward_hook(ended, with_kwargs=True, always_call=True))
            self._hooks.append(module.register_state_dict_pre_hook(stateio.state_dict_started))
            self._hooks.append(module.register_state_dict_post_hook(functools.partial(stateio.state_dict_ended)))
            self._hooks.append(module.register_load_state_dict_pre_hook(stateio.load_started))
            self._hooks.append(module.register_load_state_dict_post_hook(stateio.load_ended))
        for i, p in enumerate(self.facts.params):
            if self.facts.trainable[i]:
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(functools.partial(self.backward.accumulated, i))
                )
        if self.activations is not None:  # after the manager's root hooks: they fetch first
            self.activations.install()

    def _remove_hooks(self) -> None:
        if self.activations is not None:
            self.activations.remove()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _root_started(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.lifecycle.check_usable()
        refuse_compile()
        check_compiled_modules(self.facts.model, self._regions)  # a region compiled after rt.manage is refused
        self.training.sync()
        self.backward.settle()
        self.relayout.forward_started(args, kwargs)
        if self.relayout.plans_now():
            self.stepper.plan_first_step()
        # A forward begins: what the last phase freed leaves the heap first (NOTE [ Returning
        # freed memory ] rule 5), not while the forward streams and takes it again.
        self.store.pool.trimming.boundary()
        self.backward.new_forward()
        if torch._C._current_graph_task_id() == -1:  # not the model recomputed inside backward
            self.forward_order.began()
        if torch.is_grad_enabled():
            self.stepper.forward_with_grad()
        return None

    def _root_ended(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self.relayout.forward_ended()
        if torch._C._current_graph_task_id() == -1:
            self.forward_order.ended()
        if not any(self.training.now) and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output)
        ):
            # A frozen model's forward that no backward will follow (a teacher's, a reference
            # policy's): its streamed chunks go to spares, which any other user of the device
            # (the model that trains beside it) takes first (NOTE [ Spare chunk storage ] rule 4).
            self.store.pool.release_all()

    def _forward_started(self, module: nn.Module, _args: Any) -> None:
        self.lifecycle.check_usable()
        refuse_compile()
        names = self.facts.module_names[module]
        self.relayout.record(names)
        if torch.is_grad_enabled():
            self.backward.call_started(module)
        chunks = self.store.module_chunks[module]
        # A forward inside backward is a checkpointed block recomputed: the next chunk in forward
        # order is one backward has just used, so prefetching it only evicts the ones it needs next
        recomputing = torch._C._current_graph_task_id() != -1
        following = None if recomputing else self.forward_order.entered(chunks)
        self.store.pool.acquire(chunks, 0 if recomputing else +1, following)
        for chunk in chunks:
            chunk.pins += 1
        traced = tracing.span("forward", "forward", self._trace_names.get(module))  # NOTE [ Timeline trace ]
        self._active.append((module, torch._C._autograd._get_sequence_nr(), traced))

    def _forward_ended(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._active or self._active[-1][0] is not module:
            return  # its pre-hook failed: nothing was pinned
        _, first_node, traced = self._active.pop()
        if traced is not None:
            traced.end()
        for chunk in self.store.module_chunks[module]:
            chunk.pins -= 1
        if output is not None and not self.lifecycle.closed and torch.is_grad_enabled():
            self.backward.call_ended(module, args, kwargs, output, first_node)

    def _refuse(self, _module: nn.Module, _args: Any) -> None:
        self.lifecycle.check_usable()

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self, spill_to: str | None = None) -> None:
        """Restore ordinary parameters when they fit (on file-backed pages under ``spill_to``
        when they exceed the memory tiers' capacities), else mark them unusable; free every chunk.

        Never raises: it runs inside ``Runtime.close``, which must go on to free the tiers."""
        lifecycle = self.lifecycle
        if lifecycle.closed:
            return
        try:
            self.access.close()  # parameters are plain again before they become ordinary tensors
            self.backward.settle()
            self.stepper.close()  # the step in flight finishes; the step thread stops
            self.store.pool.clear()
            lifecycle.restored = self.stateio.restore(spill_to)
        except Exception:
            log.exception("tiermem model states: restoring parameters failed; the model is unusable now")
            lifecycle.restored = False
        lifecycle.closed = True
        try:
            self._remove_hooks()
            self.backward.remove_hooks()
            if not lifecycle.restored:
                for p in self.facts.params:
                    p.grad = None
                    # The same Parameter object, now a meta tensor: shapes stay, bytes are gone,
                    # and the hooks below refuse to run the model (set_data cannot change device).
                    meta = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                    with contextlib.suppress(RuntimeError):  # a live graph still holds it: leave it empty
                        torch.utils.swap_tensors(p, meta)
                for module in self.facts.module_names:
                    self._hooks.append(module.register_forward_pre_hook(self._refuse))
            self.relayout.free()
        except Exception:
            log.exception("tiermem model states: releasing the chunks failed")
        finally:
            self.moves.remove()
            self.copies.remove()
            if self._superseded is not None:
                self._superseded.remove()
            self.store.pstate.clear()
            _MANAGED.pop(self.facts.model, None)

    def describe(self) -> dict[str, Any]:
        """Where each chunk lives now: for logs and tests."""
        return {
            "plan": self.plan.as_dict(),
            "order": "execution" if self.relayout.order == self.relayout.recorded else "registration",
            "chunk_steps": self.chunk_steps,
            "early_chunk_steps": self.early_chunk_steps,
            "speculative_steps_kept": self.stepper.shadows.kept,
            "speculative_steps_discarded": self.stepper.shadows.discarded,
            "speculative_homes_read_ahead": self.stepper.shadows.read_ahead,
            "speculative_homes_read_on_demand": self.stepper.shadows.read_on_demand,
            "speculative_nvme_reclaims": self.stepper.nvme_room_reclaimed,
            "tied_homes_read_ahead": self.stepper.tied_homes_read_ahead,
            "stored_gradients_read_back": self.gradients.stash.stagings,
            "stored_gradients_staged_on_the_way": self.gradients.stash.staged_on_the_way,
            "chunks": [
                {
                    "index": c.index,
                    "params": len(c.layout.slots),
                    "nbytes": c.nbytes,
                    "trainable": c.trainable,
                    "persistent": c.persistent,
                    "resident": c.resident,
                    "home": c.home_tier,
                }
                for c in self.chunks
            ],
        }


@dataclasses.dataclass(frozen=True)
class DeclaredLoop:
    """What ``rt.declare`` returns: the declaration in force for one managed model and the two
    calls an integration whose loop clips (or logs the norm) through its own function makes
    instead (NOTE [ Declared steps ] rule 10)."""

    states: ModelStates

    @property
    def grad_accumulation_steps(self) -> int | None:
        return self.states.stepper.declared.accumulation

    @property
    def clip_grad_norm(self) -> float | None:
        return self.states.stepper.declared.max_norm

    def owns(self, params: list[torch.Tensor]) -> bool:
        """``params`` are exactly the model's parameters, in ``model.parameters()`` order (the
        order ``clip_grad_norm_`` sums their norms in)."""
        mine = self.states.facts.params
        return len(params) == len(mine) and all(a is b for a, b in zip(params, mine, strict=True))

    def clip_grad_norm_(self) -> torch.Tensor:
        """The runtime's declared clip of this window, at the loop's own clip call: returns the
        total norm, bitwise ``torch.nn.utils.clip_grad_norm_``'s; ``optimizer.step()`` does not
        clip again."""
        return self.states.clip_declared()

    def grad_norm(self) -> torch.Tensor:
        """The total norm without clipping (what a trainer logs when it does not clip)."""
        return self.states.grad_norm()
