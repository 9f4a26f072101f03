"""Reading and writing a managed parameter outside the model's forward and backward.

# NOTE [ Parameter access ]
1. Why: a streamed chunk is released with ``resize_(0)`` (rule 1 of NOTE [ Model-state rules ]),
   so a parameter that views it has no bytes between uses. Any op on it then (a logged norm, an
   EMA update, ``print(p)``, ``nn.init``) would read or write freed memory: a crash at best,
   stale or zero values at worst. Training code does such things between steps without
   thinking, so they must give bitwise what the plain model gives.
2. Mechanism: while no module of the model is using a chunk (``chunk.pins == 0``), each of its
   parameters is a :class:`GuardedParameter` (the same Python object, its class swapped; it is
   still an ``nn.Parameter``). Its ``__torch_function__`` brings the chunk to the device
   (DEMAND, the pool's own fetch), pins it for the op, runs the op on the real bytes, and
   unpins it (it stays cached until its slot is needed). When a module pins the chunk, the
   class goes back to ``nn.Parameter``: the forward and backward the manager drives see plain
   parameters, so a training step that touches no parameter by hand pays nothing (no Python
   dispatch per op; ``torch.compile``d blocks see the type they were compiled with). Persistent
   chunks of one dtype hold the true values at all times and are never guarded; persistent
   chunks with fp32 masters are (a write must reach the master).
   Why not a torch function mode: it would sit on every op of every step. Why not alias the host
   home: an NVMe home has none, and a write would bypass the device copy.
3. Metadata (shape, dtype, ``.grad``, ``requires_grad``, hooks, ``untyped_storage``...) passes
   through without a fetch. ``p.data`` returns a :class:`GuardedView` at once: a view of the
   chunk's storage that stays guarded for its whole life, as does any result of an op that
   aliases a chunk (``p[0]``, ``p.view(-1)``, ``p.detach()``): it is valid whenever it is
   used, however long it is kept. A view taken before the chunks were re-packed (the first
   ``optimizer.step()``, rule 2 there) no longer aliases its parameter: using it raises
   :class:`StatesUsageError` instead of reading another parameter's bytes.
4. Writes: an op that changes a guarded tensor (its version counter moves: in-place ops,
   ``out=``, ``nn.init``, ``copy_``) is a write. The device copy is written home at once
   (NVMe homes included) and, with fp32 masters, the master takes the new working values, as
   ``load_state_dict`` does; so the next forward, the optimizer and a checkpoint all see it.
   A write to a chunk a declared loop has already stepped in this window (NOTE [ Declared
   steps ]) cannot come before that step as it would in plain PyTorch: it raises
   :class:`StatesUsageError`. ``p.data = t`` copies ``t`` in when shape and dtype match
   (raises otherwise). ``p.set_(...)`` never reaches ``__torch_function__`` and is not
   supported: the parameter would leave its chunk, and its next guarded use raises as a stale
   view's does (rule 3).
5. Autograd: an op recorded by autograd (grad mode on, a parameter that requires grad: an L2
   penalty written by hand, a module using a parameter it does not own) runs on a copy of the
   values made by :class:`_Materialized`, whose backward hands the gradient to the parameter
   itself: backward never reads the chunk, which may be released by then. An in-place op on such
   a parameter raises as PyTorch does for a leaf that requires grad.
6. Copies: ``copy.deepcopy`` and ``pickle``/``torch.save`` of a guarded tensor give a plain
   ``nn.Parameter``/tensor with the true values (``tiermem.states.copies`` does the same for a
   whole model, leaving tiermem's hooks behind).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tiermem.registry import Priority
from tiermem.states.errors import StatesUsageError

if TYPE_CHECKING:
    from tiermem.states.chunks import Chunk
    from tiermem.states.facts import Lifecycle, ModelFacts
    from tiermem.states.homes import Homes
    from tiermem.states.store import ChunkStore

__all__ = ["GuardedParameter", "GuardedView", "ParameterAccess", "internal"]

_T = torch.Tensor
_NO_FETCH: frozenset[Callable[..., Any]] = frozenset(
    [
        getattr(_T, name).__get__
        for name in (
            "grad",
            "shape",
            "dtype",
            "device",
            "requires_grad",
            "is_leaf",
            "grad_fn",
            "_version",
            "ndim",
            "layout",
            "names",
            "is_cuda",
            "is_cpu",
            "is_meta",
            "is_sparse",
            "is_quantized",
            "is_mkldnn",
            "is_nested",
            "itemsize",
            "nbytes",
            "_base",
            "output_nr",
            "_backward_hooks",
            "_post_accumulate_grad_hooks",
            "retains_grad",
            "_cdata",
            "is_xpu",
            "is_mps",
            "_grad_fn",
            "_grad",
        )
        if hasattr(_T, name)
    ]
    + [
        getattr(_T, name).__set__
        for name in (
            "grad",
            "requires_grad",
            "_backward_hooks",
            "_post_accumulate_grad_hooks",
            "_grad",
            "_grad_fn",
        )
        if hasattr(_T, name)
    ]
    + [
        getattr(_T, name)
        for name in (
            "size",
            "dim",
            "numel",
            "nelement",
            "stride",
            "storage_offset",
            "is_contiguous",
            "element_size",
            "untyped_storage",
            "data_ptr",
            "is_floating_point",
            "is_complex",
            "requires_grad_",
            "register_hook",
            "register_post_accumulate_grad_hook",
            "retain_grad",
            "__len__",
            "get_device",
            "is_inference",
            "is_signed",
            "_is_view",
            "__hash__",
            "_typed_storage",
            "storage",
            "__dir__",
            "is_pinned",
        )
        if hasattr(_T, name)
    ]
)
_DATA_GET = _T.data.__get__
_DATA_SET = _T.data.__set__
#: ops whose result autograd never records: they run on the real bytes, as outside grad mode
_UNRECORDED = frozenset([_T.detach, torch.detach] + [getattr(_T, n) for n in ("equal", "allclose", "tolist", "item")])
#: ops that print a tensor
_PRINTS = frozenset([_T.__repr__, _T.__str__, _T.__format__])
#: ops that hand the memory itself to another library, which would outlive the chunk's bytes: they get a copy
_EXPORTS = frozenset(getattr(_T, n) for n in ("numpy", "__array__", "__dlpack__") if hasattr(_T, n))

_STATE = threading.local()
#: id(parameter) -> the access of the manager that owns it
_OWNERS: dict[int, weakref.ref[ParameterAccess]] = {}


def _inside() -> bool:
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """tiermem's own code touching parameters: guarded tensors behave as plain ones (no fetch).
    Used where the manager knows the bytes it touches (moving, restoring, re-packing)."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def _plain(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class _Guarded:
    """What :class:`GuardedParameter` and :class:`GuardedView` share (rules 2-6)."""

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _NO_FETCH or _inside():
            return _plain(func, args, kwargs)
        if func == _DATA_SET:
            return _access_of(args[0]).assign(args[0], args[1])
        if func == _DATA_GET:
            return _access_of(args[0]).view_of(args[0], _plain(func, args, kwargs))
        if func in _EXPORTS:
            return _exported(func, args, kwargs)
        return _run(func, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        value = _value_copy(self)  # type: ignore[arg-type]
        result = nn.Parameter(value, self.requires_grad) if isinstance(self, nn.Parameter) else value  # type: ignore[attr-defined]
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto: Any) -> Any:
        value = _value_copy(self)  # type: ignore[arg-type]
        if isinstance(self, nn.Parameter):
            return (torch._utils._rebuild_parameter, (value, self.requires_grad, OrderedDict()))
        return value.__reduce_ex__(proto)


