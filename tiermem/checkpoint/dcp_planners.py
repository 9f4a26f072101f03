"""DCP planners that stream: a save plans from tensor shapes alone and produces each tensor's
bytes only when DCP's writer asks for it; a load hands DCP's reader a temporary per tensor and
writes it into the chunk's home as soon as it is complete (NOTE [ Checkpoint rules ] rules 1-3
in :mod:`tiermem.checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem

from tiermem.states.stateio import StateTensor

#: a path in the nested state dict, as DCP's flattening records it ("model", name) ...
ObjPath = tuple[Any, ...]
#: which chunk a tensor lives in: (model number, chunk index)
ChunkKey = tuple[int, int]


def stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor with ``shape`` and ``dtype`` and one element of storage: what DCP plans from
    (sizes and properties only), never the bytes. Not a meta tensor: DCP's loader would
    materialise meta tensors on a process group's device."""
    return torch.zeros((), dtype=dtype).expand(shape)


def _in_chunk_order(items: list[Any], chunk_of: Callable[[Any], ChunkKey | None]) -> list[Any]:
    """Rule 2: items outside chunks first, then chunk by chunk (stable), so a chunk's home is
    read or staged once."""
    keyed = [(chunk_of(item), n, item) for n, item in enumerate(items)]
    keyed.sort(key=lambda k: (k[0] is not None, k[0] or (0, 0), k[1]))
    return [item for _, _, item in keyed]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a saved tensor's bytes come from: ``read()`` when DCP's writer resolves it."""

    chunk: ChunkKey
    read: Callable[[], torch.Tensor]


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (flattened keys, DCP's own metadata) over stand-ins."""

    def __init__(self, sources: Mapping[ObjPath, Source]) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.sources = sources
        self._last: torch.Tensor | None = None

    def _source(self, fqn: str) -> Source | None:
        return self.sources.get(tuple(self.mappings.get(fqn, (fqn,))))

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()

        def chunk_of(item: WriteItem) -> ChunkKey | None:
            source = self._source(item.index.fqn)
            return None if source is None else source.chunk

        self.plan = dataclasses.replace(plan, items=_in_chunk_order(plan.items, chunk_of))
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        source = self._source(write_item.index.fqn)
        if source is None:
            return super().resolve_data(write_item)  # buffers, scalars, param groups: real objects
        # TRAPS 31: DCP's writer keeps every tensor it wrote in a dict until the file is done, so
        # each copy handed out here owns its storage (the loader takes it as is, no clone of its
        # own) and is emptied when the next is asked for: the serial loader (rule 2) asks only
        # once the previous one is written.
        self.release()
        data = source.read().detach()
        copy = torch.empty(data.shape, dtype=data.dtype)
        copy.copy_(data)
        self._last = copy
        return copy

    def release(self) -> None:
        """Empty the last copy handed to DCP's writer (written by now)."""
        last, self._last = self._last, None
        if last is not None:
            last.untyped_storage().resize_(0)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a loaded tensor goes: through its chunk's writer (``tensor``), or to ``commit``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk: ChunkKey | None = None
    tensor: StateTensor | None = None
    commit: Callable[[torch.Tensor], None] | None = None


Writer = Callable[[StateTensor, torch.Tensor], None]


class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; managed tensors land in temporaries written into their chunk
    (one chunk's writer open at a time), other tensors (buffers) load in place as DCP does."""

    def __init__(
        self,
        targets: Mapping[ObjPath, Target],
        open_chunk: Callable[[ChunkKey], AbstractContextManager[Writer]],
    ) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.targets = targets
        self.open_chunk = open_chunk
        #: values of BYTE_IO items (param groups, non-tensor scalars), by path
        self.loaded: dict[ObjPath, Any] = {}
        self._remaining: dict[str, int] = {}
        self._temps: dict[str, torch.Tensor] = {}
        self._open: tuple[ChunkKey, contextlib.ExitStack, Writer] | None = None
        #: whether a managed state may have changed (a chunk's writer was opened)
        self.written = False

    def _target(self, fqn: str) -> Target | None:
        return self.targets.get(tuple(self.mappings.get(fqn, (fqn,))))

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()

        def chunk_of(item: ReadItem) -> ChunkKey | None:
            target = self._target(item.dest_index.fqn)
            return None if target is None else target.chunk

        items = _in_chunk_order(plan.items, chunk_of)
        for item in items:
            self._remaining[item.dest_index.fqn] = self._remaining.get(item.dest_index.fqn, 0) + 1
        return dataclasses.replace(plan, items=items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.loaded[tuple(self.mappings.get(fqn, (fqn,)))] = torch.load(value, weights_only=False)
        self._remaining[fqn] -= 1

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        target = self._target(fqn)
        if target is None:
            return super().resolve_tensor(read_item)
        temp = self._temps.get(fqn)
        if temp is None:
            temp = self._temps[fqn] = torch.empty(target.shape, dtype=target.dtype)
        return narrow_tensor_by_index(temp, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        target = self._target(fqn)
        self._remaining[fqn] -= 1
        if target is None or self._remaining[fqn]:
            return
        value = self._temps.pop(fqn)
        if target.commit is not None:
            target.commit(value)
            return
        assert target.chunk is not None and target.tensor is not None
        self._writer(target.chunk)(target.tensor, value)

    def _writer(self, chunk: ChunkKey) -> Writer:
        """Rule 3: the chunk's writer, closing the previous chunk's (its home written back)."""
        if self._open is not None and self._open[0] == chunk:
            return self._open[2]
        self.close()
        self.written = True
        stack = contextlib.ExitStack()
        writer = stack.enter_context(self.open_chunk(chunk))
        self._open = (chunk, stack, writer)
        return writer

    def close(self) -> None:
        """Write back the last chunk written (called once DCP's reader is done, or failed)."""
        opened, self._open = self._open, None
        if opened is not None:
            opened[1].close()

    def pending(self) -> list[str]:
        """Tensors DCP's reader did not complete (none after a successful load)."""
        return sorted(fqn for fqn, left in self._remaining.items() if left)
