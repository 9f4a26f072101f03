"""``p.grad`` of a device parameter whose gradient waits on the host.

# NOTE [ Host gradients ]
1. Between backward and the optimizer step an offloaded chunk's gradients wait on the host
   (rule 4 of NOTE [ Model-state rules ] in ``manager.py``), and user code must see the
   real gradients there (TRAPS 4). On the CPU device ``p.grad`` simply views them. A CUDA
   parameter's ``.grad`` must be on the parameter's device (autograd refuses anything
   else), so there ``p.grad`` is a :class:`HostGradient`: a tensor of the parameter's
   shape, dtype and device that owns no device memory and stands for a view of the host
   gradient (``.host``).
2. Every op on it runs where the user expects, on the device: over a transient device copy
   of the host bytes, and an op that writes it (``mul_``, ``zero_``, ``copy_``, ``add_``,
   GradScaler's unscale, ``out=``) writes the result back to the host. So
   ``clip_grad_norm_``, ``GradScaler`` and reading or editing ``.grad`` by hand get plain
   PyTorch's answers, computed by the same device kernels.
3. One gradient at a time: a foreach op over many tensors (``clip_grad_norm_``'s norms and
   scaling, ``GradScaler.unscale_``) is split into one call per tensor, so the device never
   holds more than one parameter's gradient copy, however many live on the host.
4. Views (``detach``, ``.data``, ``view``, ``t``, ``flatten``...) are HostGradients over the
   matching view of the host bytes, so a write through a view lands in the gradient. They
   do not share the version counter of the tensor they view (autograd's views do): a write
   through a view is invisible to NOTE [ Declared steps ] rule 4's guard, which only
   declared loops use, where nobody edits gradients.
5. A HostGradient is valid until its host bytes move or are freed: the next backward brings
   them back to the device, ``zero_grad`` frees them, a re-pack rebuilds them. Every
   HostGradient of those bytes, views included, shares a lease that the manager retires
   then; an op on a retired one raises :class:`StatesUsageError` (the pinned pool hands
   freed bytes to other objects, so a kept ``g = p.grad`` must not read or write them).
   Read ``p.grad`` again after backward.
6. Cost: an op moves the gradient's bytes to the device, and back when it writes them.
   Declared clipping (``rt.manage(clip_grad_norm=)``) therefore reads the host gradients in
   place instead, with torch's own norm functions (``stepping.py``).
7. The class works on any device: on the CPU device the tests run the manager with host
   gradients behind HostGradients (``ModelStates.proxy_host_gradients``) to check rules
   2-5 bitwise against plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

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


def _is_view(func: torch._ops.OpOverload) -> bool:
    """``func`` returns views of its input (schema ``Tensor(a) self -> Tensor(a)``; rule 4)."""
    schema = func._schema
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


class HostGradient(torch.Tensor):
    """A device tensor whose bytes are ``host``, a view of a gradient on the host (NOTE [ Host gradients ])."""

    host: torch.Tensor
    #: rule 5: shared by every HostGradient of the same bytes; ``[False]`` once they moved
    lease: list[bool]

    @staticmethod
    def __new__(cls, host: torch.Tensor, device: torch.device | str, lease: list[bool] | None = None) -> HostGradient:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, host.shape, strides=host.stride(), dtype=host.dtype, device=device, requires_grad=False
        )
        out.host = host
        out.lease = lease if lease is not None else [True]
        return out

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
        if not all(t.lease[0] for t in mine):
            raise StatesUsageError(
                f"tiermem: {func} on a .grad kept from before its gradient moved (a backward, zero_grad() or a "
                "re-pack since): its host bytes may hold other data now. Read p.grad again "
                "(NOTE [ Host gradients ] rule 5)."
            )
        device = mine[0].device
        if _is_view(func):  # rule 4
            lease = mine[0].lease
            unwrapped = tree_map_only(HostGradient, lambda t: t.host, (args, kwargs))
            views = func(*unwrapped[0], **unwrapped[1])
            return tree_map_only(torch.Tensor, lambda v: HostGradient(v, device, lease), views)
        copies: dict[int, torch.Tensor] = {}

        def to_device(t: HostGradient) -> torch.Tensor:
            if id(t) not in copies:
                copies[id(t)] = t.host.to(device, copy=True)
            return copies[id(t)]

        on_device = tree_map_only(HostGradient, to_device, (args, kwargs))
        out = func(*on_device[0], **on_device[1])
        written = _written(func, args, kwargs)
        for t in written:
            t.host.copy_(copies[id(t)])
        # An in-place op returns the tensor it wrote: the HostGradient, not its transient copy.
        back: dict[int, HostGradient] = {id(copies[id(t)]): t for t in written}
        swap: Callable[[Any], Any] = lambda r: back.get(id(r), r) if isinstance(r, torch.Tensor) else r  # noqa: E731
        return tree_map(swap, out)


def host_bytes(grad: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``grad``'s bytes: its host view for a HostGradient, else itself."""
    return grad.host if isinstance(grad, HostGradient) else grad
