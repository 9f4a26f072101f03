"""Steps an undeclared loop's backward runs ahead of ``optimizer.step()``, kept apart from the
chunks until the step shows they are the step it would have run.

# NOTE [ Speculative steps ]
1. Why: an undeclared loop (``rt.manage`` told nothing about the loop) may clip, scale or edit
   gradients, change hyperparameters or accumulate between backward and ``optimizer.step()``, so
   its chunks cannot step early in place (NOTE [ Declared steps ] rule 3), and its step phase
   reads and writes every NVMe home while compute waits. Most plain loops do none of those
   things, so their backward steps each NVMe chunk as a declared loop does, into a copy of its
   home, and ``optimizer.step()`` keeps the copies when nothing changed. Measured on the 210M
   HF GPT-2 at 10% / 10% (bench/README, "HF GPT-2 210M"): the step phase falls from 1.6-2.3 s
   to 0.05, the step from 8.66 to 8.29 s (on 2 cores the step's compute and I/O mostly move
   into backward; where a core idles in backward the gain is the whole phase).
2. When: a backward of an undeclared loop without clipping arms them when it is the first
   backward since ``optimizer.step()`` after one forward with grad, no re-pack is due, no
   asynchronous checkpoint is pending, no device copy is newer than its home (a state load
   writes it home later), and the last window was *clean*: one counted backward, its gradients
   untouched until ``optimizer.step()``, no optimizer attributes (``grad_scale``, ``found_inf``).
   So the first window never speculates, and neither does a loop that accumulates or edits by
   hand. Which chunks (of rule 3's): as many as the NVMe tier holds copies of beside every
   gradient of theirs the backward may store there (so a copy never takes room the plan counted
   on), the last in layout order first, since backward reaches them first; the others step at
   ``optimizer.step()``. An NVMe tier sized to the homes alone (a user's capacity set to what
   the plan needs, or the 2.5x-RAM headline GPT on a disk with room for less than twice its
   homes) thus still runs its first chunks ahead, where room for every copy was asked before.
   That count is of free bytes, and the tier places each object in one extent: shadows written
   among the gradients may leave the free bytes in pieces none of which holds the next gradient
   (the 2.5x-RAM headline GPT, plain loop, NVMe tier 66 GiB: 377 MB free, no extent of 139 MB
   for chunk 1's gradients, and the step failed). Shadows are copies, so they give their room
   back: the Stepper registers a reclaimer on the NVMe tier (NOTE [ Managed object rules ] rule
   7) that a stored gradient's write-back short of room calls, on the training thread; it
   discards every shadow of the backward (rule 5; a step in flight drops its shadow unwritten)
   and the gradient is placed again. Later backwards run ahead one chunk fewer than had shadows
   then (again at each reclaim, down to none), so the room is not given and taken back every
   window; speculation itself stays on.
3. What: chunks with NVMe homes whose gradients the runtime sees every write to: stored on NVMe
   (a :class:`~tiermem.states.stored_grads.StoredGradient`) or waiting on the host (a
   :class:`~tiermem.states.hostgrad.HostGradient`, on the CPU device too for a chunk whose home
   is on NVMe: NOTE [ Host gradients ] rule 1); every op on those passes its dispatch, views
   and ``.data`` included, and counts in ``GradientWrites``. A plain tensor's ``.grad.data`` can
   be written with no version counter moving, so gradients exposed as plain tensors never run
   ahead. Measured on the 0.15x-RAM headline GPT (``bench/states_headline.py --ratio 0.15
   --loop plain``, every home on NVMe, gradients on the host), where the CPU device exposed
   plain tensors before: the step phase fell from 1.4-1.6 s to 0.1 s and the step from 3.6-4.0 s
   to 2.8-3.1 s. How: a chunk's *shadow* is a new host block (the host tier's own, counted as one of
   the plan's ``staged_homes``) filled from its home, which stays where it is, untouched; the
   working bytes come from the device copy where it holds them as fetched (its storage waits for
   that copy before it empties). The step (``ChunkStep``, on the step thread as any early step)
   computes over the shadow with copies of its small states (``step``) and keeps the optimizer
   records it found aside; the shadow then goes to NVMe as a new object. Once a shadow's step
   started it no longer waits for it, so the next chunk's shadow may be read ahead meanwhile,
   within the same room (counted as waiting until its step finished, half of them were read
   only when their step asked). A shadow with no room is not made: that chunk steps at
   ``optimizer.step()``. A chunk's stored gradients, read for its step while the host is short,
   wait for stepped shadows' write-backs as they wait for staged homes' (the plan's room beside
   one staged home holds them once those landed). At the end of backward every step has
   finished and shadows of chunks that did not step are freed, so after backward no copy reads
   a home.
4. Kept: ``optimizer.step()`` keeps every shadow when the window held exactly one counted
   backward, ended complete, no gradient changed since it ended (tensor, version, and no write
   counted in ``GradientWrites``), the optimizer's groups hold the hyperparameters they held as
   backward began (values compared, tensors by value), the optimizer carries no
   ``grad_scale``/``found_inf``, no re-pack or asynchronous checkpoint is pending, and the store's
   version (any write to a chunk or its optimizer records: parameter writes, state loads) is the
   one backward began with. Keeping one swaps the chunk's home for its shadow, frees the old home
   and stores the records: the same bytes the step would have written in place.
5. Discarded otherwise, all of them: shadows freed, the records dropped, and every chunk steps
   at ``optimizer.step()`` from its untouched home, as if nothing had run ahead. Where the reason
   is something the loop does, speculation is then off for the model (logged once with the
   reason); a second backward before ``optimizer.step()`` discards them as it begins. A step that
   fails in backward discards every shadow of that backward, and nothing more runs ahead in it.
6. Exactness: the kept step is ``ChunkStep`` over the same home bytes, gradients and
   hyperparameters as the step ``optimizer.step()`` would run, so bitwise the same; until
   ``optimizer.step()`` parameters, optimizer state, state dicts and checkpoints all read the
   untouched homes, as plain PyTorch's do before its step. ``[model_states] speculative_steps =
   "off"`` runs every step at ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from tiermem.errors import TierCapacityError
from tiermem.registry import Handle, ObjectState, Priority, Transfer
from tiermem.states.chunks import Chunk
from tiermem.states.facts import ParamState
from tiermem.states.homes import Homes, wait_every
from tiermem.states.store import ChunkStore

__all__ = ["Shadow", "Shadows", "hyperparameters", "same_hyperparameters"]


@dataclasses.dataclass(eq=False)
class Shadow:
    """Rule 3: a chunk's home copied to the host, stepped there, then on its way to NVMe."""

    chunk: Chunk
    handle: Handle
    #: the copies into :attr:`handle` (from the home, and from the device copy), until they landed
    fills: list[Transfer]
    #: its step started (on the step thread, or inline): it no longer waits for it (Shadows.off_nvme)
    step_started: bool = False
    #: the optimizer records the step found, once it ran (None: not stepped)
    records: dict[int, ParamState] | None = None

    def landed(self) -> bool:
        return all(fill.done() for fill in self.fills)

    def wait_filled(self) -> None:
        """Wait for every copy into the shadow; then raise the first one's error."""
        fills, self.fills = self.fills, []
        wait_every(fills)


