"""What every collaborator of :class:`~tiermem.states.manager.ModelStates` may read: the facts
about the managed model that never change (:class:`ModelFacts`), whether the manager is still
open (:class:`Lifecycle`), the per-use and per-parameter records, and two helpers. Nothing
here holds bytes or touches the registry (NOTE [ Model-state rules ] lives in ``manager.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn

from tiermem.layout.chunks import ChunkLayout, ParamInfo
from tiermem.layout.placement import ChunkNeeds
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesClosedError, StatesUsageError
from tiermem.states.optimizer import coerce_optimizer, element_wise, learn_state
from tiermem.units import format_size


def memory_available(device: torch.device) -> int:
    """Free memory where restored parameters go (a seam for tests)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same bytes seen the same way."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


@dataclass(eq=False)
class Use:
    """One call of a module in a forward with grad: what its backward pins (rule 3)."""

    chunks: tuple[Chunk, ...]
    #: whether its backward reads the parameters' values (so their chunks must be resident)
    reads_values: bool = True
    waiting: int = 0
    #: autograd nodes of this call not run yet, when tracked (rule 3: a later-accumulating parameter)
    nodes: int = 0
    pinned: bool = False
    done: bool = False


@dataclass
class ParamState:
    """A parameter's optimizer state besides its sections: key order and scalars (``step``)."""

    keys: list[str]
    scalars: dict[str, Any] = field(default_factory=dict)


@dataclass
class Snapshot:
    """Per-parameter values a build starts from: data, gradient (or None), optimizer state."""

    data: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    states: dict[int, dict[str, Any]]


