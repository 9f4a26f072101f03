"""The optimizer ``rt.manage`` returns, and torch's own step run on per-parameter views.

# NOTE [ Exact optimizer step ]
1. Accepted: every per-parameter optimizer of ``torch.optim`` (``AdamW``, ``Adam``, ``SGD``,
   ``Adagrad``, ``RMSprop``, ``Adamax``, ``NAdam``, ``RAdam``, ``Adadelta``, ``Rprop``,
   ``ASGD``; exactly these classes, a subclass may change the math), Hugging Face's
   ``transformers.optimization.Adafactor``, and any optimizer class that declares the contract
   with ``tiermem_per_parameter = True`` (README, "Your optimizer"): torch.optim's param groups,
   per-parameter ``state``, and a ``step()`` that updates each parameter from its own gradient,
   state and group only. ``LBFGS`` (a closure re-evaluating the whole model, one state for all
   parameters) and ``SparseAdam`` (sparse gradients) are refused, as is anything else, with
   :class:`UnsupportedOptimizerError` naming what to do.
2. The step of a chunk runs the user's optimizer class's own ``step`` (its ``_init_group``
   and the functional ``adam``/``sgd``/... it calls, with the group's ``foreach``/``fused``/
   ``capturable``/``maximize`` settings) on a throw-away instance whose parameters are per-parameter
   views into the chunk and whose state entries are views into the chunk's state sections.
   Per-parameter math is then torch's, bit for bit (TRAPS 3: never one call over a flat
   chunk). The instance is rebuilt through the unpickling path (``__setstate__``) and its
   unhooked ``step`` is called, so global optimizer hooks fire once, on the managed
   optimizer, not per chunk.
3. State of any shape: the layout is learned from the optimizer, never from a list of names.
   :func:`learn_state` runs the class's own constructor and two steps on small CPU samples (one
   per group, dimensionality and dtype of the parameters it steps) and classifies every state
   entry: a tensor with its parameter's shape and dtype (Adam's moments, Rprop's step sizes,
   Adafactor's first moment) gets a *section* of the chunk's home (host or NVMe), the same bytes
   as the parameter; anything else (``step``, ASGD's ``eta``, Adafactor's factored row/column
   statistics: rows + columns elements, not rows x columns) is a *small state* kept with the
   parameter's record in memory, as ``step`` always was. So is a vector's state that matrices do
   not keep whole (Adafactor's unfactored second moment of biases and norms): a vector's state
   gets a section only where a matrix's of the same name does. State the class creates lazily is
   copied into the sections after the step and the views take its place; a state the samples did
   not predict is kept as a small state (correct, only not offloaded).
4. A declared optimizer (rule 1's attribute) is checked on the same samples: two parameters
   stepped together must end bitwise as each stepped alone, else it reads across parameters
   (a global norm, a shared statistic) and is refused before the first step. Built-in ones are
   known per-parameter and skip the check.
5. ``param_groups`` are live: each step reads every hyper-parameter from them, so LR
   schedulers and hand edits take effect at the next step. ``optimizer.state`` stays empty:
   states live in chunks; ``state_dict()``/``load_state_dict()`` speak PyTorch's format.
6. Element-wise optimizers (exactly rule 1's torch.optim classes: :func:`element_wise`) update
   every element of a parameter from the same element of its gradient and states, plus small
   states (``step``, ASGD's ``eta``, NAdam's ``mu_product``) that depend on no element. Their
   step over slices of a parameter, one after another, each from the small states as they were
   before the step, is bitwise their step over the whole parameter (torch 2.13's CPU kernels give
   the same bits at any offset and length: ``tests/test_sliced_steps.py`` checks every flag). A
   chunk too large to stage whole steps so (NOTE [ Sliced steps ] in ``chunk_step.py``). Factored
   or declared optimizers (Adafactor's row and column statistics, a trust ratio) are not
   element-wise: their chunks stage whole, and the placement plans room for that.
7. Copies: ``copy.deepcopy(optimizer)`` and pickling (``torch.save(optimizer)``) give a plain
   optimizer of the user's class with the true states (fresh CPU copies read from the chunks, as
   ``state_dict()`` gives them) over copies of the parameters, as PyTorch's deepcopy of an
   optimizer would: the parameters copy themselves with their true values, and copied together
   with the model (``copy.deepcopy((model, optimizer))``) they are the copied model's. The copy
   is ordinary, not managed, as the model's copies are (``copies.py``). Copied as an object, the
   managed optimizer would lose its states (they are not in ``optimizer.state``) and its link to
   the chunks.
8. An optimizer instance handed to ``rt.manage`` is superseded: its states move into the chunks
   (its ``state`` is emptied) and, until the model's close, its ``step()`` refuses with a
   :class:`StatesUsageError` naming the optimizer to step instead. Stepped out of habit, it would
   build its states afresh in RAM and train apart from the managed ones, which checkpoints save.
   Its ``param_groups`` are the managed optimizer's (the same list, again after a
   ``load_state_dict``): an LR scheduler made on it before ``rt.manage`` drives the managed
   optimizer's learning rate, where it would have changed only groups nothing steps.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import types
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tiermem.states.errors import StatesUsageError, UnsupportedOptimizerError

#: Rule 1: the per-parameter optimizers of torch.optim (exactly these classes)
SUPPORTED: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.AdamW,
        torch.optim.Adam,
        torch.optim.SGD,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adadelta,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)
#: Rule 1: third-party per-parameter optimizers accepted by their qualified name (not imported here)
KNOWN_PER_PARAMETER = frozenset({"transformers.optimization.Adafactor"})
#: Rule 1: the class attribute a per-parameter optimizer declares the contract with
DECLARATION = "tiermem_per_parameter"
#: Rule 1: refused even when declared, with why
REFUSED: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.LBFGS: (
        "its step() needs a closure that re-evaluates the whole model several times per step and it keeps one "
        "state for all parameters together; use a per-parameter optimizer (AdamW, SGD, Adafactor, ...) with "
        "rt.manage, or train without tiermem's model states"
    ),
    torch.optim.SparseAdam: (
        "it needs sparse gradients and tiermem's chunks hold dense ones; use Adam or AdamW (dense gradients)"
    ),
}

_SUPPORTED_NAMES = (
    "the per-parameter torch.optim optimizers (AdamW, Adam, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam, "
    "Adadelta, Rprop, ASGD), transformers' Adafactor, and optimizer classes declaring "
    f"{DECLARATION} = True"
)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def accepted(cls: type) -> bool:
    """Rule 1: whether ``cls`` is stepped (before the declared-contract check of rule 4)."""
    if cls in REFUSED:
        return False
    return cls in SUPPORTED or qualified_name(cls) in KNOWN_PER_PARAMETER or cls.__dict__.get(DECLARATION) is True


def declared(cls: type) -> bool:
    """Rule 4: accepted on the class's own word (so checked on samples)."""
    return cls not in SUPPORTED and qualified_name(cls) not in KNOWN_PER_PARAMETER


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
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        cls = optimizer
    else:
        raise UnsupportedOptimizerError(
            f"tiermem manage: the optimizer must be a torch.optim.Optimizer or its class, got "
            f"{type(optimizer).__name__}; supported: {_SUPPORTED_NAMES}"
        )
    for refused, why in REFUSED.items():
        if issubclass(cls, refused):
            raise UnsupportedOptimizerError(f"tiermem manage: {qualified_name(cls)} is not supported: {why}")
    if not accepted(cls):
        raise UnsupportedOptimizerError(
            f"tiermem manage: {qualified_name(cls)} is not supported; tiermem steps {_SUPPORTED_NAMES} "
            "(a subclass of a supported class is not trusted: it may change the math). If its step() updates "
            "each parameter from its own gradient, state and param group only, declare it: "
            f"`{cls.__qualname__}.{DECLARATION} = True` (README, 'Your optimizer'; NOTE [ Exact optimizer step ])"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        try:
            optimizer = cls([p for p in params if p.requires_grad], **kwargs)
        except TypeError as exc:
            meant = _manage_keyword_meant(cls, kwargs)
            if meant is None:
                raise
            raise TypeError(
                f"tiermem manage: {cls.__name__} refused {meant[0]}= ({exc}); rt.manage() passes the keyword "
                f"arguments it does not take to the optimizer class. Did you mean rt.manage's {meant[1]}=?"
            ) from None
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


#: the keyword arguments of ``rt.manage`` itself: the rest go to the optimizer class (checked
#: against ``Runtime.manage``'s signature by the tests)
MANAGE_KEYWORDS = (
    "plan",
    "sample",
    "grad_accumulation_steps",
    "clip_grad_norm",
    "keep_gradients",
    "param_dtype",
    "activations",
)


def _manage_keyword_meant(cls: type, kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
    """A keyword ``cls`` does not take that looks like a misspelt keyword of ``rt.manage``:
    (the keyword, the one meant), or None."""
    try:
        taken = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # no signature to read
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return None
    for name in kwargs:
        if name not in taken:
            close = difflib.get_close_matches(name, MANAGE_KEYWORDS, n=1, cutoff=0.6)
            if close:
                return name, close[0]
    return None


def no_optimizer() -> torch.optim.Optimizer:
    """What a model managed without an optimizer carries (``rt.manage(model)``): one group of no
    parameters, so its states and checkpoints have the shape of every other managed model's;
    nothing ever steps it (every parameter is frozen)."""
    return torch.optim.SGD([{"params": []}], lr=0.0)


def element_wise(cls: type[torch.optim.Optimizer]) -> bool:
    """Rule 6: whether ``cls``'s step is element-wise (the per-parameter torch.optim optimizers of
    rule 1): stepping any slices of a parameter one after another gives bitwise its whole step."""
    return cls in SUPPORTED


def require_element_wise(cls: type[torch.optim.Optimizer]) -> None:
    """An FSDP2-sharded model steps each rank's local shards as tensors of their own: exact only for
    optimizers whose math is element-wise (torch.optim's per-parameter ones, rule 1). Adafactor's
    factored statistics and parameter RMS, or a declared optimizer's, would be of the shard, not
    of the parameter: refused with what to do (NOTE [ Sharded model states ])."""
    if not element_wise(cls):
        raise UnsupportedOptimizerError(
            f"tiermem manage: {qualified_name(cls)} on an FSDP2-sharded model: tiermem steps each rank's local "
            "shards, exact only for the element-wise torch.optim optimizers (AdamW, Adam, SGD, Adagrad, RMSprop, "
            "Adamax, NAdam, RAdam, Adadelta, Rprop, ASGD); a factored or declared optimizer would see a shard, not "
            "its parameter. Use one of those, or manage the model unsharded"
        )


@dataclass(frozen=True)
class StateLayout:
    """Rule 3: what the optimizer keeps per parameter, learned on samples."""

    #: section keys, in the order of the chunk's sections
    names: tuple[str, ...]
    #: per parameter (by id) the optimizer steps: its section keys
    keys: dict[int, tuple[str, ...]]
    #: per parameter (by id) the optimizer steps: every state key it keeps (sections and small ones)
    all_keys: dict[int, tuple[str, ...]]

    def sections(self, p: torch.Tensor) -> int:
        """Sections a chunk holding ``p`` needs for it: its last section key's index + 1."""
        keys = self.keys.get(id(p), ())
        return 1 + max(self.names.index(k) for k in keys) if keys else 0


_PROBE_FLAGS = {"capturable": False, "fused": False, "differentiable": False}
"""Settings a CPU sample cannot take; none of them changes what state is kept or its shape."""


def _unhooked_step(cls: type[torch.optim.Optimizer]) -> Callable[[Any], Any]:
    step = cls.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]


def _construct(
    cls: type[torch.optim.Optimizer], defaults: Mapping[str, Any], groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A fresh instance over sample groups (its constructor may create state, as Adagrad's does);
    the unpickling path where the constructor needs more than its defaults."""
    try:
        accepted_args = inspect.signature(cls.__init__).parameters
        takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted_args.values())
        kwargs = {k: v for k, v in defaults.items() if (takes_any or k in accepted_args) and k not in _PROBE_FLAGS}
        return cls(groups, **kwargs)
    except (TypeError, ValueError):
        shadow = cls.__new__(cls)
        shadow.__setstate__({"defaults": dict(defaults), "state": defaultdict(dict), "param_groups": groups})
        return shadow


def _probe(
    cls: type[torch.optim.Optimizer], defaults: Mapping[str, Any], groups: list[dict[str, Any]], steps: int
) -> torch.optim.Optimizer:
    """``steps`` steps of ``cls`` over ``groups`` (sample parameters whose ``.grad`` is set)."""
    instance = _construct(cls, defaults, groups)
    instance._warned_capturable_if_run_uncaptured = True  # type: ignore[attr-defined]
    step = _unhooked_step(cls)
    for _ in range(steps):
        step(instance)
    return instance


def _sample(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, generator=generator).to(dtype).requires_grad_(True)
    t.grad = torch.randn(shape, generator=generator).to(dtype)
    return t


def _sample_shape(ndim: int) -> tuple[int, ...]:
    return tuple(3 + k for k in range(ndim))  # distinct sizes: a row statistic never looks like a column one


def learn_state(
    cls: type[torch.optim.Optimizer],
    defaults: Mapping[str, Any],
    groups: list[dict[str, Any]],
    master_dtype: torch.dtype | None = None,
) -> StateLayout:
    """Rules 3 and 4: the state ``cls`` keeps for each parameter of ``groups`` (stepped in
    ``master_dtype`` when given, else its own dtype), learned on CPU samples; raises
    UnsupportedOptimizerError for a declared optimizer that reads across parameters."""
    generator = torch.Generator().manual_seed(0)
    kinds: list[list[tuple[int, torch.dtype]]] = []
    sample_groups: list[dict[str, Any]] = []
    for group in groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        hyper.update({k: v for k, v in _PROBE_FLAGS.items() if k in hyper})
        found = sorted(
            {(p.dim(), master_dtype or p.dtype) for p in group["params"]}
            | {(n, master_dtype or torch.float32) for n in (1, 2)},
            key=str,
        )
        kinds.append(found)
        params = [_sample(_sample_shape(ndim), dtype, generator) for ndim, dtype in found]
        sample_groups.append({**hyper, "params": params})
    with torch.random.fork_rng(devices=[]):  # an optimizer drawing random numbers leaves the user's RNG as it was
        instance = _probe(cls, defaults, sample_groups, steps=2)
    by_kind: list[dict[tuple[int, torch.dtype], tuple[str, ...]]] = []
    every_key: list[dict[tuple[int, torch.dtype], tuple[str, ...]]] = []
    order: list[str] = []
    for found, group in zip(kinds, sample_groups, strict=True):
        classified: dict[tuple[int, torch.dtype], tuple[str, ...]] = {}
        every_key.append(
            {kind: tuple(instance.state.get(p, {})) for kind, p in zip(found, group["params"], strict=True)}
        )
        one_d = {}
        for (ndim, dtype), p in zip(found, group["params"], strict=True):
            entry = instance.state.get(p, {})
            keys = tuple(
                k
                for k, v in entry.items()
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dtype == p.dtype and v.dim() > 0
            )
            classified[ndim, dtype] = keys
            if ndim == 1:
                one_d[dtype] = keys
        for (ndim, dtype), p in zip(found, group["params"], strict=True):
            if ndim == 0:  # a 0-d state of a 0-d parameter is a section where a 1-d one's is
                entry = instance.state.get(p, {})
                classified[ndim, dtype] = tuple(
                    k
                    for k in one_d.get(dtype, ())
                    if isinstance(entry.get(k), torch.Tensor) and entry[k].dtype == dtype and entry[k].dim() == 0
                )
        # a vector's state gets a section only where a matrix's of the same name does: state a
        # factored optimizer keeps whole only for vectors (Adafactor's) is small, as theirs is
        matrix = {k for (ndim, _), keys in classified.items() if ndim >= 2 for k in keys}
        for kind, keys in classified.items():
            if kind[0] <= 1:
                classified[kind] = tuple(k for k in keys if k in matrix)
        for keys in classified.values():
            order += [k for k in keys if k not in order]
        by_kind.append(classified)
    if declared(cls):
        with torch.random.fork_rng(devices=[]):
            _check_independent(cls, defaults, sample_groups)
    keys = {
        id(p): by_kind[g][p.dim(), master_dtype or p.dtype] for g, group in enumerate(groups) for p in group["params"]
    }
    all_keys = {
        id(p): every_key[g][p.dim(), master_dtype or p.dtype] for g, group in enumerate(groups) for p in group["params"]
    }
    return StateLayout(tuple(order), keys, all_keys)


def _check_independent(
    cls: type[torch.optim.Optimizer], defaults: Mapping[str, Any], sample_groups: list[dict[str, Any]]
) -> None:
    """Rule 4: two sample parameters stepped together end bitwise as each stepped alone."""
    hyper = {k: v for k, v in sample_groups[0].items() if k != "params"}
    generator = torch.Generator().manual_seed(1)
    pair = [_sample((3, 4), torch.float32, generator), _sample((5,), torch.float32, generator)]
    pair[1].grad.mul_(100.0)  # type: ignore[union-attr]  # different scales: a global norm shows

    def fresh() -> list[torch.Tensor]:
        out = []
        for t in pair:
            c = t.detach().clone().requires_grad_(True)
            c.grad = t.grad.clone()  # type: ignore[union-attr]
            out.append(c)
        return out

    together = fresh()
    _probe(cls, defaults, [{**hyper, "params": together}], steps=3)
    for k, t in enumerate(fresh()):
        _probe(cls, defaults, [{**hyper, "params": [t]}], steps=3)
        if not torch.equal(t.detach(), together[k].detach()):
            raise UnsupportedOptimizerError(
                f"tiermem manage: {qualified_name(cls)} declares {DECLARATION} = True, but its step reads across "
                "parameters: two parameters stepped together end differently from each stepped alone (a global "
                "norm or shared statistic?). tiermem steps chunk by chunk and would change its math; remove the "
                "cross-parameter part (clip with rt.manage(clip_grad_norm=) instead) or train without tiermem's "
                "model states (NOTE [ Exact optimizer step ] rule 4)"
            )


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
    _unhooked_step(cls)(shadow)
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
        #: rule 8: the user's optimizer this one replaced, sharing its param groups
        self._superseded: Superseded | None = None
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
        if self._superseded is not None:  # rule 8: PyTorch's load made new groups
            self._superseded.share_groups()
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

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Rule 7: rebuilt as a plain ``optimizer_class`` with the true states (pickle and deepcopy)."""
        states = self._backend.export_optimizer_state(self)
        plain = {
            "defaults": dict(self.defaults),
            "state": defaultdict(dict, {p: dict(s) for p, s in states.items() if s}),
            "param_groups": [dict(group) for group in self.param_groups],
        }
        return (_plain_optimizer, (self.optimizer_class,), plain)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.optim.Optimizer:
        return copy._reconstruct(self, memo, *self.__reduce_ex__(4))  # type: ignore[attr-defined,no-any-return]


def _plain_optimizer(cls: type[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """Rule 7: an empty instance of ``cls``; pickle and deepcopy then restore its state through
    ``__setstate__``, as they do for any torch optimizer."""
    return cls.__new__(cls)


def _refuse_superseded(optimizer: torch.optim.Optimizer, *_args: Any, **_kwargs: Any) -> Any:
    """Rule 8: the ``step`` of a superseded optimizer, bound to it (an LR scheduler made on it
    later wraps its ``step.__func__`` and binds that to the optimizer again)."""
    raise StatesUsageError(
        f"tiermem manage: this {type(optimizer).__name__} was handed to rt.manage(), and its states now live in "
        f"tiermem's chunks; step the optimizer rt.manage() returned (`model, optimizer = rt.manage(model, "
        f"optimizer)`). Stepping this one would build its states afresh in RAM and train apart from them "
        f"(NOTE [ Exact optimizer step ] rule 8)"
    )


class Superseded:
    """Rule 8: the optimizer instance handed to ``rt.manage`` refuses ``step()`` until :meth:`remove`,
    and shares the managed optimizer's param groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, managed: ManagedOptimizer) -> None:
        self.optimizer = optimizer
        self.managed = managed
        #: what the instance had as its own ``step`` (an LR scheduler's wrapper), put back at removal
        self._own = vars(optimizer).get("step")
        optimizer.step = types.MethodType(_refuse_superseded, optimizer)  # type: ignore[method-assign]
        managed._superseded = self
        self.share_groups()

    def share_groups(self) -> None:
        self.optimizer.param_groups = self.managed.param_groups

    def remove(self) -> None:
        if getattr(vars(self.optimizer).get("step"), "__func__", None) is _refuse_superseded:
            if self._own is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self._own  # type: ignore[method-assign]
