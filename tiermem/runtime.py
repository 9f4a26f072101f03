"""``tiermem.Runtime``: builds the tiers, the scheduler and the registry from a config.

::

    with tiermem.Runtime("tiers.toml") as rt:      # or a dict, a Config, or nothing
        handle = rt.store(tensor, "nvme")          # write-back in flight, source readable
        again = handle.tensor()                    # forwarded, or fetched on demand
        print(rt.stats())

Leaving ``with`` frees every object, stops the scheduler and removes every file the
runtime created. A forked child (DataLoader workers) never runs the parent's
cleanup (TRAPS 12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, overload

import torch

from tiermem import distributed, tracing
from tiermem.activations import ActivationCounters, ActivationOffloader
from tiermem.activations.blocks import BlockSpec, find_blocks
from tiermem.activations.managed import ManagedRequest, held_if_managed, refuse_sharded
from tiermem.config import AUTO, Config
from tiermem.errors import PlanError, RuntimeClosedError, StatesMemoryError, TierCapacityError
from tiermem.interrupts import RuntimeInterruptGuard
from tiermem.layout.activation_policy import PolicySpec
from tiermem.layout.placement import Plan, PlanRequest
from tiermem.malloc import return_freed_memory
from tiermem.registry import Handle, Registry
from tiermem.schedulers.asyncio_scheduler import AsyncioScheduler
from tiermem.schedulers.base import Priority, Scheduler
from tiermem.states import ModelStates, StatesUsageError
from tiermem.states.declarations import check_declarations, grads_stream
from tiermem.states.manager import DeclaredLoop
from tiermem.states.materialize import DEFAULT_MIN_BYTES, file_backed_init
from tiermem.states.optimizer import no_optimizer
from tiermem.states.relayout import FirstStepPlanner
from tiermem.states.sharded.manager import ShardedModelStates, is_sharded
from tiermem.stats import ActivationStatistics, ModelStateStatistics, Stats
from tiermem.tiers.base import Tier
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.fsinfo import filesystem_of
from tiermem.tiers.host import HostTier
from tiermem.tiers.rundir import RunDirectory
from tiermem.units import format_size

if TYPE_CHECKING:
    from tiermem.checkpoint.background import PendingSave
    from tiermem.planner.search import Decision

log = logging.getLogger("tiermem")

ConfigLike = Config | Mapping[str, Any] | str | os.PathLike[str] | None


def _plan_from_first_step(
    planner: Callable[[torch.nn.Module, Any], PlanRequest],
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> PlanRequest:
    """NOTE [ Model-state rules ] rule 9: the first forward's arguments are the planner's sample."""
    from tiermem.planner.profiler import Batch  # the planner only when asked

    return planner(model, Batch(args, kwargs) if kwargs else args)


def _sized(plan: Any, size: int | str) -> Any:
    """``plan=`` with ``[model_states] chunk_size`` where it names no size: a dict gains it, None
    or ``"auto"`` (the default rule) becomes ``{"chunk_size": size}``; a ``Plan``, a request or
    a file is whole already. ``size`` ``"auto"``: the plan as it is (None for ``"auto"``)."""
    if plan == AUTO:
        plan = None
    if size == AUTO:
        return plan
    if plan is None:
        return {"chunk_size": size}
    if isinstance(plan, Mapping) and plan.get("chunk_size") in (None, AUTO):
        return {**plan, "chunk_size": size}
    return plan


@contextlib.contextmanager
def _configured_size_named(plan: Any, sized: Any, size: int | str) -> Iterator[None]:
    """A chunk size refused inside that came from ``[model_states] chunk_size`` (``_sized`` put it
    into ``plan``, which named none) says so: the user looks for it in the configuration, not in
    the call."""
    try:
        yield
    except (PlanError, StatesMemoryError) as exc:
        if size != AUTO and sized is not plan:
            exc.add_note(
                f"tiermem manage: the chunk size in force, {format_size(size)}, is [model_states] chunk_size = "
                f'{size} ("auto": the planner\'s)'
            )
        raise


@contextlib.contextmanager
def _held_run_directory(parent: str) -> Iterator[Any]:
    """``rt.init()``'s run directory, its ``path`` reaching it through the descriptor it holds
    (NOTE [ Run directory rules ] rule 7): renaming entries above it while the model is built
    cannot redirect the files that back its parameters."""
    with RunDirectory.create(parent) as run:
        yield types.SimpleNamespace(path=run.held_path)


class Runtime:
    """The tiered store of one training process."""

    def __init__(self, config: ConfigLike = None) -> None:
        self.config: Config = Config.coerce(config)
        self.resolved: Config | None = None
        self._tiers: dict[str, Tier] = {}
        self._scheduler: Scheduler | None = None
        self._registry: Registry | None = None
        self._owner_pid: int | None = None
        self._activation_counters = ActivationCounters()
        self._model_states: list[ModelStates] = []
        self._interrupt_guard: RuntimeInterruptGuard | None = None
        self._pending_save: PendingSave | None = None  # rt.save(blocking=False) in progress
        self._recorder: tracing.Recorder | None = None  # rt.trace / [trace] path
        self._plan: Plan | None = None
        #: What the planner decided for the model ``rt.manage`` planned last from a ``sample=`` (the
        #: plan, its predicted step time and peak per tier, its reasons); None otherwise. The
        #: ``tiermem train`` summary and the planner benchmarks read it.
        self.decision: Decision | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Runtime:
        """Resolve the config, create the tiers and start the scheduler."""
        if self._scheduler is not None:
            return self
        from tiermem.tiers.nvme import NvmeTier  # only the runtime needs storage I/O machinery

        # NOTE [ Ranks ] in tiermem.distributed: in a multi-process job this rank's files go to
        # <path>/rank<R> under each NVMe path and its auto capacities are its share of the machine.
        ranks = distributed.detect()
        return_freed_memory()  # NOTE [ Returning freed memory ]
        resolved = self.config.resolve()
        d, h, n, s = resolved.device, resolved.host, resolved.nvme, resolved.scheduler
        tiers: dict[str, Tier] = {}
        try:
            tiers["device"] = DeviceTier(d.capacity, d.device)
            tiers["host"] = HostTier(h.capacity, pinned=h.pinned)
            tiers["nvme"] = NvmeTier(
                n.paths,
                n.capacity,
                backend=n.backend,
                block_size=n.block_size,
                queue_depth=n.queue_depth,
                checksum=n.checksum,
                direct=n.direct,
                subdirectory=ranks.subdirectory,
            )
            overrides = {
                name: section.max_inflight
                for name, section in (("device", d), ("host", h), ("nvme", n))
                if section.max_inflight is not None
            }
            self._scheduler = AsyncioScheduler(
                max_inflight=s.max_inflight,
                tier_max_inflight=overrides,
                block_size=n.block_size,
                loop=s.loop,
            )
        except BaseException:
            for tier in tiers.values():
                tier.close()
            raise
        self._tiers = tiers
        self._registry = Registry(tiers, self._scheduler)
        self.resolved = ranks.for_rank(resolved)  # rt.init() and the planner see this rank's paths
        self._owner_pid = os.getpid()
        # Ctrl-C inside the runtime's hooks, waits and finalizers is held until they are
        # done (TRAPS 18, 25); elsewhere it interrupts at once, as without tiermem.
        self._interrupt_guard = RuntimeInterruptGuard()
        self._interrupt_guard.install()
        log.info("tiermem runtime started: %s", {name: t.describe() for name, t in tiers.items()})
        if resolved.trace.path and tracing.RECORDER is not None:  # one recording at a time, the first one's
            log.warning("tiermem trace: %s is being recorded; this runtime records nothing", tracing.RECORDER.path)
        elif resolved.trace.path:  # [trace] path or TIERMEM_TRACE: the whole run, until close()
            suffix = f".rank{ranks.rank}" if ranks.multi_process else ""
            self.start_trace(resolved.trace.path + suffix)
        return self

    def close(self) -> None:
        """Free every object, stop the scheduler, remove the runtime's files. Idempotent."""
        if self._scheduler is None:
            return
        if os.getpid() != self._owner_pid:
            # A forked child shares the parent's files and locks; it must not clean up.
            self._scheduler = None
            return
        save_error = self._finish_save(raising=False)  # an async save commits before the tiers close
        try:
            states, self._model_states = self._model_states, []
            spill_to = self.resolved.nvme.paths[0] if self.resolved is not None and self.resolved.nvme.paths else None
            for managed in states:
                # managed parameters back into ordinary tensors (never raises); file-backed under the
                # first NVMe path when they exceed the memory tiers' capacities
                managed.close(spill_to)
            if self._registry is not None:
                self._registry.free_all()
            # the last moves' ends and the loop's shutdown: a wait of the training thread, traced
            with tracing.traced("close runtime", "phase"), tracing.traced("wait scheduler close", "wait"):
                self._scheduler.close()
        finally:
            try:
                self.stop_trace()  # every move has ended: the trace's bytes are the links'
                for tier in self._tiers.values():
                    tier.close()
            finally:
                self._scheduler = None
                guard, self._interrupt_guard = self._interrupt_guard, None
                if guard is not None:
                    guard.uninstall()  # a Ctrl-C held until now is raised here, the files gone
        if save_error is not None:
            raise save_error

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None and (error := self._finish_save(raising=False)) is not None:
            log.error("tiermem checkpoint: the pending save failed (the block's error goes on): %s", error)
        self.close()

    @property
    def running(self) -> bool:
        return self._scheduler is not None

    # -- the timeline trace (NOTE [ Timeline trace ] in tiermem.tracing) ------------------------
    def trace(
        self, path: str | os.PathLike[str], *, max_size: int | None = None
    ) -> contextlib.AbstractContextManager[tracing.Recorder]:
        """Record a timeline of the ``with`` block to ``path`` (Chrome trace JSON: Perfetto,
        chrome://tracing, ``tiermem trace summary|plot``): the training and step threads' phases,
        every move over every link, every wait, and each tier's bytes in use."""
        return self._tracing(path, max_size)

    @contextlib.contextmanager
    def _tracing(self, path: str | os.PathLike[str], max_size: int | None) -> Iterator[tracing.Recorder]:
        recorder = self.start_trace(path, max_size=max_size)
        try:
            yield recorder
        finally:
            if self._recorder is recorder:
                self.stop_trace()

    def start_trace(self, path: str | os.PathLike[str], *, max_size: int | None = None) -> tracing.Recorder:
        """Start recording to ``path`` (``max_size``: bytes of file after which events are dropped,
        default ``[trace] max_size``); :meth:`stop_trace` ends it, as does leaving ``with rt``."""
        scheduler = self.scheduler  # raises a clear error outside `with rt`
        settings = (self.resolved or self.config).trace
        recorder = tracing.Recorder(path, max_bytes=settings.max_size if max_size is None else max_size)
        # Read before the recording starts (and after it stopped, below): asking the scheduler is
        # a wait of this thread's, which belongs to no phase of the run the trace shows.
        links = {k: v.as_dict() for k, v in scheduler.statistics().links.items()}
        recorder.start()
        recorder.info["links_at_start"] = links
        self._recorder = recorder
        return recorder

    def stop_trace(self) -> str | None:
        """Stop the trace in progress and close its file; its path, or None when none was on."""
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return None
        try:
            recorder.detach()
            if self._scheduler is not None:
                links = self._scheduler.statistics().links
                recorder.info["links_at_stop"] = {k: v.as_dict() for k, v in links.items()}
        finally:
            recorder.stop()
        return recorder.path

    # -- objects ----------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, tier: str = "device") -> Handle:
        """Manage ``tensor`` in ``tier`` (adopted without a copy when it already lives on
        that tier's device; deduplicated by storage and version)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"tiermem register/store: expected a torch.Tensor, got {type(tensor).__name__}; "
                "make it a tensor first (torch.as_tensor(...))"
            )
        return self.registry.register(tensor, tier)

    def store(self, tensor: torch.Tensor, tier: str = "nvme", priority: Priority = Priority.WRITEBACK) -> Handle:
        """Register ``tensor`` on the device and start moving it to ``tier``.

        Returns at once; the tensor stays readable (forwarded) until the move lands.
        ``handle.wait()`` waits for it, ``handle.tensor()`` reads it back.
        """
        handle = self.register(tensor, "device")
        try:
            handle.move_to(tier, priority)
        except BaseException:
            handle.free()
            raise
        return handle

    def offload_activations(
        self,
        model: torch.nn.Module,
        policy: PolicySpec = None,
        blocks: BlockSpec = None,
    ) -> contextlib.AbstractContextManager[ActivationOffloader]:
        """Context manager around forward and backward: the saved activations of ``model``'s
        blocks are kept, recomputed, or offloaded to host or NVMe.

        ``policy``: ``auto | keep | recompute | host | nvme`` or a mapping from block (index
        or qualified name) to one of the last four; default ``[activations] policy``.
        ``blocks``: module types, qualified names or the model's own modules (one alone, or a list; an
        ``nn.ModuleList`` gives its layers); default the model's repeated layers.

        On a model whose activations ``rt.manage`` applies, it holds the model for its body
        (NOTE [ Managed activations ] rule 5).
        """
        settings = (self.resolved or self.config).activations
        self.registry  # noqa: B018  (raises a clear error outside `with rt`)
        if (settings.policy if policy is None else policy) == "auto":
            # A planned model's per-block policy is what "auto" means for it.
            for states in self._model_states:
                planned = states.plan.block_policy
                if states.model is model and planned is not None and len(planned) == len(find_blocks(model, blocks)):
                    policy = dict(enumerate(planned))
        offloader = ActivationOffloader(
            self.registry,
            model,
            self._activation_counters,
            policy=policy,
            default_policy=settings.policy,
            blocks=blocks,
            min_bytes=settings.min_bytes,
        )
        return held_if_managed(offloader, blocks is None, settings.policy)

    def init(self, min_bytes: int | None = None) -> contextlib.AbstractContextManager[Any]:
        """Build a model inside ``with rt.init():`` and its large parameters live on file-backed
        pages on the first NVMe path until ``rt.manage`` packs them into chunks, so a model
        larger than RAM can be built; values are bitwise a plain construction's (NOTE
        [ Materialising under rt.init() ] in ``tiermem.states.materialize``)."""
        self.registry  # noqa: B018  (raises a clear error outside `with rt`)
        assert self.resolved is not None
        paths = self.resolved.nvme.paths
        return file_backed_init(
            paths[0],
            DEFAULT_MIN_BYTES if min_bytes is None else min_bytes,
            run_directory=_held_run_directory,
            is_tmpfs=lambda path: filesystem_of(path).fstype == "tmpfs",
        )

    @overload
    def manage(
        self,
        model: torch.nn.Module,
        optimizer: None = None,
        plan: Any = "auto",
        *,
        sample: Any = None,
        grad_accumulation_steps: int | None = None,
        clip_grad_norm: float | None = None,
        keep_gradients: bool = True,
        param_dtype: torch.dtype | None = None,
        activations: Any = "auto",
    ) -> torch.nn.Module: ...

    @overload
    def manage(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        plan: Any = "auto",
        *,
        sample: Any = None,
        grad_accumulation_steps: int | None = None,
        clip_grad_norm: float | None = None,
        keep_gradients: bool = True,
        param_dtype: torch.dtype | None = None,
        activations: Any = "auto",
        **optimizer_kwargs: Any,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]: ...

    def manage(
        self,
        model: torch.nn.Module,
        optimizer: Any = None,
        plan: Any = "auto",
        *,
        sample: Any = None,
        grad_accumulation_steps: int | None = None,
        clip_grad_norm: float | None = None,
        keep_gradients: bool = True,
        param_dtype: torch.dtype | None = None,
        activations: Any = "auto",
        **optimizer_kwargs: Any,
    ) -> torch.nn.Module | tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Put ``model``'s parameters, gradients and optimizer states into chunks across the tiers,
        and apply an activation policy to its forwards with grad from now on.

        Without ``optimizer`` (a distillation teacher, the reference policy of DPO, evaluation of
        a model larger than the device), every parameter is frozen (``requires_grad_(False)``):
        the weights stream through the device for forward (and backward into the inputs) and
        nothing else is kept for them; returns the model alone, placed by the default rule
        (NOTE [ Default placement rule ]) or ``plan``. Parameters with ``requires_grad=False``
        of a trained model (a LoRA base) are kept the same way.

        ``optimizer``: a constructed per-parameter optimizer over the model's parameters (any
        per-parameter ``torch.optim`` one, transformers' Adafactor, or a class declaring
        ``tiermem_per_parameter = True``; param groups and hyper-parameters kept), or such a class
        plus keyword arguments (NOTE [ Exact optimizer step ]). ``plan``: ``"auto"`` (or None) asks the
        planner, or a hand-written placement (dict, ``Plan`` or JSON path saved by ``rt.plan.save``,
        ``tiermem.layout.placement``).
        Returns the same model and the optimizer to use from now on; ``rt.plan`` is the plan in force.

        ``sample``: what the planner profiles (NOTE [ Profiling step ] in
        ``tiermem.planner.profiler``): the model's positional arguments for one training batch
        (a tuple), or a callable ``sample(model) -> loss``; RNG, buffers and ``.grad`` are left
        as they were, and the profile is cached. The plan carries a per-block activation policy
        and its predictions (``rt.plan.predicted``). Without a sample, the first step runs under
        the default placement rule and the first ``optimizer.step()`` plans from that step's
        forward and re-packs the chunks (NOTE [ Model-state rules ] rule 9), exactly alike; where
        the model's last profiled batch has its profile cached, the plan is made from it at once
        and the first step re-plans only for a batch of other shapes (NOTE [ Profile cache ] rule 6).
        ``plan={"block_policy": "nvme"}`` (or one policy per block) plans around that policy.

        ``activations`` (NOTE [ Managed activations ] in ``tiermem.activations.managed``): ``"auto"``
        (the plan's per-block policy, else ``[activations] policy``), a policy name or per-block
        mapping planned around, or None (``rt.offload_activations`` only).

        ``grad_accumulation_steps`` / ``clip_grad_norm`` (max L2 norm) declare the loop: step
        and zero_grad after every N-th backward, gradients clipped by the runtime and not
        edited by hand; the optimizer step of offloaded chunks then overlaps the last backward
        of each window (NOTE [ Declared steps ] in ``tiermem.states.stepping``).
        ``keep_gradients=False`` (declared loops): ``.grad`` of offloaded chunks is None after their step.
        ``param_dtype`` (``torch.bfloat16``/``torch.float16``): working copies in that dtype on
        the device, fp32 masters stepped with the optimizer states (exactly), restored at the end.
        """
        if optimizer is None:
            return self._manage_frozen(
                model,
                plan,
                sample=sample,
                declared=(grad_accumulation_steps, clip_grad_norm, keep_gradients, optimizer_kwargs),
                param_dtype=param_dtype,
                activations=activations,
            )
        if is_sharded(model):  # FSDP2: NOTE [ Sharded model states ] in tiermem.states.sharded.manager
            refuse_sharded(activations)
            return self._manage_sharded(
                model,
                optimizer,
                plan,
                sample,
                optimizer_kwargs,
                grad_accumulation_steps=grad_accumulation_steps,
                clip_grad_norm=clip_grad_norm,
                keep_gradients=keep_gradients,
                param_dtype=param_dtype,
            )
        # plan={"block_policy": ...} or activations=<policy>: the planner plans around that policy.
        fixed = plan["block_policy"] if isinstance(plan, Mapping) and set(plan) == {"block_policy"} else None
        planned = plan is None or plan == "auto" or fixed is not None
        # [model_states] chunk_size: the one size the default rule and the planner use, unless plan= names one
        size = (self.resolved or self.config).model_states.chunk_size
        sizes = None if size == AUTO else (size,)
        sized = _sized(plan, size)
        named = _configured_size_named(plan, sized, size)
        plan = sized if isinstance(plan, Mapping) else plan
        default = _sized(None, size)  # the first step's placement, until the planner's
        settings = (self.resolved or self.config).activations
        managed_activations = ManagedRequest(model, activations, settings, fixed, planned=planned)
        fixed = fixed if fixed is not None or not planned else managed_activations.fixed
        accumulation, max_norm = check_declarations(grad_accumulation_steps, clip_grad_norm)
        streams = grads_stream(accumulation, max_norm, keep_gradients)
        planner = functools.partial(self._plan_request, optimizer, optimizer_kwargs, fixed, streams, sizes)
        build = functools.partial(
            ModelStates,
            self.registry,
            model,
            optimizer,
            optimizer_kwargs=optimizer_kwargs,
            plan_owner=self,
            grad_accumulation_steps=grad_accumulation_steps,
            clip_grad_norm=clip_grad_norm,
            keep_gradients=keep_gradients,
            param_dtype=param_dtype,
            step_thread=(self.resolved or self.config).model_states.step_thread,
            speculative_steps=(self.resolved or self.config).model_states.speculative_steps,
            recomputed=managed_activations.recomputable,
        )
        with named:
            if planned and sample is not None:
                # pack in execution order now, no re-pack at the first step
                states = build(plan=planner(model, sample), first_step_planner=None)
            elif planned:  # the default rule carries the first step; the planner keeps a fixed policy
                from tiermem.planner.auto import last_plan_request  # the planner only when asked

                assert self.resolved is not None  # set whenever registry is reachable
                first_step = FirstStepPlanner(functools.partial(_plan_from_first_step, planner))
                last_plan = functools.partial(
                    last_plan_request,
                    self.registry,
                    self.resolved,
                    model,
                    optimizer,
                    optimizer_kwargs,
                    fixed,
                    streams,
                    sizes,
                )
                states = self._build_from_last_profile(build, first_step, last_plan, default)
            else:
                states = build(plan=plan, first_step_planner=None)
        self._model_states.append(states)
        managed_activations.apply(states, self._activation_counters)  # NOTE [ Managed activations ]
        return model, states.optimizer

    def manages(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is one this Runtime manages (``rt.manage`` returned it)."""
        return any(states.model is model for states in self._model_states)

    def declare(
        self,
        model: torch.nn.Module,
        *,
        grad_accumulation_steps: int | None = None,
        clip_grad_norm: float | None = None,
        keep_gradients: bool = True,
    ) -> DeclaredLoop:
        """Declare (or re-declare) the training loop of a model ``rt.manage`` manages, as
        ``rt.manage(..., grad_accumulation_steps=, clip_grad_norm=, keep_gradients=)`` would have:
        for a loop known only after ``rt.manage`` ran (a Trainer's, an Accelerator's: the
        integrations in ``tiermem.integrations.hf`` call it). In force from now on, between
        forward and backward passes; refused while chunks stepped early in this window under the
        old declaration. Where whether gradients stream changes (``keep_gradients=False`` with one
        backward per step and no clipping), the placement depends on it: the layout is chosen
        again and the chunks re-packed now, where no parameter holds a gradient. All
        ``None`` makes the loop undeclared. Returns the :class:`~tiermem.states.manager.DeclaredLoop`,
        whose ``clip_grad_norm_()`` runs the declared clip at the loop's own clip call (NOTE
        [ Declared steps ] rule 10 in ``tiermem.states.stepping``)."""
        self.registry  # noqa: B018  (raises a clear error outside `with rt`)
        found = [states for states in self._model_states if states.model is model]
        if not found or not isinstance(found[0], ModelStates):
            what = "an FSDP2-sharded model (declare its loop at rt.manage)" if found else "not managed by this Runtime"
            raise StatesUsageError(
                f"tiermem declare: this {type(model).__name__} is {what}; give the model rt.manage returned"
            )
        return found[0].declare(grad_accumulation_steps, clip_grad_norm, keep_gradients)

    def _manage_frozen(
        self,
        model: torch.nn.Module,
        plan: Any,
        *,
        sample: Any,
        declared: tuple[Any, Any, bool, Mapping[str, Any]],
        param_dtype: torch.dtype | None,
        activations: Any,
    ) -> torch.nn.Module:
        """``manage`` without an optimizer: every parameter frozen and streamed as a LoRA base is
        (NOTE [ Default placement rule ] rule 1), under the default rule or ``plan``."""
        accumulation, max_norm, keep_gradients, kwargs = declared
        asked = [
            name
            for name, given in (
                ("sample=", sample is not None),
                ("grad_accumulation_steps=", accumulation is not None),
                ("clip_grad_norm=", max_norm is not None),
                ("keep_gradients=False", not keep_gradients),
                (", ".join(f"{k}=" for k in kwargs), bool(kwargs)),
            )
            if given
        ]
        if asked:
            raise StatesUsageError(
                f"tiermem manage: {', '.join(asked)} given without an optimizer. A model managed without one is "
                "frozen (nothing trains, so there is no step to declare or profile) and placed by the default rule; "
                "leave these out, or give the optimizer that trains the model"
            )
        if is_sharded(model):
            raise StatesUsageError(
                "tiermem manage: an FSDP2-sharded model without an optimizer: tiermem keeps only the optimizer "
                "states of sharded models (FSDP2 owns the parameters), so there is nothing to manage; use the "
                "sharded model as it is"
            )
        settings = (self.resolved or self.config).activations
        managed_activations = ManagedRequest(model, activations, settings, None, planned=False)
        wanted = [(p, p.requires_grad) for p in model.parameters()]
        for p, _ in wanted:
            p.requires_grad_(False)
        size = (self.resolved or self.config).model_states.chunk_size  # [model_states] chunk_size, as in manage()
        sized = _sized(plan, size)
        try:
            with _configured_size_named(plan, sized, size):
                states = ModelStates(
                    self.registry,
                    model,
                    no_optimizer(),
                    plan=sized,
                    plan_owner=self,
                    param_dtype=param_dtype,
                    step_thread=(self.resolved or self.config).model_states.step_thread,
                    recomputed=managed_activations.recomputable,
                )
        except BaseException:
            for p, requires_grad in wanted:  # refused: the model is as it was
                p.requires_grad_(requires_grad)
            raise
        self._model_states.append(states)
        managed_activations.apply(states, self._activation_counters)  # NOTE [ Managed activations ]
        return model

    def _manage_sharded(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        plan: Any,
        sample: Any,
        optimizer_kwargs: Mapping[str, Any],
        *,
        grad_accumulation_steps: int | None,
        clip_grad_norm: float | None,
        keep_gradients: bool,
        param_dtype: torch.dtype | None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """``manage`` of a model whose parameters FSDP2's ``fully_shard`` made DTensors: each
        rank's optimizer states in chunks, the parameters left to FSDP2 (NOTE [ Sharded model
        states ]). Collective: every rank calls it for the same model."""
        assert self.resolved is not None  # set whenever registry is reachable
        if sample is not None:
            raise StatesUsageError(
                "tiermem manage: sample= (profiling a step to plan) is not yet for FSDP2-sharded models; leave it "
                "out: their optimizer states are placed from each rank's free bytes"
            )
        # Every rank's configuration must give the same size: the packing digests differ otherwise,
        # and every rank raises (as when one rank refuses its size: NOTE [ Sharded model states ] rule 3).
        size = self.resolved.model_states.chunk_size
        sized = _sized(plan, size)
        with _configured_size_named(plan, sized, size):
            sharded = ShardedModelStates(
                self.registry,
                model,
                optimizer,
                plan=sized,
                optimizer_kwargs=optimizer_kwargs,
                keep_gradients=keep_gradients,
                param_dtype=param_dtype,
                grad_accumulation_steps=grad_accumulation_steps,
                clip_grad_norm=clip_grad_norm,
                host_adopts_pageable=not self.resolved.host.pinned,
            )
        self._model_states.append(sharded)  # type: ignore[arg-type]  # what Runtime uses of a ModelStates
        self.plan = sharded.plan
        return model, sharded.optimizer

    def _build_from_last_profile(
        self,
        build: Callable[..., ModelStates],
        first_step: FirstStepPlanner,
        last_plan: Callable[[], Any],
        default: Mapping[str, Any] | None,
    ) -> ModelStates:
        """NOTE [ Profile cache ] rule 6: the model states built under ``last_plan()``'s plan (from
        the cached profile of the model's last profiled batch), the first step planning only for a
        batch of other shapes; else (none, or its plan does not build now: logged) under the
        default rule, the first step planning."""
        with tracing.traced("cached plan", "profile"):  # NOTE [ Timeline trace ]
            found = last_plan()
        if found is not None:
            request, decision, planned_for = found
            covered = dataclasses.replace(first_step, planned_for=planned_for)
            try:
                states = build(plan=request, first_step_planner=covered)
            except (PlanError, StatesMemoryError, TierCapacityError) as exc:  # the tiers changed since
                log.warning("tiermem manage: the cached profile's plan does not build now (%s); step 1 plans", exc)
            else:
                self.decision = decision
                return states
        return build(plan=default, first_step_planner=first_step)

    def _plan_request(
        self,
        optimizer: Any,
        optimizer_kwargs: Mapping[str, Any],
        block_policy: Any,
        streams: bool,
        chunk_sizes: tuple[int, ...] | None,
        model: torch.nn.Module,
        sample: Any,
    ) -> PlanRequest:
        """Profile ``model`` on ``sample`` (or its cached profile) and search: the plan to build
        (``chunk_sizes``: the sizes it may choose from, None: any)."""
        assert self.resolved is not None  # set whenever registry is reachable
        from tiermem.planner.auto import plan_request  # the planner only when asked

        with tracing.traced("profile and plan", "profile"):  # NOTE [ Timeline trace ]
            request, decision = plan_request(
                self.registry,
                self.resolved,
                model,
                optimizer,
                optimizer_kwargs,
                sample,
                block_policy=block_policy,
                grads_stream=streams,
                chunk_sizes=chunk_sizes,
            )
        self.decision = decision
        return request

    # -- checkpoints (NOTE [ Checkpoint rules ] in tiermem.checkpoint) -------------------------
    def save(
        self, path: str | os.PathLike[str], *, extra: Any = None, format: str | None = None, blocking: bool = True
    ) -> PendingSave | None:
        """Save every model and optimizer this runtime manages, the RNG states, the declared
        loop's position and ``extra`` (picklable: an LR scheduler's state_dict, the data position)
        as a DCP checkpoint at ``path``, streamed from the tier that holds each chunk; written
        beside ``path`` and committed atomically, so a crash keeps the previous one. ``format``:
        ``"dcp"`` (DCP's filesystem format) or ``"zarr"`` (a zarr v3 array per tensor, through
        tensorstore); None is ``tiermem.checkpoint.DEFAULT_FORMAT``. ``rt.load`` reads either.

        ``blocking=False`` returns a ``PendingSave`` (``wait()``, ``done()``) at once; training goes on
        while the states of this call are written (NOTE [ Asynchronous saves ]). With FSDP2-sharded
        models it is collective: every rank calls it, each writes its own shards into one DCP
        checkpoint on a filesystem every rank sees (NOTE [ Checkpoints on ranks ]; blocking only)."""
        from tiermem import checkpoint  # DCP only when asked
        from tiermem.checkpoint import background

        registry = self.registry  # raises a clear error outside `with rt`
        self._finish_save()
        if blocking:
            checkpoint.save(self._model_states, path, extra=extra, format=format)
            return None
        self._pending_save = background.start(self._model_states, registry, path, extra=extra, format=format)
        return self._pending_save

    def _finish_save(self, *, raising: bool = True) -> BaseException | None:
        """Wait for a pending asynchronous save: its error nobody was told of, raised or returned."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.finish(raising=raising)

    def load(self, path: str | os.PathLike[str]) -> Any:
        """Load a checkpoint ``rt.save`` wrote (or a plain DCP one) into the models managed so far
        (``rt.manage`` of the same architecture, in the same order); returns its ``extra``.
        Collective on ranks for FSDP2-sharded models, across world sizes (DCP reshards)."""
        from tiermem import checkpoint

        self.registry  # noqa: B018
        self._finish_save()
        return checkpoint.load(self._model_states, path)

    # -- introspection ----------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan in force for the model ``rt.manage`` managed last (None before); with
        ``sample=`` given, the planner's, with its predictions (``rt.plan.as_dict()``)."""
        return self._plan

    @plan.setter
    def plan(self, value: Plan | None) -> None:
        self._plan = value  # the manager keeps it current (re-packs included)

    @property
    def registry(self) -> Registry:
        if self._registry is None or self._scheduler is None:
            raise RuntimeClosedError("this tiermem Runtime")
        return self._registry

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeClosedError("this tiermem Runtime")
        return self._scheduler

    @property
    def tiers(self) -> Mapping[str, Tier]:
        if self._scheduler is None:
            raise RuntimeClosedError("this tiermem Runtime")
        return dict(self._tiers)

    def stats(self) -> Stats:
        """A snapshot of every tier, link and counter (see ``Stats.as_dict``)."""
        registry = self.registry
        c = self._activation_counters
        with c.lock:
            activations = ActivationStatistics(
                peak_resident_bytes=registry.peak_resident_bytes("activation", "device"),
                resident_bytes=registry.resident_bytes("activation", "device"),
                captured_bytes=c.captured_bytes,
                backward_wait_s=c.backward_wait_s,
                bytes_written=dict(c.offloaded_bytes),
                bytes_read=dict(c.fetched_bytes),
                dedup_hits=c.dedup_hits,
                forwarded=c.forwarded,
                cancelled=c.cancelled,
                prefetch_released=c.prefetch_released,
                fallbacks=c.fallbacks,
                fallback_reasons=dict(c.fallback_reasons),
            )
        tiers = ("device", "host", "nvme")
        managed = [states.describe() for states in self._model_states]
        model_states = ModelStateStatistics(
            models=len(managed),
            chunks=sum(len(d["chunks"]) for d in managed),
            persistent_chunks=sum(d["plan"]["persistent_chunks"] for d in managed),
            resident_bytes={tier: registry.resident_bytes("chunk", tier) for tier in tiers},
            peak_resident_bytes={tier: registry.peak_resident_bytes("chunk", tier) for tier in tiers},
            chunk_steps=sum(d["chunk_steps"] for d in managed),
            early_chunk_steps=sum(d["early_chunk_steps"] for d in managed),
            speculative_steps_kept=sum(d.get("speculative_steps_kept", 0) for d in managed),
            speculative_steps_discarded=sum(d.get("speculative_steps_discarded", 0) for d in managed),
            speculative_homes_read_ahead=sum(d.get("speculative_homes_read_ahead", 0) for d in managed),
            speculative_homes_read_on_demand=sum(d.get("speculative_homes_read_on_demand", 0) for d in managed),
            speculative_nvme_reclaims=sum(d.get("speculative_nvme_reclaims", 0) for d in managed),
            tied_homes_read_ahead=sum(d.get("tied_homes_read_ahead", 0) for d in managed),
            stored_gradients_read_back=sum(d.get("stored_gradients_read_back", 0) for d in managed),
            stored_gradients_staged_on_the_way=sum(d.get("stored_gradients_staged_on_the_way", 0) for d in managed),
        )
        return Stats(
            tiers={name: tier.statistics() for name, tier in self.tiers.items()},
            scheduler=self.scheduler.statistics(),
            registry=registry.statistics(),
            activations=activations,
            model_states=model_states,
        )
