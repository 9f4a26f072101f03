"""Saved tensors whose storage belongs to someone else: the parameters and buffers the
model's modules hold when they run (NOTE [ Activation offload rules ] rule 3, in
``tiermem/activations/offloader.py``), and storages freed or resized under a write-back in
flight (rule 9 there). TRAPS 30."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiermem.errors import TiermemError
from tiermem.registry import ManagedObject, ObjectState


class ActivationStorageError(TiermemError, RuntimeError):
    """Raised when backward needs a saved tensor whose bytes tiermem wrote out while
    something else freed or resized its storage (NOTE [ Activation offload rules ] rule 9):
    the copy may hold freed memory's bytes, so it is never returned."""


def _storages(tensors: Iterable[torch.Tensor]) -> Iterable[torch.UntypedStorage]:
    for tensor in tensors:
        try:
            yield tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass with no storage of its own
            local = getattr(tensor, "_local_tensor", None)  # DTensor: its shard
            if isinstance(local, torch.Tensor):
                yield local.untyped_storage()


class ProtectedStorages:
    """Rule 3: the storages of the parameters and buffers the model's modules hold *when they
    run*, held weakly and matched by identity (never by ``id`` alone, which Python reuses).

    Refreshed by forward pre-hooks registered after those already there (FSDP2's unshard is
    prepended), so what a module holds then (FSDP2 swaps ``module._parameters[name]`` to its
    all-gathered full parameter) counts, not only what ``model.parameters()`` gave at entry."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(storage))
        return ref is not None and ref() is storage

    def add(self, module: nn.Module, *, recurse: bool) -> None:
        tensors = (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse))
        for storage in _storages(tensors):
            ref = self._refs.get(id(storage))
            if ref is None or ref() is not storage:
                self._refs[id(storage)] = weakref.ref(storage)

    def reset(self, module: nn.Module) -> None:
        """The whole model, as it holds its parameters now (a new forward: stale entries go)."""
        self._refs = {}
        self.add(module, recurse=True)

    def register(self, model: nn.Module, blocks: Sequence[nn.Module]) -> list[Any]:
        """Forward pre-hooks on the model (reset), on every block (its subtree: a block may use
        a child's parameter without calling the child) and on every other module holding
        parameters or buffers itself (an FSDP2 unit inside a block unshards in its own pre-hook).
        Returns the hook handles, to remove at exit; removes those it registered if it raises."""
        handles: list[Any] = []
        try:
            self.reset(model)
            handles.append(model.register_forward_pre_hook(lambda m, _a: self.reset(m)))
            block_ids = {id(b) for b in blocks}
            for block in blocks:
                handles.append(block.register_forward_pre_hook(lambda m, _a: self.add(m, recurse=True)))
            for module in model.modules():
                if module is model or id(module) in block_ids or not (module._parameters or module._buffers):
                    continue
                handles.append(module.register_forward_pre_hook(lambda m, _a: self.add(m, recurse=False)))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles


@dataclass(eq=False)
class _Watched:
    obj: weakref.ref[ManagedObject]
    #: Strong until the write has ended: the registry drops its own reference as it lands.
    storage: torch.UntypedStorage
    #: The object's landed moves when the write started: unchanged once the move ended iff the
    #: write did not land (cancelled or failed: NOTE [ Managed object rules ] rules 2 and 3).
    landed_before: int
    data_ptr: int
    nbytes: int
    tier: str
    where: str
    changed: bool = False

    def changed_now(self) -> bool:
        storage = self.storage
        return storage.nbytes() != self.nbytes or storage.data_ptr() != self.data_ptr


class StorageWatch:
    """Rule 9: the storages of saved tensors whose write-back is in flight, with their address
    and size when the write started. A change seen at a checkpoint (block start and end, never
    per pack or unpack: rule 9 says why) or when the write ends, on a write that landed, breaks
    the object: every unpack of it raises :class:`ActivationStorageError`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}
        self._broken: weakref.WeakKeyDictionary[ManagedObject, str] = weakref.WeakKeyDictionary()

    def started(self, obj: ManagedObject, storage: torch.UntypedStorage, where: str) -> None:
        """A write-back of ``obj`` (adopted from ``storage``) may have started: watch it while in flight."""
        transfer, tier = obj.transfer, obj.target_tier
        if transfer is None or tier is None:  # none started, or it already ended
            return
        entry = _Watched(weakref.ref(obj), storage, obj.moves_landed, storage.data_ptr(), storage.nbytes(), tier, where)
        key = obj.id
        with self._lock:
            self._watched[key] = entry
        # Holds no transfer, tensor or object: the key only (TRAPS 14).
        transfer.add_done_callback(lambda _t: self._judge(key))

    def check(self) -> None:
        """A checkpoint on the training thread: note every watched storage changed since its write started."""
        if not self._watched:  # a racy peek is fine: a write that starts later is seen at the next one
            return
        with self._lock:
            for entry in self._watched.values():
                if not entry.changed and entry.changed_now():
                    entry.changed = True

    def _judge(self, key: int, obj: ManagedObject | None = None) -> None:
        """The write ended: did it land from a storage that changed under it? Only a write that
        landed counts: one cancelled or failed left the object at home, in its own storage (read
        as plain PyTorch would read it). Judged on the scheduler's thread after the registry's own
        callback, or at unpack when that thread has not got to it yet (the object may be back from
        the write's tier by then, so "landed" is "a move of it landed since the write started")."""
        with self._lock:
            entry = self._watched.pop(key, None)
        if entry is None:
            return
        obj = obj if obj is not None else entry.obj()
        landed = obj is not None and obj.moves_landed != entry.landed_before
        if obj is not None and landed and (entry.changed or entry.changed_now()):
            self._broken[obj] = (
                f"tiermem activations: a saved tensor of {obj.nbytes} bytes ({entry.where}) was written to "
                f"{entry.tier} while something else freed or resized its storage (``untyped_storage().resize_``: "
                "FSDP-style frameworks free the full parameters they gather this way, TRAPS 30); the copy may "
                "hold freed memory's bytes, so it is not returned (NOTE [ Activation offload rules ] rule 9). "
                "Keep tensors whose storage their owner frees out of offloading: make them parameters or "
                "buffers of a module that runs inside the model (rule 3), keep this block (a policy mapping such "
                "as {0: 'keep'}), raise [activations] min_bytes above this tensor's size, or have the owner "
                "keep the storage until backward."
            )
        entry.storage = None  # type: ignore[assignment]  # the bytes may go now

    def broken(self, obj: ManagedObject) -> ActivationStorageError | None:
        """The error to raise for ``obj`` at unpack, if any; judges a write whose end was not judged yet."""
        if obj.state is not ObjectState.MOVING:
            self._judge(obj.id, obj)
        message = self._broken.get(obj)
        return None if message is None else ActivationStorageError(message)
