"""The optimizer ``rt.manage`` returns, and torch's own step run on per-parameter views.

# NOTE [ Exact optimizer step ]
1. Supported: ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (exactly these classes: a subclass
   may change the math). Anything else raises :class:`UnsupportedOptimizerError`.
2. The step of a chunk runs the user's optimizer class's own ``step`` (its ``_init_group``
   and the functional ``adam``/``sgd`` it calls, with the group's ``foreach``/``fused``/
   ``capturable`` settings) on a throw-away instance whose parameters are per-parameter
   views into the chunk and whose state entries are views into the chunk's state sections.
   Per-parameter math is then torch's, bit for bit (TRAPS 3: never one call over a flat
   chunk). The instance is rebuilt through the unpickling path (``__setstate__``) and its
   unhooked ``step`` is called, so global optimizer hooks fire once, on the managed
   optimizer, not per chunk.
3. State the class creates lazily (Adam's moments at the first step, SGD's momentum buffer)
   is copied into the chunk's sections after the step and the views take its place; scalars
   (``step``) stay small CPU tensors in memory.
4. ``param_groups`` are live: each step reads every hyper-parameter from them, so LR
   schedulers and hand edits take effect at the next step. ``optimizer.state`` stays empty:
   states live in chunks; ``state_dict()``/``load_state_dict()`` speak PyTorch's format.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from tiermem.states.errors import StatesUsageError, UnsupportedOptimizerError

#: Rule 1: class -> the per-parameter state tensors it keeps, given its param groups.
SUPPORTED: dict[type[torch.optim.Optimizer], Callable[[list[dict[str, Any]]], tuple[str, ...]]] = {
    torch.optim.AdamW: lambda groups: (
        ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if any(g.get("amsgrad") for g in groups) else ())
    ),
    torch.optim.Adam: lambda groups: (
        ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if any(g.get("amsgrad") for g in groups) else ())
    ),
    torch.optim.SGD: lambda groups: ("momentum_buffer",) if any(g.get("momentum", 0) != 0 for g in groups) else (),
}

_SUPPORTED_NAMES = "torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD"


def coerce_optimizer(
    params: Iterable[nn.Parameter], optimizer: Any, kwargs: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """The plain torch optimizer ``rt.manage`` takes groups, defaults and state from."""
    params = list(params)
    if isinstance(optimizer, torch.optim.Optimizer):
        if kwargs:
            raise TypeError(
                f"tiermem manage: keyword arguments ({', '.join(kwargs)}) go with an optimizer class, "
                "not with a constructed optimizer"
            )
        cls = type(optimizer)
    elif isinstance(optimizer, type):
        cls = optimizer
    else:
        raise UnsupportedOptimizerError(
            f"tiermem manage: the optimizer must be a torch.optim optimizer or its class, got "
            f"{type(optimizer).__name__}; supported: {_SUPPORTED_NAMES}"
        )
    if cls not in SUPPORTED:
        raise UnsupportedOptimizerError(
            f"tiermem manage: {cls.__module__}.{cls.__qualname__} is not supported; tiermem reproduces "
            f"{_SUPPORTED_NAMES} exactly (subclasses excluded, they may change the math)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = cls([p for p in params if p.requires_grad], **kwargs)
    known = {id(p) for p in params}
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise UnsupportedOptimizerError("tiermem manage: differentiable=True optimizers are not supported")
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"tiermem manage: the optimizer holds a parameter of shape {list(p.shape)} that is not in the model"
                )
    return optimizer


def state_names(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> tuple[str, ...]:
    return SUPPORTED[cls](groups)


def run_step(
    cls: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    groups: list[tuple[dict[str, Any], list[torch.Tensor]]],
    state: dict[torch.Tensor, dict[str, Any]],
    attributes: Mapping[str, Any],
) -> defaultdict[torch.Tensor, dict[str, Any]]:
    """Rule 2: one step of ``cls`` over ``groups`` (live group dict, parameter views) starting
    from ``state``; returns the state afterwards, keyed like ``state``."""
    shadow = cls.__new__(cls)
    shadow_groups = [
        {**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": params}
        for group, params in groups
    ]
    shadow.__setstate__({"defaults": dict(defaults), "state": defaultdict(dict, state), "param_groups": shadow_groups})
    shadow._warned_capturable_if_run_uncaptured = True
    for name, value in attributes.items():  # e.g. GradScaler's grad_scale/found_inf
        setattr(shadow, name, value)
    step = cls.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__  # type: ignore[attr-defined]
    step(shadow)
    return shadow.state


class StatesBackend(Protocol):
    """What :class:`ManagedOptimizer` needs from the model-state manager."""

    def step(self, optimizer: ManagedOptimizer) -> None: ...

    def zero_grad(self, optimizer: ManagedOptimizer, set_to_none: bool) -> None: ...

    def export_optimizer_state(self, optimizer: ManagedOptimizer) -> dict[torch.Tensor, dict[str, Any]]: ...

    def import_optimizer_state(self, optimizer: ManagedOptimizer, state: Mapping[torch.Tensor, Any]) -> None: ...


class ManagedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose states live in tiermem chunks (NOTE [ Exact optimizer step ]).

    ``param_groups`` hold the model's own parameters and every hyper-parameter of the
    optimizer it was made from; ``optimizer_class`` is that optimizer's class.
    """

    def __init__(self, backend: StatesBackend, base: torch.optim.Optimizer) -> None:
        self._backend = backend
        self._frozen_groups = False
        self.optimizer_class: type[torch.optim.Optimizer] = type(base)
        #: the total gradient norm of the last step when rt.manage(clip_grad_norm=) clips
        self.grad_norm: torch.Tensor | None = None
        super().__init__([dict(group) for group in base.param_groups], dict(base.defaults))
        self._frozen_groups = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen_groups", False):
            raise StatesUsageError(
                "tiermem: a managed optimizer's parameter groups are fixed at rt.manage(); build the optimizer with "
                "every group before managing the model"
            )
        super().add_param_group(param_group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._backend.step(self)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._backend.zero_grad(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's format: ``{"state": {index: {...}}, "param_groups": [...]}``; tensors are
        fresh CPU copies read from the chunks."""
        self.state.update(self._backend.export_optimizer_state(self))
        try:
            return super().state_dict()
        finally:
            self.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # validates and matches parameters, as PyTorch does
        # PyTorch casts floating states to each parameter's dtype; under mixed precision the
        # parameters are working copies (bf16) and the states belong to the fp32 masters, so
        # the chunks take the saved values themselves, matched to parameters as PyTorch does.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        by_id = dict(zip(saved_ids, params, strict=True))
        raw = {by_id[k]: v for k, v in state_dict["state"].items() if k in by_id}
        try:
            self._backend.import_optimizer_state(self, {p: raw.get(p, s) for p, s in self.state.items()})
        finally:
            self.state.clear()

    def __repr__(self) -> str:
        return "Managed" + torch.optim.Optimizer.__repr__(self).replace(
            type(self).__name__, self.optimizer_class.__name__, 1
        )
