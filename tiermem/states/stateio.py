"""Reading and writing model states in PyTorch's shapes: the model's and the optimizer's state
dicts, re-pack snapshots, and restoring ordinary parameters when the Runtime closes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tiermem.errors import TierCapacityError
from tiermem.registry import KnownBytes, Priority
from tiermem.states import core
from tiermem.states.chunks import Chunk
from tiermem.states.core import ParamState, Snapshot, StatesBase
from tiermem.states.errors import StatesMemoryError, StatesUsageError
from tiermem.states.optimizer import ManagedOptimizer
from tiermem.units import format_size

log = logging.getLogger("tiermem.states")


class StateIOMixin(StatesBase):
    """State dicts and restore of :class:`~tiermem.states.manager.ModelStates`."""

    def export_optimizer_state(self, optimizer: ManagedOptimizer) -> dict[torch.Tensor, dict[str, Any]]:
        """Per-parameter state in PyTorch's shape, as fresh CPU copies."""
        self._check_usable()
        self._settle_backward()
        names = self.state_names
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for chunk in self.chunks:
            records = [(s, self._pstate[s.index]) for s in chunk.layout.slots if s.index in self._pstate]
            if not records:
                continue
            home = self._home_readable(chunk) if chunk.home is not None else None
            for slot, record in records:
                entry: dict[str, Any] = {}
                for key in record.keys:
                    if key in record.scalars:
                        value = record.scalars[key]
                        entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    else:
                        view = slot.master_view(home, chunk.section_base(names.index(key)), chunk.master_scale)  # type: ignore[arg-type]
                        entry[key] = view.to("cpu", copy=True)
                out[self.params[slot.index]] = entry
        return out

    def import_optimizer_state(self, optimizer: ManagedOptimizer, state: Mapping[torch.Tensor, Any]) -> None:
        self._check_usable()
        self._import_states({self._index[id(p)]: dict(s) for p, s in state.items() if s and id(p) in self._index})

    def _import_states(self, states: Mapping[int, dict[str, Any]]) -> None:
        """Write per-parameter optimizer states (keyed by parameter index) into the chunks."""
        names = self.state_names
        for chunk in self.chunks:
            slots = [s for s in chunk.layout.slots if s.index in states or s.index in self._pstate]
            if not slots:
                continue
            tensors = [s for s in slots if chunk.sections and any(k in names for k in states.get(s.index, {}))]
            home_ctx = self._home_writable(chunk) if tensors else contextlib.nullcontext(None)
            with home_ctx as home:
                for slot in slots:
                    entry = states.get(slot.index)
                    if not entry:
                        self._pstate.pop(slot.index, None)
                        continue
                    record = ParamState(list(entry))
                    for key, value in entry.items():
                        if key in names and chunk.sections and isinstance(value, torch.Tensor):
                            if tuple(value.shape) != slot.shape:
                                raise ValueError(
                                    f"tiermem: optimizer state {key!r} has shape {list(value.shape)} but its "
                                    f"parameter has {list(slot.shape)}"
                                )
                            base = chunk.section_base(names.index(key))
                            slot.master_view(home, base, chunk.master_scale).copy_(value)
                        else:
                            record.scalars[key] = value
                    self._pstate[slot.index] = record
        self._generation += 1

    @contextlib.contextmanager
    def _home_on_host(self, chunk: Chunk, known: KnownBytes | None = None) -> Iterator[torch.Tensor]:
        """An NVMe home staged on the host for writing, and written back after (WRITEBACK);
        ``known``: what memory holds of it already (NOTE [ Managed object rules ] rule 6)."""
        handle = chunk.home
        assert handle is not None
        try:
            handle.move_to("host", Priority.DEMAND, known)
        except TierCapacityError:
            # Earlier homes' write-backs free host memory when they land (the plan stages two).
            self._wait_home_moves(skip=chunk)
            try:
                handle.move_to("host", Priority.DEMAND, known)
            except TierCapacityError as exc:
                raise StatesMemoryError(
                    f"tiermem model states: staging chunk {chunk.index}'s NVMe home ({format_size(exc.requested)}) "
                    f"needs host memory, but {format_size(exc.used)} of {format_size(exc.capacity)} are in use; "
                    "raise [host] capacity"
                ) from exc
        handle.wait()
        try:
            yield handle.tensor("host")
        finally:
            handle.move_to("nvme", Priority.WRITEBACK)
            self._read_cache = None

    @contextlib.contextmanager
    def _home_writable(self, chunk: Chunk) -> Iterator[torch.Tensor]:
        assert chunk.home is not None
        if chunk.home_tier == "nvme":
            with self._home_on_host(chunk) as data:
                yield data
        else:
            chunk.home.wait()
            yield chunk.home.tensor(chunk.home.tier)

    def _home_readable(self, chunk: Chunk) -> torch.Tensor:
        """A chunk's home bytes to read: in place in memory, or read from NVMe (cached per generation)."""
        handle = chunk.home
        assert handle is not None
        handle.wait()
        if handle.tier != "nvme":
            return handle.tensor(handle.tier)
        cache = self._read_cache
        if cache is not None and cache[0] == chunk.index and cache[1] == self._version():
            return cache[2]
        data = handle.read_out()
        self._read_cache = (chunk.index, self._version(), data)
        return data

    def _param_copy(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s values as a fresh CPU tensor of its own (its working dtype)."""
        chunk, slot = self._slots[i]
        if chunk.resident:
            self.pool.wait(chunk)
            source = slot.view(chunk.data)
        else:
            source = slot.view(self._home_readable(chunk), chunk.working_base)
        return source.to("cpu", copy=True)

    def _master_copy(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full-precision value: its fp32 master under mixed precision."""
        chunk, slot = self._slots[i]
        if chunk.master_scale == 1:
            return self._param_copy(i)
        assert chunk.home is not None
        home = self._home_readable(chunk) if chunk.offloaded else chunk.home.tensor("device")
        return slot.master_view(home, 0, chunk.master_scale).to("cpu", copy=True)

    def _state_dict_started(self, _module: nn.Module, _prefix: str, keep_vars: bool) -> None:
        self._sd_keep_vars = keep_vars

    def _state_dict_ended(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        """One CPU tensor per parameter (safetensors refuses shared storage; TRAPS 2)."""
        if self._sd_keep_vars or self._closed:
            return
        for name, i in self._module_names[module]:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = self._param_copy(i)

    def _load_started(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        *_: Any,
    ) -> None:
        """Make the module's chunks resident so PyTorch's own loader copies into them."""
        self._check_usable()
        if local_metadata.get("assign_to_params_buffers", False):
            raise StatesUsageError(
                "tiermem: load_state_dict(assign=True) would replace managed parameters; load without assign"
            )
        self._unpin_loading()
        chunks = tuple(
            sorted(
                {self._slots[i][0] for name, i in self._module_names[module] if prefix + name in state_dict},
                key=lambda c: c.index,
            )
        )
        if not chunks:
            return
        for chunk in chunks:
            self.pool.fetch(chunk, Priority.DEMAND, chunks)
        for chunk in chunks:
            self.pool.wait(chunk)
            chunk.pins += 1
            chunk.dirty = not chunk.persistent
            self._loading.append(chunk)
        self._generation += 1

    def _load_ended(self, _module: nn.Module, _incompatible: Any) -> None:
        self._unpin_loading()

    def _unpin_loading(self) -> None:
        """The loaded chunks are written: their masters take the loaded values (chunk layout
        rule 6), and they may be evicted again."""
        for chunk in self._loading:
            if chunk.master_scale > 1:
                with self._home_writable(chunk) as home:
                    for slot in chunk.layout.slots:
                        slot.master_view(home, 0, chunk.master_scale).copy_(slot.view(chunk.data))
            chunk.pins -= 1
        self._loading.clear()

    def _snapshot(self) -> Snapshot:
        data = [self._master_copy(i) for i in range(len(self.params))]
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for chunk in self.chunks:
            if chunk.grad is None:
                continue
            buffer = self._grad_bytes(chunk)
            for slot in chunk.layout.slots:
                if self._has_grad[slot.index]:
                    grads[slot.index] = slot.view(buffer).to("cpu", copy=True)
        exported = self.export_optimizer_state(self.optimizer)
        states = {self._index[id(p)]: s for p, s in exported.items()}
        return Snapshot(data, grads, states)

    def _restore(self) -> bool:
        """Copy every parameter (and gradient) into an ordinary tensor, chunk by chunk."""
        needed = sum(info.nbytes for info in self._info)
        needed += sum(info.nbytes for info, has in zip(self._info, self._has_grad, strict=True) if has)
        needed *= self.chunks[0].master_scale if self.chunks else 1  # fp32 masters come back
        ours = sum(self._held_bytes().get(t, 0) for t in ("device", "host")) if self.device.type == "cpu" else 0
        if needed > core.memory_available(self.device) + ours:
            log.warning(
                "tiermem model states: %s of parameters do not fit in memory; the model is unusable after the "
                "Runtime closed",
                format_size(needed),
            )
            return False
        for chunk in list(self.chunks):
            # Mixed precision restores the fp32 masters (and fp32 gradients): the full-precision
            # model, as the master-weights loop would hand it over.
            scale, base = chunk.master_scale, 0
            if chunk.resident and scale == 1:
                self.pool.wait(chunk)
                source = chunk.data
            elif scale > 1 and not chunk.offloaded:
                assert chunk.home is not None
                source = chunk.home.tensor("device")
            else:
                source = self._home_readable(chunk)
            grads = self._grad_bytes(chunk) if chunk.grad is not None else None
            for slot in chunk.layout.slots:
                p = self.params[slot.index]
                value = slot.master_view(source, base, scale)
                p.grad = None
                p.data = torch.empty(slot.shape, dtype=value.dtype, device=self.device).copy_(value)
                if grads is not None and self._has_grad[slot.index]:
                    p.grad = torch.empty(slot.shape, dtype=value.dtype, device=self.device).copy_(slot.view(grads))
            # Give this chunk's memory back before the next one is copied.
            chunk.empty_storage()
            for handle in (chunk.dev, chunk.home, chunk.grad):
                if handle is not None:
                    handle.free()
            chunk.dev = chunk.home = chunk.grad = None
            self._read_cache = None
        return True
