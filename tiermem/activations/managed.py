"""``rt.manage`` applies a model's activation policy itself: the offloader's capture around every
forward with grad of the managed model, with no context for the caller to open.

# NOTE [ Managed activations ]
1. Scope: the offloader's saved-tensor hooks are pushed in the root module's forward pre-hook
   and popped in its forward post-hook (``always_call=True``), on the same thread: both run in
   the same ``Module.__call__`` frame, so the push and the pop nest with every context the
   forward opens and closes itself (a non-reentrant ``torch.utils.checkpoint`` pushes its own
   hooks inside ours and pops them before the forward returns). Never at the end of backward:
   ``saved_tensors_hooks`` is a thread-local stack, and autograd runs hooks and final callbacks
   under the thread-local state it captured when backward began and puts the caller's back
   afterwards, so a pop there is undone and the hooks stay pushed on the caller's thread
   (TRAPS 33). Backward needs nothing pushed: autograd keeps each saved tensor's unpack hook
   with the tensor. The post-hook pops only when our hooks are on top of the stack; anything
   else means something inside the forward pushed without popping, and it raises.
2. Which forwards: grad enabled, not inside a backward (a reentrant checkpoint recomputing),
   saved-tensor hooks not disabled (``torch.autograd.graph.disable_saved_tensors_hooks``), no
   ``rt.offload_activations`` context holding the model (rule 5), and no saved-tensor hooks
   pushed already around the call (the caller's own, ``torch.autograd.graph.save_on_cpu``, a
   checkpoint of the whole model, the planner's profiling step): whoever pushed them decides
   what is saved, never two sets of hooks. One capture at a time: a
   call of the root inside its own forward is counted, not pushed again, and a forward on
   another thread while one captures runs uncaptured. ``model.eval()`` with ``torch.no_grad()``
   (evaluation, ``generate``) is never captured.
3. What: the tensors autograd saves inside the root's forward, as the planner's profile of a
   sample counts them (NOTE [ Profiling step ] rule 1): a model that computes its loss in
   forward (Hugging Face models given ``labels``) has the loss's saved tensors captured; a loss
   the caller computes from the outputs is the caller's, as in plain PyTorch. To capture it
   too, wrap forward, loss and backward in ``rt.offload_activations(model)`` (rule 5).
4. The step: the block hooks and recompute wrappers are installed for the forward only (a
   recomputation in backward calls the block forward ``torch.utils.checkpoint`` captured, never
   them); what spans forward and backward, the prefetch window's learning and the write-back
   failures to act on (``ActivationOffloader.finish``), ends at the end of backward, in an
   autograd final callback queued at the first unpack of a backward (Python state only,
   nothing thread-local), or else at the next forward, ``optimizer.step()``/``zero_grad()``,
   or when management ends.
5. ``rt.offload_activations(model)`` on a model whose activations ``rt.manage`` applies holds
   the model for its body: the root hooks step aside and the context applies the managed
   offloader (no policy, or the one in force) or one of its own (another policy, or
   ``blocks=``) around everything inside it, then hands the model back. One set of hooks at a
   time, never two; the choice is logged at debug level. Opening it inside the model's own
   forward raises.
6. Exceptions: torch runs ``always_call`` hooks when the forward raises an ``Exception``, so
   the hooks are popped and the block hooks removed. A ``BaseException`` (``KeyboardInterrupt``)
   bypasses them: the capture stays open until the next ``optimizer.step()``/``zero_grad()`` or
   the end of management closes it (popping only our own hooks, on the thread that pushed them).
7. Policy: ``"auto"`` resolves at each forward's start from the plan in force (a first-step
   plan takes over from the configuration's policy from the forward it is made at the start
   of, or, made at an ``optimizer.step()``, from the next forward on); a fixed one never
   changes. A new policy gets a new offloader; what the old one
   learned is the model's (NOTE [ Activation offload rules ] rule 8).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tiermem.activations.blocks import find_blocks
from tiermem.activations.counters import ActivationCounters
from tiermem.activations.offloader import ActivationOffloader
from tiermem.activations.saved import in_backward
from tiermem.layout.activation_policy import PolicySpec, resolve_policies

log = logging.getLogger("tiermem.activations")


class ActivationPolicyError(ValueError):
    """``rt.manage``'s ``activations=`` cannot be applied as given."""


