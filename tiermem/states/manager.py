"""ModelStates: one model's parameters, gradients and optimizer states, in chunks across tiers.

The parts: this module (building chunks under a plan, forward hooks, the step, lifecycle);
``pool.py`` (which streamed chunks hold device bytes: rules 1, 3, 6); ``backward.py`` (pins
through backward, gradient routing: rules 3, 4); ``stateio.py`` (state dicts, re-pack
snapshots, restore at close); ``placement.py`` (the plan); ``optimizer.py`` (the exact step).

# NOTE [ Model-state rules ]
1. Every parameter (a tied one once) lives in one chunk's own storage and ``p.data`` is a view
   into it for the manager's whole life, so tied weights, optimizers and autograd's saved
   ``weight.t()`` stay attached (TRAPS 2). A non-persistent chunk is released with
   ``untyped_storage().resize_(0)`` (on the CPU device its bytes move to a spare the next
   fetch takes: NOTE [ Spare chunk storage ]) and refilled in place before use. While it is
   released its parameters' values cannot be read (their storage is empty; reading them outside the
   model's forward, backward and state-dict calls is not supported): ``model.state_dict()``
   serves them from the chunk's home, and leaving the Runtime restores ordinary tensors.
   Parameters are stored contiguous. A module may use its own and its submodules'
   parameters through those submodules; a parameter read directly by a module that does
   not own it is not fetched for it.
2. Layout order: module registration order from ``rt.manage()`` until the first complete
   forward, which records the execution order (each module's own parameters as its forward
   pre-hook runs, unused ones last); when it differs, the chunks are re-packed at the next
   ``optimizer.step()``, the first point where backward is done and no graph should hold
   views of the old chunks. A hand-written plan that no longer fits the new packing keeps
   the old layout (with a warning).
3. Residency: a module's forward pre-hook fetches the chunks of its own parameters (DEMAND)
   and prefetches the next chunk in order. Each output's ``grad_fn`` gets a pre-hook that
   fetches them again before the module's backward (not an ``nn.Embedding``'s: its backward
   reads only the indices) and prefetches the previous chunk; it
   runs after the tensor hooks on that output, so the module that consumed it has already
   unpinned. A chunk is pinned while a module using it runs forward, and from that module's
   backward start until the use is done: every own trainable parameter has accumulated, or,
   for a module without trainable parameters of its own, every input that requires grad has
   its gradient (the end of backward unpins the rest). A call whose parameter accumulates
   later than its own backward (a tied weight, whose other owner's backward comes last; a
   module called again) is also done once every autograd node its forward made has run
   (they hold what it saved): an LM head does not pin the tied chunk through all backward.
   Unpinned chunks stay cached until a fetch needs their slot (least recently used first; a
   prefetch evicts only chunks behind it); at most ``plan.buffers`` streamed chunks are
   resident at once.
4. Gradients: autograd accumulates exactly as in plain PyTorch. A post-accumulate hook copies
   a fresh gradient into the chunk's device gradient buffer, or adds it with the ``add_``
   autograd itself uses when earlier micro-batches' gradients are there, and ``p.grad``
   becomes a view of the buffer. When every used trainable parameter of an offloaded chunk
   has its gradient, the buffer moves to the host (WRITEBACK, also for NVMe-homed chunks);
   after backward ``p.grad`` views it there, so ``clip_grad_norm_`` and user code read and
   write the real gradients (TRAPS 4); on CUDA, where ``.grad`` must be on the parameter's
   device, it is a :class:`HostGradient` standing for that view (NOTE [ Host gradients ],
   TRAPS 29). The next backward brings them back to accumulate.
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
   chunks, then raises :class:`StatesMemoryError`.
7. Threads: hooks run on the thread that runs forward and backward (autograd's CPU engine
   runs them on the caller's; on CUDA backward hooks run on autograd's device thread while
   the caller waits in ``backward()``, so they never overlap forward's); the manager is not
   meant to be driven from two threads.
8. CUDA: everything above holds; the device tier copies on its own stream, fenced after the
   stream that produced the bytes (TRAPS 28), host homes live in the pinned pool, and
   offloaded chunks step on the CPU (rule 5). Not yet: ``create_graph=True`` backward,
   ``model.to()`` after managing. ``torch.compile`` of a managed model raises
   :class:`StatesUsageError` (dynamo would trace the hooks that refill chunk storage).
   Reentrant checkpointing works (its nested backward may end ours early; later gradients
   are then brought back and added, exactly).
9. Planning on the first real step (``rt.manage(plan="auto")`` without ``sample=``): the
   default placement rule carries the first step; the root's forward pre-hook keeps the
   arguments of the first forward with grad (detached), and the next ``optimizer.step()``
   (where a re-pack would run, rule 2, once backward is done and gradients are known) hands
   them to the planner on plain parameters: the chunks are snapshotted and freed, the
   parameters become ordinary tensors again and the manager's hooks are off while the
   profiling step runs (it leaves RNG, buffers and gradients as they were; NOTE [ Profiling
   step ]), and the chunks are rebuilt from the snapshot under the planned plan, in its
   execution order, before the step goes on; so the step and everything after it are
   exactly what they would have been. Planning is skipped (with the reason logged, the
   default placement kept) when the snapshot would not fit in free memory, when the step is
   called inside ``rt.offload_activations`` (its saved-tensor hooks would capture the
   profiling step: tried again at the next step), or when the planner fails.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

from tiermem.errors import TierCapacityError
from tiermem.layout.chunks import ChunkLayout, ParamInfo, Slot, pack, size_candidates, waste
from tiermem.layout.placement import Budgets, ChunkNeeds, Plan, PlanRequest, choose_layout, chunk_sizes, parse_plan
from tiermem.registry import Registry
from tiermem.states import core
from tiermem.states.backward import BackwardMixin
from tiermem.states.chunks import Chunk
from tiermem.states.core import ParamState, Snapshot, Use
from tiermem.states.errors import PlanError, StatesMemoryError, StatesUsageError
from tiermem.states.optimizer import ManagedOptimizer, coerce_optimizer, state_names
from tiermem.states.pool import ChunkPool
from tiermem.states.stateio import StateIOMixin
from tiermem.states.stepping import StepMixin
from tiermem.units import format_size

FirstStepPlanner = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], PlanRequest]
"""Rule 9: given the model (plain parameters) and its first forward's arguments, the plan."""

