"""Which chunk layout is in force, and every (re)build of the chunks: the first build at
``rt.manage``, the re-pack in execution order (rule 2 of NOTE [ Model-state rules ] in
``manager.py``), planning from the first real step (rule 9), and freeing them.

:class:`Relayout` owns the plan request, the parameter order the chunks are packed in, the
execution order a forward records, whether a re-pack is due, and the first-step planner with the
arguments it will be given. It may touch: the store's chunks (built, freed) and the parameters'
``.data``/``.grad`` while the planner profiles plain parameters, the manager's hooks (through the
``unhook``/``hook`` it is given), and the plan owner's ``plan``. Where chunks go is the plan's
(:func:`~tiermem.layout.placement.choose_layout`); values move through
:class:`~tiermem.states.stateio.StateIO` snapshots, or, where a snapshot does not fit in memory,
through NVMe (:mod:`~tiermem.states.spilled_snapshot`). Where a plain copy of the model states
would break the capacities, the first-step planner profiles the chunks in place, streamed
(:mod:`~tiermem.states.streamed_profile`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from tiermem.errors import TierCapacityError, TiermemError
from tiermem.layout.choose import choose_layout, chunk_sizes
from tiermem.layout.chunks import ChunkLayout, outlier_candidates, pack, packing_floor, size_candidates, waste
from tiermem.layout.placement import Budgets, Plan, PlanRequest
from tiermem.malloc import trim
from tiermem.registry import Registry
from tiermem.states import facts as model_facts
from tiermem.states.access import internal
from tiermem.states.errors import PlanError, StatesMemoryError
from tiermem.states.facts import ModelFacts, Snapshot
from tiermem.states.gradients import Gradients
from tiermem.states.homes import Homes
from tiermem.states.spilled_snapshot import spill
from tiermem.states.stateio import StateIO
from tiermem.states.store import ChunkStore
from tiermem.states.streamed_profile import StreamedProfiling
from tiermem.units import format_size


def _never(_args: tuple[Any, ...], _kwargs: dict[str, Any]) -> bool:
    return False


@dataclass(frozen=True)
class FirstStepPlanner:
    """Rule 9: who plans at the first step."""

    #: given the model (plain parameters, or streamed) and its first forward's arguments, the plan
    plan: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], PlanRequest]
    #: whether the plan in force was already planned for a first forward given these arguments
    #: (from the cached profile of a batch of their shapes: NOTE [ Profile cache ] rule 6 in
    #: ``tiermem.planner.cache``): then nothing is planned at the first step
    planned_for: Callable[[tuple[Any, ...], dict[str, Any]], bool] = _never


Layout = tuple[Sequence[ChunkLayout], Plan, list[int]]
"""Chunk layouts, their plan and the parameter order they were packed in."""

log = logging.getLogger("tiermem.states")


class Relayout:
    """The layout in force for one model's chunks, and building them anew."""

    def __init__(
        self,
        registry: Registry,
        facts: ModelFacts,
        *,
        store: ChunkStore,
        homes: Homes,
        gradients: Gradients,
        stateio: StateIO,
        request: PlanRequest,
        planner: FirstStepPlanner | None,
        plan_owner: object | None,
        grads_stream: bool,
        remove_hooks: Callable[[], None],
        register_hooks: Callable[[], None],
    ) -> None:
        """``store`` to ``stateio``: the collaborators a build fills; ``remove_hooks`` and
        ``register_hooks``: the manager's hooks, off while the first-step planner profiles plain
        parameters."""
        self.registry = registry
        self.facts = facts
        self.store, self.homes, self.gradients, self.stateio = store, homes, gradients, stateio
        self.request = request
        self._grads_stream = grads_stream
        self._unhook, self._hook = remove_hooks, register_hooks
        # ``plan_owner.plan`` follows the plan in force (the Runtime's ``rt.plan``); held weakly.
        self._plan_owner = weakref.ref(plan_owner) if plan_owner is not None else None
        #: rule 2: the order the chunks are packed in; the one being recorded; the recorded one
        self.order = self._initial_order()
        self._recording: list[int] | None = None
        self._seen: set[int] = set()
        self.recorded: list[int] | None = None
        #: a re-pack (or a first-step plan) runs at the next optimizer.step()
        self.pending = False
        #: rule 9: who plans at the first step, and the first forward's arguments
        self._planner = planner
        self._plan_batch: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        #: rule 9: planning as a forward starts (plan_at_forward), where a failing model plans again
        self._retry_failed = False

    def _initial_order(self) -> list[int]:
        """Rule 2: registration order, or the execution order the planner's profile recorded
        (``PlanRequest.order``), which spares the re-pack at the first step."""
        order = self.request.order
        count = len(self.facts.params)
        if order is None or sorted(order) != list(range(count)):
            return list(range(count))
        return list(order)

    def plan_layout(
        self, order: Sequence[int], held: Mapping[str, int] | None = None
    ) -> tuple[list[ChunkLayout], Plan]:
        """Pack ``order`` and decide the plan (NOTE [ Chunk layout rules ] rule 5); ``held``:
        bytes per tier the chunks in force hold, free once they are rebuilt."""
        held = held or {}
        budgets = Budgets(
            **{name: self.registry.free_bytes(name) + held.get(name, 0) for name in ("device", "host", "nvme")}
        )
        info = self.facts.info
        largest = max(i.nbytes for i in info)
        return choose_layout(
            chunk_sizes(
                self.request, largest, lambda: size_candidates(info), packing_floor(info), name_of=self._name_of
            ),
            # NOTE [ Chunk layout rules ] rule 4: a parameter above the chunk size is an outlier
            # (the sizes tried are at least the floor) and gets a chunk of its own
            lambda size: pack(info, order, size, oversized=True),
            lambda layouts: (self.facts.needs(layouts), self.facts.min_buffers(layouts)),
            waste,
            budgets=budgets,
            request=self.request,
            grads_stream=self._grads_stream,
            # NOTE [ Declared steps ] rule 8: on the CPU device a step reads its gradients in place
            grads_via_host=self.facts.device.type != "cpu",
            fallback=outlier_candidates(info) if self.request.chunk_size is None else (),
            recompute_buffers=self.facts.recompute_buffers,
        )

    def _name_of(self, nbytes: int) -> str:
        """The name of the first parameter of ``nbytes`` bytes, for a refusal of the chunk size."""
        index = next(i for i, p in enumerate(self.facts.info) if p.nbytes == nbytes)
        return self.facts.param_names([index])[0]

    # -- building ------------------------------------------------------------------------------
    def build(self, layouts: Sequence[ChunkLayout], plan: Plan, snapshot: Snapshot) -> None:
        """Chunks of ``layouts`` under ``plan`` holding ``snapshot``'s values, gradients and states."""
        filled: dict[int, dict[int, dict[str, Any]]] = {}  # chunks whose NVMe homes hold their states
        self.store.build(layouts, plan, snapshot, self.stateio.home_filler(snapshot.states, filled))
        self.gradients.expose()
        self.stateio.import_states(snapshot.states, filled)
        owner = self._plan_owner() if self._plan_owner is not None else None
        if owner is not None:
            owner.plan = plan  # type: ignore[attr-defined]

    def free(self) -> None:
        """Free every chunk's bytes (accounting included); parameters keep dangling views."""
        # staged gradient copies first: one staged on its way to NVMe may still read its device
        # buffer (NOTE [ Stored gradients ] rule 7), which freeing the chunk releases
        self.gradients.retire()
        self.store.free()
        self.homes.forget()

    def _clear(self) -> None:
        """Free every chunk and forget gradients and states: a snapshot holds them (rules 2, 9)."""
        self.free()
        self.store.forget_values()

    def _in_force(self) -> Layout:
        assert self.store.plan is not None
        return [chunk.layout for chunk in self.store.chunks], self.store.plan, list(self.order)

    def _rebuild(self, new: Layout, old: Layout, snapshot: Snapshot) -> bool:
        """Build ``new`` from ``snapshot``, or ``old`` again when ``new`` does not fit after all
        (logged); whether ``new`` was built."""
        try:
            self.build(new[0], new[1], snapshot)
            self.order = new[2]
            return True
        except (StatesMemoryError, TierCapacityError) as exc:
            log.warning("tiermem model states: the new chunk layout could not be built (%s); keeping the old", exc)
            self._clear()
            self.build(old[0], old[1], snapshot)
            self.order = old[2]
            return False

    def restream(self, grads_stream: bool) -> None:
        """NOTE [ Declared steps ] rule 10: a declaration changed whether gradients stream, which
        decides where they wait (NOTE [ Default placement rule ] rule 3): the layout in force is
        chosen again for it and the chunks re-packed, between steps. A first-step plan still due
        was asked for the old declaration and is dropped (logged); the re-chosen layout stays.
        Raises :class:`PlanError` when no layout fits, and :class:`StatesMemoryError` when the
        re-pack kept the old layout; either way the old placement is in force."""
        if grads_stream == self._grads_stream:
            return
        old_stream, self._grads_stream = self._grads_stream, grads_stream
        try:
            self.store.pool.clear()
            layouts, plan = self.plan_layout(self.order, held=self._settled_held())
            if not self._repack((layouts, plan, list(self.order)), self._in_force()):
                raise StatesMemoryError(
                    "tiermem declare: the chunks could not be re-packed for the new declaration (logged above); "
                    "the placement in force was made for the old one, which stays declared"
                )
        except BaseException:
            self._grads_stream = old_stream
            raise
        if self._planner is not None:
            log.info("tiermem model states: the first-step plan was asked for the loop declared before; not planned")
            self._planner, self._plan_batch = None, None

    # -- rule 2: the execution order -----------------------------------------------------------
    def forward_started(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The root's forward starts: record its order if none was, keep the first-step batch."""
        if self.recorded is None and self._recording is None:
            self._recording, self._seen = [], set()
        if torch.is_grad_enabled() and self._planner is not None and self._plan_batch is None:  # kept to plan from
            if self._planner.planned_for(tuple(args), dict(kwargs)):
                self._planner = None  # the plan in force is this batch's: nothing to plan at the step
                return
            detach = functools.partial(tree_map_only, torch.Tensor, torch.Tensor.detach)
            self._plan_batch = (detach(tuple(args)), detach(dict(kwargs)))

    def record(self, names: Sequence[tuple[str, int]]) -> None:
        """A module's forward starts: its own parameters come next in execution order."""
        if self._recording is not None:
            for _, i in names:
                if i not in self._seen:
                    self._seen.add(i)
                    self._recording.append(i)

    def plans_now(self) -> bool:
        """Rule 9: whether the first-step plan is made now, as the root's forward with grad
        starts (before its forward, so that step runs on the planned chunks): not for a forward
        in eval mode (a validation pass with grad left on), one that autograd runs again inside
        backward, nor one under saved-tensor hooks (the offloader's would capture the profiling
        step); the next ``optimizer.step()`` plans then."""
        return (
            self._plan_batch is not None
            and self.facts.model.training
            and torch.is_grad_enabled()  # a batch kept from an eval forward, now without grad
            and not torch.is_inference_mode_enabled()
            and torch._C._current_graph_task_id() == -1
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        )

    def plan_at_forward(self) -> None:
        """Rule 9: the first-step plan as the first training forward starts (:meth:`plans_now`).
        The profiling step runs the model before its forward ever completed, so where it fails
        in the model's own code (an exception other than tiermem's: a bad batch, a user's hook,
        an interrupt) the next training forward plans again instead of the default placement
        staying for good. Autocast's cache of casts goes before and after: the profiling step's
        casts of the parameters are of the chunks the re-pack frees, and the forward would take
        them, with their graph, from the cache."""
        torch.clear_autocast_cache()
        self._retry_failed = True
        try:
            self.run()
        finally:
            self._retry_failed = False
            torch.clear_autocast_cache()

    def forward_ended(self) -> None:
        if self._plan_batch is not None:
            self.pending = True  # rule 9: not planned as the forward started; at the next optimizer.step()
        if self._recording is None:
            return
        order = self._recording + [i for i in range(len(self.facts.params)) if i not in self._seen]
        self._recording, self.recorded = None, order
        if order != self.order:
            self.pending = True  # rule 2: at the next optimizer.step()

    def run(self) -> None:
        """The re-pack (or first-step plan) due at this optimizer.step(), backward being done, or
        the first-step plan as the first forward starts (:meth:`plans_now`)."""
        self.pending = False
        if self._plan_batch is not None and self._plan_first_step():
            trim()  # NOTE [ Returning freed memory ] rule 4: the profiling step's and the old chunks' heap
            return
        order = self.recorded
        if order is None or order == self.order:
            return
        self.store.pool.clear()
        try:
            layouts, plan = self.plan_layout(order, held=self._settled_held())
        except (PlanError, StatesMemoryError) as exc:
            log.warning("tiermem model states: keeping registration order; the execution-order plan fails: %s", exc)
            return
        self._repack((layouts, plan, list(order)), self._in_force())
        trim()  # the snapshot's and the old chunks' freed heap (NOTE [ Returning freed memory ] rule 4)

    # -- rule 9: planning from the first step --------------------------------------------------
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
        self._planner = None  # once, whatever happens below (but a failing first forward: plan_at_forward)
        try:
            return self._plan_first_step_with(planner, batch)
        except BaseException:
            if self._retry(planner):
                log.info("tiermem model states: profiling the first forward stopped; the next training forward plans")
            raise

    def _retry(self, planner: FirstStepPlanner) -> bool:
        """:meth:`plan_at_forward`: a first forward that failed plans at the next training forward;
        whether it will."""
        if self._retry_failed:
            self._planner = planner
        return self._retry_failed

    def _plan_first_step_with(self, planner: FirstStepPlanner, batch: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
        refused = self._plain_copy_refused()
        if refused is not None:
            log.info("tiermem model states: profiling the first step with the chunks streamed: %s", refused)
            return self._plan_streamed(planner, batch)
        self.store.pool.clear()
        snapshot = self.stateio.snapshot()
        old = self._in_force()
        self._clear()
        self._unhook()
        request = self.request
        new = old
        try:
            working = self.facts.param_dtype
            for p, data in zip(self.facts.params, snapshot.data, strict=True):
                # What training computes with, where it computes (snapshots are CPU copies).
                with internal():  # a new tensor, not a write (NOTE [ Parameter access ] rule 4)
                    p.data = data.to(self.facts.device, working or data.dtype)
                p.grad = None
            new = self._plan_on_plain(planner, batch, old)
        finally:
            if not self._rebuild(new, old, snapshot):
                self.request = request
            self._hook()
        return True

    def _plan_streamed(self, planner: FirstStepPlanner, batch: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
        """Rule 9 when a plain copy would not fit: profile with the chunks in place, streamed
        (NOTE [ Streamed first-step profiling ]), then re-pack as any re-pack does (NOTE
        [ Spilled snapshots ] where the snapshot does not fit in memory either)."""
        request = self.request
        old = self._in_force()
        self.store.pool.clear()  # the pool's device bytes are not the chunks' to keep while planning
        held = self._settled_held()
        self._unhook()
        try:
            with StreamedProfiling(self.store, self.facts, held):
                new = self._plan_on_plain(planner, batch, old, held)
        finally:
            self._hook()
        if new is old:
            return True
        # the profiling step's freed heap goes back before the re-pack allocates (NOTE [ Returning
        # freed memory ] rule 4)
        trim()
        if not self._repack(new, old):
            self.request = request
        return True

    def _settled_held(self) -> dict[str, int]:
        """Bytes per tier the chunks hold, once no home or gradient is on its way between tiers:
        a move that lands later frees its source's bytes, which would then count twice (free
        and held; measured: a declared loop's host planned 27% above its capacity)."""
        self.homes.wait_moves()
        for chunk in self.store.chunks:
            if chunk.grad is not None:
                chunk.grad.wait()
        return self.store.held_bytes()

    def _plain_copy_refused(self) -> str | None:
        """Rule 9: why the profiling step cannot run on plain parameters (None: it can): they and
        their gradients must fit where training computes, and the snapshot (a plain copy of the
        model states) in free memory and in what the memory tiers have free."""
        facts = self.facts
        needed = self._snapshot_bytes()
        on_device = sum(info.nbytes * (1 + info.trainable) for info in facts.info)  # parameters, gradients
        if facts.device.type != "cpu" and on_device > 0.8 * model_facts.memory_available(facts.device):
            return (
                f"the plain parameters and gradients ({format_size(on_device)}) do not fit in {facts.device}'s free "
                "memory"
            )
        if needed > 0.8 * model_facts.memory_available(torch.device("cpu")):
            return f"a plain copy of the model states ({format_size(needed)}) does not fit in free memory"
        return self._beyond_capacities(needed, on_device - sum(info.nbytes for info in facts.info))

    def _snapshot_bytes(self) -> int:
        """A snapshot's bytes: every value, gradient and optimizer state as a plain copy."""
        facts = self.facts
        return sum(
            info.nbytes * facts.master_scale * (1 + facts.param_sections(i) + info.trainable)
            for i, info in enumerate(facts.info)
        )

    def _beyond_capacities(self, copy: int, grads: int) -> str | None:
        """Rule 9: the plain copy (``copy`` bytes, and on the CPU device the profiling step's
        ``grads``) would sit in memory beside the chunks until they are freed, outside the tiers'
        accounting: it must fit in what the memory tiers have free, or the process would hold
        more than the capacities promise (measured: a 34M GPT with 60% of its states on NVMe
        peaked above plain PyTorch's RSS on its first step). Why not, or None."""
        registry = self.registry
        cpu_device = self.facts.device.type == "cpu"
        tiers = [t for t in ("device", "host") if registry.has_tier(t) and (t == "host" or cpu_device)]
        free = sum(registry.free_bytes(t) for t in tiers)
        need = copy + (grads if cpu_device else 0)
        if need <= free:
            return None
        return (
            f"a plain copy of the model states ({format_size(need)}) is more than the {' and '.join(tiers)} "
            f"tier{'s' if len(tiers) > 1 else ''} ha{'ve' if len(tiers) > 1 else 's'} free ({format_size(free)}), "
            "and the capacities are a promise"
        )

    def _repack(self, new: Layout, old: Layout) -> bool:
        """Rules 2 and 9: snapshot, free the chunks, build ``new`` (``old`` again where ``new``
        does not fit); the snapshot in memory where it fits there and in the memory tiers'
        free bytes, else on NVMe (NOTE [ Spilled snapshots ]). False (logged) when ``old`` stays."""
        self.store.pool.clear()
        spilled = None
        needed = self._snapshot_bytes()
        if needed > 0.8 * model_facts.memory_available(torch.device("cpu")) or self._beyond_capacities(needed, 0):
            if not self.registry.has_tier("nvme"):
                log.warning(
                    "tiermem model states: keeping the chunk layout in force: re-packing needs a snapshot of the "
                    "model states (%s), more than memory and the capacities allow, and there is no NVMe tier to "
                    "spill it to",
                    format_size(needed),
                )
                return False
            try:
                spilled = spill(self.registry, self.facts, self.store, self.homes, self.gradients, self.stateio)
            except StatesMemoryError as exc:
                log.warning("tiermem model states: keeping the chunk layout in force: %s", exc)
                return False
        try:
            if spilled is not None:  # its old chunks read ahead in the order the build takes them
                plan = new[1]
                spilled.expect(
                    (
                        [slot.index for slot in layout.slots],
                        layout.index >= plan.persistent_chunks and plan.state_home[layout.index] == "nvme",
                    )
                    for layout in new[0]
                )
            snapshot = spilled.as_snapshot() if spilled else self.stateio.snapshot()
            self._clear()
            return self._rebuild(new, old, snapshot)
        finally:
            if spilled is not None:
                spilled.free()

    def _plan_on_plain(
        self,
        planner: FirstStepPlanner,
        batch: tuple[tuple[Any, ...], dict[str, Any]],
        old: Layout,
        held: Mapping[str, int] | None = None,
    ) -> Layout:
        """Rule 9: the planner's layout for the model (its request in force from now on), or,
        when it fails (logged), ``old`` re-packed in the recorded order where that plans (``old``
        itself when nothing changes). ``held``: what the chunks in force hold (streamed)."""
        request = self.request
        layouts, plan, order = old
        try:
            planned = planner.plan(self.facts.model, *batch)
            self.request = planned
            new_order = list(planned.order) if planned.order is not None else (self.recorded or order)
            if sorted(new_order) != list(range(len(self.facts.params))):
                new_order = self.recorded or order
            layouts, plan = self.plan_layout(new_order, held)
            order = new_order
        except Exception as exc:  # noqa: BLE001 - the default placement carries on, as logged
            self.request = request
            retried = not isinstance(exc, TiermemError) and self._retry(planner)  # the model's own error
            log.warning(
                "tiermem model states: planning from the first step failed, %s: %s: %s",
                "the next training forward plans again"
                if retried
                else "the default placement stays (give rt.manage a plan= or sample= to choose)",
                type(exc).__name__,
                exc,
            )
            if self.recorded is not None and self.recorded != order:
                with contextlib.suppress(PlanError, StatesMemoryError):
                    layouts, plan = self.plan_layout(self.recorded, held)
                    return layouts, plan, list(self.recorded)
            return old
        return layouts, plan, order