class ManagedRequest:
    """``rt.manage``'s ``activations=``, checked against the model and a plan's fixed ``block_policy``
    before anything is built. ``fixed``: the activation policy the planner plans around (the plan's,
    or the one ``activations`` fixes: a name, or one per block); ``count``: the blocks it applies to
    (0: none); ``planned``: the plan in force is the planner's (not a hand plan), so under ``"auto"``
    its block policy is tiermem's choice, which fallbacks may change (NOTE [ Activation fallbacks ]
    rule 2)."""

    def __init__(
        self, model: nn.Module, activations: Any, settings: Any, plan_fixed: Any, planned: bool = True
    ) -> None:
        self.activations = activations
        self.settings = settings
        self.count, self.fixed = 0, plan_fixed
        #: the blocks whose chunks the model states keep room for together (set below)
        self.recomputable: list[nn.Module] = []
        self.chosen = activations == "auto" and plan_fixed is None and planned
        if activations is None:
            return
        if not isinstance(activations, str | Mapping):
            raise ActivationPolicyError(
                "tiermem manage: activations= takes 'auto', a policy name (keep, recompute, host, nvme), a mapping "
                f"from block (index or qualified name) to one, or None; got {activations!r}"
            )
        try:
            found = find_blocks(model)
            names = [name for name, _ in found]
            policies, _ = resolve_policies(activations, names, settings.policy)
        except ValueError as exc:
            if activations == "auto":  # a model without repeated blocks: nothing to apply
                log.debug("tiermem manage: no activation policy applied: %s", exc)
                return
            raise ActivationPolicyError(f"tiermem manage: activations={activations!r}: {exc}") from None
        self.count = len(names)
        # The blocks whose forward may run again in backward: every one but those a user keeps
        # (a chosen or an offloading policy may fall back to recompute, the last block of a plain
        # offloading one included: NOTE [ Activation fallbacks ] rules 2 and 4); the model states
        # keep room for each one's chunks together.
        everywhere = isinstance(activations, str) and activations != "keep"
        self.recomputable = [
            block for (_, block), policy in zip(found, policies, strict=True) if everywhere or policy.value != "keep"
        ]
        if activations == "auto":
            return
        fixed = activations if isinstance(activations, str) else [p.value for p in policies]
        if plan_fixed is not None and plan_fixed != fixed:
            raise ActivationPolicyError(
                f"tiermem manage: the plan's block_policy {plan_fixed!r} and activations={activations!r} fix two "
                "activation policies; give one of them"
            )
        self.fixed = fixed

    def apply(self, states: Any, counters: ActivationCounters) -> None:
        """Apply the policy to the model ``states`` (a ``ModelStates``) manages, from its next forward."""
        if not self.count:
            return
        model, registry, settings = states.model, states.registry, self.settings

        def make(policy: PolicySpec) -> ActivationOffloader:
            return ActivationOffloader(
                registry,
                model,
                counters,
                policy=policy,
                default_policy=settings.policy,
                min_bytes=settings.min_bytes,
                chosen=self.chosen,
            )

        planned = policy_in_force(self.activations, lambda: states.plan.block_policy, self.count)
        states.apply_activations(ManagedActivations(model, make, planned))


def policy_in_force(
    activations: Any, planned: Callable[[], Sequence[str] | None], count: int
) -> Callable[[], PolicySpec]:
    """Rule 7: ``activations`` itself when fixed; under ``"auto"`` the plan's per-block policy in
    force (``planned()``), else None (the configuration's)."""

    def policy() -> PolicySpec:
        if activations != "auto":
            return activations  # type: ignore[no-any-return]
        blocks = planned()
        return dict(enumerate(blocks)) if blocks is not None and len(blocks) == count else None

    return policy


#: The models whose activations rt.manage applies now (NOTE [ Managed activations ] rule 5).
_APPLIED: weakref.WeakKeyDictionary[nn.Module, ManagedActivations] = weakref.WeakKeyDictionary()


def held_if_managed(offloader: ActivationOffloader, default_blocks: bool, default: str) -> Any:
    """What ``rt.offload_activations`` returns: ``offloader``, or on a model whose activations
    ``rt.manage`` applies, the context that holds the model (rule 5)."""
    managed = _APPLIED.get(offloader.model)
    return offloader if managed is None else managed.held(offloader, default_blocks, default)


def refuse_sharded(activations: Any) -> None:
    """FSDP2-sharded models: rt.manage applies no activation policy yet (``"auto"`` applies none)."""
    if activations not in ("auto", None):
        raise ActivationPolicyError(
            f"tiermem manage: activations={activations!r} is not yet for FSDP2-sharded models; leave it out and wrap "
            "forward and backward in rt.offload_activations(model, policy=...)"
        )


class ActivationCaptureError(RuntimeError):
    """The saved-tensor hook stack is not as ``rt.manage``'s capture left it (NOTE [ Managed activations ])."""