def _working_dtype(param_dtype: Any, params: Sequence[nn.Parameter]) -> tuple[torch.dtype | None, int]:
    """``rt.manage(param_dtype=)``: the working dtype and the master scale (chunk layout rule 6)."""
    if param_dtype is None:
        return None, 1
    if param_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"tiermem manage: param_dtype must be torch.bfloat16 or torch.float16 (working parameters with fp32 "
            f"masters), got {param_dtype!r}"
        )
    other = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if other:
        raise StatesUsageError(
            f"tiermem manage: param_dtype={param_dtype} keeps fp32 masters of fp32 parameters, but the model has "
            f"{', '.join(other)} parameters; build the model in float32"
        )
    return param_dtype, 4 // param_dtype.itemsize


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """The managed model as ``rt.manage`` found it: fixed for the manager's whole life."""

    model: nn.Module
    #: the torch device of the device tier
    device: torch.device
    params: list[nn.Parameter]
    #: id(parameter) -> its index in ``params``
    index: dict[int, int]
    #: what packing needs per parameter (in its working dtype)
    info: list[ParamInfo]
    trainable: list[bool]
    #: each module's own parameters: (name, index)
    module_names: dict[nn.Module, list[tuple[str, int]]]
    #: parameters several modules own (tied weights)
    shared: set[int]
    #: parameters the optimizer steps
    optimized: set[int]
    optimizer_class: type[torch.optim.Optimizer]
    #: the optimizer-state sections, in home order (NOTE [ Exact optimizer step ] rule 3)
    state_names: tuple[str, ...]
    #: per parameter index: its state keys that have sections (the rest are small states)
    section_keys: tuple[tuple[str, ...], ...]
    #: per parameter index: every state key the optimizer keeps for it (learned on samples)
    state_keys: tuple[tuple[str, ...], ...]
    #: rt.manage(param_dtype=): the working dtype, None without mixed precision
    param_dtype: torch.dtype | None
    #: fp32 master bytes per working byte (chunk layout rule 6)
    master_scale: int
    #: the parameters of each activation block whose forward may run again in backward
    #: (recompute, chosen or a fallback's): its chunks are all resident at once then
    recomputed: tuple[frozenset[int], ...] = ()

    @classmethod
    def of(
        cls, model: nn.Module, device: torch.device, optimizer: Any, kwargs: Any, param_dtype: Any
    ) -> tuple[ModelFacts, torch.optim.Optimizer]:
        """The facts, and the plain torch optimizer ``optimizer`` (with ``kwargs``) stands for."""
        params = list(model.parameters())
        if not params:
            raise ValueError("tiermem manage: the model has no parameters")
        for p in params:
            if p.layout != torch.strided or p.device.type == "meta":
                raise StatesUsageError(
                    f"tiermem manage: parameters must be dense tensors with data; got {p.layout} on {p.device}"
                )
        index = {id(p): i for i, p in enumerate(params)}
        working, master_scale = _working_dtype(param_dtype, params)
        base = coerce_optimizer(params, optimizer, kwargs or {})
        info = [
            ParamInfo(p.numel() * working.itemsize, tuple(p.shape), working, p.requires_grad)
            if working is not None
            else ParamInfo(p.numel() * p.element_size(), tuple(p.shape), p.dtype, p.requires_grad)
            for p in params
        ]
        module_names: dict[nn.Module, list[tuple[str, int]]] = {}
        for module in model.modules():
            names = [(n, index[id(p)]) for n, p in module._parameters.items() if p is not None]
            if names:
                module_names[module] = names
        layout = learn_state(
            type(base), base.defaults, base.param_groups, torch.float32 if working is not None else None
        )
        owners = Counter(i for names in module_names.values() for _, i in names)
        facts = cls(
            model=model,
            device=device,
            params=params,
            index=index,
            info=info,
            trainable=[p.requires_grad for p in params],
            module_names=module_names,
            shared={i for i, count in owners.items() if count > 1},
            optimized={index[id(p)] for group in base.param_groups for p in group["params"]},
            optimizer_class=type(base),
            state_names=layout.names,
            section_keys=tuple(layout.keys.get(id(p), ()) for p in params),
            state_keys=tuple(layout.all_keys.get(id(p), ()) for p in params),
            param_dtype=working,
            master_scale=master_scale,
        )
        return facts, base

    def param_sections(self, i: int) -> int:
        """Sections parameter ``i`` needs: its last section key's index + 1 (0: nothing steps it,
        or all its state is small, NOTE [ Exact optimizer step ] rule 3)."""
        keys = self.section_keys[i] if i in self.optimized else ()
        return 1 + max(self.state_names.index(k) for k in keys) if keys else 0

    def sections(self, layout: ChunkLayout) -> int:
        """Optimizer-state sections of a chunk's home: what its parameters need, none for a
        chunk nothing steps or whose parameters keep only small states."""
        return max((self.param_sections(s.index) for s in layout.slots), default=0)

    def is_section(self, i: int, key: str) -> bool:
        """State ``key`` of parameter ``i`` lives in a section of its chunk's home."""
        return key in self.section_keys[i]

    def needs(self, layouts: Sequence[ChunkLayout]) -> list[ChunkNeeds]:
        sliceable = element_wise(self.optimizer_class)  # slicing is exact only element-wise
        return [
            ChunkNeeds(layout.nbytes, layout.trainable, self.sections(layout), self.master_scale, sliceable)
            for layout in layouts
        ]

    def tied(self, layout: ChunkLayout) -> bool:
        """Whether the chunk of ``layout`` holds a parameter several modules own (a tied weight)."""
        return any(slot.index in self.shared for slot in layout.slots)

    def min_buffers(self, layouts: Sequence[ChunkLayout]) -> int:
        """Rule 4 of NOTE [ Default placement rule ]: chunks one module spans + shared chunks."""
        where = {slot.index: layout.index for layout in layouts for slot in layout.slots}
        span = max(len({where[i] for _, i in names}) for names in self.module_names.values())
        return span + len({where[i] for i in self.shared})

    def recompute_buffers(self, layouts: Sequence[ChunkLayout]) -> int:
        """Rule 4 of NOTE [ Default placement rule ]: the fewest buffers with which a block that
        may be recomputed runs its forward again inside backward: one module's chunks and the one
        backward holds, at most the block's own span (0: no block is recomputed). Measured: a
        200M LoRA at device 10%, 49 MiB chunks through one buffer, fell back to recompute and
        failed its second step, the recomputed block's first chunk not fitting beside its last;
        two buffers of 4.4 MiB chunks recompute a 12 MiB block."""
        where = {slot.index: layout.index for layout in layouts for slot in layout.slots}
        spans = [len({where[i] for i in block}) for block in self.recomputed if block]
        if not spans:
            return 0
        shared = len({where[i] for i in self.shared})
        return min(max(spans), self.min_buffers(layouts) - shared + 1) + shared

    def param_names(self, indices: list[int]) -> list[str]:
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        return [names.get(id(self.params[i]), f"parameter {i}") for i in indices]


class Lifecycle:
    """Whether the manager is open; after close, whether the parameters were restored."""

    def __init__(self, param_bytes: int) -> None:
        self._param_bytes = param_bytes
        self.closed = False
        self.restored = False

    def check_usable(self) -> None:
        if not self.closed:
            return
        if self.restored:
            raise StatesClosedError(
                "tiermem: the Runtime that managed this model's states has closed; its parameters are ordinary "
                "tensors again. Build a new optimizer over them (or manage the model in a new Runtime)."
            )
        raise StatesClosedError(
            "tiermem: the Runtime that managed this model's states has closed and its parameters did not fit in "
            f"memory ({format_size(self._param_bytes)} needed), so they were not restored. Save "
            "model.state_dict() before leaving `with rt`, or free memory before it closes."
        )