log = logging.getLogger("tiermem.states")

#: Models under management, so one model is not managed twice.
_MANAGED: weakref.WeakKeyDictionary[nn.Module, ModelStates] = weakref.WeakKeyDictionary()


def _working_dtype(param_dtype: Any, params: Sequence[nn.Parameter]) -> tuple[torch.dtype | None, int]:
    """``rt.manage(param_dtype=)``: the working dtype and the master scale (chunk layout rule 6)."""
    if param_dtype is None:
        return None, 1
    if param_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"tiermem manage: param_dtype must be torch.bfloat16 or torch.float16 (working parameters with fp32 "
            f"masters), got {param_dtype!r}"
        )
    other = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if other:
        raise StatesUsageError(
            f"tiermem manage: param_dtype={param_dtype} keeps fp32 masters of fp32 parameters, but the model has "
            f"{', '.join(other)} parameters; build the model in float32"
        )
    return param_dtype, 4 // param_dtype.itemsize


def _refuse_compile() -> None:
    """Rule 8: dynamo would trace the hooks that fetch, release and refill chunk storage into graphs."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    callback = getattr(eval_frame, "get_eval_frame_callback", None)
    # A hook dynamo cannot trace runs eagerly inside the compiled call, where is_compiling() is
    # False but dynamo's frame callback is set.
    if torch.compiler.is_compiling() or (callback is not None and callback() not in (None, False)):
        raise StatesUsageError(
            "tiermem: torch.compile of a model whose states rt.manage() manages is not supported yet: its hooks "
            "fetch, release and refill chunk storage, which compiled graphs must not capture. Run the managed model "
            "eagerly."
        )


class ModelStates(StepMixin, BackwardMixin, StateIOMixin):
    """Carries out a :class:`Plan` for one model and its optimizer (NOTE [ Model-state rules ])."""

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"tiermem manage: model must be a torch.nn.Module, got {type(model).__name__}")
        if model in _MANAGED:
            raise StatesUsageError("tiermem manage: this model is already managed; call rt.manage once per model")
        self.registry = registry
        self.device: torch.device = registry.device
        self.model = model
        self.params: list[nn.Parameter] = list(model.parameters())
        if not self.params:
            raise ValueError("tiermem manage: the model has no parameters")
        for p in self.params:
            if p.layout != torch.strided or p.device.type == "meta":
                raise StatesUsageError(
                    f"tiermem manage: parameters must be dense tensors with data; got {p.layout} on {p.device}"
                )
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._param_dtype, self._master_scale = _working_dtype(param_dtype, self.params)
        base = coerce_optimizer(self.params, optimizer, optimizer_kwargs or {})
        self.optimizer_class = type(base)
        self.state_names = state_names(self.optimizer_class, base.param_groups)
        self._optimized = {self._index[id(p)] for group in base.param_groups for p in group["params"]}
        self._trainable = [p.requires_grad for p in self.params]
        working = self._param_dtype
        self._info = [
            ParamInfo(p.numel() * working.itemsize, tuple(p.shape), working, p.requires_grad)
            if working is not None
            else ParamInfo(p.numel() * p.element_size(), tuple(p.shape), p.dtype, p.requires_grad)
            for p in self.params
        ]
        self._module_names: dict[nn.Module, list[tuple[str, int]]] = {}
        for module in model.modules():
            names = [(n, self._index[id(p)]) for n, p in module._parameters.items() if p is not None]
            if names:
                self._module_names[module] = names
        owners = Counter(i for names in self._module_names.values() for _, i in names)
        self._shared = {i for i, count in owners.items() if count > 1}
        self._request: PlanRequest = parse_plan(plan)
        self._init_stepping(grad_accumulation_steps, clip_grad_norm, keep_gradients)
        # ``plan_owner.plan`` follows the plan in force (the Runtime's ``rt.plan``); held weakly.
        self._plan_owner = weakref.ref(plan_owner) if plan_owner is not None else None

        self.chunks: list[Chunk] = []
        self._slots: list[tuple[Chunk, Slot]] = []
        self._module_chunks: dict[nn.Module, tuple[Chunk, ...]] = {}
        self.pool = ChunkPool(registry, [], 0)
        self._has_grad = [False] * len(self.params)
        #: NOTE [ Host gradients ] rule 5: per chunk, the lease of the HostGradients exposed now
        self._grad_leases: dict[int, list[bool]] = {}
        self._pstate: dict[int, ParamState] = {}
        self._order = self._initial_order()
        self._recording: list[int] | None = None
        self._seen: set[int] = set()
        self._recorded: list[int] | None = None
        self._repack_pending = False
        self._generation = 0
        self._read_cache: tuple[int, tuple[int, int], torch.Tensor] | None = None
        self._in_backward = False
        self._uses: weakref.WeakSet[Use] = weakref.WeakSet()
        self._waiters: dict[int, weakref.WeakSet[Use]] = {}
        self._leaf_hooks: list[RemovableHandle] = []
        #: modules whose forward runs, with the autograd sequence number their forward started at
        self._active: list[tuple[nn.Module, int]] = []
        #: calls of each module since the root's forward started (rule 3: a repeated call)
        self._calls: Counter[nn.Module] = Counter()
        self._loading: list[Chunk] = []
        self._sd_keep_vars = False
        self._hooks: list[RemovableHandle] = []
        #: rule 9: who plans at the first step, and the first forward's arguments
        self._planner = first_step_planner
        self._plan_batch: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._closed = False
        self._restored = False

        snapshot = Snapshot(
            data=[p.detach() for p in self.params],
            grads=[p.grad for p in self.params],
            states={self._index[id(p)]: dict(s) for p, s in base.state.items() if s},
        )
        layouts, self.plan = self._plan_layout(self._order)
        try:
            self._build(layouts, self.plan, snapshot)
        except BaseException:
            self._free_chunks()
            for p, data, grad in zip(self.params, snapshot.data, snapshot.grads, strict=True):
                p.data, p.grad = data, grad
            raise
        base.state.clear()  # its states now live in chunks
        # CUDA: buffers follow the parameters to the device (they are not managed).
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != self.device:
                    module._buffers[name] = buffer.to(self.device)
                if buffer is not None and self._param_dtype is not None and buffer.is_floating_point():
                    module._buffers[name] = module._buffers[name].to(self._param_dtype)  # as model.to(dtype)
        self.optimizer = ManagedOptimizer(self, base)
        self._register_hooks()
        _MANAGED[model] = self

    def _initial_order(self) -> list[int]:
        """Rule 2: registration order, or the execution order the planner's profile recorded
        (``PlanRequest.order``), which spares the re-pack at the first step."""
        order = self._request.order
        if order is None or sorted(order) != list(range(len(self.params))):
            return list(range(len(self.params)))
        return list(order)

    def _plan_layout(
        self, order: Sequence[int], held: Mapping[str, int] | None = None
    ) -> tuple[list[ChunkLayout], Plan]:
        """Pack ``order`` and decide the plan (NOTE [ Chunk layout rules ] rule 5)."""
        held = held or {}
        budgets = Budgets(
            **{name: self.registry.free_bytes(name) + held.get(name, 0) for name in ("device", "host", "nvme")}
        )
        largest = max(info.nbytes for info in self._info)
        return choose_layout(
            chunk_sizes(self._request, largest, lambda: size_candidates(self._info)),
            lambda size: pack(self._info, order, size),
            lambda layouts: (self._needs(layouts), self._min_buffers(layouts)),
            waste,
            budgets=budgets,
            request=self._request,
            grads_stream=self._grads_stream,
        )

    def _needs(self, layouts: Sequence[ChunkLayout]) -> list[ChunkNeeds]:
        return [
            ChunkNeeds(layout.nbytes, layout.trainable, self._sections(layout), self._master_scale)
            for layout in layouts
        ]

    def _sections(self, layout: ChunkLayout) -> int:
        return len(self.state_names) if any(s.index in self._optimized for s in layout.slots) else 0

    def _min_buffers(self, layouts: Sequence[ChunkLayout]) -> int:
        """Rule 4 of NOTE [ Default placement rule ]: chunks one module spans + shared chunks."""
        where = {slot.index: layout.index for layout in layouts for slot in layout.slots}
        span = max(len({where[i] for _, i in names}) for names in self._module_names.values())
        return span + len({where[i] for i in self._shared})

    def _build(self, layouts: Sequence[ChunkLayout], plan: Plan, snapshot: Snapshot) -> None:
        """Create the chunks of ``layouts`` under ``plan`` holding ``snapshot``'s values."""
        self.plan = plan
        slots: list[tuple[Chunk, Slot] | None] = [None] * len(self.params)
        for layout in layouts:
            persistent = layout.index < plan.persistent_chunks
            chunk = Chunk(
                layout,
                persistent=persistent,
                home=plan.state_home[layout.index],
                sections=self._sections(layout),
                device=self.device,
                master_scale=self._master_scale,
            )
            self.chunks.append(chunk)
            for slot in layout.slots:
                slots[slot.index] = (chunk, slot)
            if not persistent:
                # Rule 1: parameters view the chunk's storage, emptied right away (on CUDA all
                # chunks at full size at once would be the whole model in device memory).
                for slot in layout.slots:
                    p = self.params[slot.index]
                    if p.dtype != slot.dtype:
                        p.grad = None  # a working dtype: the gradient comes back as a view below
                    p.data = slot.view(chunk.data)
                chunk.data.untyped_storage().resize_(0)
            if persistent:
                chunk.dev = self._register(chunk.data, "device")
                for slot in layout.slots:
                    slot.view(chunk.data).copy_(snapshot.data[slot.index])  # casts to a working dtype
                if chunk.sections or chunk.has_master:
                    home = torch.zeros(chunk.home_bytes, dtype=torch.uint8, device=self.device)
                    if chunk.has_master:  # fp32 masters of working chunks (chunk layout rule 6)
                        for slot in layout.slots:
                            slot.master_view(home, 0, chunk.master_scale).copy_(snapshot.data[slot.index])
                    chunk.home = self._register(home, "device")
            else:
                home = torch.zeros(chunk.home_bytes, dtype=torch.uint8)
                for slot in layout.slots:
                    if chunk.master_scale > 1:
                        slot.master_view(home, 0, chunk.master_scale).copy_(snapshot.data[slot.index])
                    slot.view(home, chunk.working_base).copy_(snapshot.data[slot.index])
                chunk.home = self._register(home, chunk.home_tier)
            grads = [(slot, snapshot.grads[slot.index]) for slot in layout.slots]
            if any(grad is not None for _, grad in grads):
                tier = "host" if chunk.offloaded else "device"
                buffer = torch.zeros(chunk.nbytes, dtype=torch.uint8, device="cpu" if chunk.offloaded else self.device)
                for slot, grad in grads:
                    if grad is not None:
                        slot.view(buffer).copy_(grad)
                        self._has_grad[slot.index] = True
                chunk.grad = self._register(buffer, tier)
        self.pool = ChunkPool(self.registry, self.chunks, plan.buffers)
        self._slots = [s for s in slots if s is not None]
        if len(self._slots) != len(self.params):
            raise AssertionError("tiermem internal error (please report): a parameter was left out of every chunk")
        for p, (chunk, slot) in zip(self.params, self._slots, strict=True):
            if chunk.persistent:
                if p.dtype != slot.dtype:
                    p.grad = None  # a working dtype: the gradient comes back as a view below
                p.data = slot.view(chunk.data)
        self._expose_grads()
        self._module_chunks = {
            module: tuple(sorted({self._slots[i][0] for _, i in names}, key=lambda c: c.index))
            for module, names in self._module_names.items()
        }
        self._import_states(snapshot.states)
        owner = self._plan_owner() if self._plan_owner is not None else None
        if owner is not None:
            owner.plan = plan  # type: ignore[attr-defined]

    def _free_chunks(self) -> None:
        """Free every chunk's bytes (accounting included); parameters keep dangling views."""
        for chunk in self.chunks:
            if chunk.fetching is not None:
                transfer, chunk.fetching = chunk.fetching, None
                transfer.cancel()
                with contextlib.suppress(Exception):
                    transfer.wait()
            chunk.empty_storage()
            for handle in (chunk.dev, chunk.home, chunk.grad):
                if handle is not None:
                    handle.free()
            chunk.dev = chunk.home = chunk.grad = None
        self._retire_host_grads()
        self.chunks = []
        self.pool.resident.clear()
        self.pool.drop_spares()
        self._read_cache = None

    def _register_hooks(self) -> None:
        model = self.model
        self._hooks.append(model.register_forward_pre_hook(self._root_started, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._root_ended, always_call=True))
        for module in self._module_names:
            self._hooks.append(module.register_forward_pre_hook(self._forward_started))
            self._hooks.append(module.register_forward_hook(self._forward_ended, with_kwargs=True, always_call=True))
            self._hooks.append(module.register_state_dict_pre_hook(self._state_dict_started))
            self._hooks.append(module.register_state_dict_post_hook(functools.partial(self._state_dict_ended)))
            self._hooks.append(module.register_load_state_dict_pre_hook(self._load_started))
            self._hooks.append(module.register_load_state_dict_post_hook(self._load_ended))
        for i, p in enumerate(self.params):
            if self._trainable[i]:
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i)))

    def _root_started(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._check_usable()
        _refuse_compile()
        self._settle_backward()
        if self._recorded is None and self._recording is None:
            self._recording, self._seen = [], set()
        self._calls.clear()
        if torch.is_grad_enabled():
            self._forward_with_grad()
            if self._planner is not None and self._plan_batch is None:  # rule 9
                detach = functools.partial(tree_map_only, torch.Tensor, torch.Tensor.detach)
                self._plan_batch = (detach(tuple(args)), detach(dict(kwargs)))
        return None

    def _root_ended(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._plan_batch is not None:
            self._repack_pending = True  # rule 9: plan at the next optimizer.step()
        if self._recording is None:
            return
        order = self._recording + [i for i in range(len(self.params)) if i not in self._seen]
        self._recording, self._recorded = None, order
        if order != self._order:
            self._repack_pending = True  # rule 2: at the next optimizer.step()

    def _forward_started(self, module: nn.Module, _args: Any) -> None:
        self._check_usable()
        _refuse_compile()
        names = self._module_names[module]
        if self._recording is not None:
            for _, i in names:
                if i not in self._seen:
                    self._seen.add(i)
                    self._recording.append(i)
        if torch.is_grad_enabled():
            for _, i in names:
                if self._trainable[i]:
                    self._slots[i][0].pending.add(i)
        chunks = self._module_chunks[module]
        self.pool.acquire(chunks, +1)
        for chunk in chunks:
            chunk.pins += 1
        self._active.append((module, torch._C._autograd._get_sequence_nr()))

    def _forward_ended(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._active or self._active[-1][0] is not module:
            return  # its pre-hook failed: nothing was pinned
        _, first_node = self._active.pop()
        for chunk in self._module_chunks[module]:
            chunk.pins -= 1
        if output is not None and not self._closed and torch.is_grad_enabled():
            self._calls[module] += 1
            self._track_use(module, args, kwargs, output, first_node)

    def _repack(self) -> None:
        self._repack_pending = False
        if self._plan_batch is not None and self._plan_first_step():
            return
        order = self._recorded
        if order is None or order == self._order:
            return
        self.pool.clear()
        try:
            layouts, plan = self._plan_layout(order, held=self._held_bytes())
        except (PlanError, StatesMemoryError) as exc:
            log.warning("tiermem model states: keeping registration order; the execution-order plan fails: %s", exc)
            return
        snapshot = self._snapshot()
        old = self._layout_in_force()
        self._clear_chunks()
        self._rebuild((layouts, plan, list(order)), old, snapshot)

    def _layout_in_force(self) -> tuple[list[ChunkLayout], Plan, list[int]]:
        return [chunk.layout for chunk in self.chunks], self.plan, list(self._order)

    def _clear_chunks(self) -> None:
        """Free every chunk and forget gradients and states: a snapshot holds them (rules 2, 9)."""
        self._free_chunks()
        self._has_grad = [False] * len(self.params)
        self._pstate.clear()

    def _rebuild(
        self,
        new: tuple[Sequence[ChunkLayout], Plan, list[int]],
        old: tuple[Sequence[ChunkLayout], Plan, list[int]],
        snapshot: Snapshot,
    ) -> bool:
        """Build ``new`` (layouts, plan, order) from ``snapshot``, or ``old`` again when ``new``
        does not fit after all (logged); whether ``new`` was built."""
        try:
            self._build(new[0], new[1], snapshot)
            self._order = new[2]
            return True
        except (StatesMemoryError, TierCapacityError) as exc:
            log.warning("tiermem model states: the new chunk layout could not be built (%s); keeping the old", exc)
            self._clear_chunks()
            self._build(old[0], old[1], snapshot)
            self._order = old[2]
            return False

    def _plan_first_step(self) -> bool:
        """Rule 9: plan from the first forward's arguments and rebuild the chunks under the plan.
        False when planning is skipped (the caller re-packs as rule 2 says); True once rebuilt."""
        planner, batch = self._planner, self._plan_batch
        assert planner is not None and batch is not None
        self._plan_batch = None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            log.info(
                "tiermem model states: optimizer.step() inside rt.offload_activations(); planning waits for a "
                "step outside it (the offloader's hooks would capture the profiling step)"
            )
            return False
        self._planner = None  # once, whatever happens below
        needed = sum(
            info.nbytes * self._master_scale * (1 + info.trainable + len(self.state_names)) for info in self._info
        )
        on_device = sum(info.nbytes * (1 + info.trainable) for info in self._info)  # parameters, gradients
        if self.device.type != "cpu" and on_device > 0.8 * core.memory_available(self.device):
            log.warning(
                "tiermem model states: not planning from the first step: the plain parameters and gradients (%s) "
                "do not fit in %s's free memory for the profiling step; the default placement stays. Give "
                "rt.manage a plan= (or sample= on a machine with the room)",
                format_size(on_device),
                self.device,
            )
            return False
        if needed > 0.8 * core.memory_available(torch.device("cpu")):
            log.warning(
                "tiermem model states: not planning from the first step: a plain copy of the model states (%s) does "
                "not fit in free memory; the default placement stays. Give rt.manage a plan= (or sample= on a "
                "machine with the room)",
                format_size(needed),
            )
            return False
        self.pool.clear()
        snapshot = self._snapshot()
        old = self._layout_in_force()
        layouts, plan, order = old
        self._clear_chunks()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        request = self._request
        try:
            working = self._param_dtype
            for p, data in zip(self.params, snapshot.data, strict=True):
                # What training computes with, where it computes (snapshots are CPU copies).
                p.data = data.to(self.device, working or data.dtype)
                p.grad = None
            try:
                planned = planner(self.model, *batch)
                self._request = planned
                new_order = list(planned.order) if planned.order is not None else (self._recorded or order)
                if sorted(new_order) != list(range(len(self.params))):
                    new_order = self._recorded or order
                layouts, plan = self._plan_layout(new_order)
                order = new_order
            except Exception as exc:  # noqa: BLE001 - the default placement carries on, as logged
                self._request = request
                log.warning(
                    "tiermem model states: planning from the first step failed, the default placement stays "
                    "(give rt.manage a plan= or sample= to choose): %s: %s",
                    type(exc).__name__,
                    exc,
                )
                if self._recorded is not None and self._recorded != order:
                    with contextlib.suppress(PlanError, StatesMemoryError):
                        layouts, plan = self._plan_layout(self._recorded)
                        order = list(self._recorded)
        finally:
            if not self._rebuild((layouts, plan, order), old, snapshot):
                self._request = request
            self._register_hooks()
        return True

    def close(self) -> None:
        """Restore ordinary parameters when they fit, else mark them unusable; free every chunk.

        Never raises: it runs inside ``Runtime.close``, which must go on to free the tiers."""
        if self._closed:
            return
        try:
            self._settle_backward()
            self.pool.clear()
            self._restored = self._restore()
        except Exception:
            log.exception("tiermem model states: restoring parameters failed; the model is unusable now")
            self._restored = False
        self._closed = True
        try:
            for handle in self._hooks + self._leaf_hooks:
                handle.remove()
            self._hooks.clear()
            self._leaf_hooks.clear()
            if not self._restored:
                for p in self.params:
                    p.grad = None
                    # The same Parameter object, now a meta tensor: shapes stay, bytes are gone,
                    # and the hooks below refuse to run the model (set_data cannot change device).
                    meta = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                    with contextlib.suppress(RuntimeError):  # a live graph still holds it: leave it empty
                        torch.utils.swap_tensors(p, meta)
                for module in self._module_names:
                    self._hooks.append(module.register_forward_pre_hook(self._refuse))
            self._free_chunks()
        except Exception:
            log.exception("tiermem model states: releasing the chunks failed")
        finally:
            self._pstate.clear()
            _MANAGED.pop(self.model, None)

    def _refuse(self, _module: nn.Module, _args: Any) -> None:
        self._check_usable()

    def describe(self) -> dict[str, Any]:
        """Where each chunk lives now: for logs and tests."""
        return {
            "plan": self.plan.as_dict(),
            "order": "execution" if self._order == self._recorded else "registration",
            "chunk_steps": self.chunk_steps,
            "early_chunk_steps": self.early_chunk_steps,
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
