"""Checkpoint access to the optimizer states of an FSDP2-sharded model (rule 9 of NOTE [ Sharded
model states ] in :mod:`tiermem.states.sharded.manager`): the same five calls a checkpoint makes of a
:class:`~tiermem.states.stateio.StateIO` (``checkpoint_tensors``, ``state_entries``,
``read_tensor``, ``chunk_writer``, ``set_scalars``), over this rank's state chunks.

The tensors are this rank's *local* shards of each state (the shape of the parameter's local
shard); the parameters themselves are FSDP2's and a checkpoint reads and writes them as the
DTensors FSDP2 keeps. Bytes are reached only through the chunks' registry handles (NOTE
[ Checkpoint rules ] rule 1): a home is read once per chunk while its tensors are streamed,
and written through :meth:`ShardSteps.writable` (staged and written back for NVMe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tiermem.layout.chunks import Slot
from tiermem.states.facts import ParamState
from tiermem.states.sharded.step import ShardSteps, StateChunk, local_of, state_view
from tiermem.states.stateio import StateTensor


class ShardedStateIO:
    """This rank's optimizer-state chunks as a checkpoint streams them."""

    def __init__(self, steps: ShardSteps) -> None:
        self.steps = steps
        self.slots: dict[int, tuple[StateChunk, Slot]] = {
            slot.index: (chunk, slot) for chunk in steps.chunks for slot in chunk.layout.slots
        }
        #: the home last read (a chunk's tensors are streamed together: one read per chunk)
        self._read: tuple[int, torch.Tensor] | None = None

    def _local(self, i: int) -> torch.Tensor:
        return local_of(self.steps.params[i])

    def checkpoint_tensors(self) -> list[StateTensor]:
        """Every optimizer-state section this rank holds, chunk by chunk (no bytes read); the
        parameters' values are FSDP2's, not listed here."""
        out = []
        for chunk in self.steps.chunks:
            for slot in chunk.layout.slots:
                record = self.steps.records.get(slot.index)
                for key in record.keys if record is not None else ():
                    if key in self.steps.names and key not in record.scalars:  # type: ignore[union-attr]
                        out.append(self._tensor(slot.index, key))
        return out

    def _tensor(self, i: int, key: str) -> StateTensor:
        chunk, slot = self.slots[i]
        return StateTensor(i, key, tuple(self._local(i).shape), slot.dtype, chunk.index)

    def has_section(self, i: int, key: str) -> bool:
        """Whether state ``key`` of parameter ``i`` lives in a chunk (an optimized parameter's
        ``exp_avg``, not its ``step``)."""
        return i in self.slots and key in self.steps.names

    def section(self, i: int, key: str) -> StateTensor:
        """State ``key`` of parameter ``i`` as a load writes it (local shard shape)."""
        return self._tensor(i, key)

    def state_entries(self, i: int) -> dict[str, Any]:
        """Parameter ``i``'s optimizer state in its key order: sections as :class:`StateTensor`,
        scalars (``step``) as they are; empty before its first step."""
        record = self.steps.records.get(i)
        if record is None:
            return {}
        return {key: record.scalars[key] if key in record.scalars else self._tensor(i, key) for key in record.keys}

    def read_tensor(self, tensor: StateTensor) -> torch.Tensor:
        """``tensor``'s bytes where they live (a view, valid until the next read of another chunk)."""
        assert tensor.key is not None
        chunk, slot = self.slots[tensor.index]
        if self._read is None or self._read[0] != chunk.index:
            self._read = None  # the previous chunk's bytes go before the next are read
            self._read = (chunk.index, self.steps.readable(chunk))
        base = self.steps.names.index(tensor.key) * chunk.layout.nbytes
        return state_view(self._read[1], base, slot, self._local(tensor.index))

    @contextlib.contextmanager
    def chunk_writer(self, index: int) -> Iterator[Callable[[StateTensor, torch.Tensor], None]]:
        """Write loaded sections into chunk ``index``: its home where the step writes it (an NVMe
        home staged, and written back when the block ends)."""
        chunk = self.steps.chunks[index]
        self._read = None
        assert chunk.home is not None
        with self.steps.writable(chunk) as data:

            def put(tensor: StateTensor, value: torch.Tensor) -> None:
                assert tensor.key is not None
                slot = self.slots[tensor.index][1]
                base = self.steps.names.index(tensor.key) * chunk.layout.nbytes
                state_view(data, base, slot, self._local(tensor.index)).copy_(value)

            yield put

    def set_scalars(self, i: int, state: Mapping[str, Any] | None) -> None:
        """Parameter ``i``'s record after a load: its keys in order, each a scalar's value or None
        for a section (written with :meth:`chunk_writer`); None: no state yet."""
        if not state:
            self.steps.records.pop(i, None)
        else:
            self.steps.records[i] = ParamState(list(state), {k: v for k, v in state.items() if v is not None})
