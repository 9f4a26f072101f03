"""``copy.deepcopy`` and ``pickle`` of a managed model give a plain model with its true values.

An EMA copy, a frozen reference model for a KL or DPO loss and a teacher are made with
``copy.deepcopy(model)``; ``torch.save(model)`` pickles it. A managed model's modules carry
tiermem's hooks (bound to the manager, which holds locks, threads and tier handles) and its
guarded parameters have no bytes of their own (NOTE [ Parameter access ] in ``access.py``).
:class:`PlainCopies` gives each module of the model an instance ``__deepcopy__`` and
``__reduce_ex__`` that copy the module as PyTorch would, less tiermem's hooks and instance
attributes; parameters copy themselves with their true values (rule 6 there). The copy is an
ordinary model, not managed: manage it in its own ``rt.manage`` call if it should be.
"""

from __future__ import annotations

import copy
import functools
import types
import weakref
from collections import OrderedDict
from typing import Any

from torch import nn

__all__ = ["PlainCopies"]

#: instance attributes tiermem sets on a managed model's modules
_OURS = ("_apply", "__deepcopy__", "__reduce_ex__")


def _is_ours(hook: Any) -> bool:
    """A hook tiermem registered: its function is defined in the tiermem package."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    func = getattr(hook, "__func__", hook)
    return str(getattr(func, "__module__", "") or "").startswith("tiermem.")


def _plain_state(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``module``'s pickled state without tiermem's hooks and instance attributes."""
    out: dict[str, Any] = {}
    dropped: set[int] = set()
    for key, value in state.items():
        if key in _OURS and isinstance(value, (types.MethodType, functools.partial)):
            continue
        if key.endswith("hooks") and isinstance(value, dict):
            kept = OrderedDict()
            for hook_id, hook in value.items():
                if _is_ours(hook):
                    dropped.add(hook_id)
                else:
                    kept[hook_id] = hook
            value = kept
        out[key] = value
    for key in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
        if key in out and isinstance(out[key], dict):
            out[key] = OrderedDict((k, v) for k, v in out[key].items() if k not in dropped)
    return out


def _reduce(module: nn.Module, proto: int) -> tuple[Any, ...]:
    reduced = type(module).__reduce_ex__(module, proto)
    if not isinstance(reduced, tuple) or len(reduced) < 3 or not isinstance(reduced[2], dict):
        return reduced  # type: ignore[no-any-return]
    return (reduced[0], reduced[1], _plain_state(module, reduced[2]), *reduced[3:])


def _deepcopy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    reduced = _reduce(module, 4)
    return copy._reconstruct(module, memo, *reduced)  # type: ignore[attr-defined,no-any-return]


class PlainCopies:
    """Installs and removes the per-module copy methods of one managed model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._patched: list[weakref.ref[nn.Module]] = []

    def install(self) -> None:
        for module in self.model.modules():
            if "__deepcopy__" in vars(module) or "__reduce_ex__" in vars(module):
                continue  # the user's own, or another manager's
            object.__setattr__(module, "__deepcopy__", types.MethodType(_deepcopy, module))
            object.__setattr__(module, "__reduce_ex__", types.MethodType(_reduce, module))
            self._patched.append(weakref.ref(module))

    def remove(self) -> None:
        for ref in self._patched:
            module = ref()
            if module is not None:
                vars(module).pop("__deepcopy__", None)
                vars(module).pop("__reduce_ex__", None)
        self._patched.clear()
