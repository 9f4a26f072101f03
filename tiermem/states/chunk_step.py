"""One chunk's optimizer step, split where threads meet: :meth:`ChunkStep.prepare` gathers the
tensors on the training thread (gradient bytes, state views, the user's groups cleaned for a CPU
step), :meth:`ChunkStep.compute` runs torch's own step over them and touches nothing but those
tensors (so it may run on a step thread: NOTE [ Step threads ] in ``step_thread.py``), and
:meth:`ChunkStep.commit` records the new optimizer state on the training thread.

It may touch: the chunk's home bytes as given (already staged in memory), its gradient bytes
through :class:`~tiermem.states.gradients.Gradients` (in ``prepare`` only) and the store's
optimizer records (in ``commit`` only). It never moves a home or a gradient buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tiermem.layout.chunks import Slot
from tiermem.states.chunks import Chunk
from tiermem.states.core import ModelFacts, ParamState, same
from tiermem.states.cpu_step import for_cpu_step
from tiermem.states.gradients import Gradients
from tiermem.states.optimizer import ManagedOptimizer, run_step
from tiermem.states.store import ChunkStore

Groups = list[tuple[dict[str, Any], list[torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One slice of a chunk stepped on its own (NOTE [ Sliced steps ] in ``stepping.py``): its
    slots cut to the slice (:func:`cut_slots`), the slice's home bytes laid out as a chunk's of
    the slice's bytes would be (:class:`~tiermem.states.homes.HomeSlice`) and its gradient bytes."""

    slots: list[Slot]
    home: torch.Tensor
    grads: torch.Tensor
    section_base: Callable[[int], int]
    working_base: int