class GuardedParameter(_Guarded, nn.Parameter):
    """A managed parameter whose chunk no module is using (rule 2): ops fetch its bytes first."""


class GuardedView(_Guarded, torch.Tensor):
    """A view of a managed chunk handed to user code (rule 3): ops fetch its bytes first."""

    _tiermem_owner: tuple[ParameterAccess, int]


def _value_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The true values of a guarded tensor, as a plain tensor of their own."""
    return _run(_T.clone, (tensor,), {"memory_format": torch.preserve_format}, record=False)


def _exported(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``numpy()``, ``__array__`` and DLPack of a guarded tensor: memory shared with another
    library would outlive the chunk's bytes, so it gets a copy of the values; a NumPy copy is
    read-only, so a write meant for the parameter fails loudly instead of being lost."""
    out = _plain(func, (_value_copy(args[0]), *args[1:]), kwargs)
    if hasattr(out, "flags"):
        out.flags.writeable = False
    return out


def _printable(tensor: Any) -> Any:
    """A plain alias of ``tensor`` that prints as the plain parameter or tensor would."""
    if not isinstance(tensor, _Guarded):
        return tensor
    return tensor.detach().requires_grad_(tensor.requires_grad)  # type: ignore[attr-defined]


def _access_of(tensor: torch.Tensor) -> ParameterAccess:
    owner = getattr(tensor, "_tiermem_owner", None) if type(tensor) is GuardedView else None
    if owner is not None:
        access: ParameterAccess | None = owner[0]
    else:
        ref = _OWNERS.get(id(tensor))
        access = ref() if ref is not None else None
    if access is None:
        raise StatesUsageError(
            "tiermem parameter access: this tensor belonged to a managed model whose Runtime has closed; "
            "use the model's parameters themselves (ordinary tensors again)"
        )
    return access


