"""One chunk's optimizer step, split where threads meet: :meth:`ChunkStep.prepare` gathers the
tensors on the training thread (gradient bytes, state views, the user's groups cleaned for a CPU
step), :meth:`ChunkStep.compute` runs torch's own step over them and touches nothing but those
tensors (so it may run on a step thread: NOTE [ Step threads ] in ``step_thread.py``), and
:meth:`ChunkStep.commit` records the new optimizer state on the training thread.

It may touch: the chunk's home bytes as given (already staged in memory), its gradient bytes
through :class:`~tiermem.states.gradients.Gradients` (in ``prepare`` only) and the store's
optimizer records (in ``commit`` only). It never moves a home or a gradient buffer.
:class:`SlicedStep` runs the step of a chunk too large to stage whole as ``ChunkStep`` s over
slices of it: it stages and writes back each slice through
:class:`~tiermem.states.homes.Homes` and ``Gradients`` (range copies, no move) and hands each
compute to the step thread.

# NOTE [ Sliced steps ]
1. Which: a trainable chunk whose home is on NVMe and which is larger than the plan's chunk
   size (an outlier's own chunk, NOTE [ Chunk layout rules ] rule 4: a vocabulary's embedding)
   steps in slices of ``chunk_size`` bytes (``Chunk.slice_span``) when its optimizer is
   element-wise (NOTE [ Exact optimizer step ] rule 6); the placement keeps host room for two
   slices, never for its whole home (NOTE [ Default placement rule ] rule 6). A slice is bytes
   ``[lo, hi)`` of the chunk, ``lo`` a multiple of the span, so every range of it is page-aligned
   (O_DIRECT, no read-modify-write); each parameter's part in it steps as a flat tensor
   (``cut_slots``: an element-wise step sees no shapes).
2. Staging: for each slice a host buffer, registered on the host tier, gets the slice's range of
   every section of the home (master, each optimizer state, the working copy under mixed
   precision) through the registry's range copies (``Handle.fill_from`` with offsets, NOTE
   [ Managed object rules ] rule 8: the home stays resident on NVMe, never moves), and the
   range of the gradients: viewed in place where the CPU addresses them (the host, the CPU
   device), else copied in (NVMe, a CUDA device). A slice computes on the step thread while
   the next is read (NOTE [ Step threads ]); when it finishes, its ranges are written back
   (WRITEBACK), and the buffer after next is made only once that write landed: at most two
   slices' bytes are on the host. The chunk's step ends once every write landed, so the next
   forward's fetch reads the stepped bytes. No other NVMe home is prefetched beside a sliced
   step: the slices take that room.
3. Exactness: every slice's step starts from copies of the small states as they were before
   the step (torch's step counts ``step`` in place: shared, it would count once per slice);
   the records after the step (equal in every slice) are kept once all slices stepped. With
   an element-wise optimizer the chunk's step is then bitwise its whole step.
4. Its gradients wait on NVMe between backward and the step whatever ``grad_home`` says (the
   host would hold all of them), and it steps at ``optimizer.step()``, never early in backward
   (NOTE [ Declared steps ] rule 3 stages whole homes). ``p.grad`` of it is a ``StoredGradient``: an op on it stages the
   whole gradient on the host and needs that room (refused with the sizes otherwise); a
   snapshot reads it out without staging. State imports (an optimizer's ``load_state_dict``,
   ``rt.load``, state an optimizer's constructor makes) write its home by ranges through a
   buffer of one slice (``Homes.write_range``); writes to its parameters between steps (NOTE
   [ Parameter access ]) still stage the whole home and need that room.
5. An error in a slice (its compute or I/O) ends the step and is raised: the slices before it
   are stepped in the home, the later ones are not; resume from a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tiermem import tracing
from tiermem.layout.chunks import Slot
from tiermem.states.chunks import Chunk
from tiermem.states.cpu_step import for_cpu_step
from tiermem.states.facts import ModelFacts, ParamState, same
from tiermem.states.gradients import Gradients
from tiermem.states.homes import Homes, HomeSlice
from tiermem.states.optimizer import ManagedOptimizer, run_step
from tiermem.states.step_thread import StepThread
from tiermem.states.store import ChunkStore

Groups = list[tuple[dict[str, Any], list[torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One slice of a chunk stepped on its own (NOTE [ Sliced steps ]): its
    slots cut to the slice (:func:`cut_slots`), the slice's home bytes laid out as a chunk's of
    the slice's bytes would be (:class:`~tiermem.states.homes.HomeSlice`) and its gradient bytes."""

    slots: list[Slot]
    home: torch.Tensor
    grads: torch.Tensor
    section_base: Callable[[int], int]
    working_base: int


