"""``rt.manage(model, optimizer)`` on a model sharded with FSDP2's ``fully_shard``: each rank's
optimizer states in chunks across the tiers, FSDP2's parameters left where FSDP2 keeps them.

:class:`ShardedModelStates` owns the plan in force, the accounting of the shards it
adopts, the declared loop's counters and the managed optimizer's backend; the chunks and the
step are :class:`~tiermem.states.sharded.step.ShardSteps`'s, packing and placement
:mod:`tiermem.states.sharded.layout`'s, what is read of FSDP2 and the collective agreement
:mod:`tiermem.states.sharded.fsdp`'s.

# NOTE [ Sharded model states ]
1. FSDP2 owns the parameters: the DTensor shards and their storage (on the device, or on the
   host under ``CPUOffloadPolicy``), the gradients (``.grad`` DTensors its reduce-scatter
   assigns), and its all-gather and reduce-scatter buffers, which live only inside its
   collectives and are not counted in any tier. tiermem never moves, replaces or frees a
   parameter's storage. A local shard on the device is adopted into the device tier's accounting
   (``Registry.register``, kind ``"fsdp_shard"``, no copy), so the device budget counts it; an
   offloaded one into the host's when the host tier can adopt it (a pinned host tier cannot
   adopt pageable shards: they are then not counted, and that is logged).
2. Packing is the same on every rank: each optimized parameter gets a slot of its *padded* shard
   shape (FSDP2 pads every rank's shard to ``ceil(size / mesh size)`` along each sharded dim),
   packed in parameter order (NOTE [ Chunk layout rules ]; an outlier, rule 4, alone); a rank's own
   shard fills the first elements of its slot. At ``rt.manage`` every rank sends its packing digest and free bytes
   (one ``all_gather_object`` on the default group); rank 0 checks that the digests are equal.
3. One plan: rank 0 decides it (a hand plan's ``chunk_size``, ``state_home`` and
   ``persistent_chunks`` are honoured, ``[model_states] chunk_size`` where ``plan=`` names no
   size, as in one process; ``"auto"`` sizes and places chunks by the default rule of
   :func:`~tiermem.states.sharded.layout.size_shards` on the smallest free bytes of all ranks,
   since the config's capacities are per rank: the largest chunk size that fits, two homes
   staged for the step where they fit, else one) and broadcasts it, or the error every rank then
   raises (``broadcast_object_list``): no rank plans alone, none hangs on another's error. A
   rank that cannot pack at its chunk size at all (its ``plan=`` or ``[model_states]
   chunk_size`` below its largest shard) joins the gather with that refusal and raises it; the
   others raise an error naming it. So
   ``rt.manage`` is collective: every rank calls it for the same model, in the same order.
4. tiermem owns each rank's optimizer states: one registry object of kind ``"chunk"`` per chunk,
   ``sections`` sections (``exp_avg``, ``exp_avg_sq``[, ``max_exp_avg_sq``]; SGD's momentum) of
   the chunk's size, homed on the device, the host or NVMe by the plan. Scalars (``step``) stay
   small tensors in memory.
5. The step is NOTE [ Exact optimizer step ]'s: torch's own ``step`` over per-parameter aliases
   (``local.detach()``: a fresh leaf sharing the shard's storage and version counter, so the
   in-place update lands in what FSDP2 all-gathers next) whose ``.grad`` is the local gradient,
   and state entries viewing the chunk. A home the parameters' device cannot address (NVMe; the
   device's for CPU-offloaded shards on a CUDA device; the host's for shards on a CUDA device) is
   staged on the parameters' tier (DEMAND), the next one prefetched where the plan has room to
   stage two (``staged_homes``; with one, each is staged once the one before is written back),
   and written back (WRITEBACK).
6. Declared loops: FSDP2 calls each sharded parameter's post-accumulate-grad hooks after its
   reduce-scatter. Each optimized parameter's arrivals are counted per window; without clipping a
   chunk steps in backward as soon as each of its parameters arrived ``grad_accumulation_steps``
   times, and with ``keep_gradients=False`` its ``.grad`` is dropped after (``zero_grad`` would).
   Guard: ``optimizer.step()`` raises :class:`StatesUsageError` when a chunk that stepped early saw
   its gradient change since (another arrival, a new tensor or an in-place edit): never a silently
   different step. A loop that turns FSDP2's gradient sync off for all but the last micro-batch
   (``set_requires_gradient_sync(False)``) gets one arrival per window: its chunks step at
   ``optimizer.step()``, exactly, without overlap. On CUDA the hook runs on FSDP2's post-reduce
   stream, so the step's kernels are queued before the event FSDP2 makes the next forward wait on.
7. Declared clipping: ``torch.nn.utils.clip_grad_norm_`` over the DTensor parameters, the call a
   plain FSDP2 loop makes, so the norm is bitwise plain FSDP2's: DTensor takes each rank's local
   norms, then their norm as a ``_NormPartial`` that ONE all-reduce (of the squared local norm)
   completes. It runs at ``optimizer.step()``, before any chunk steps (no early steps then).
8. ``optimizer.state_dict()`` / ``load_state_dict()`` speak PyTorch's format with states as
   DTensors placed like their parameters (plain FSDP2's), so DCP's ``get_optimizer_state_dict``
   / ``set_optimizer_state_dict`` work; ``optimizer.state`` is truthy while chunks hold states,
   so DCP never runs its zero-gradient initialising step over trained states.
9. Checkpoints (``rt.save`` / ``rt.load``, NOTE [ Checkpoints on ranks ] in
   ``tiermem.checkpoint.ranks``): the parameters are FSDP2's DTensors, saved and loaded in place
   as DCP does them; the optimizer states are read from and written into this rank's chunks
   through :class:`~tiermem.states.sharded.stateio.ShardedStateIO` (local shards, one home read per
   chunk), in ``get_state_dict``'s layout. Only between steps: a declared window with arrivals
   counted, or any ``.grad`` still set, is refused by the save (gradients are not saved).
10. Mixed precision is FSDP2's ``MixedPrecisionPolicy(param_dtype=)``: its fp32 shards are the
   masters the step updates (tiered states beside them, bitwise plain FSDP2 with the policy,
   ``tests/test_states_fsdp.py``) and it gathers in low precision; ``rt.manage(param_dtype=)`` is
   refused with that pointer. Not yet: ``sample=`` profiling, parameters resting on NVMe
   (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiermem.layout.placement import Budgets, Plan, parse_plan
from tiermem.registry import Handle, Registry
from tiermem.states.declarations import Declarations
from tiermem.states.errors import PlanError, StatesClosedError, StatesUsageError
from tiermem.states.optimizer import ManagedOptimizer, coerce_optimizer, learn_state, require_element_wise
from tiermem.states.sharded.fsdp import agree, cpu_offloaded, is_sharded, padded_shape, sharded_params, staging_tier
from tiermem.states.sharded.layout import ShardSpec, pack_shards, signature, size_shards
from tiermem.states.sharded.stateio import ShardedStateIO
from tiermem.states.sharded.step import ShardSteps, local_of

__all__ = ["ShardedModelStates", "ShardedOptimizer", "is_sharded"]

log = logging.getLogger("tiermem.states")

#: Models under management, so one model is not managed twice.
_MANAGED: weakref.WeakKeyDictionary[nn.Module, ShardedModelStates] = weakref.WeakKeyDictionary()


class _ChunkStates(defaultdict):  # type: ignore[type-arg]
    """``optimizer.state``: empty (states live in chunks) but truthy while chunks hold states (rule 8)."""

    def __init__(self, holds: Any) -> None:
        super().__init__(dict)
        self._holds = holds

    def __bool__(self) -> bool:
        return len(self) > 0 or bool(self._holds())


class ShardedOptimizer(ManagedOptimizer):
    """The managed optimizer of a sharded model (rule 8: its ``state`` is a :class:`_ChunkStates`)."""

    def __init__(self, backend: ShardedModelStates, base: torch.optim.Optimizer) -> None:
        super().__init__(backend, base)
        self.state = _ChunkStates(backend.holds_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        try:
            super().load_state_dict(state_dict)
        finally:
            self.state = _ChunkStates(self._backend.holds_state)  # type: ignore[attr-defined]


class ShardedModelStates:
    """Optimizer states of one FSDP2-sharded model in chunks (NOTE [ Sharded model states ])."""

    def __init__(
        self,
        registry: Registry,
        model: nn.Module,
        optimizer: Any,
        *,
        plan: Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        grad_accumulation_steps: int | None = None,
        clip_grad_norm: float | None = None,
        keep_gradients: bool = True,
        param_dtype: torch.dtype | None = None,
        host_adopts_pageable: bool = True,
    ) -> None:
        if param_dtype is not None:
            raise StatesUsageError(
                f"tiermem manage: param_dtype={param_dtype} is not supported for an FSDP2-sharded model; give "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...)) instead: FSDP2 keeps the fp32 "
                "shards as masters and all-gathers them in low precision"
            )
        if model in _MANAGED:
            raise StatesUsageError("tiermem manage: this model is already managed; call rt.manage once per model")
        self.registry = registry
        self._model = model
        self.params = sharded_params(model)
        base = coerce_optimizer(self.params, optimizer, optimizer_kwargs or {})
        require_element_wise(type(base))
        self.declared = Declarations.check(grad_accumulation_steps, clip_grad_norm, keep_gradients)
        self.optimizer_class = type(base)
        self.group_of = {id(p): g for g, group in enumerate(base.param_groups) for p in group["params"]}
        names = learn_state(self.optimizer_class, base.defaults, base.param_groups).names
        self.closed = False
        self._adopted: list[Handle] = []
        self._hooks: list[Any] = []
        self.steps = ShardSteps(registry, self.params, names, self.optimizer_class, staging_tier(self.params))
        try:
            self._adopt_shards(host_adopts_pageable)
            specs = [
                ShardSpec(padded_shape(p), p.dtype, p.requires_grad and id(p) in self.group_of) for p in self.params
            ]
            request = parse_plan(plan)
            # the digest of the default packing: every rank that packs alike there packs alike
            # at the size rank 0 then picks from every rank's free bytes (rule 2)
            try:
                digest: str | PlanError = signature(*pack_shards(specs, request.chunk_size), len(names))
            except PlanError as exc:  # rule 3: the other ranks learn of it in the gather, none waits
                digest = exc
            staging = self.steps.staging
            self.plan: Plan = agree(
                digest, self._budgets(), lambda b: size_shards(specs, len(names), b, request, staging)
            )
            _, layouts = pack_shards(specs, self.plan.chunk_size)
            self.steps.build(layouts, self.plan.state_home, self.plan.staged_homes)
            self.slots = {slot.index: (chunk, slot) for chunk in self.steps.chunks for slot in chunk.layout.slots}
            self.optimizer: ShardedOptimizer = ShardedOptimizer(self, base)
            if base.state:  # a constructed optimizer that already stepped: its states move into the chunks
                self.steps.import_state({p: base.state[p] for p in self.params if p in base.state})
            self._register_hooks()
        except BaseException:
            self._release()
            raise
        self._reset_window()
        #: optimizer steps taken (a declared loop's windows, rule 9)
        self.windows = 0
        self.chunk_steps = 0
        self.early_chunk_steps = 0
        _MANAGED[model] = self

    # -- FSDP2's shards adopted, one packing and one plan on every rank ----------------------------
    def _adopt_shards(self, host_adopts_pageable: bool) -> None:
        """Rule 1: account each local shard's storage where it is, without a copy."""
        device = self.registry.device
        offloaded = cpu_offloaded(self._model)
        for p in self.params:
            local = local_of(p)
            if local.untyped_storage().nbytes() == 0:
                continue
            on_device = local.device == device and id(p) not in offloaded
            if on_device:
                tier = "device"
            elif local.device.type == "cpu" and (host_adopts_pageable or local.is_pinned()):
                tier = "host"
            else:
                log.info(
                    "tiermem sharded states: a CPU-offloaded shard is pageable and the host tier is pinned; "
                    "FSDP2 keeps it outside the host budget"
                )
                continue
            self._adopted.append(self.registry.register(local, tier, dedup=False, kind="fsdp_shard"))

    def _budgets(self) -> Budgets:
        free = self.registry.free_bytes
        return Budgets(free("device"), free("host"), free("nvme"))

    # -- the module's surface (what Runtime uses of a ModelStates) ------------------------------
    @property
    def model(self) -> nn.Module:
        return self._model

    def holds_state(self) -> bool:
        return bool(self.steps.records)

    def describe(self) -> dict[str, Any]:
        """Where each chunk's states live: for logs, tests and ``rt.stats()``."""
        return {
            "plan": self.plan.as_dict(),
            "order": "registration",
            "sharded": True,
            "chunk_steps": self.chunk_steps,
            "early_chunk_steps": self.early_chunk_steps,
            "adopted_shard_bytes": sum(h.reserved for h in self._adopted if not h.freed),
            "chunks": [
                {
                    "index": c.index,
                    "params": len(c.layout.slots),
                    "nbytes": c.layout.nbytes,
                    "trainable": True,
                    "persistent": c.home_tier == "device",
                    "resident": c.home_tier == "device",
                    "home": c.home_tier,
                }
                for c in self.steps.chunks
            ],
        }

    def checkpoint_io(self, what: str) -> ShardedStateIO:
        """Rule 9: this rank's optimizer-state chunks as a checkpoint ``what`` ("save"/"load") streams them."""
        self._check_open()
        return ShardedStateIO(self.steps)

    def gradients_unstepped(self) -> bool:
        """Rule 9: a save would lose gradients: some parameter still has a ``.grad`` (FSDP2's
        reduce-scatter set it since the last ``zero_grad()``)."""
        return any(p.grad is not None for p in self.params)

    def loop_position(self) -> dict[str, int] | None:
        """The declared loop's position: windows stepped, arrivals counted in the current one."""
        if self.declared.accumulation is None:
            return None
        return {"windows": self.windows, "counted": sum(self._arrivals.values())}

    def restore_loop_position(self, position: Mapping[str, Any]) -> None:
        """A checkpoint's position, taken at a window boundary: nothing counted yet."""
        self.windows = int(position.get("windows", 0))
        self._reset_window()

    def close(self, spill_to: str | None = None) -> None:
        """Free every chunk and the shards' accounting; FSDP2's parameters stay as they are. Never raises."""
        if self.closed:
            return
        self.closed = True
        try:
            self._release()
        except Exception:
            log.exception("tiermem sharded states: releasing the chunks failed")
        finally:
            _MANAGED.pop(self._model, None)

    def _release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.steps.free()
        for handle in self._adopted:
            handle.free()
        self._adopted.clear()

    def _check_open(self) -> None:
        if self.closed:
            raise StatesClosedError(
                "tiermem: the Runtime that managed this FSDP2 model closed and freed its optimizer states; manage it "
                "again inside a running Runtime (and load a checkpoint) before stepping"
            )

    # -- declared loops ------------------------------------------------------------------
    def _register_hooks(self) -> None:
        if self.declared.accumulation is None:
            return
        for i, p in enumerate(self.params):
            if i in self.slots:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook_for(i)))

    def _hook_for(self, index: int) -> Any:
        def arrived(_param: torch.Tensor) -> None:
            self._arrived(index)

        return arrived

    def _reset_window(self) -> None:
        self._arrivals: dict[int, int] = {}
        #: chunk -> parameter -> (its .grad when the chunk stepped, _versions of it)
        self._early: dict[int, dict[int, tuple[torch.Tensor | None, tuple[int, int]]]] = {}
        #: gradient storage -> parameters of stepped chunks whose gradient views it (rule 6)
        self._stepped_grads: dict[int, list[int]] = {}
        self._overflow: set[int] = set()

    def _arrived(self, index: int) -> None:
        """A reduce-scattered gradient landed in parameter ``index`` (rule 6)."""
        if self.closed:
            return
        accumulation = self.declared.accumulation
        assert accumulation is not None
        count = self._arrivals[index] = self._arrivals.get(index, 0) + 1
        self._refresh_versions(index)
        chunk, _ = self.slots[index]
        if count > accumulation or chunk.index in self._early:
            self._overflow.add(index)
            return
        if self.declared.max_norm is not None or count < accumulation:
            return
        members = list(chunk.layout.slots)
        if any(self._arrivals.get(slot.index, 0) < accumulation for slot in members):
            if sum(self._arrivals.get(slot.index, 0) == accumulation for slot in members) == 1:
                self.steps.prefetch(chunk)  # its first final gradient: stage its home meanwhile
            return
        attributes = _step_attributes(self.optimizer)
        self.steps.step_chunk(chunk, members, self.optimizer, self.group_of, attributes)
        self.early_chunk_steps += 1
        record: dict[int, tuple[torch.Tensor | None, tuple[int, int]]] = {}
        for slot in members:
            p = self.params[slot.index]
            if not self.declared.keep_gradients:
                p.grad = None
            record[slot.index] = (p.grad, _versions(p.grad))
            if p.grad is not None:
                self._stepped_grads.setdefault(local_of(p.grad).untyped_storage().data_ptr(), []).append(slot.index)
        self._early[chunk.index] = record

    def _refresh_versions(self, index: int) -> None:
        """FSDP2's gradients of one group view one reduce-scatter output, so their version counter is
        shared: accumulating into a later parameter's gradient (just before its hook, this call)
        bumps the version of stepped ones. Those bumps are FSDP2's, not edits: take them in."""
        grad = self.params[index].grad
        if grad is None or not self._stepped_grads:
            return
        for i in self._stepped_grads.get(local_of(grad).untyped_storage().data_ptr(), ()):
            record = self._early[self.slots[i][0].index]
            seen, _ = record[i]
            record[i] = (seen, _versions(seen))

    def _check_early_gradients(self) -> None:
        """Rule 6's guard."""
        changed = sorted(self._overflow)
        for record in self._early.values():
            for i, (grad, versions) in record.items():
                now = self.params[i].grad
                if now is not grad or _versions(now) != versions:
                    changed.append(i)
        if changed:
            raise StatesUsageError(
                f"tiermem: gradients of {len(set(changed))} parameter(s) changed after rt.manage(grad_accumulation_"
                f"steps={self.declared.accumulation}) stepped their chunks during backward (another backward than "
                "declared, or .grad edited before optimizer.step()); the step would differ from plain PyTorch's. Keep "
                "to the declared loop, or call rt.manage without grad_accumulation_steps."
            )

    # -- the managed optimizer's backend ---------------------------------------------------------
    def step(self, optimizer: ManagedOptimizer) -> None:
        self._check_open()
        try:
            self._check_early_gradients()
            if self.declared.max_norm is not None:
                with_grad = [p for p in self.params if p.grad is not None]
                optimizer.grad_norm = torch.nn.utils.clip_grad_norm_(with_grad, self.declared.max_norm)
            attributes = _step_attributes(optimizer)
            work = []
            for chunk in self.steps.chunks:
                if chunk.index in self._early:
                    continue
                slots = [s for s in chunk.layout.slots if self.params[s.index].grad is not None]
                if slots:
                    work.append((chunk, slots))
            staged = [chunk for chunk, _ in work if not self.steps.in_place(chunk) and chunk.home is not None]
            for chunk, slots in work:
                if chunk in staged and staged.index(chunk) + 1 < len(staged):
                    self.steps.prefetch(staged[staged.index(chunk) + 1])  # the next home while this one steps
                self.steps.step_chunk(chunk, slots, optimizer, self.group_of, attributes)
                self.chunk_steps += 1
            self.windows += 1
        finally:
            self._reset_window()

    def zero_grad(self, optimizer: ManagedOptimizer, set_to_none: bool) -> None:
        self._check_open()
        torch.optim.Optimizer.zero_grad(optimizer, set_to_none)

    def export_optimizer_state(self, optimizer: ManagedOptimizer) -> dict[torch.Tensor, dict[str, Any]]:
        self._check_open()
        return self.steps.export_state()

    def import_optimizer_state(self, optimizer: ManagedOptimizer, state: Mapping[torch.Tensor, Any]) -> None:
        self._check_open()
        self.steps.import_state(state)


def _versions(grad: torch.Tensor | None) -> tuple[int, int]:
    """Rule 6: a gradient's in-place changes show in its own version counter (a DTensor's ``mul_``
    bumps the DTensor's) or its local tensor's (FSDP2's ``grad._local_tensor += new`` bumps that)."""
    if grad is None:
        return (-1, -1)
    return (grad._version, local_of(grad)._version)


def _step_attributes(optimizer: ManagedOptimizer) -> dict[str, Any]:
    return {name: getattr(optimizer, name) for name in ("grad_scale", "found_inf") if hasattr(optimizer, name)}