class Shadows:
    """Rule 3's shadows of one model's chunks, by chunk index: made and filled, sent to NVMe once
    stepped, freed, or kept as the chunks' homes (rule 4). Mechanism only: when to make, keep or
    discard them is :class:`~tiermem.states.stepping.Stepper`'s."""

    def __init__(self, store: ChunkStore, homes: Homes) -> None:
        self.store = store
        self.homes = homes
        self._by_index: dict[int, Shadow] = {}
        #: stepped shadows kept as homes and discarded (cumulative, for stats)
        self.kept = 0
        self.discarded = 0
        #: shadows read ahead of their step, and when the step asked for them (cumulative, for stats)
        self.read_ahead = 0
        self.read_on_demand = 0

    def __bool__(self) -> bool:
        return bool(self._by_index)

    def __contains__(self, index: int) -> bool:
        return index in self._by_index

    def chunks(self) -> list[Chunk]:
        return [shadow.chunk for shadow in self._by_index.values()]

    def unstepped(self) -> list[Chunk]:
        """Chunks whose shadow was made but did not step."""
        return [shadow.chunk for shadow in self._by_index.values() if shadow.records is None]

    def stepped_count(self) -> int:
        return sum(shadow.records is not None for shadow in self._by_index.values())

    def landed(self, chunk: Chunk) -> bool:
        """``chunk``'s shadow exists and is filled."""
        shadow = self._by_index.get(chunk.index)
        return shadow is not None and shadow.landed()

    def fitting_on_nvme(self, chunks: list[Chunk], most: int | None = None) -> list[Chunk]:
        """Rule 2: of ``chunks`` (in layout order), those whose shadows the NVMe tier holds beside
        every gradient the backward may store there (any trainable chunk's with ``grad_home``
        "nvme", sliced ones included; gradients on the host never go there), so a shadow never
        takes room the plan counted on: the last ones first, which backward reaches first, and
        ``most`` of them at most (after a reclaim)."""
        registry = self.store.registry
        stored = [c for c in self.store.chunks if c.trainable and c.grad_home == "nvme"]
        room = registry.free_bytes("nvme") - sum(registry.reserved_size("nvme", c.nbytes) for c in stored)
        fitting: list[Chunk] = []
        for chunk in reversed(chunks):
            shadow = registry.reserved_size("nvme", chunk.home_bytes)
            if shadow > room or len(fitting) == most:
                break
            room -= shadow
            fitting.append(chunk)
        return fitting[::-1]

    def off_nvme(self) -> tuple[int, int]:
        """Shadows holding host bytes (filled, stepping, or on their way to NVMe): those waiting
        for their step, and all; each counts as a staged home. One whose step started waits no
        more, as a staged home whose step runs does not (rule 3)."""
        waiting = off_nvme = 0
        for shadow in self._by_index.values():
            handle = shadow.handle
            if handle.state is ObjectState.MOVING or handle.tier != "nvme":
                off_nvme += 1
                waiting += not shadow.step_started
        return waiting, off_nvme

    def make(self, chunk: Chunk, priority: Priority, from_device: bool) -> Shadow | None:
        """Start copying ``chunk``'s NVMe home into a new host block (its working bytes from the
        device copy with ``from_device``); None without host room now."""
        try:
            handle, fills = self.homes.copy_to_host(chunk, priority, from_device=from_device)
        except TierCapacityError:
            return None
        shadow = self._by_index[chunk.index] = Shadow(chunk, handle, fills)
        if priority is Priority.DEMAND:
            self.read_on_demand += 1
        else:
            self.read_ahead += 1
        return shadow

    def for_step(self, chunk: Chunk, from_device: bool) -> Shadow | None:
        """``chunk``'s shadow, made now if it was not copied ahead (DEMAND) once write-backs in
        flight free host room; None when the host has none."""
        shadow = self._by_index.get(chunk.index)
        while shadow is None:
            shadow = self.make(chunk, Priority.DEMAND, from_device)
            if shadow is None and not (self._wait_write_back() or self.homes.wait_write_back(skip=chunk)):
                return None
        return shadow

    def wait_host_room(self) -> None:
        """Every write-back to NVMe in flight lands, homes' and stepped shadows': each frees the
        host bytes it was staged in. A shadow counts as a staged home (rule 3), so a caller short
        of the host room the plan keeps beside the staged homes (a chunk's stored gradients read
        for its step) finds it once they landed, as it does behind homes' write-backs."""
        self.homes.wait_moves()
        for shadow in self._writing_back():
            shadow.handle.wait()

    def _wait_write_back(self) -> bool:
        """Wait for the first stepped shadow still on its way to NVMe; False when none is."""
        for shadow in self._writing_back():
            shadow.handle.wait()
            return True
        return False

    def _writing_back(self) -> list[Shadow]:
        """Stepped shadows still on their way to NVMe (a list: waiting may run code that drops shadows)."""
        return [s for s in self._by_index.values() if s.records is not None and s.handle.state is ObjectState.MOVING]

    def send(self, shadow: Shadow, records: dict[int, ParamState]) -> bool:
        """``shadow`` stepped, finding ``records``: on its way to NVMe now. False without NVMe room
        (the caller drops it)."""
        try:
            shadow.handle.move_to("nvme", Priority.WRITEBACK)
        except TierCapacityError:
            return False
        shadow.records = records
        return True

    def settle(self) -> None:
        """Every shadow's move in flight ended (its errors aside): freed then, a shadow's NVMe
        extent is free at once rather than once its cancelled write-back ends (rule 2)."""
        for shadow in list(self._by_index.values()):
            with contextlib.suppress(Exception):
                shadow.wait_filled()
                shadow.handle.wait()

    def drop(self, chunk: Chunk) -> bool:
        """Free ``chunk``'s shadow once no copy writes it; False when it had none."""
        shadow = self._by_index.pop(chunk.index, None)
        if shadow is None:
            return False
        with contextlib.suppress(Exception):  # never freed while its fill still writes it
            shadow.wait_filled()
        shadow.handle.free()
        return True

    def keep(self) -> None:
        """Rule 4: each stepped shadow becomes its chunk's home, with the optimizer records its
        step found; the old homes are freed."""
        shadows, self._by_index = self._by_index, {}
        for index in sorted(shadows):
            shadow = shadows[index]
            chunk = shadow.chunk
            assert shadow.records is not None and chunk.home is not None
            old, chunk.home = chunk.home, shadow.handle
            old.free()
            self.store.pstate.update(shadow.records)
            self.kept += 1
        self.homes.forget()


def hyperparameters(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rule 4: every group's settings but its parameters, tensors copied (a scheduler may change a
    tensor learning rate in place)."""
    return [
        {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in param_groups
    ]


def same_hyperparameters(before: list[dict[str, Any]], param_groups: Sequence[dict[str, Any]]) -> bool:
    """Rule 4: the groups still hold the settings :func:`hyperparameters` recorded."""
    now = [{k: v for k, v in group.items() if k != "params"} for group in param_groups]
    if len(now) != len(before) or any(a.keys() != b.keys() for a, b in zip(before, now, strict=True)):
        return False
    for a, b in zip(before, now, strict=True):
        for key, old in a.items():
            new = b[key]
            if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
                if not (
                    isinstance(old, torch.Tensor)
                    and isinstance(new, torch.Tensor)
                    and old.shape == new.shape
                    and old.dtype == new.dtype
                    and torch.equal(old, new.detach().to(old.device))
                ):
                    return False
                continue
            try:
                if type(old) is not type(new) or bool(old != new):
                    return False
            except Exception:  # noqa: BLE001 - a value that cannot be compared counts as changed
                return False
    return True
