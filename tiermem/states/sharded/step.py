"""The optimizer step of FSDP2 shards over optimizer states held in chunks (rules 5-7 of NOTE
[ Sharded model states ] in :mod:`tiermem.states.sharded.manager`).

:class:`ShardSteps` owns the state chunks (their homes, through registry handles only) and each
parameter's scalar state (``step``). It may touch: the chunks' homes (``move_to`` / ``wait`` /
``tensor`` / ``read_out``: NOTE [ Managed object rules ]), and each FSDP2 parameter's local
shard and gradient through plain-tensor aliases; never FSDP2's storage layout or its buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiermem.errors import TierCapacityError
from tiermem.layout.chunks import ChunkLayout, Slot
from tiermem.layout.placement import STAGED_HOMES
from tiermem.registry import Handle, ObjectState, Priority, Registry
from tiermem.states.core import ParamState, same
from tiermem.states.errors import StatesMemoryError, StatesUsageError
from tiermem.states.optimizer import ManagedOptimizer, run_step


@dataclass(eq=False)
class StateChunk:
    """One chunk of optimizer states: ``sections`` sections of ``layout.nbytes`` bytes, section
    ``k`` holding state ``names[k]`` of every slot at the slot's offset (chunk layout rule 3)."""

    layout: ChunkLayout
    home_tier: str
    home: Handle | None = None

    @property
    def index(self) -> int:
        return self.layout.index


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself for a plain one), no autograd."""
    with torch.no_grad():
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # type: ignore[no-any-return]


def state_view(data: torch.Tensor, base: int, slot: Slot, local: torch.Tensor) -> torch.Tensor:
    """Rule 2: the first ``local.numel()`` elements of ``slot`` in a section, shaped as the local
    shard (a rank's shard may be shorter than the padded slot)."""
    start = base + slot.offset
    nbytes = local.numel() * local.element_size()
    return data[start : start + nbytes].view(slot.dtype).view(local.shape)


class ShardSteps:
    """Chunk steps, and state export and import, over the chunks of one sharded model."""

    def __init__(
        self,
        registry: Registry,
        params: Sequence[nn.Parameter],
        names: tuple[str, ...],
        optimizer_class: type[torch.optim.Optimizer],
        staging: str,
    ) -> None:
        self.registry = registry
        self.params = list(params)
        self.names = names
        self.optimizer_class = optimizer_class
        #: the memory tier where the step runs: where the parameters are (rule 5)
        self.staging = staging
        self.chunks: list[StateChunk] = []
        self.records: dict[int, ParamState] = {}
        #: homes off home at once, as the plan has room for (NOTE [ Default placement rule ] rule 3)
        self.staged_homes = STAGED_HOMES

    @property
    def sections(self) -> int:
        return len(self.names)

    def build(self, layouts: Sequence[ChunkLayout], homes: Sequence[str], staged_homes: int = STAGED_HOMES) -> None:
        """Register every chunk's home (zeros) on its tier, as a registry object of kind "chunk";
        ``staged_homes``: homes the plan has room to stage at once (one: none is prefetched)."""
        self.staged_homes = staged_homes
        for layout, tier in zip(layouts, homes, strict=True):
            chunk = StateChunk(layout, tier)
            self.chunks.append(chunk)
            if not self.sections:
                continue
            nbytes = layout.nbytes * self.sections
            device = self.registry.device if tier == "device" else torch.device("cpu")
            try:
                chunk.home = self.registry.register(
                    torch.zeros(nbytes, dtype=torch.uint8, device=device),
                    tier,
                    dedup=False,
                    kind="chunk",
                    label="chunk home",
                )
            except TierCapacityError as exc:
                raise StatesMemoryError.tier_full(
                    exc, f"chunk {layout.index}'s states", " or plan state_home elsewhere", sharded=True
                ) from exc

    def free(self) -> None:
        for chunk in self.chunks:
            if chunk.home is not None:
                chunk.home.free()
                chunk.home = None
        self.chunks = []
        self.records.clear()

    # -- homes where the step reads and writes them (rule 5) ------------------------------------
    def in_place(self, chunk: StateChunk) -> bool:
        """The home is in memory the parameters' device can address: stepped where it lives."""
        if chunk.home_tier == "nvme":
            return False
        where = self.registry.device if chunk.home_tier == "device" else torch.device("cpu")
        return where.type == (self.registry.device if self.staging == "device" else torch.device("cpu")).type

    @contextlib.contextmanager
    def writable(self, chunk: StateChunk) -> Iterator[torch.Tensor]:
        """The chunk's home bytes where the step can write them: in place, or staged on the
        staging tier (DEMAND) and written back home after (WRITEBACK)."""
        handle = chunk.home
        assert handle is not None
        if self.in_place(chunk):
            handle.wait()
            yield handle.tensor(chunk.home_tier)
            return
        self._stage(chunk, Priority.DEMAND)
        handle.wait()
        try:
            yield handle.tensor(self.staging)
        finally:
            handle.move_to(chunk.home_tier, Priority.WRITEBACK)

    def _stage(self, chunk: StateChunk, priority: Priority) -> None:
        handle = chunk.home
        assert handle is not None
        try:
            handle.move_to(self.staging, priority)
        except TierCapacityError:
            self.wait_moves(skip=chunk)  # earlier homes' write-backs free the room when they land
            try:
                handle.move_to(self.staging, priority)
            except TierCapacityError as exc:
                raise StatesMemoryError.tier_full(
                    exc, f"staging chunk {chunk.index}'s states for its step", sharded=True
                ) from exc

    def prefetch(self, chunk: StateChunk) -> None:
        """Stage ``chunk``'s home ahead of its step while fewer than ``staged_homes`` are off home.
        With room for one home, none is prefetched: the step that stages its own would otherwise
        find the room taken by the next one's."""
        if chunk.home is None or self.in_place(chunk) or self.staged_homes < 2:
            return
        away = sum(
            1
            for c in self.chunks
            if c.home is not None
            and c is not chunk
            and (c.home.state is ObjectState.MOVING or c.home.tier != c.home_tier)
        )
        if away < self.staged_homes:
            with contextlib.suppress(TierCapacityError):  # no room yet: the step stages it on demand
                chunk.home.move_to(self.staging, Priority.PREFETCH)

    def wait_moves(self, skip: StateChunk | None = None) -> None:
        for chunk in self.chunks:
            if chunk is not skip and chunk.home is not None and chunk.home.state is ObjectState.MOVING:
                chunk.home.wait()

    # -- the step (NOTE [ Exact optimizer step ]) -------------------------------------------------
    def step_chunk(
        self,
        chunk: StateChunk,
        slots: Sequence[Slot],
        optimizer: ManagedOptimizer,
        group_of: Mapping[int, int],
        attributes: Mapping[str, Any],
    ) -> None:
        """Rule 5: torch's own step of ``optimizer_class`` over aliases of the local shards, with
        state entries viewing the chunk's sections."""
        if chunk.home is None:
            self._step(chunk, None, slots, optimizer, group_of, attributes)
            return
        with self.writable(chunk) as data:
            self._step(chunk, data, slots, optimizer, group_of, attributes)

    def _step(
        self,
        chunk: StateChunk,
        data: torch.Tensor | None,
        slots: Sequence[Slot],
        optimizer: ManagedOptimizer,
        group_of: Mapping[int, int],
        attributes: Mapping[str, Any],
    ) -> None:
        layout_bytes = chunk.layout.nbytes
        aliases: dict[int, torch.Tensor] = {}
        locals_: dict[int, torch.Tensor] = {}
        for slot in slots:
            p = self.params[slot.index]
            local = local_of(p)
            alias = local.detach()  # a fresh leaf over the shard's storage: the update lands in FSDP2's
            assert p.grad is not None
            alias.grad = local_of(p.grad)
            aliases[slot.index], locals_[slot.index] = alias, local
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for slot in slots:
            record = self.records.get(slot.index)
            if record is not None:
                assert data is not None
                state[aliases[slot.index]] = {
                    key: state_view(data, self.names.index(key) * layout_bytes, slot, locals_[slot.index])
                    if key in self.names
                    else record.scalars[key]
                    for key in record.keys
                }
        by_group: dict[int, list[torch.Tensor]] = {}
        for slot in slots:
            by_group.setdefault(group_of[id(self.params[slot.index])], []).append(aliases[slot.index])
        groups = [(optimizer.param_groups[g], members) for g, members in sorted(by_group.items())]
        try:
            after = run_step(self.optimizer_class, optimizer.defaults, groups, state, attributes)
            for slot in slots:  # states the step created lazily move into the chunk
                alias = aliases[slot.index]
                entry = after.get(alias)
                if not entry:
                    continue
                record = ParamState(list(entry))
                for key, value in entry.items():
                    if key in self.names and isinstance(value, torch.Tensor) and value.shape == alias.shape:
                        assert data is not None
                        target = state_view(data, self.names.index(key) * layout_bytes, slot, locals_[slot.index])
                        if not same(value, target):
                            target.copy_(value)
                    else:
                        record.scalars[key] = value
                self.records[slot.index] = record
        finally:
            for alias in aliases.values():
                alias.grad = None

    # -- optimizer state in PyTorch's format (rule 8) ------------------------------------------
    def export_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per parameter, its state as plain FSDP2 + the optimizer holds it: DTensors shaped like
        the parameter (fresh copies on the local shard's device), scalars as they are."""
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for chunk in self.chunks:
            data: torch.Tensor | None = None
            for slot in chunk.layout.slots:
                record = self.records.get(slot.index)
                if record is None:
                    continue
                if data is None and chunk.home is not None:
                    data = self.readable(chunk)
                p = self.params[slot.index]
                local = local_of(p)
                entry: dict[str, Any] = {}
                for key in record.keys:
                    if key in self.names:
                        assert data is not None
                        view = state_view(data, self.names.index(key) * chunk.layout.nbytes, slot, local)
                        entry[key] = as_like(p, view.to(local.device, copy=True))
                    else:
                        value = record.scalars[key]
                        entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                out[p] = entry
        return out

    def readable(self, chunk: StateChunk) -> torch.Tensor:
        """The chunk's home bytes for reading: in place in memory, or read out of NVMe (a fresh tensor)."""
        handle = chunk.home
        assert handle is not None
        handle.wait()
        if chunk.home_tier == "nvme" and handle.tier == "nvme":
            return handle.read_out()
        return handle.tensor(handle.tier)

    def import_state(self, state: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Rule 8: ``state`` (PyTorch's per-parameter format; DTensors like FSDP2's, or tensors of
        the local shard's shape) into the chunks; everything is checked before anything is written."""
        index = {id(p): i for i, p in enumerate(self.params)}
        checked: dict[int, tuple[list[str], dict[str, torch.Tensor], dict[str, Any]]] = {}
        slot_of = {slot.index: (chunk, slot) for chunk in self.chunks for slot in chunk.layout.slots}
        for p, entry in state.items():
            i = index[id(p)]
            tensors, scalars = {}, {}
            for key, value in entry.items():
                if key in self.names:
                    if i not in slot_of:
                        raise StatesUsageError(f"tiermem load_state_dict: parameter {i} keeps no {key!r} state here")
                    tensors[key] = self._local_value(p, key, value)
                else:
                    scalars[key] = value.clone() if isinstance(value, torch.Tensor) else value
            checked[i] = (list(entry), tensors, scalars)
        self.records.clear()
        for chunk in self.chunks:
            mine = [slot for slot in chunk.layout.slots if slot.index in checked and checked[slot.index][1]]
            if mine and chunk.home is not None:
                with self.writable(chunk) as data:
                    for slot in mine:
                        local = local_of(self.params[slot.index])
                        for key, value in checked[slot.index][1].items():
                            base = self.names.index(key) * chunk.layout.nbytes
                            state_view(data, base, slot, local).copy_(value)
        for i, (keys, _, scalars) in checked.items():
            self.records[i] = ParamState(keys, scalars)

    def _local_value(self, p: torch.Tensor, key: str, value: Any) -> torch.Tensor:
        local = local_of(p)
        if not isinstance(value, torch.Tensor):
            raise StatesUsageError(
                f"tiermem load_state_dict: state {key!r} must be a tensor, got {type(value).__name__}"
            )
        if hasattr(value, "placements"):
            if tuple(value.placements) != tuple(p.placements) or tuple(value.shape) != tuple(p.shape):  # type: ignore[attr-defined]
                raise StatesUsageError(
                    f"tiermem load_state_dict: state {key!r} is a DTensor of shape {list(value.shape)} placed "
                    f"{value.placements}, but the parameter is {list(p.shape)} placed {p.placements}"  # type: ignore[attr-defined]
                    "; load it with torch.distributed.checkpoint.state_dict.set_optimizer_state_dict"
                )
            value = local_of(value)
        if tuple(value.shape) != tuple(local.shape):
            raise StatesUsageError(
                f"tiermem load_state_dict: state {key!r} has shape {list(value.shape)} but this rank's shard of the "
                f"parameter is {list(local.shape)}; give each rank its own shard (DTensors, as FSDP2 keeps them)"
            )
        return value.detach()


def as_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor placed like ``param`` (plain FSDP2's optimizer states are), or as it is."""
    if not hasattr(param, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),  # type: ignore[attr-defined]
    )