def _run(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *, record: bool = True) -> Any:
    """Rules 2, 4, 5: ``func`` over the guarded tensors among its arguments, with their chunks
    resident and pinned for its duration."""
    flat, _ = tree_flatten((args, kwargs))
    guarded = [t for t in flat if isinstance(t, _Guarded)]
    by_access: dict[int, tuple[ParameterAccess, list[torch.Tensor]]] = {}
    for t in guarded:
        access = _access_of(t)  # type: ignore[arg-type]
        by_access.setdefault(id(access), (access, []))[1].append(t)  # type: ignore[arg-type]
    with contextlib.ExitStack() as stack:
        for access, tensors in by_access.values():
            stack.enter_context(access.resident(tensors))
        if func in _PRINTS:  # printed as the plain tensor would be: no subclass name, no grad_fn
            with torch._C.DisableTorchFunctionSubclass():
                return func(_printable(args[0]), *args[1:], **kwargs)
        if record and func not in _UNRECORDED and torch.is_grad_enabled() and any(t.requires_grad for t in guarded):
            return _run_recorded(func, args, kwargs, guarded)
        versions = [t._version for t in guarded]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            written = [t for t, v in zip(guarded, versions, strict=True) if t._version != v]
        for access, _tensors in by_access.values():
            mine = [t for t in written if _access_of(t) is access]
            if mine:
                access.written(mine)
        return _wrap_views(out, guarded)


def _wrap_views(out: Any, guarded: list[torch.Tensor]) -> Any:
    """Results that alias a chunk come back guarded (rule 3); the others are the caller's own."""
    if isinstance(out, torch.Tensor):
        if any(out is t for t in guarded) or type(out) is not torch.Tensor:
            return out
        for t in guarded:
            with torch._C.DisableTorchFunctionSubclass():
                same = out.untyped_storage()._cdata == t.untyped_storage()._cdata
            if same:
                return _access_of(t).view_of(t, out)
        return out
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return type(out)(_wrap_views(o, guarded) for o in out)
    return out


class _Materialized(torch.autograd.Function):
    """Rule 5: a parameter's values as a tensor of their own; the gradient goes to the parameter."""

    @staticmethod
    def forward(param: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return param.detach().clone(memory_format=torch.preserve_format)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _run_recorded(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], guarded: list[torch.Tensor]
) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        copies = {id(t): _Materialized.apply(t) for t in guarded}
        versions = {id(t): c._version for t, c in ((t, copies[id(t)]) for t in guarded)}

        def swap(x: Any) -> Any:
            return copies.get(id(x), x) if isinstance(x, torch.Tensor) else x

        new_args = torch.utils._pytree.tree_map(swap, list(args))
        new_kwargs = torch.utils._pytree.tree_map(swap, kwargs)
        out = func(*new_args, **new_kwargs)
        if any(copies[id(t)]._version != versions[id(t)] for t in guarded if t.requires_grad):
            raise RuntimeError(
                "a leaf Variable that requires grad is being used in an in-place operation. "
                "(tiermem: write managed parameters under torch.no_grad())"
            )
        if any(copies[id(t)]._version != versions[id(t)] for t in guarded):
            raise StatesUsageError(
                "tiermem parameter access: an in-place op that autograd records wrote a view of a managed "
                "parameter; write parameters under torch.no_grad()"
            )
    return out


