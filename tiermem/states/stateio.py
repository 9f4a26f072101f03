"""Reading and writing model states in PyTorch's shapes: the model's and the optimizer's state
dicts, re-pack snapshots, and restoring ordinary parameters when the Runtime closes.

:class:`StateIO` owns what a ``load_state_dict`` in progress pinned and whether the current
``state_dict`` keeps variables. It may touch: chunk values (device copies through the pool,
homes through :class:`~tiermem.states.homes.Homes`), the store's optimizer records and
generation, and, when restoring, the parameters' ``.data``/``.grad`` and every chunk's handles.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tiermem.errors import internal_error
from tiermem.layout.chunks import Slot
from tiermem.layout.placement import staging_bytes
from tiermem.registry import Handle, Priority
from tiermem.states import facts as model_facts
from tiermem.states.access import internal
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesUsageError
from tiermem.states.facts import Lifecycle, ModelFacts, ParamState, Snapshot
from tiermem.states.gradients import Gradients
from tiermem.states.homes import Homes
from tiermem.states.materialize import DEFAULT_MIN_BYTES, file_backed_empty, release_file_pages
from tiermem.states.store import ChunkStore
from tiermem.units import ALIGNMENT, format_size

log = logging.getLogger("tiermem.states")


@dataclass(frozen=True)
class StateTensor:
    """One tensor a checkpoint streams for parameter ``index``: its full-precision value (``key``
    None: the fp32 master under mixed precision) or one optimizer-state section (``key``)."""

    index: int
    key: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: the chunk holding it: a checkpoint reads and writes one chunk's tensors together
    chunk: int


_WRITTEN = object()
"""A section tensor :meth:`StateIO.home_filler` wrote into its chunk's home as it was built."""


class SaveGuard(Protocol):
    """An asynchronous checkpoint in progress (NOTE [ Asynchronous saves ] in
    :mod:`tiermem.checkpoint.background`), told on the training thread before chunk bytes change."""

    def pump(self) -> None:
        """A safe point: copy more chunks for the writer."""

    def before_step(self, chunk: Chunk) -> None:
        """``chunk``'s home (or persistent device copy) is about to be stepped: copy it first."""

    def before_move(self, chunk: Chunk) -> None:
        """``chunk``'s home is about to move: let a copy reading it land first."""

    def before_rewrite(self) -> None:
        """Every chunk may change (a re-pack, a state-dict load, closing): copy all left."""


#: where a checkpointed tensor is in copies of its chunk's regions (see :meth:`StateIO.capture_layout`)
CapturedView = Callable[["StateTensor", Sequence[torch.Tensor]], torch.Tensor]


