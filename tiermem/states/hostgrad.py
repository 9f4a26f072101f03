"""``p.grad`` of a device parameter whose gradient waits on the host.

# NOTE [ Host gradients ]
1. Between backward and the optimizer step an offloaded chunk's gradients wait on the host
   (rule 4 of NOTE [ Model-state rules ] in ``manager.py``), and user code must see the
   real gradients there (TRAPS 4). A CUDA parameter's ``.grad`` must be on the parameter's
   device (autograd refuses anything else), so there ``p.grad`` is a :class:`HostGradient`:
   a tensor of the parameter's shape, dtype and device that owns no device memory and stands
   for a view of the host gradient (``.host``). On the CPU device ``p.grad`` could simply
   view them, and does for a chunk whose home is in memory; for a chunk whose home is on
   NVMe it is a HostGradient too while the loop may run ahead, so the runtime sees every
   write to it, ``.data`` included, and the plain loop's backward may step that chunk ahead
   (NOTE [ Speculative steps ] rule 3): a plain tensor's ``.data`` can be written with no
   version counter moving. Not with ``[model_states] speculative_steps = "off"``, in a
   declared loop, nor once the loop showed it changes things between backward and the step
   (rule 5 there): nothing runs ahead then, and ``p.grad`` views the host bytes.
2. Every op on it runs where the user expects, on the device: over a transient device copy
   of the host bytes, and an op that writes it (``mul_``, ``zero_``, ``copy_``, ``add_``,
   GradScaler's unscale, ``out=``) writes the result back to the host. So
   ``clip_grad_norm_``, ``GradScaler`` and reading or editing ``.grad`` by hand get plain
   PyTorch's answers, computed by the same device kernels.
3. One gradient at a time: a foreach op over many tensors (``clip_grad_norm_``'s norms and
   scaling, ``GradScaler.unscale_``) is split into one call per tensor, so the device never
   holds more than one parameter's gradient copy, however many live on the host.
4. Views (``detach``, ``.data``, ``view``, ``t``, ``flatten``, and ``unsafe_split`` and its kin,
   whose schemas do not say they alias) are HostGradients over the matching view of the host
   bytes, so a write through a view lands in the gradient. They
   do not share the version counter of the tensor they view (autograd's views do): a write
   through a view moves no version NOTE [ Declared steps ] rule 4's guard reads, so every
   write is counted in ``GradientWrites`` too, which that guard and NOTE [ Speculative steps ]
   compare.
5. A HostGradient is valid until its host bytes move or are freed: the next backward brings
   them back to the device, ``zero_grad`` frees them, a re-pack rebuilds them. Every
   HostGradient of those bytes, views included, shares a lease that the manager retires
   then; an op on a retired one raises :class:`StatesUsageError` (the pinned pool hands
   freed bytes to other objects, so a kept ``g = p.grad`` must not read or write them).
   Read ``p.grad`` again after backward.
6. Metadata: in-place view ops (``t_``, ``transpose_``, ``unsqueeze_``, ``squeeze_``,
   ``as_strided_``, ``swapdims_``, ``detach_``: torch's ``inplace_view`` tag) change the
   HostGradient's own shape and strides and those of a fresh alias of its host view, as
   they do a plain tensor's, and move no bytes. Ops that would change which bytes it stands
   for (``resize_`` to another size, ``set_``), or any op that leaves a written gradient with
   another shape than its host bytes, raise :class:`StatesUsageError` before anything is
   written back. ``copy.deepcopy`` gives a HostGradient over a copy of the host bytes (a
   copied model's gradients stay on the host; the copy is nobody's lease).
7. ``clip_grad_norm_`` by hand takes the path it takes for plain gradients: HostGradient is
   listed in torch's foreach-supported types, so ``_foreach_norm`` and ``_foreach_mul_`` run
   (split per tensor, rule 3) wherever plain gradients would run them, not the per-tensor
   ``vector_norm`` fallback torch takes for tensor subclasses.
8. Cost: an op moves the gradient's bytes to the device, and back when it writes them.
   Declared clipping (``rt.manage(clip_grad_norm=)``) therefore reads the host gradients in
   place instead, with torch's own norm functions (``stepping.py``).
9. The class works on any device: on the CPU device the tests run the manager with every
   host gradient behind a HostGradient (``ModelStates.proxy_host_gradients``) to check rules
   2-7 bitwise against plain PyTorch.
10. On the CPU device the host bytes are where the op runs anyway, so an op that writes no
   gradient, or only its own ``self`` in place (``mul_``, ``zero_``, ``copy_``: an in-place op
   keeps its operand's shape, so rule 6's check cannot fail after the fact), runs over them
   directly, with no transient copy: ``clip_grad_norm_`` by hand reads and scales each gradient
   once, as over plain tensors. Each write is counted (rule 4) before the op runs, since one
   that fails part way (``scatter_`` with an index out of range) may have written some. Any
   other tensor it returns over the host bytes comes back as a HostGradient view. Ops with
   ``out=``, ops that resize, and writes to a stored gradient (whose staged bytes are read-only:
   NOTE [ Stored gradients ]) take rule 2's copy.
11. ``numpy()`` and ``tolist()``, which torch refuses on every tensor subclass, give the
   gradient's values: ``numpy()`` a read-only array of its own (``p.grad.cpu().numpy()`` is a
   logging habit, and on the CPU ``cpu()`` returns the gradient itself), so a write into it
   raises rather than being lost, and no array pins the host bytes (TRAPS 32, 42).
12. ``p.grad.data = t`` (a habit of older code: ``p.grad.data = p.grad.data.clamp(-1, 1)``)
   writes ``t``'s values into the host bytes, counted as a write (rule 4); torch's own
   ``set_data`` would rebind the wrapper and leave ``.host`` as it was, so the step would use
   the old gradient. Another shape or dtype raises, as rule 6's ops do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _foreach_utils
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from tiermem.errors import internal_error
from tiermem.states.errors import StatesUsageError


def _written(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[HostGradient]:
    """The HostGradients ``func`` writes: its arguments marked ``(a!)`` in the schema (rule 2)."""
    out = []
    for position, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[position] if position < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        out.extend(t for t in tree_leaves(value) if isinstance(t, HostGradient))
    return out


#: Ops that return views of their input without saying so in their schema (rule 4).
_UNMARKED_VIEWS = frozenset(
    ("aten::unsafe_split", "aten::unsafe_split_with_sizes", "aten::unsafe_chunk", "aten::_unsafe_view")
)


def _is_view(func: torch._ops.OpOverload) -> bool:
    """``func`` returns views of its input (schema ``Tensor(a) self -> Tensor(a)``; rule 4)."""
    schema = func._schema
    if schema.name in _UNMARKED_VIEWS:
        return True
    if not schema.returns or not schema.arguments:
        return False
    first = schema.arguments[0].alias_info
    if first is None or first.is_write:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


#: Ops that run per tensor over lists (rule 3): torch's foreach, fused and AMP list kernels.
_LIST_OP_PREFIXES = ("aten::_foreach_", "aten::_fused_", "aten::_amp_foreach_")


def _split(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """Rule 3: a foreach-style op over several tensors, run one tensor at a time; (False, None)
    for any other op (sizes, dims, index lists and ``cat``'s inputs are lists too) and for
    lists of one. Only the schema's ``Tensor[]`` and ``Scalar[]`` arguments are split."""
    schema = func._schema
    if not schema.name.startswith(_LIST_OP_PREFIXES):
        return False, None
    split_names = {a.name for a in schema.arguments if str(a.type) in ("List[Tensor]", "List[number]")}
    positions = {i for i, a in enumerate(schema.arguments) if a.name in split_names}
    lengths = {len(v) for i, v in enumerate(args) if i in positions} | {
        len(v) for k, v in kwargs.items() if k in split_names
    }
    if len(lengths) != 1 or (n := lengths.pop()) <= 1:
        return False, None

    def call(k: int) -> Any:
        picked = [[v[k]] if i in positions else v for i, v in enumerate(args)]
        return func(*picked, **{name: [v[k]] if name in split_names else v for name, v in kwargs.items()})

    results = [call(k) for k in range(n)]
    if all(r is None for r in results):
        return True, None
    if all(isinstance(r, (list, tuple)) and len(r) == 1 for r in results):
        return True, [r[0] for r in results]
    raise NotImplementedError(f"tiermem HostGradient: cannot split {func} over its tensor list")


class GradientWrites:
    """Writes to gradients held off the device, process-wide: every one passes through
    :meth:`HostGradient.__torch_dispatch__` (views and ``.data`` included) or the stash of stored
    gradients (a deferred scaling), where ``p.grad``'s version counter need not move (a view's has
    its own, rule 4; a foreach op on a wrapper subclass moves none). NOTE [ Speculative steps ]
    rule 4 in ``speculation.py`` compares it across backward and ``optimizer.step()``."""

    count = 0

    @classmethod
    def note(cls) -> None:
        cls.count += 1


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with the index a tensor made there would name (``cuda`` -> ``cuda:0`` where 0 is
    current). Every real CUDA tensor's device names its index, and assigning ``p.grad`` compares the
    two: a wrapper on an index-less ``cuda`` failed there (TRAPS 40)."""
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        device = torch.empty(0, device=device).device
    return device


class HostGradient(torch.Tensor):
    """A device tensor whose bytes are ``host``, a view of a gradient on the host (NOTE [ Host gradients ])."""

    host: torch.Tensor
    #: rule 5: shared by every HostGradient of the same bytes; ``[False]`` once they moved
    lease: list[bool]
    #: rule 10: on the CPU device, ops run over the host bytes where they can (tests turn it off
    #: to run rule 2's transient copies on the CPU, as every op runs on CUDA)
    ops_over_host_bytes: bool = True

    @staticmethod
    def __new__(cls, host: torch.Tensor, device: torch.device | str, lease: list[bool] | None = None) -> HostGradient:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, host.shape, strides=host.stride(), dtype=host.dtype, device=indexed(device), requires_grad=False
        )
        out.host = host
        out.lease = lease if lease is not None else [True]
        return out

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        """Rule 4: a HostGradient over the same host bytes (torch's own ``.data``, a view)."""
        return torch._C.TensorBase.data.__get__(self, type(self))  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """Rule 12: ``p.grad.data = t`` writes ``t``'s values into the gradient's host bytes, which
        keep their shape and dtype; torch would rebind the wrapper alone, and the write would be lost."""
        self._check_lease(".data =")
        if not isinstance(value, torch.Tensor) or value.shape != self.shape or value.dtype != self.dtype:
            got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
            raise StatesUsageError(
                f"tiermem: .data = {got} on a HostGradient of shape {tuple(self.shape)} and {self.dtype}: its bytes "
                "are a parameter's gradient on the host and keep their shape and dtype; assign a new tensor to "
                "p.grad instead (NOTE [ Host gradients ] rule 12)"
            )
        source = host_bytes(value) if isinstance(value, HostGradient) else value
        self.write_host(source.to(self.host.device))

    def numpy(self, *, force: bool = False) -> Any:
        """Rule 11: the gradient's values as a read-only NumPy array of their own (torch refuses
        ``numpy()`` on tensor subclasses, and an array over the host bytes would pin them)."""
        self._check_lease("numpy()")
        array = self.host.detach().clone().numpy()
        array.flags.writeable = False
        return array

    def tolist(self) -> Any:
        """Rule 11: the gradient's values as nested lists (torch refuses it on tensor subclasses)."""
        self._check_lease("tolist()")
        return self.host.tolist()

    def _check_lease(self, what: str) -> None:
        if not self.lease[0]:
            raise StatesUsageError(
                f"tiermem: {what} on a .grad kept from before its gradient moved (a backward, zero_grad() or a "
                "re-pack since): its host bytes may hold other data now. Read p.grad again "
                "(NOTE [ Host gradients ] rule 5)."
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> HostGradient:
        """Rule 6: a HostGradient over a copy of the host bytes, with a lease of its own."""
        if not self.lease[0]:
            raise StatesUsageError(
                "tiermem: copy.deepcopy of a .grad kept from before its gradient moved; read p.grad again "
                "(NOTE [ Host gradients ] rule 5)"
            )
        if id(self) not in memo:
            memo[id(self)] = HostGradient(self.host.clone(), self.device)
        return memo[id(self)]

    def like(self, view: torch.Tensor) -> HostGradient:
        """Rule 4: a gradient of the same kind and lease standing for ``view``, a view of
        this one's host bytes."""
        return HostGradient(view, self.device, self.lease)

    def write_host(self, value: torch.Tensor) -> None:
        """Rule 2: the result of an op that wrote this gradient, into its host bytes."""
        GradientWrites.note()
        self.host.copy_(value)

    def zero_host_(self) -> None:
        """``zero_grad(set_to_none=False)``: zeros written where the bytes are, no device copy."""
        GradientWrites.note()
        self.host.zero_()

    # Every torch function reaches __torch_dispatch__ as aten ops (the usual wrapper subclass setup).
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"HostGradient(device={self.device}, host={self.host!r})"

    @classmethod
    def __torch_dispatch__(
        cls,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        split, result = _split(func, args, kwargs)
        if split:
            return result
        mine = [t for t in tree_leaves((args, kwargs)) if isinstance(t, HostGradient)]
        for t in mine:
            t._check_lease(str(func))
        device = mine[0].device
        if func in _REFUSED:  # rule 6 (resize_ is tagged inplace_view too)
            _refuse_rebinding(func, args, kwargs)
            return args[0]
        if torch.Tag.inplace_view in func.tags:
            return _change_metadata(func, args, kwargs)
        if _is_view(func):  # rule 4: a view's writes must land in the gradient
            source = mine[0]
            unwrapped = tree_map_only(HostGradient, lambda t: t.host, (args, kwargs))
            views = func(*unwrapped[0], **unwrapped[1])
            return tree_map_only(torch.Tensor, source.like, views)
        written = _written(func, args, kwargs)
        if device.type == "cpu" and HostGradient.ops_over_host_bytes and _in_place_where_they_are(func, args, written):
            return _run_on_host(func, args, kwargs, written)
        copies: dict[int, torch.Tensor] = {}

        def to_device(t: HostGradient) -> torch.Tensor:
            if id(t) not in copies:
                copies[id(t)] = t.host.to(device, copy=True)
            return copies[id(t)]

        on_device = tree_map_only(HostGradient, to_device, (args, kwargs))
        out = func(*on_device[0], **on_device[1])
        for t in written:  # rule 6: never a shape mismatch at write-back
            if copies[id(t)].shape != t.host.shape:
                raise StatesUsageError(
                    f"tiermem: {func} would change a HostGradient's shape from {tuple(t.host.shape)} to "
                    f"{tuple(copies[id(t)].shape)}: its bytes are a parameter's gradient on the host, which keeps "
                    "its shape; use an out-of-place op (NOTE [ Host gradients ] rule 6)"
                )
        for t in written:
            t.write_host(copies[id(t)])
        # An in-place op returns the tensor it wrote: the HostGradient, not its transient copy.
        back: dict[int, HostGradient] = {id(copies[id(t)]): t for t in written}
        swap: Callable[[Any], Any] = lambda r: back.get(id(r), r) if isinstance(r, torch.Tensor) else r  # noqa: E731
        return tree_map(swap, out)


def _in_place_where_they_are(func: torch._ops.OpOverload, args: tuple[Any, ...], written: list[HostGradient]) -> bool:
    """Rule 10: on the CPU device ``func`` may run over the host bytes themselves: it writes no
    gradient, or only its own ``self`` in place (an in-place op keeps its operand's shape; a
    foreach op split to one tensor, rule 3, takes it as a list of one) and that is a gradient
    whose host bytes are its own (a stored gradient's staged bytes are read-only). Never an op
    that resizes (``_resize_output_``, ``resize_as_``): rule 6's check runs before any write-back."""
    name = func._schema.name
    if "resize" in name:
        return False
    if not written:
        return True
    if len(written) != 1 or type(written[0]) is not HostGradient or not args or not name.endswith("_"):
        return False
    first = args[0]
    alone = first[0] if isinstance(first, list) and len(first) == 1 else first
    return alone is written[0] and not func._schema.arguments[0].kwarg_only


def _run_on_host(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    written: list[HostGradient],
) -> Any:
    """Rule 10: ``func`` over the host bytes of every HostGradient in its arguments; what it returns
    of those bytes comes back as the HostGradient that stands for them, or as a HostGradient view
    (rule 4) where it is another tensor over them (``unsafe_split`` is not marked a view)."""
    hosts: dict[int, HostGradient] = {}
    storages: dict[int, HostGradient] = {}

    def unwrap(t: HostGradient) -> torch.Tensor:
        host = t.host  # a stored gradient's staged bytes, read afresh each time
        hosts[id(host)] = t
        storages[host.untyped_storage().data_ptr()] = t
        return host

    unwrapped = tree_map_only(HostGradient, unwrap, (args, kwargs))
    for _ in written:  # before the op: one that fails part way may have written some already
        GradientWrites.note()
    out = func(*unwrapped[0], **unwrapped[1])

    def swap(result: Any) -> Any:
        if not isinstance(result, torch.Tensor) or result.layout is not torch.strided:
            return result  # not a tensor over bytes (a sparse result has no storage to ask)
        if id(result) in hosts:
            return hosts[id(result)]
        over = storages.get(result.untyped_storage().data_ptr())
        return result if over is None else over.like(result)

    return tree_map(swap, out)


#: Ops that would make a HostGradient stand for other bytes (rule 6).
_REFUSED = (torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.source_Storage,
            torch.ops.aten.set_.source_Storage_storage_offset, torch.ops.aten.set_.default)  # fmt: skip


def _refuse_rebinding(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``resize_`` to the size it has is a no-op (and allowed); anything else of ``_REFUSED`` raises."""
    target = args[0]
    if func is torch.ops.aten.resize_.default and tuple(args[1]) == tuple(target.shape):
        return
    raise StatesUsageError(
        f"tiermem: {func} on a HostGradient of shape {tuple(target.shape)}: its bytes are a parameter's gradient "
        "on the host and cannot be resized or replaced; assign a new tensor to p.grad instead "
        "(NOTE [ Host gradients ] rule 6)"
    )


def _change_metadata(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Rule 6: an in-place view op (``t_``...) on a HostGradient: the same op on a fresh alias of
    its host view (other HostGradients of those bytes keep theirs), and on the wrapper's own
    metadata without dispatching (what ``return_and_correct_aliasing`` does for wrapper subclasses)."""
    target = args[0]
    host = target.host
    alias = host.as_strided(host.size(), host.stride(), host.storage_offset())
    func(alias, *args[1:], **kwargs)
    with no_dispatch():
        func(target, *args[1:], **kwargs)
    if alias.shape != target.shape or alias.stride() != target.stride():
        raise internal_error(f"HostGradient {func}: wrapper {target.shape} and host {alias.shape} disagree")
    target.host = alias
    return target


def _list_in_foreach_types() -> None:
    """Rule 7: torch's clipping (and any foreach user) treats HostGradients as it treats plain tensors."""
    supported = getattr(_foreach_utils, "_foreach_supported_types", None)
    if isinstance(supported, list) and HostGradient not in supported:
        supported.append(HostGradient)


_list_in_foreach_types()


def host_bytes(grad: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``grad``'s bytes: its host view for a HostGradient, else itself."""
    return grad.host if isinstance(grad, HostGradient) else grad
