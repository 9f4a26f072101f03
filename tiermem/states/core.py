"""What the parts of the model-state manager share: per-use and per-parameter records, the
attributes :class:`StatesBase` declares, and two helpers (NOTE [ Model-state rules ] lives in
``manager.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tiermem.errors import TierCapacityError
from tiermem.layout.chunks import ParamInfo, Slot
from tiermem.layout.placement import Plan
from tiermem.registry import Handle, KnownBytes, ObjectState, Registry
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesClosedError, StatesMemoryError
from tiermem.states.optimizer import ManagedOptimizer
from tiermem.states.pool import ChunkPool
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


class StatesBase:
    """Attributes every part of :class:`~tiermem.states.manager.ModelStates` reads; set there."""

    registry: Registry
    device: torch.device
    model: nn.Module
    params: list[nn.Parameter]
    optimizer: ManagedOptimizer
    optimizer_class: type[torch.optim.Optimizer]
    state_names: tuple[str, ...]
    plan: Plan
    chunks: list[Chunk]
    pool: ChunkPool
    _index: dict[int, int]
    _info: list[ParamInfo]
    _trainable: list[bool]
    _module_names: dict[nn.Module, list[tuple[str, int]]]
    #: calls of each module since the root's forward started
    _calls: Counter[nn.Module]
    _slots: list[tuple[Chunk, Slot]]
    _has_grad: list[bool]
    _pstate: dict[int, ParamState]
    _generation: int
    _read_cache: tuple[int, tuple[int, int], torch.Tensor] | None
    _in_backward: bool
    _uses: weakref.WeakSet[Use]
    _waiters: dict[int, weakref.WeakSet[Use]]
    _leaf_hooks: list[RemovableHandle]
    _loading: list[Chunk]
    _sd_keep_vars: bool
    _closed: bool
    #: NOTE [ Host gradients ] rule 6: expose host gradients through HostGradients on the CPU
    #: device too (tests); on CUDA they always are
    proxy_host_gradients: bool = False
    _restored: bool

    # Implemented by BackwardMixin; declared here for the parts that call across.
    def _settle_backward(self) -> None:
        raise NotImplementedError

    _repack_pending: bool
    #: parameters several modules own (tied weights)
    _shared: set[int]

    def _repack(self) -> None:
        raise NotImplementedError

    def _flush(self, chunk: Chunk) -> None:
        raise NotImplementedError

    def _reconcile_grads(self) -> None:
        raise NotImplementedError

    _grad_leases: dict[int, list[bool]]

    def _retire_host_grads(self, chunk: Chunk | None = None) -> None:
        raise NotImplementedError

    def _drop_grads(self, chunk: Chunk) -> None:
        raise NotImplementedError

    def _home_on_host(
        self, chunk: Chunk, known: KnownBytes | None = None
    ) -> contextlib.AbstractContextManager[torch.Tensor]:
        raise NotImplementedError

    # Implemented by StepMixin (NOTE [ Declared steps ]); called from the hooks.
    def _forward_with_grad(self) -> None:
        raise NotImplementedError

    def _arm_early_steps(self) -> None:
        raise NotImplementedError

    def _backward_entered(self, chunk: Chunk) -> None:
        raise NotImplementedError

    def _gradients_complete(self, chunk: Chunk) -> None:
        raise NotImplementedError

    def _backward_ended(self, complete: bool) -> None:
        raise NotImplementedError

    def _grad_bytes(self, chunk: Chunk) -> torch.Tensor:
        raise NotImplementedError

    def _wait_home_moves(self, skip: Chunk | None = None) -> None:
        """Wait until no home but ``skip``'s is moving: write-backs of NVMe homes free the
        host bytes they were staged in when they land."""
        for other in self.chunks:
            if other.home is not None and other is not skip and other.home.state is ObjectState.MOVING:
                other.home.wait()

    def _version(self) -> tuple[int, int]:
        """Changes whenever a chunk's home may have changed (cache key for home reads)."""
        return (self._generation, self.pool.writes)

    def _held_bytes(self) -> dict[str, int]:
        """Bytes this manager holds, per tier."""
        held: dict[str, int] = {}
        for chunk in self.chunks:
            for handle in (chunk.dev, chunk.home, chunk.grad):
                if handle is not None:
                    held[handle.tier] = held.get(handle.tier, 0) + handle.reserved
        return held

    def _register(self, tensor: torch.Tensor, tier: str) -> Handle:
        """Account ``tensor`` (adopted on a memory tier of its device, copied to NVMe)."""
        try:
            return self.registry.register(tensor, tier, dedup=False, kind="chunk")
        except TierCapacityError as exc:
            raise StatesMemoryError(
                f"tiermem model states: {format_size(exc.requested)} do not fit in the {tier} tier "
                f"({format_size(exc.used)} of {format_size(exc.capacity)} in use). Raise [{tier}] capacity or give "
                "plan= fewer persistent chunks or a smaller chunk_size."
            ) from exc

    def _check_usable(self) -> None:
        if self._closed:
            if self._restored:
                raise StatesClosedError(
                    "tiermem: the Runtime that managed this model's states has closed; its parameters are ordinary "
                    "tensors again. Build a new optimizer over them (or manage the model in a new Runtime)."
                )
            raise StatesClosedError(
                "tiermem: the Runtime that managed this model's states has closed and its parameters did not fit in "
                f"memory ({format_size(sum(i.nbytes for i in self._info))} needed), so they were not restored. Save "
                "model.state_dict() before leaving `with rt`, or free memory before it closes."
            )