class StateIO:
    """State dicts, snapshots and the restore at close of ``store``'s chunks."""

    def __init__(
        self, facts: ModelFacts, store: ChunkStore, homes: Homes, gradients: Gradients, lifecycle: Lifecycle
    ) -> None:
        self.facts = facts
        self.store = store
        self.homes = homes
        self.gradients = gradients
        self.lifecycle = lifecycle
        #: chunks a load_state_dict in progress pinned
        self._loading: list[Chunk] = []
        self._keep_vars = False
        #: a pending asynchronous checkpoint, told before chunks are rewritten; its copies answer
        #: :meth:`read_tensor` on its writer thread (the only reader while it is pending)
        self.save_guard: SaveGuard | None = None
        self.copied: Callable[[StateTensor], torch.Tensor] | None = None

    def _settle_save(self) -> None:
        if self.save_guard is not None:
            self.save_guard.before_rewrite()

    # -- the optimizer's state -----------------------------------------------------------------
    def export_optimizer_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per-parameter state in PyTorch's shape, as fresh CPU copies."""
        names = self.facts.state_names
        pstate = self.store.pstate
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for chunk in self.store.chunks:
            records = [(s, pstate[s.index]) for s in chunk.layout.slots if s.index in pstate]
            if not records:
                continue
            home = self.homes.readable(chunk) if chunk.home is not None else None
            for slot, record in records:
                entry: dict[str, Any] = {}
                for key in record.keys:
                    if key in record.scalars:
                        value = record.scalars[key]
                        entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    else:
                        view = slot.master_view(home, chunk.section_base(names.index(key)), chunk.master_scale)  # type: ignore[arg-type]
                        entry[key] = view.to("cpu", copy=True)
                out[self.facts.params[slot.index]] = entry
        return out

    def import_optimizer_state(self, state: Mapping[torch.Tensor, Any]) -> None:
        index = self.facts.index
        self.import_states({index[id(p)]: dict(s) for p, s in state.items() if s and id(p) in index})

    def home_filler(
        self, states: Mapping[int, dict[str, Any]], filled: dict[int, dict[int, dict[str, Any]]]
    ) -> Callable[[Chunk, torch.Tensor], bool]:
        """For :meth:`ChunkStore.build`: write ``states``' section tensors into a new chunk's home
        bytes before the home is first written to NVMe, and keep in ``filled`` (by chunk, then
        parameter) each state entry with those tensors marked written, which :meth:`import_states`
        is then given: it writes those chunks' records only, reading neither the home back
        (measured: about a third of a spilled re-pack on the 30M first-step bench) nor the
        snapshot's tensors again. A chunk with a state of another shape is left to the import,
        which says so. It returns whether it wrote any state bytes (the sections are zeros
        otherwise: NOTE [ Managed object rules ] rule 12)."""
        names = self.facts.state_names

        def fill(chunk: Chunk, home: torch.Tensor) -> bool:
            writes, entries = [], {}
            for slot in chunk.layout.slots:
                entry = states.get(slot.index)
                if entry is None:
                    continue
                kept = dict(entry)
                for key, value in entry.items():
                    if self.facts.is_section(slot.index, key) and chunk.sections and isinstance(value, torch.Tensor):
                        if tuple(value.shape) != slot.shape:
                            return False
                        writes.append((slot, chunk.section_base(names.index(key)), value))
                        kept[key] = _WRITTEN
                entries[slot.index] = kept
            for slot, base, value in writes:
                slot.master_view(home, base, chunk.master_scale).copy_(value)
            filled[chunk.index] = entries
            return bool(writes)

        return fill

    def import_states(
        self, states: Mapping[int, dict[str, Any]], filled: Mapping[int, Mapping[int, dict[str, Any]]] | None = None
    ) -> None:
        """Write per-parameter optimizer states (keyed by parameter index) into the chunks;
        ``filled``: chunks whose homes hold their section tensors already, with their entries
        (:meth:`home_filler`)."""
        filled = filled or {}
        self._settle_save()
        names = self.facts.state_names
        pstate = self.store.pstate
        for chunk in self.store.chunks:
            slots = [s for s in chunk.layout.slots if s.index in states or s.index in pstate]
            if not slots:
                continue
            facts = self.facts
            tensors = [
                s
                for s in slots
                if chunk.sections
                and chunk.index not in filled
                and any(facts.is_section(s.index, k) for k in states.get(s.index, {}))
            ]
            # a home too large to stage whole takes each tensor by ranges (NOTE [ Sliced steps ] rule 4)
            ranged = chunk.slice_span is not None and chunk.home is not None and chunk.home.tier == "nvme"
            home_ctx = self.homes.writable(chunk) if tensors and not ranged else contextlib.nullcontext(None)
            with home_ctx as home:
                for slot in slots:
                    entry = filled[chunk.index].get(slot.index) if chunk.index in filled else states.get(slot.index)
                    if not entry:
                        pstate.pop(slot.index, None)
                        continue
                    record = ParamState(list(entry))
                    for key, value in entry.items():
                        if value is _WRITTEN:
                            continue  # written with the home (home_filler)
                        if facts.is_section(slot.index, key) and chunk.sections and isinstance(value, torch.Tensor):
                            if tuple(value.shape) != slot.shape:
                                raise ValueError(
                                    f"tiermem: optimizer state {key!r} has shape {list(value.shape)} but its "
                                    f"parameter has {list(slot.shape)}"
                                )
                            base = chunk.section_base(names.index(key))
                            if ranged:
                                dtype = torch.float32 if chunk.master_scale > 1 else slot.dtype
                                value = value.to("cpu", dtype).contiguous()
                                self.homes.write_range(chunk, base + slot.offset * chunk.master_scale, value)
                            else:
                                slot.master_view(home, base, chunk.master_scale).copy_(value)
                        else:
                            record.scalars[key] = value
                    pstate[slot.index] = record
        self.store.generation += 1

    # -- parameter values ----------------------------------------------------------------------
    def _param_source(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s values (its working dtype) where they are: the device copy when
        resident, else its home (an NVMe home read once per chunk and version)."""
        chunk, slot = self.store.slots[i]
        if chunk.resident:
            self.store.pool.wait(chunk)
            return slot.view(chunk.data)
        return slot.view(self.homes.readable(chunk), chunk.working_base)

    def master_source(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full-precision value where it is: its fp32 master under mixed precision."""
        chunk, slot = self.store.slots[i]
        if chunk.master_scale == 1:
            return self._param_source(i)
        assert chunk.home is not None
        home = self.homes.readable(chunk) if chunk.offloaded else chunk.home.tensor("device")
        return slot.master_view(home, 0, chunk.master_scale)

    def _param_copy(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s values as a fresh CPU tensor of its own (its working dtype)."""
        return self._param_source(i).to("cpu", copy=True)

    def _master_copy(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full-precision value: its fp32 master under mixed precision."""
        return self.master_source(i).to("cpu", copy=True)

    # -- module state dicts (hooks) ------------------------------------------------------------
    def state_dict_started(self, _module: nn.Module, _prefix: str, keep_vars: bool) -> None:
        self._keep_vars = keep_vars

    def state_dict_ended(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        """One CPU tensor per parameter (safetensors refuses shared storage; TRAPS 2)."""
        if self._keep_vars or self.lifecycle.closed:
            return
        for name, i in self.facts.module_names[module]:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = self._param_copy(i)

    def load_started(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        *_: Any,
    ) -> None:
        """Make the module's chunks resident so PyTorch's own loader copies into them."""
        self.lifecycle.check_usable()
        if local_metadata.get("assign_to_params_buffers", False):
            raise StatesUsageError(
                "tiermem: load_state_dict(assign=True) would replace managed parameters; load without assign"
            )
        self._settle_save()
        self.unpin_loading()
        names = self.facts.module_names[module]
        chunks = tuple(
            sorted({self.store.slots[i][0] for name, i in names if prefix + name in state_dict}, key=lambda c: c.index)
        )
        if not chunks:
            return
        pool = self.store.pool
        for chunk in chunks:
            pool.fetch(chunk, Priority.DEMAND, chunks)
        for chunk in chunks:
            pool.wait(chunk)
            chunk.pins += 1
            chunk.dirty = not chunk.persistent
            self._loading.append(chunk)
        self.store.generation += 1

    def load_ended(self, _module: nn.Module, _incompatible: Any) -> None:
        self.unpin_loading()

    def unpin_loading(self) -> None:
        """The loaded chunks are written: their masters take the loaded values (chunk layout
        rule 6), and they may be evicted again."""
        for chunk in self._loading:
            if chunk.master_scale > 1:
                with self.homes.writable(chunk) as home:
                    for slot in chunk.layout.slots:
                        slot.master_view(home, 0, chunk.master_scale).copy_(slot.view(chunk.data))
            chunk.pins -= 1
        self._loading.clear()

    # -- whole-model copies --------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Every parameter's value, gradient and optimizer state as CPU copies (rules 2, 9)."""
        params = self.facts.params
        data = [self._master_copy(i) for i in range(len(params))]
        grads: list[torch.Tensor | None] = [None] * len(params)
        for chunk in self.store.chunks:
            if chunk.grad is None:
                continue
            buffer = self.gradients.grad_bytes(chunk)
            for slot in chunk.layout.slots:
                if self.store.has_grad[slot.index]:
                    grads[slot.index] = slot.view(buffer).to("cpu", copy=True)
        exported = self.export_optimizer_state()
        states = {self.facts.index[id(p)]: s for p, s in exported.items()}
        return Snapshot(data, grads, states)

    def restore(self, spill_to: str | None = None) -> bool:
        """Copy every parameter (and gradient) into an ordinary tensor, chunk by chunk; on the
        CPU device, onto file-backed pages under ``spill_to`` when they exceed the memory tiers'
        capacities (NOTE [ Materialising under rt.init() ] rule 6)."""
        self._settle_save()
        facts, store = self.facts, self.store
        needed = sum(info.nbytes for info in facts.info)
        needed += sum(info.nbytes for info, has in zip(facts.info, store.has_grad, strict=True) if has)
        needed *= store.chunks[0].master_scale if store.chunks else 1  # fp32 masters come back
        ours = sum(store.held_bytes().get(t, 0) for t in ("device", "host")) if facts.device.type == "cpu" else 0
        capacities = sum(store.registry.tier_statistics(t).capacity for t in ("device", "host"))
        if facts.device.type == "cpu" and spill_to is not None and needed > capacities:
            free = shutil.disk_usage(spill_to).free
            if needed > free:  # checked before a byte is written (NOTE [ Materialising under rt.init() ] rule 7)
                log.warning(
                    "tiermem model states: %s of parameters exceed the memory tiers' capacities (%s) and the %s free "
                    "under %s; the model is unusable after the Runtime closed (rt.save a checkpoint before leaving "
                    "it, or free disk space there)",
                    format_size(needed),
                    format_size(capacities),
                    format_size(free),
                    spill_to,
                )
                return False
            log.info(
                "tiermem model states: %s of parameters exceed the memory tiers' capacities (%s); they come back on "
                "file-backed pages under %s",
                format_size(needed),
                format_size(capacities),
                spill_to,
            )
            for chunk in list(store.chunks):
                self._restore_chunk(chunk, spill_to)
            return True
        if needed > model_facts.memory_available(facts.device) + ours:
            log.warning(
                "tiermem model states: %s of parameters do not fit in memory; the model is unusable after the "
                "Runtime closed",
                format_size(needed),
            )
            return False
        for chunk in list(store.chunks):
            self._restore_chunk(chunk)
        return True

    def _restore_chunk(self, chunk: Chunk, spill_to: str | None = None) -> None:
        # Mixed precision restores the fp32 masters (and fp32 gradients): the full-precision
        # model, as the master-weights loop would hand it over.
        scale, base, device = chunk.master_scale, 0, self.facts.device
        if chunk.resident and scale == 1:
            self.store.pool.wait(chunk)
            source = chunk.data
        elif scale > 1 and not chunk.offloaded:
            assert chunk.home is not None
            source = chunk.home.tensor("device")
        else:
            source = self.homes.readable(chunk)
        grads = self.gradients.grad_bytes(chunk) if chunk.grad is not None else None

        def ordinary(like: torch.Tensor) -> torch.Tensor:
            if spill_to is None or like.numel() * like.element_size() < DEFAULT_MIN_BYTES:
                return torch.empty(like.shape, dtype=like.dtype, device=device).copy_(like)
            out = file_backed_empty(spill_to, like.shape, like.dtype).copy_(like)
            release_file_pages(out)  # its pages go back to the file (NOTE [ Materialising under rt.init() ] rule 6)
            return out

        for slot in chunk.layout.slots:
            p = self.facts.params[slot.index]
            value = slot.master_view(source, base, scale)
            p.grad = None
            with internal():  # a new tensor, not a write (NOTE [ Parameter access ] rule 4)
                p.data = ordinary(value)
            if grads is not None and self.store.has_grad[slot.index]:
                p.grad = ordinary(slot.view(grads))
        # Give this chunk's memory back before the next one is copied.
        chunk.empty_storage()
        self.store.free_handles(chunk)
        self.homes.forget()

    # -- checkpoints (NOTE [ Checkpoint rules ] in tiermem.checkpoint) -------------------------
    def checkpoint_tensors(self) -> list[StateTensor]:
        """Every parameter's value and optimizer-state sections, chunk by chunk (no bytes read)."""
        names, pstate, out = self.facts.state_names, self.store.pstate, []
        for chunk in self.store.chunks:
            for slot in chunk.layout.slots:
                dtype = torch.float32 if chunk.master_scale > 1 else slot.dtype
                out.append(StateTensor(slot.index, None, slot.shape, dtype, chunk.index))
                record = pstate.get(slot.index)
                for key in record.keys if record is not None and chunk.sections else ():
                    if key in names and key not in record.scalars:
                        out.append(StateTensor(slot.index, key, slot.shape, dtype, chunk.index))
        return out

    def state_entries(self, i: int) -> dict[str, Any]:
        """Parameter ``i``'s optimizer state in its key order: sections as :class:`StateTensor`
        (read with :meth:`read_tensor`), scalars (``step``) as they are; empty before its first step."""
        record = self.store.pstate.get(i)
        if record is None:
            return {}
        chunk, slot = self.store.slots[i]
        dtype = torch.float32 if chunk.master_scale > 1 else slot.dtype
        return {
            key: record.scalars[key] if key in record.scalars else StateTensor(i, key, slot.shape, dtype, chunk.index)
            for key in record.keys
        }

    def read_tensor(self, tensor: StateTensor) -> torch.Tensor:
        """``tensor``'s bytes where they live, without a copy where they are in memory: valid until
        the next read (an NVMe home is read once per chunk and version, NOTE [ Managed object
        rules ] rule 9, so reading a chunk's tensors together reads its home once); an asynchronous
        save's copies while one is pending."""
        if self.copied is not None:
            return self.copied(tensor)
        if tensor.key is None:
            return self.master_source(tensor.index)
        chunk, slot = self.store.slots[tensor.index]
        section = chunk.section_base(self.facts.state_names.index(tensor.key))
        return slot.master_view(self.homes.readable(chunk), section, chunk.master_scale)

    @contextlib.contextmanager
    def chunk_writer(self, index: int) -> Iterator[Callable[[StateTensor, torch.Tensor], None]]:
        """Write checkpointed values into chunk ``index``: ``put(tensor, value)`` copies into its
        home (an NVMe home staged on the host, written back at exit) and, for a persistent chunk,
        its device copy; a streamed chunk's device copy is released first (it would go stale)."""
        self._settle_save()
        chunk = self.store.chunks[index]
        if not chunk.persistent and not chunk.offloaded:
            raise internal_error(f"{chunk!r}: a streamed chunk is always offloaded")
        self.store.pool.release(chunk)
        names, scale = self.facts.state_names, chunk.master_scale
        span = self._range_span(chunk)
        staged = chunk.home is not None and span is None
        home_ctx = self.homes.writable(chunk) if staged else contextlib.nullcontext(None)
        try:
            with home_ctx as home:

                def put(tensor: StateTensor, value: torch.Tensor) -> None:
                    slot = self.store.slots[tensor.index][1]
                    if span is not None:  # by ranges, as the home is laid out (no device copy to fill)
                        self._put_ranges(chunk, slot, tensor.key, value, span)
                        return
                    if tensor.key is not None:
                        base = chunk.section_base(names.index(tensor.key))
                        slot.master_view(home, base, scale).copy_(value)  # type: ignore[arg-type]
                        return
                    if chunk.persistent:
                        slot.view(chunk.data).copy_(value)  # the working copy (the master at scale 1)
                    if scale > 1:
                        slot.master_view(home, 0, scale).copy_(value)  # type: ignore[arg-type]
                    if chunk.offloaded:
                        slot.view(home, chunk.working_base).copy_(value)  # type: ignore[arg-type]

                yield put
        finally:
            self.store.generation += 1
            self.homes.forget()

    def staging_room(self) -> int:
        """Host bytes the plan keeps free to stage this model's trainable NVMe homes for its step
        (placement rules 3 and 6: ``staged_homes`` whole homes, or two slices of a sliced one);
        0 without a plan or without such homes. A checkpoint's copies leave this room alone, so a
        save never makes a step short of its staging."""
        plan = self.store.plan
        if plan is None:
            return 0
        stepping = [c.layout for c in self.store.chunks if c.trainable and c.home_tier == "nvme" and not c.persistent]
        return staging_bytes(self.facts.needs(stepping), plan.chunk_size, plan.slice_bytes, plan.staged_homes)

    def _range_span(self, chunk: Chunk) -> int | None:
        """The bytes at a time a load writes ``chunk``'s NVMe home in, when the plan gives it no
        host room to stage whole; None: staged whole. A chunk that steps in slices: its slice
        span. A frozen one, which never steps: the room the plan keeps to stage one trainable
        home (free while nothing steps), at least a page, at most the chunk size."""
        plan = self.store.plan
        if chunk.home is None or chunk.home_tier != "nvme" or chunk.persistent or plan is None:
            return None
        if chunk.slice_span is not None:
            return chunk.slice_span
        if chunk.trainable:
            return None
        stepping = [c.layout for c in self.store.chunks if c.trainable and c.home_tier == "nvme"]
        room = max(
            (n.staged_home_bytes(plan.chunk_size, plan.slice_bytes) for n in self.facts.needs(stepping)), default=0
        )
        return max(ALIGNMENT, min(room, plan.chunk_size) // ALIGNMENT * ALIGNMENT)

    def _put_ranges(self, chunk: Chunk, slot: Slot, key: str | None, value: torch.Tensor, span: int) -> None:
        """:meth:`chunk_writer`'s ``put`` for a home written by ranges: a state section, or the
        parameter's master (fp32 under mixed precision) and its working copy."""
        scale = chunk.master_scale
        if key is not None:
            base = chunk.section_base(self.facts.state_names.index(key))
            dtype = torch.float32 if scale > 1 else slot.dtype
            self.homes.write_range(chunk, base + slot.offset * scale, value.to("cpu", dtype).contiguous(), span)
            return
        if scale > 1:
            self.homes.write_range(chunk, slot.offset * scale, value.to("cpu", torch.float32).contiguous(), span)
        if chunk.offloaded:
            working = value.to("cpu", slot.dtype).contiguous()
            self.homes.write_range(chunk, chunk.working_base + slot.offset, working, span)

    def capture_layout(self, index: int) -> tuple[list[tuple[Handle, int]], CapturedView]:
        """What an asynchronous checkpoint copies of chunk ``index``: ``(handle, nbytes)`` regions
        read from offset 0 (its home, then, for a device-homed chunk at full precision, its device
        copy, which is the master), and where each of its :class:`StateTensor` is in copies of
        them. Bound now: a later re-pack does not change the answer."""
        chunk = self.store.chunks[index]
        device_master = not chunk.offloaded and chunk.master_scale == 1
        regions = [(chunk.home, chunk.home_bytes)] if chunk.home is not None else []
        if device_master:
            assert chunk.dev is not None
            regions.append((chunk.dev, chunk.nbytes))
        slots = {slot.index: slot for slot in chunk.layout.slots}
        bases = {key: chunk.section_base(k) for k, key in enumerate(self.facts.state_names)}
        scale, working = chunk.master_scale, chunk.working_base

        def view(tensor: StateTensor, copies: Sequence[torch.Tensor]) -> torch.Tensor:
            slot = slots[tensor.index]
            if tensor.key is not None:
                return slot.master_view(copies[0], bases[tensor.key], scale)
            if device_master:
                return slot.view(copies[-1])
            return slot.master_view(copies[0], 0, scale) if scale > 1 else slot.view(copies[0], working)

        return regions, view

    def set_scalars(self, i: int, state: Mapping[str, Any] | None) -> None:
        """Parameter ``i``'s optimizer record after a checkpoint load: its keys in order, each a
        scalar's value or None for a section (written with :meth:`chunk_writer`); None: no state yet."""
        if not state:
            self.store.pstate.pop(i, None)
        else:
            self.store.pstate[i] = ParamState(list(state), {k: v for k, v in state.items() if v is not None})
        self.store.generation += 1