def cut_slots(slots: Sequence[Slot], lo: int, hi: int) -> list[Slot]:
    """The parts of ``slots`` inside bytes ``[lo, hi)`` of their chunk, as flat slots whose offsets
    count from ``lo`` (NOTE [ Sliced steps ] rule 1: element-wise steps do not see shapes)."""
    cut = []
    for slot in slots:
        start, end = max(slot.offset, lo), min(slot.offset + slot.nbytes, hi)
        if start < end:
            itemsize = slot.dtype.itemsize
            cut.append(Slot(slot.index, start - lo, end - start, ((end - start) // itemsize,), slot.dtype))
    return cut


@dataclasses.dataclass(eq=False)
class ChunkStep:
    """The step of ``slots`` of one chunk over tensors in memory (NOTE [ Exact optimizer step ])."""

    optimizer_class: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: Groups
    state: dict[torch.Tensor, dict[str, Any]]
    attributes: dict[str, Any]
    #: per parameter index: the tensor torch steps (a master view, or the parameter itself)
    objects: dict[int, torch.Tensor]
    #: per (parameter index, state name): the chunk's section view that state lives in
    sections: dict[tuple[int, str], torch.Tensor]
    #: (working copy view, master) pairs refreshed after the step (chunk layout rule 6)
    refresh: list[tuple[torch.Tensor, torch.Tensor]]
    #: the stepped tensors are masters whose ``.grad`` the step lent them
    lent_grads: bool
    #: what :meth:`compute` found: per parameter index, the record :meth:`commit` stores
    records: dict[int, ParamState] = dataclasses.field(default_factory=dict)

    # long: one pass over the chunk's slots per kind of view, kept together so the order stays plain
    @classmethod
    def prepare(
        cls,
        facts: ModelFacts,
        store: ChunkStore,
        gradients: Gradients,
        work: tuple[Chunk, list[Slot], torch.Tensor | None],
        optimizer: ManagedOptimizer,
        group_of: Mapping[int, int],
        attributes: Mapping[str, Any],
        piece: Piece | None = None,
    ) -> ChunkStep:
        """On the training thread: the views of ``work`` (a chunk, the slots that step, and its
        home bytes in memory, staged by the caller), its gradients, states and groups; or of one
        slice of it (``piece``: NOTE [ Sliced steps ] rule 1), whose small states are copies."""
        chunk, slots, home = work
        section_base = chunk.section_base
        if piece is not None:
            slots, home, section_base = piece.slots, piece.home, piece.section_base
        names = facts.state_names
        scale = chunk.master_scale
        objects: dict[int, torch.Tensor] = {}
        if chunk.has_master:
            # The optimizer steps the master (an offloaded home's, or the fp32 master of a working
            # chunk, chunk layout rule 6) with the gradient in its dtype, as a master-weights loop does.
            assert home is not None and chunk.grad is not None
            grads = gradients.grad_bytes(chunk) if piece is None else piece.grads
            for slot in slots:
                master = slot.master_view(home, 0, scale)
                grad = slot.view(grads)
                master.grad = grad.float() if scale > 1 else grad
                objects[slot.index] = master
        else:
            objects = {slot.index: facts.params[slot.index] for slot in slots}
        sections: dict[tuple[int, str], torch.Tensor] = {}
        if home is not None:
            for slot in slots:
                for name in facts.section_keys[slot.index]:
                    base = section_base(names.index(name))
                    sections[slot.index, name] = slot.master_view(home, base, scale)
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for slot in slots:
            record = store.pstate.get(slot.index)
            if record is not None:
                state[objects[slot.index]] = {
                    key: _small(record.scalars[key], piece is not None)
                    if key in record.scalars
                    else sections[slot.index, key]
                    for key in record.keys
                }
        by_group: dict[int, list[torch.Tensor]] = {}
        for slot in slots:
            by_group.setdefault(group_of[id(facts.params[slot.index])], []).append(objects[slot.index])
        groups = [(optimizer.param_groups[g], params) for g, params in sorted(by_group.items())]
        groups, state, cleaned = for_cpu_step(
            facts.device, groups, state, attributes, optimizer_class=facts.optimizer_class
        )
        refresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        if scale > 1:  # the working copy follows the stepped masters (chunk layout rule 6)
            for slot in slots:
                if piece is not None:
                    working = slot.view(home, piece.working_base)
                else:
                    working = slot.view(home, chunk.working_base) if chunk.offloaded else slot.view(chunk.data)
                refresh.append((working, objects[slot.index]))
        return cls(
            facts.optimizer_class,
            dict(optimizer.defaults),
            groups,
            state,
            cleaned,
            objects,
            sections,
            refresh,
            chunk.has_master,
        )

    def compute(self) -> None:
        """torch's step, then the states it created lazily copied into the chunk's sections
        (rule 3 of NOTE [ Exact optimizer step ]): tensors only, no registry, no chunk records."""
        try:
            after = run_step(self.optimizer_class, self.defaults, self.groups, self.state, self.attributes)
            for index, obj in self.objects.items():
                entry = after.get(obj)
                if not entry:
                    continue
                record = ParamState(list(entry))
                for key, value in entry.items():
                    target = self.sections.get((index, key))
                    if (
                        target is not None
                        and isinstance(value, torch.Tensor)
                        and value.shape == target.shape
                        and value.dtype == target.dtype
                    ):
                        if not same(value, target):
                            target.copy_(value)
                    else:
                        record.scalars[key] = value
                self.records[index] = record
            for working, master in self.refresh:
                working.copy_(master)
        finally:
            if self.lent_grads:
                for obj in self.objects.values():
                    obj.grad = None

    def commit(self, store: ChunkStore) -> None:
        """On the training thread, once :meth:`compute` returned: the new optimizer records."""
        store.pstate.update(self.records)


def _small(value: Any, copy: bool) -> Any:
    """A small state (``step``) for a step, a copy when ``copy``: torch's step updates it in place,
    and every slice of a sliced step starts from the value before the step (NOTE [ Sliced steps ])."""
    return value.clone() if copy and isinstance(value, torch.Tensor) else value