class ParameterAccess:
    """One manager's guarded parameters: which class each has, and the fetches and write-backs
    their ops need (NOTE [ Parameter access ])."""

    def __init__(
        self,
        facts: ModelFacts,
        store: ChunkStore,
        homes: Homes,
        lifecycle: Lifecycle,
        stepped_early: Callable[[Chunk], bool],
    ) -> None:
        self.facts = facts
        self.store = store
        self.homes = homes
        self.lifecycle = lifecycle
        self.stepped_early = stepped_early
        for p in facts.params:
            _OWNERS[id(p)] = weakref.ref(self)

    def close(self) -> None:
        """Every parameter back to ``nn.Parameter``; views left in user code refuse from now on."""
        for chunk in self.store.chunks:
            chunk.unguard()
        for p in self.facts.params:
            if type(p) is GuardedParameter:
                p.__class__ = nn.Parameter
            ref = _OWNERS.get(id(p))
            if ref is not None and ref() is self:
                del _OWNERS[id(p)]

    # -- what the torch function handler asks ----------------------------------------------------
    def _index(self, tensor: torch.Tensor) -> int:
        owner = getattr(tensor, "_tiermem_owner", None) if type(tensor) is GuardedView else None
        return owner[1] if owner is not None else self.facts.index[id(tensor)]

    def _chunk(self, tensor: torch.Tensor) -> Chunk:
        """The chunk ``tensor`` views now; a view of chunks since re-packed refuses (rule 3)."""
        self.lifecycle.check_usable()
        chunk = self.store.slots[self._index(tensor)][0]
        with torch._C.DisableTorchFunctionSubclass():
            current = tensor.untyped_storage()._cdata == chunk.data.untyped_storage()._cdata
        if not current:
            raise StatesUsageError(
                "tiermem parameter access: this view of a managed parameter was taken before its chunks were "
                "re-packed (by the first-step plan, as the first training forward starts or at the first "
                "optimizer.step(), or by an execution-order re-pack); take the view again from the parameter"
            )
        return chunk

    def view_of(self, source: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """``view`` (aliasing ``source``'s chunk) as a :class:`GuardedView`."""
        index = self._index(source)
        out = view.as_subclass(GuardedView)
        out._tiermem_owner = (self, index)
        return out

    @contextlib.contextmanager
    def resident(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """The chunks of ``tensors`` fetched (DEMAND) and pinned while the op runs."""
        chunks = tuple(sorted({id(c): c for c in (self._chunk(t) for t in tensors)}.values(), key=lambda c: c.index))
        pool = self.store.pool
        pinned: list[Chunk] = []
        try:
            for chunk in chunks:
                pool.fetch(chunk, Priority.DEMAND, chunks)
            for chunk in chunks:
                pool.wait(chunk)
                chunk.pins += 1
                pinned.append(chunk)
            yield
        finally:
            for chunk in pinned:
                chunk.pins -= 1

    def written(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rule 4: the chunks of ``tensors`` were written: their homes (and masters) follow now."""
        chunks = {id(c): c for c in (self._chunk(t) for t in tensors)}.values()
        for chunk in chunks:
            if self.stepped_early(chunk):
                raise StatesUsageError(
                    f"tiermem parameter access: chunk {chunk.index} already stepped during backward (a declared "
                    "loop steps offloaded chunks early), so this write would land after its step instead of "
                    "before it; edit parameters after optimizer.step() or before backward, or do not declare "
                    "grad_accumulation_steps"
                )
            if chunk.master_scale > 1:
                with self.homes.writable(chunk) as home:
                    for slot in chunk.layout.slots:
                        slot.master_view(home, 0, chunk.master_scale).copy_(slot.view(chunk.data))
            if not chunk.persistent:
                self.store.pool.write_home(chunk)
            self.store.generation += 1
            self.homes.forget()

    def assign(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """``p.data = value`` (rule 4): copy in, when it fits the parameter as it is."""
        if value.shape != param.shape or value.dtype != param.dtype:
            raise StatesUsageError(
                f"tiermem parameter access: p.data = t with t of shape {list(value.shape)} and {value.dtype} would "
                f"replace a managed parameter of shape {list(param.shape)} and {param.dtype}; copy values of the "
                "parameter's shape and dtype in (p.data = t does that), or change the model before rt.manage()"
            )
        with torch.no_grad():
            _run(_T.copy_, (param, value), {}, record=False)