class ManagedActivations:
    """Applies ``policy()`` to every captured forward of ``model`` (NOTE [ Managed activations ]).

    ``make(policy)`` builds an offloader for a policy; ``policy()`` is the policy in force now."""

    def __init__(
        self, model: nn.Module, make: Callable[[PolicySpec], ActivationOffloader], policy: Callable[[], PolicySpec]
    ) -> None:
        self.model = model
        self._make = make
        self._policy = policy
        self._offloader: ActivationOffloader | None = None
        self._spec: PolicySpec = None
        self._hooks: list[RemovableHandle] = []
        #: rule 1: the forward that captures now (its thread, root calls deep, its offloader)
        self._thread: int | None = None
        self._depth = 0
        self._capturing: ActivationOffloader | None = None
        #: rule 4: the offloader whose step (forward to end of backward) is open
        self._open: ActivationOffloader | None = None
        self._ending_task = -1
        #: rule 5: a rt.offload_activations context holds the model
        self._held = False

    # -- what the runtime asks -----------------------------------------------------------------
    def offloader(self) -> ActivationOffloader:
        """The offloader of the policy in force now (rule 7)."""
        spec = self._policy()
        if self._offloader is None or spec != self._spec:
            if self._open is not None:
                self._end_step()
            self._offloader, self._spec = self._make(spec), spec
            self._offloader.hooks.on_unpack = self._unpacked
        return self._offloader

    @contextlib.contextmanager
    def held(self, offloader: ActivationOffloader, default_blocks: bool, default: str) -> Iterator[ActivationOffloader]:
        """Rule 5: around the body, the managed offloader when ``offloader`` (what
        ``rt.offload_activations`` built) asks for its policy on its blocks, else ``offloader``;
        the root hooks step aside. ``default``: the configuration's policy (what None means)."""
        if self._thread is not None and self._depth:
            raise ActivationCaptureError(
                "tiermem activations: rt.offload_activations(model) was opened inside the managed model's own "
                "forward; open it around forward and backward, or leave it out: rt.manage applies the policy"
            )
        if self._held:
            raise ActivationCaptureError(
                "tiermem activations: rt.offload_activations(model) is already open for this model; nest it once"
            )
        self.close_step()
        asked, applied = offloader.requested, self.offloader().requested
        same = default_blocks and (default if asked is None else asked) == (default if applied is None else applied)
        chosen = self.offloader() if same else offloader
        log.debug(
            "tiermem activations: rt.offload_activations on a managed model applies %s for the context's body",
            "the managed policy" if same else f"its own policy {asked!r}",
        )
        self._held = True
        try:
            with chosen:
                yield chosen
        finally:
            self._held = False

    # -- install and remove (the manager's hooks) ----------------------------------------------
    def install(self) -> None:
        if self._hooks:
            return
        _APPLIED[self.model] = self
        self._hooks.append(self.model.register_forward_pre_hook(self._forward_started))
        self._hooks.append(self.model.register_forward_hook(self._forward_ended, always_call=True))

    def remove(self) -> None:
        """Management ends, or pauses (a first-step plan's profiling step): no capture stays."""
        if _APPLIED.get(self.model) is self:
            del _APPLIED[self.model]
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.close_step()

    def close_step(self) -> None:
        """Rules 4, 6: end the open step; a capture a ``BaseException`` left open is closed."""
        if self._thread == threading.get_ident():  # no forward of the model runs here now
            self._close_capture(stale=True)
        if self._open is not None:
            self._end_step()

    # -- rule 1, 2: the root's forward ---------------------------------------------------------
    def _forward_started(self, _module: nn.Module, _args: Any) -> None:
        me = threading.get_ident()
        if self._thread is not None:
            if self._thread == me:
                self._depth += 1  # the root called inside its own forward: one capture
            else:
                log.debug("tiermem activations: a forward on another thread while one captures is not captured")
            return
        if self._held or not torch.is_grad_enabled() or in_backward():
            return
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            log.debug("tiermem activations: the forward runs inside saved-tensor hooks already: not captured")
            return
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():
            return
        offloader = self.offloader()
        if self._open is not offloader:
            if self._open is not None:
                self._end_step()
            offloader.prefetcher.context_entered()
            self._open = offloader
        offloader.install()
        try:
            offloader.push_saved_hooks()
        except BaseException:
            offloader.uninstall()
            raise
        self._thread, self._depth, self._capturing = me, 1, offloader

    def _forward_ended(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._thread is None or self._thread != threading.get_ident():  # nothing captures (no call traced)
            return
        self._depth -= 1
        if self._depth == 0:
            self._close_capture(stale=False)

    def _close_capture(self, *, stale: bool) -> None:
        offloader = self._capturing
        assert offloader is not None
        thread = self._thread
        self._thread, self._depth, self._capturing = None, 0, None
        try:
            if offloader.pushed:
                if thread != threading.get_ident() or not offloader.on_top():
                    offloader.abandon_saved_hooks()  # what is on top is someone else's: never pop it
                    raise ActivationCaptureError(
                        "tiermem activations: the saved-tensor hooks rt.manage pushed for the model's forward are not "
                        "the innermost ones at its end: something inside the forward (or, after an interrupted "
                        "forward, the caller) pushed torch.autograd.graph.saved_tensors_hooks without popping them. "
                        "Close such contexts inside the forward (NOTE [ Managed activations ] rule 1)"
                    )
                offloader.pop_saved_hooks()
                if stale:
                    log.warning("tiermem activations: closed the capture an interrupted forward left open")
        finally:
            offloader.uninstall()

    # -- rule 4: the end of the step -----------------------------------------------------------
    def _unpacked(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._ending_task and self._open is not None:
            self._ending_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._ending_task = -1
        if self._open is not None and self._thread is None:
            self._end_step()

    def _end_step(self) -> None:
        offloader, self._open = self._open, None
        if offloader is not None:
            offloader.finish()