def cut_slots(slots: Sequence[Slot], lo: int, hi: int) -> list[Slot]:
    """The parts of ``slots`` inside bytes ``[lo, hi)`` of their chunk, as flat slots whose offsets
    count from ``lo`` (rule 1 of NOTE [ Sliced steps ]: element-wise steps do not see shapes)."""
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

    @classmethod
    def prepare(
        cls,
        facts: ModelFacts,
        store: ChunkStore,
        gradients: Gradients,
        chunk: Chunk,
        slots: list[Slot],
        home: torch.Tensor | None,
        optimizer: ManagedOptimizer,
        group_of: Mapping[int, int],
        attributes: Mapping[str, Any],
        piece: Piece | None = None,
        *,
        copy_small: bool = False,
    ) -> ChunkStep:
        """On the training thread: the views of ``chunk``'s ``slots`` that step in ``home`` (its
        home bytes in memory, staged by the caller), its gradients, states and groups; or of one
        slice of it (``piece``: NOTE [ Sliced steps ] rule 1), whose small states are copies, as
        they are with ``copy_small`` (a step whose records may be dropped: NOTE [ Speculative
        steps ] rule 3)."""
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
                    key: _small(record.scalars[key], piece is not None or copy_small)
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
            # The views into the home go with the compute (only ``records`` is read after it): its
            # write-back may land before the training thread finishes this step (NOTE [ Step threads ]
            # rule 7), and a host block some tensor still views is let go rather than kept for the
            # next staging (NOTE [ Spare tier blocks ] rule 3): 1.7-1.9 GiB of fresh pages a step against
            # 0.44-0.50 on the 210M HF GPT-2 of bench/hf_states.py (declared), and the scheduler thread
            # 0.71-0.82 CPU s against 0.34-0.38.
            self.groups, self.state, self.objects, self.sections, self.refresh = [], {}, {}, {}, []

    def commit(self, store: ChunkStore) -> None:
        """On the training thread, once :meth:`compute` returned: the new optimizer records."""
        store.pstate.update(self.records)


def _small(value: Any, copy: bool) -> Any:
    """A small state (``step``) for a step, a copy when ``copy``: torch's step updates it in place,
    and every slice of a sliced step starts from the value before the step (NOTE [ Sliced steps ])."""
    return value.clone() if copy and isinstance(value, torch.Tensor) else value


class SlicedStep:
    """NOTE [ Sliced steps ]: the step of a chunk too large to stage whole, slice by slice."""

    def __init__(
        self, facts: ModelFacts, store: ChunkStore, gradients: Gradients, homes: Homes, steps: StepThread
    ) -> None:
        self.facts = facts
        self.store = store
        self.gradients = gradients
        self.homes = homes
        self.steps = steps

    def run(
        self,
        chunk: Chunk,
        slots: list[Slot],
        optimizer: ManagedOptimizer,
        group_of: Mapping[int, int],
        attributes: Mapping[str, Any],
    ) -> dict[int, ParamState]:
        """Step ``slots`` of ``chunk`` over slices of ``chunk.slice_span`` bytes, each staged on the
        host, computed (on the step thread while the next is read) and written back (rule 2); the
        optimizer records after the whole step (rule 3). The caller finished every step in flight."""
        span = chunk.slice_span
        assert span is not None and chunk.grad is not None
        records: dict[int, ParamState] = {}
        writing: list[HomeSlice] = []  # slices whose write-back is in flight (rule 2)
        # staged gradient copies (an op on .grad made them) go first: written ones land on NVMe, and
        # the host room is the slices' (NOTE [ Stored gradients ] rule 2)
        self.gradients.stash.release_all()
        # and homes still on their way back to NVMe hold the staged homes' room the slices take:
        # early steps', or steps run ahead whose copies became homes (NOTE [ Speculative steps ] 4)
        self.homes.wait_moves(skip=chunk)
        try:
            for lo in range(0, chunk.nbytes, span):
                hi = min(lo + span, chunk.nbytes)
                cut = cut_slots(slots, lo, hi)
                if not cut:
                    continue
                while writing:  # rule 2: at most two slices' bytes on the host
                    self.homes.free_slice(writing.pop())
                piece = self.homes.stage_slice(chunk, lo, hi, grad_room=not self.gradients.addressable(chunk))
                try:
                    grads = self.gradients.grad_range(chunk, piece)
                    self.homes.wait_slice(piece)
                    if not self.gradients.addressable(chunk):  # a copy: a clip's deferred scaling
                        self.gradients.stash.scale_range(chunk, lo, grads)  # (NOTE [ Stored gradients ] 6b)
                    job = ChunkStep.prepare(
                        self.facts,
                        self.store,
                        self.gradients,
                        chunk,
                        slots,
                        None,
                        optimizer,
                        group_of,
                        attributes,
                        Piece(cut, piece.home(), grads, piece.section_base, piece.working_base),
                    )
                    # the slice in flight ends here, its error raised while this one is still ours to free
                    self.steps.finish_all()
                except BaseException:
                    self.homes.free_slice(piece, quiet=True)
                    raise
                finish = functools.partial(self._finish, chunk, piece, job, records, writing)
                compute = tracing.wrap(job.compute, f"chunk step {chunk.index} compute", "chunk_step")
                self.steps.run(chunk.index, compute, finish)  # slices are host bytes (NOTE [ Step threads ] 2)
            self.steps.finish_all()
            while writing:
                self.homes.free_slice(writing.pop())
        except BaseException:
            with contextlib.suppress(Exception):  # rule 5: the slice in flight ends (and joins ``writing``)
                self.steps.finish_all()
            for piece in writing:
                self.homes.free_slice(piece, quiet=True)
            raise
        return records

    def _finish(
        self,
        chunk: Chunk,
        piece: HomeSlice,
        job: ChunkStep,
        records: dict[int, ParamState],
        writing: list[HomeSlice],
        ok: bool,
    ) -> None:
        """Rule 2, on the training thread once a slice computed: its records kept for the end, its
        bytes written back (a failed slice's are dropped unwritten)."""
        if not ok:
            self.homes.free_slice(piece, quiet=True)
            return
        records.update(job.records)
        self.homes.write_slice(chunk, piece)
        writing.append(piece)
