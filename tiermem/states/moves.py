"""Moving, casting and freezing a managed model: what ``model.to()``, ``.cuda()``, ``.half()``,
``load_state_dict`` and ``requires_grad_`` may do to parameters that are views into chunks.

:class:`ParameterMoves` owns the ``_apply`` guards it puts on the model's modules and a
``load_state_dict`` pre-hook; :class:`Training` owns which managed parameters train now. They
may read the managed parameters' metadata (never their values: a released chunk's storage is
empty, rule 1 of NOTE [ Model-state rules ]) and swap a parameter's ``.data`` back to the view
it had; they hold no bytes and never touch the registry.

# NOTE [ Moving a managed model ]
1. ``nn.Module.to/cuda/cpu/half/bfloat16/float/double/type/to_empty/share_memory`` all run
   ``nn.Module._apply(fn)``, which sets ``p.data = fn(p)`` (or, under
   ``torch.__future__``'s overwrite/swap flags, replaces or swaps the Parameter): a changed
   tensor would leave the chunk while the optimizer, autograd's saved views and the chunk's
   steps go on using the old bytes. Every module of a managed model gets an instance
   ``_apply`` that, on the outermost call, first runs ``fn`` on a fake tensor (no storage,
   ``FakeTensorMode``) shaped like each managed parameter of that subtree, so a released
   chunk's empty storage is never read. A parameter ``fn`` returns unchanged (a move to where
   it already is, a cast to its dtype) lets the call go on, with the future flags off for its
   duration (they would replace even unchanged parameters); anything else raises
   :class:`StatesUsageError` before any tensor changes, saying what to do instead (choose the
   device with ``[device] device``, the dtype before ``rt.manage`` or with ``param_dtype=``,
   or leave the Runtime first: its parameters are then ordinary tensors). ``fn`` that the fake
   tensor cannot run is refused the same way.
2. After the call every managed parameter it reached must still be the view it was (same
   storage, offset, shape, strides, dtype): if one is not, its view is put back and the call
   raises. Buffers are not managed and follow ``fn`` as in plain PyTorch.
3. ``load_state_dict`` copies into the chunks (``StateIO``); under
   ``torch.__future__.set_swap_module_params_on_conversion(True)`` it would swap the
   parameters out instead, so it is refused before anything is loaded.
4. Freezing: a parameter that required grad at ``rt.manage`` may stop (``requires_grad_(False)``)
   and start again between steps. The root's forward pre-hook reads ``requires_grad`` of every
   managed parameter; the backward tracker waits only for the gradients of parameters that
   train now (a frozen one's never comes: waiting would pin its chunks through backward and
   never count the backward complete). A frozen parameter gets no gradient, so with
   ``zero_grad(set_to_none=True)`` the optimizer skips it and with ``set_to_none=False`` it
   steps on its zeroed gradient: both exactly as plain PyTorch. A parameter frozen at
   ``rt.manage`` has no room for a gradient in its chunk: requiring grad later is refused at
   the next forward (make it require grad before ``rt.manage`` and freeze it after).
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tiermem.states.access import internal
from tiermem.states.errors import StatesUsageError
from tiermem.states.facts import ModelFacts

__all__ = ["ParameterMoves", "Training"]

#: modules whose ``_apply`` is guarded, and by whom
_GUARDED: weakref.WeakKeyDictionary[nn.Module, ParameterMoves] = weakref.WeakKeyDictionary()
_CALLS = threading.local()

_WHAT_INSTEAD = (
    "leave the Runtime first (`with rt` ends: the parameters become ordinary tensors) and move or cast the model "
    "then, or do it before rt.manage()"
)


def _guarded_apply(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    """Rule 1: the instance ``_apply`` of every module of a managed model."""
    moves = _GUARDED.get(module)
    cls_apply = type(module)._apply
    if moves is None or getattr(_CALLS, "inside", False):
        return cls_apply(module, fn, recurse)
    return moves.apply(module, fn, recurse, cls_apply)


@contextlib.contextmanager
def _conversion_flags_off() -> Iterator[None]:
    """``_apply`` with ``p.data = fn(p)`` semantics: the future flags would put new Parameter
    objects in the model even for an unchanged ``fn(p)``."""
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(False)
    torch.__future__.set_swap_module_params_on_conversion(False)
    _CALLS.inside = True
    try:
        yield
    finally:
        _CALLS.inside = False
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        torch.__future__.set_swap_module_params_on_conversion(swap)


def _view_of(p: torch.Tensor) -> tuple[Any, ...]:
    return (p.untyped_storage()._cdata, p.storage_offset(), tuple(p.shape), p.stride(), p.dtype, p.device)


class ParameterMoves:
    """Rules 1-3: guards on a managed model's ``_apply`` and ``load_state_dict``."""

    def __init__(self, facts: ModelFacts) -> None:
        self.facts = facts
        self._names = {id(p): n for n, p in facts.model.named_parameters(remove_duplicate=True)}
        self._patched: list[weakref.ref[nn.Module]] = []
        self._hooks: list[RemovableHandle] = []

    def install(self) -> None:
        for module in self.facts.model.modules():
            if module in _GUARDED or "_apply" in vars(module):
                continue  # another manager's guard, or the user's own override: left alone
            _GUARDED[module] = self
            object.__setattr__(module, "_apply", types.MethodType(_guarded_apply, module))
            self._patched.append(weakref.ref(module))
        for module in self.facts.module_names:
            self._hooks.append(module.register_load_state_dict_pre_hook(self._load_started))

    def remove(self) -> None:
        for ref in self._patched:
            module = ref()
            if module is not None and _GUARDED.get(module) is self:
                del _GUARDED[module]
                vars(module).pop("_apply", None)
        self._patched.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -- .to(), casts and _apply: refused unless nothing changes -----------------------------------
    def apply(
        self,
        module: nn.Module,
        fn: Callable[[torch.Tensor], torch.Tensor],
        recurse: bool,
        cls_apply: Callable[..., Any],
    ) -> nn.Module:
        from torch._subclasses.fake_tensor import FakeTensorMode

        reached = [p for p in module.parameters(recurse=recurse) if id(p) in self.facts.index]
        if reached:
            mode = FakeTensorMode()
            for p in reached:
                self._check_unchanged(p, fn, mode)
        with internal():  # fn leaves them unchanged: no bytes are read (NOTE [ Parameter access ])
            views = [(p, p.detach(), _view_of(p)) for p in reached]
            with _conversion_flags_off():
                out = cls_apply(module, fn, recurse)
            moved = [p for p, _, view in views if _view_of(p) != view]
            for p, alias, _ in views:
                if _view_of(p) != _view_of(alias):
                    p.data = alias  # rule 2: back into its chunk
        if moved:
            raise StatesUsageError(
                f"tiermem: nn.Module._apply (model.to(), .half(), ...) replaced the managed parameter "
                f"{self._name(moved[0])!r} although a fake run of it left the parameter unchanged; the chunk's view "
                f"was put back. Managed parameters stay in their chunks: {_WHAT_INSTEAD}"
            )
        return out  # type: ignore[no-any-return]

    def _check_unchanged(self, p: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], mode: Any) -> None:
        """Rule 1: ``fn`` on a fake tensor like ``p`` returns it unchanged, else a clear refusal."""
        name = self._name(p)
        try:
            with mode, torch.no_grad():
                fake = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
                out = fn(fake)
                if out is fake:
                    return
                changed = (str(out.device), out.dtype, tuple(out.stride()))
        except Exception as exc:
            raise StatesUsageError(
                f"tiermem: cannot tell what nn.Module._apply (model.to(), .cuda(), .half(), share_memory(), ...) would "
                f"do to the managed parameter {name!r} ({type(exc).__name__}: {exc}); refused before anything changed. "
                f"Managed parameters stay in their chunks: {_WHAT_INSTEAD}"
            ) from exc
        device, dtype, stride = changed
        if device != str(p.device):
            raise StatesUsageError(
                f"tiermem: moving the managed model would move parameter {name!r} from {p.device} to {device}; "
                f"rt.manage keeps parameters in chunks on the device tier ({self.facts.device}) and moves them "
                f'itself. Choose the device with [device] device = "..." before rt.manage (it moves a CPU-built '
                f"model there), or {_WHAT_INSTEAD}"
            )
        if dtype != p.dtype:
            raise StatesUsageError(
                f"tiermem: casting the managed model would turn parameter {name!r} from {p.dtype} into {dtype}; its "
                f"chunk and optimizer states are laid out for {p.dtype}. For bf16/fp16 working parameters with fp32 "
                "masters use rt.manage(model, ..., param_dtype=torch.bfloat16) (or torch.autocast for the compute); "
                f"otherwise cast the model before rt.manage, or {_WHAT_INSTEAD}"
            )
        raise StatesUsageError(
            f"tiermem: nn.Module._apply would replace the managed parameter {name!r} ({p.dtype} on {p.device}) with "
            f"another tensor of strides {stride} (a copy, another memory format or an empty tensor); managed "
            f"parameters are contiguous views into their chunks. {_WHAT_INSTEAD[0].upper()}{_WHAT_INSTEAD[1:]}"
        )

    def _name(self, p: torch.Tensor) -> str:
        return self._names.get(id(p), f"parameter {self.facts.index.get(id(p))}")

    # -- load_state_dict under the swap flag, and freezing -----------------------------------------
    def _load_started(self, _module: nn.Module, *_: Any) -> None:
        if torch.__future__.get_swap_module_params_on_conversion():
            raise StatesUsageError(
                "tiermem: load_state_dict under torch.__future__.set_swap_module_params_on_conversion(True) would swap "
                "managed parameters out of their chunks; set it back to False for the load (the values are copied "
                "into the chunks then)"
            )


class Training:
    """Rule 4: which managed parameters train now, for the backward tracker."""

    def __init__(self, facts: ModelFacts) -> None:
        self.facts = facts
        #: per parameter, whether it requires grad now (the tracker's ``trainable``)
        self.now = list(facts.trainable)

    def sync(self) -> None:
        """At the root's forward start: read ``requires_grad``; refuse a parameter frozen at
        ``rt.manage`` that requires grad now."""
        facts = self.facts
        for i, p in enumerate(facts.params):
            wants = p.requires_grad
            if wants and not facts.trainable[i]:
                (name,) = facts.param_names([i])
                raise StatesUsageError(
                    f"tiermem: parameter {name!r} did not require grad when rt.manage() ran, so its chunk has no room "
                    "for a gradient and it cannot start training now. Call requires_grad_(True) on every parameter "
                    "that will ever train before rt.manage() and freeze it with requires_grad_(False) after "
                    "(freezing and unfreezing those later is supported)"
                )
            self.now[i] = wants
