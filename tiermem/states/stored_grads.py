"""Gradients that wait on NVMe between backward and the optimizer step, and ``p.grad`` of them.

# NOTE [ Stored gradients ]
1. Where: a plan with ``grad_home = "nvme"`` (NOTE [ Default placement rule ] rule 3: the
   host cannot hold every NVMe chunk's gradients) sends an NVMe-homed chunk's gradient buffer
   from the device to NVMe when its backward ends (WRITEBACK), instead of to the host. Host-
   and device-homed chunks keep theirs where they were. Values never change on the way: a
   gradient is the bytes autograd accumulated, exactly as in plain PyTorch.
2. Reading them: whoever needs a stored gradient's bytes (the chunk's optimizer step, a
   state-dict snapshot, ``p.grad`` below) asks :class:`GradientStash` for the chunk's buffer.
   The stash copies it into a host buffer registered on the host tier (``Handle.fill_from``:
   the NVMe copy stays valid, so a copy nobody wrote is dropped without a write) and keeps at
   most the plan's ``staged_homes`` chunks staged, least recently used out first; a staged copy
   that was written is copied back to NVMe before it goes. Every staged byte is accounted on the
   host tier, so the host's capacity holds; the plan keeps room for that many staged gradients.
3. ``p.grad`` of a stored gradient is a :class:`StoredGradient`: a :class:`HostGradient`
   (NOTE [ Host gradients ], every rule of which holds) whose host bytes are fetched when an
   op touches them. It records where in the chunk's buffer it stands (byte offset, dtype,
   shape, strides) instead of a host tensor, so views, ``t_()`` and the like follow the
   staged copy wherever it lands. One op at a time: a foreach op is split per tensor (rule 3
   there), so clipping by hand, ``GradScaler.unscale_`` and user edits stage one chunk at a
   time and write back what they wrote.
4. Life: the step stages each chunk's gradients with its home, and drops its staged copy when
   its step is done (the step never writes gradients); ``zero_grad`` frees them; the next
   backward brings them back to the device (written-back copies first) to accumulate. The
   lease of NOTE [ Host gradients ] rule 5 ends whenever the stored bytes move or are freed.
5. Threads: a staged copy a chunk step still reads on the step thread is not dropped before
   that step finished (``fence``, NOTE [ Step threads ] rule 4).
6. Clipping by hand reads each stored gradient once per step (the step's read), not three
   times (the norm's, the scaling's read and write, the step's). ``clip_grad_norm_`` computes
   each gradient's norm, then multiplies every gradient by one factor; both are answered
   without staging:
   a. Norms as gradients land: a norm op on one whole stored gradient (``_foreach_norm`` of a
      list of one, which is what rule 3 of NOTE [ Host gradients ] splits torch's call into, or
      ``linalg_vector_norm``) that finds no norm kept is staged and run as before, and its op
      and arguments are remembered. From then on, when a chunk's gradients are sent to NVMe,
      each of its gradients' norms is computed first, by that same op with the same arguments on
      the device buffer, which holds the same bytes, shape and strides on the same device as
      the transient copy the staged path computes on: the same kernel over the same values, so
      the same bits. The next such op is answered with a copy of the kept norm. A norm is kept
      only while no byte of its gradient is written (a write, a deferred scale, the next
      backward bringing the gradients back, ``zero_grad``); otherwise it is computed as before.
   b. Scaling deferred: an in-place multiplication of one whole stored gradient by a number or
      a 0-dim tensor (``_foreach_mul_`` of a list of one, ``mul_``) is recorded, not run. The
      staged copy carries every recorded scaling: they run in order on it when it is staged
      (or at once when it is staged now), as the same op on the same device the HostGradient
      path runs it on; the copy is not marked written, so dropping it writes nothing and the
      next staging runs them again on the NVMe bytes. A copy written for another reason goes
      back with them applied, and the record is cleared. The gradients brought back to the
      device for the next backward are staged, scaled and written back first.
   A chunk that steps in slices (NOTE [ Sliced steps ]) keeps its norms the same way, and the
   default clip's (the 2-norm) from its first landing, since its whole gradient may not fit on
   the host to answer a first call the staged way; its recorded scalings run on each slice of
   its gradients as the sliced step reads it. So ``clip_grad_norm_`` with its default norm never
   stages such a gradient whole (another norm type's first call does, refused with the sizes
   when the host cannot hold it).
7. Staged on the way: a chunk whose step runs in this backward (an early or speculative step,
   NOTE [ Declared steps ], NOTE [ Speculative steps ]) reads its gradients right after they
   went to NVMe. So as the device buffer goes, a host copy of it is staged first, within rule
   2's count and the host's room (:meth:`GradientStash.stage_on_the_way`), and the write-back
   waits for that copy (NOTE [ Managed object rules ] rules 8, 11: the buffer stays unmoved
   until the copy ended). The step reads the copy, not the NVMe bytes, and need not wait for
   the write-back to land; a copy written is sent to NVMe once it landed. Without a slot or
   room the gradients are staged from NVMe as before. Errors: a copy that failed is dropped and
   the gradients are read from NVMe; a write-back that cannot start drops the copy with its
   error, and a buffer whose write-back failed drops it before autograd adds to the buffer
   again (the copy would go stale); chunks are freed only once no copy reads their buffers.
   On a CUDA device the buffer then crosses PCIe twice (the copy, and the write-back's bounce
   through pinned memory) where it crossed once; that is far less than the NVMe read it saves,
   but no GPU has measured it.
   Measured on the 210M HF GPT-2 plain loop (bench/hf_states.py): its backward read every
   stepped gradient back, 753 MiB a step, on a disk busy 90% of backward; now it reads none
   of them (4,226-4,235 MiB a step instead of 4,969-4,988). On the tests' small GPT, whose
   steps are short beside its backward, 3-5 of 25 chunks a window still read theirs back (the
   stash's two slots taken), 16-18 beside two busy loops.
   Tried, not kept: moving the device buffer itself to the host on its way, so that its device
   bytes go as soon as they landed there and the write to NVMe reads the host bytes (after the
   step; or at once, the host block kept until the step ended). On the 210M HF GPT-2 plain loop
   (``bench/hf_states.py --worker undeclared``, 3 alternated pairs each) the host, which the
   shadows and these copies share at 10%, held each block longer: shadows and copies then waited
   for host room (up to 1.0 s a step), gradients that found no slot still went from the device and
   were waited for, and the steps ran 4.48 / 4.73 / 4.40 s against 4.36 / 4.66 / 4.33 (written
   after the step) and 5.59 / 5.27 / 5.19 s against 5.15 / 5.34 / 4.77 (written at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from tiermem.errors import TierCapacityError, internal_error
from tiermem.layout.chunks import Slot
from tiermem.registry import Handle, ObjectState, Priority, Transfer
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesMemoryError
from tiermem.states.hostgrad import GradientWrites, HostGradient, indexed
from tiermem.states.store import ChunkStore


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where a gradient (or a view of one) stands in its chunk's gradient buffer (rule 3)."""

    offset: int
    """bytes from the start of the chunk's gradient buffer to the view's first element"""
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of_slot(cls, slot: Slot) -> Geometry:
        """A whole parameter's gradient (``Slot.view``: contiguous at the slot's offset)."""
        return cls(slot.offset, slot.dtype, tuple(slot.shape), torch.empty(slot.shape, device="meta").stride())

    @classmethod
    def of_view(cls, view: torch.Tensor, buffer: torch.Tensor) -> Geometry:
        """Where ``view`` (a view of ``buffer``'s storage) stands in ``buffer``."""
        if view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            raise internal_error("a stored gradient's view left the staged bytes it was made from")
        offset = view.storage_offset() * view.element_size() - buffer.storage_offset()
        return cls(offset, view.dtype, tuple(view.shape), tuple(view.stride()))

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This geometry over ``buffer`` (a 1-D uint8 tensor holding the chunk's gradients)."""
        start, rest = divmod(buffer.storage_offset() + self.offset, self.dtype.itemsize)
        if rest:
            raise internal_error(f"stored gradient at byte {self.offset} is not aligned to {self.dtype}")
        return torch.empty(0, dtype=self.dtype).set_(buffer.untyped_storage(), start, self.shape, self.stride)


NormKey = tuple[Any, ...]
#: Rule 6a: the norm ops ``torch.nn.utils.clip_grad_norm_`` runs with its default 2-norm (one
#: ``linalg_vector_norm`` a gradient, as it does for tensor subclasses; ``_foreach_norm`` of one
#: with ``foreach=True``): kept for a sliced chunk from its first landing, since its whole
#: gradient may not fit on the host to answer a first call the staged way.
DEFAULT_CLIP_NORMS: frozenset[NormKey] = frozenset(
    {(torch.ops.aten.linalg_vector_norm.default, (2.0,), ()), (torch.ops.aten._foreach_norm.Scalar, (2.0,), ())}
)
"""Rule 6a: a norm op and its arguments after the gradient (hashable)."""
_NORMS = (torch.ops.aten._foreach_norm.Scalar, torch.ops.aten.linalg_vector_norm.default)
_SCALES = (
    torch.ops.aten._foreach_mul_.Tensor,
    torch.ops.aten._foreach_mul_.Scalar,
    torch.ops.aten.mul_.Tensor,
    torch.ops.aten.mul_.Scalar,
)


@dataclasses.dataclass(frozen=True)
class _Scale:
    """Rule 6b: a recorded in-place multiplication of one whole stored gradient."""

    geometry: Geometry
    func: torch._ops.OpOverload
    factor: Any
    device: torch.device

    def run(self, buffer: torch.Tensor) -> None:
        """The op on ``buffer``'s bytes of the gradient, on its device, as NOTE [ Host gradients ]
        rule 2 runs it (a transient device copy, written back), in place on the CPU."""
        view = self.geometry.view(buffer)
        target = view if self.device.type == "cpu" else view.to(self.device, copy=True)
        self.func([target] if self.func.name().startswith("aten::_foreach_") else target, self.factor)
        if target is not view:
            view.copy_(target)

    def run_range(self, data: torch.Tensor, lo: int) -> None:
        """The op on the elements of this gradient (a whole one: contiguous) that bytes
        ``[lo, lo + len(data))`` of the chunk's gradients hold, ``data`` being those bytes (a
        slice read for a sliced step, NOTE [ Sliced steps ]). An element-wise multiplication, so
        each element comes out as the op over the whole gradient makes it."""
        g = self.geometry
        start = max(lo, g.offset)
        stop = min(lo + data.numel(), g.offset + math.prod(g.shape) * g.dtype.itemsize)
        if stop <= start:
            return
        view = data[start - lo : stop - lo].view(g.dtype)
        target = view if self.device.type == "cpu" else view.to(self.device, copy=True)
        self.func([target] if self.func.name().startswith("aten::_foreach_") else target, self.factor)
        if target is not view:
            view.copy_(target)


def _norm_key(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NormKey | None:
    """Rule 6a: the op and its arguments after the gradient, when they are plain values."""
    rest = tuple(tuple(a) if isinstance(a, list) else a for a in args[1:])
    key = (func, rest, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    plain = (int, float, bool, type(None), torch.dtype, tuple, str)
    return key if all(isinstance(a, plain) for a in (*rest, *kwargs.values())) else None


@dataclasses.dataclass
class _Staged:
    handle: Handle
    written: bool = False
    #: copied from the device buffer as it went to NVMe (rule 7), not read from there
    on_the_way: bool = False
    #: the copy from NVMe, while it runs (a prefetch)
    filling: Transfer | None = None
    #: rule 6b: recorded scalings already run on this copy
    scaled: int = 0

    def landed(self) -> None:
        if self.filling is not None:
            filling, self.filling = self.filling, None
            filling.wait()


class GradientStash:
    """Host copies of stored gradient buffers, at most ``plan.staged_homes`` chunks at once (rule 2)."""

    def __init__(self, store: ChunkStore, wait_write_backs: Callable[[], None], fence: Callable[[Chunk], None]) -> None:
        self.store = store
        self._wait_write_backs = wait_write_backs
        self._staged: OrderedDict[int, _Staged] = OrderedDict()
        #: NOTE [ Step threads ] rule 4: finishes a chunk's step in flight
        self.fence = fence
        #: chunks staged from NVMe, staged on their way there (rule 7), and bytes written back since
        #: the manager began (tests, reports)
        self.stagings = 0
        self.staged_on_the_way = 0
        self.write_backs = 0
        #: rule 6a: norm ops asked of stored gradients, computed as gradients land from now on
        self.norm_keys: set[NormKey] = set()
        #: rule 6a: per chunk, the kept norms by (gradient offset, norm key)
        self._norms: dict[int, dict[tuple[int, NormKey], torch.Tensor]] = {}
        #: rule 6b: per chunk, recorded scalings not in its NVMe bytes
        self._scales: dict[int, list[_Scale]] = {}
        #: norm ops answered from kept norms, scalings recorded (tests, reports)
        self.norms_kept = 0
        self.scales_deferred = 0

    @staticmethod
    def stored(chunk: Chunk) -> bool:
        """The chunk's gradient buffer lives on NVMe now (rule 1)."""
        return chunk.grad is not None and chunk.grad.tier == "nvme"

    def staged(self, chunk: Chunk) -> bool:
        """A host copy of ``chunk``'s stored gradients is kept now."""
        return chunk.index in self._staged

    def ready(self, chunk: Chunk) -> bool:
        """Reading ``chunk``'s gradient bytes would not wait: they are not moving, and not stored
        or staged and landed (NOTE [ Declared steps ] rule 9 asks before a hook starts a step)."""
        staged = self._staged.get(chunk.index)
        if staged is not None:  # its write-back may still run (rule 7): the copy is what is read
            return staged.filling is None or staged.filling.done()
        grad = chunk.grad
        return grad is None or (not self.stored(chunk) and grad.state is not ObjectState.MOVING)

    def buffer(self, chunk: Chunk, *, write: bool = False) -> torch.Tensor:
        """The chunk's gradient bytes on the host, staged from NVMe if need be; ``write``: the
        caller writes them (they go back to NVMe before the copy is dropped)."""
        staged = self._staged.get(chunk.index)
        if staged is None:
            staged = self._stage(chunk)
        try:
            staged.landed()
        except Exception:
            if not staged.on_the_way:
                self.discard(chunk)
                raise
            # rule 7's copy failed; the gradients themselves are intact: read them from NVMe
            self.drop_copy(chunk)
            staged = self._stage(chunk)
        except BaseException:
            self.discard(chunk)
            raise
        self._staged.move_to_end(chunk.index)
        data = staged.handle.tensor("host")
        scales = self._scales.get(chunk.index, ())
        for scale in scales[staged.scaled :]:  # rule 6b: the copy carries every recorded scaling
            scale.run(data)
        staged.scaled = len(scales)
        if write:
            GradientWrites.note()
            self._norms.pop(chunk.index, None)  # rule 6a: its bytes change
        staged.written = staged.written or write
        return data

    # -- rule 6: clipping by hand ---------------------------------------------------------------
    def land(self, chunk: Chunk, data: torch.Tensor, slots: list[Slot]) -> None:
        """Rule 6a: ``chunk``'s gradients (``data``, its device buffer) are about to go to NVMe:
        keep the norms of ``slots``' gradients that norm ops asked for before."""
        self._norms.pop(chunk.index, None)
        self._scales.pop(chunk.index, None)
        keys = self.norm_keys | DEFAULT_CLIP_NORMS if chunk.slice_span is not None else self.norm_keys
        if not keys:
            return
        kept = self._norms[chunk.index] = {}
        for slot in slots:
            view = slot.view(data)
            for key in keys:
                func, rest, kwargs = key
                if func is torch.ops.aten._foreach_norm.Scalar:
                    kept[slot.offset, key] = func([view], *rest, **dict(kwargs))[0]
                else:
                    kept[slot.offset, key] = func(view, *rest, **dict(kwargs))

    def kept_norm(
        self, grad: StoredGradient, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Rule 6a: the answer to norm op ``func`` on ``grad`` alone from the kept norms, or None
        (the op is then remembered, and runs on the staged bytes)."""
        key = _norm_key(func, args, kwargs)
        slot = grad.whole_slot()
        if key is None or slot is None:
            return None
        norm = self._norms.get(grad.chunk.index, {}).get((slot.offset, key))
        if norm is None:
            self.norm_keys.add(key)
            return None
        self.norms_kept += 1
        return [norm.clone()] if func is torch.ops.aten._foreach_norm.Scalar else norm.clone()

    def defer_scale(self, grad: StoredGradient, func: torch._ops.OpOverload, factor: Any) -> bool:
        """Rule 6b: record ``func`` (an in-place multiplication by ``factor``) of ``grad`` alone
        instead of running it; False when it must run as before."""
        slot = grad.whole_slot()
        if slot is None:
            return False
        if isinstance(factor, torch.Tensor):
            if isinstance(factor, HostGradient) or factor.dim() != 0:
                return False
            factor = factor.detach().clone()  # the caller may reuse its tensor
        elif not isinstance(factor, (int, float, bool)):
            return False
        index = grad.chunk.index
        self._scales.setdefault(index, []).append(_Scale(grad.geometry, func, factor, grad.device))
        kept = self._norms.get(index)
        if kept is not None:
            for key in [k for k in kept if k[0] == slot.offset]:
                del kept[key]
        self.scales_deferred += 1
        GradientWrites.note()
        if index in self._staged:
            self.fence(grad.chunk)  # NOTE [ Step threads ] rule 4: no step reads the copy meanwhile
            self.buffer(grad.chunk)  # a staged copy carries every recorded scaling
        return True

    def scale_range(self, chunk: Chunk, lo: int, data: torch.Tensor) -> None:
        """Rule 6b for a chunk that steps in slices: the recorded scalings run on ``data``, bytes
        ``[lo, lo + len(data))`` of its gradients read from NVMe for one slice's step (the
        stored bytes stay as they are, as a staged copy's do)."""
        for scale in self._scales.get(chunk.index, ()):
            scale.run_range(data, lo)

    def settle(self, chunk: Chunk) -> None:
        """Rule 6: ``chunk``'s stored bytes are about to move (back to the device to accumulate):
        recorded scalings are written into them first, and kept norms are forgotten."""
        self._norms.pop(chunk.index, None)
        if self._scales.get(chunk.index):
            self.buffer(chunk, write=True)
        self.release(chunk)

    def prefetch(self, chunk: Chunk) -> None:
        """Start staging ``chunk``'s stored gradients while the host has room for them beside
        what is staged (the step reads them next); nothing when it has not."""
        if not self.stored(chunk):
            return
        assert chunk.grad is not None
        if chunk.grad.state is ObjectState.MOVING:
            return  # its write-back from the device has not landed: staged on demand
        if self._start_copy(chunk, on_the_way=False):
            self.stagings += 1

    def stage_on_the_way(self, chunk: Chunk) -> Future[None] | None:
        """Rule 7: stage a host copy of ``chunk``'s gradients from its device buffer, about to go
        to NVMe; the copy's end, which the write-back waits for, or None without a slot or host
        room (the step then stages them from NVMe)."""
        if chunk.slice_span is not None:
            return None
        staged = self._start_copy(chunk, on_the_way=True)
        if staged is None:
            return None
        assert staged.filling is not None
        copied: Future[None] = Future()
        # whatever its outcome: a failed or cancelled copy leaves the buffer as it was
        staged.filling.add_done_callback(lambda _transfer: copied.set_result(None))
        self.staged_on_the_way += 1
        return copied

    def _start_copy(self, chunk: Chunk, *, on_the_way: bool) -> _Staged | None:
        """Start copying ``chunk``'s gradients (where they are now) into a new host block, kept as
        its staged copy; None where it has one already, or without a slot (rule 2) or host room."""
        assert chunk.grad is not None
        if chunk.index in self._staged or len(self._staged) >= self.store.staged_homes:
            return None
        try:
            handle = self.store.registry.make(
                "host", chunk.nbytes, kind="chunk", label="gradient", room=self._room(chunk)
            )
        except TierCapacityError:
            return None
        try:
            filling = handle.fill_from(chunk.grad, nbytes=chunk.nbytes, priority=Priority.PREFETCH)
        except BaseException:
            handle.free()
            raise
        staged = self._staged[chunk.index] = _Staged(handle, filling=filling, on_the_way=on_the_way)
        return staged

    def drop_copy(self, chunk: Chunk) -> None:
        """Free ``chunk``'s staged copy, unwritten, its copy in flight cancelled or finished first;
        kept norms and recorded scalings stay (the gradients are as they were)."""
        staged = self._staged.pop(chunk.index, None)
        if staged is not None:
            self.fence(chunk)
            _free(staged)

    def _stage(self, chunk: Chunk) -> _Staged:
        assert chunk.grad is not None
        chunk.grad.wait()  # the write-back from the device lands first
        while len(self._staged) >= self.store.staged_homes:
            self.release(self.store.chunks[next(iter(self._staged))])
        handle = self._make_copy(chunk)
        try:
            handle.fill_from(chunk.grad, nbytes=chunk.nbytes).wait()
        except BaseException:
            handle.free()
            raise
        self.stagings += 1
        staged = self._staged[chunk.index] = _Staged(handle)
        return staged

    def _room(self, chunk: Chunk) -> int:
        """The block a host copy of ``chunk``'s gradients takes: the store's common room for these
        copies (NOTE [ Spare tier blocks ] rule 6), so the block one copy leaves serves the next
        whatever its chunk's size. A sliced chunk's gradients, read whole only for an op on them,
        take their own bytes."""
        return self.store.stored_grad_room if chunk.slice_span is None else 0

    def _make_copy(self, chunk: Chunk) -> Handle:
        # made by the tier: a block it kept (NOTE [ Spare tier blocks ]), not fresh pages the
        # kernel zeroes inside the read that fills them
        registry = self.store.registry
        room = self._room(chunk)
        try:
            return registry.make("host", chunk.nbytes, kind="chunk", label="gradient", room=room)
        except TierCapacityError:
            # Staged NVMe homes and stepped shadows of homes free host bytes as their write-backs
            # land; so do our other copies.
            self.release_all()
            self._wait_write_backs()
            try:
                return registry.make("host", chunk.nbytes, kind="chunk", label="gradient", room=room)
            except TierCapacityError as exc:
                why = "it steps in slices" if chunk.slice_span is not None else "grad_home 'nvme'"
                what = f"reading chunk {chunk.index}'s gradients, which wait on NVMe ({why}), whole"
                raise StatesMemoryError.tier_full(exc, what) from exc

    def release(self, chunk: Chunk) -> None:
        """Drop ``chunk``'s staged copy, written back to NVMe first if it was written."""
        staged = self._staged.pop(chunk.index, None)
        if staged is None:
            return
        self.fence(chunk)
        try:
            staged.landed()
            if staged.written and chunk.grad is not None and not chunk.grad.freed:
                chunk.grad.wait()  # staged on its way to NVMe (rule 7): the write-back lands first
                chunk.grad.fill_from(staged.handle, nbytes=chunk.nbytes, priority=Priority.WRITEBACK).wait()
                self.write_backs += 1
                self._scales.pop(chunk.index, None)  # rule 6b: the NVMe bytes carry them now
        finally:
            staged.handle.free()

    def discard(self, chunk: Chunk) -> None:
        """Drop ``chunk``'s staged copy without writing it back (its gradients are freed)."""
        self._norms.pop(chunk.index, None)
        self._scales.pop(chunk.index, None)
        self.drop_copy(chunk)

    def release_all(self) -> None:
        for index in list(self._staged):
            self.release(self.store.chunks[index])

    def discard_all(self) -> None:
        """Forget every staged copy (the chunks are being freed or rebuilt)."""
        for staged in self._staged.values():
            _free(staged)
        self._staged.clear()
        self._norms.clear()
        self._scales.clear()


def _free(staged: _Staged) -> None:
    """Free a staged copy, its prefetch (if still running) finished or cancelled first."""
    filling, staged.filling = staged.filling, None
    if filling is not None:
        filling.cancel()
        with contextlib.suppress(Exception):  # cancelled, or its error: the copy is dropped anyway
            filling.wait()
    staged.handle.free()


class StoredGradient(HostGradient):
    """``p.grad`` of a gradient stored on NVMe: its host bytes are staged when an op touches
    them (NOTE [ Stored gradients ] rule 3)."""

    stash: GradientStash
    chunk: Chunk
    geometry: Geometry

    @staticmethod
    def __new__(  # type: ignore[override]
        cls,
        stash: GradientStash,
        chunk: Chunk,
        geometry: Geometry,
        device: torch.device | str,
        lease: list[bool],
    ) -> StoredGradient:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            geometry.shape,
            strides=geometry.stride,
            dtype=geometry.dtype,
            device=indexed(device),
            requires_grad=False,
        )
        out.stash = stash
        out.chunk = chunk
        out.geometry = geometry
        out.lease = lease
        return out

    @property  # type: ignore[override]
    def host(self) -> torch.Tensor:
        """The host bytes this gradient stands for, staged now (read only: see :meth:`write_host`)."""
        return self.geometry.view(self.stash.buffer(self.chunk))

    @host.setter
    def host(self, view: torch.Tensor) -> None:
        # NOTE [ Host gradients ] rule 6: an in-place view op changed the shape or strides
        self.geometry = Geometry.of_view(view, self.stash.buffer(self.chunk))

    def like(self, view: torch.Tensor) -> HostGradient:
        return StoredGradient(
            self.stash, self.chunk, Geometry.of_view(view, self.stash.buffer(self.chunk)), self.device, self.lease
        )

    def write_host(self, value: torch.Tensor) -> None:
        self.geometry.view(self.stash.buffer(self.chunk, write=True)).copy_(value)

    def zero_host_(self) -> None:
        self.geometry.view(self.stash.buffer(self.chunk, write=True)).zero_()

    def whole_slot(self) -> Slot | None:
        """The parameter whose whole gradient this is as exposed (rule 6), or None (a view)."""
        for slot in self.chunk.layout.slots:
            if slot.offset == self.geometry.offset and self.stands_for(self.chunk, slot):
                return slot
        return None

    @classmethod
    def __torch_dispatch__(
        cls,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Rule 6: clipping's norm and scaling of one whole stored gradient, without staging."""
        kwargs = kwargs or {}
        if func in _NORMS or func in _SCALES:
            first = args[0] if args else None
            alone = first[0] if isinstance(first, list) and len(first) == 1 else first
            if isinstance(alone, StoredGradient) and alone.lease[0]:
                if func in _NORMS:
                    answer = alone.stash.kept_norm(alone, func, args, kwargs)
                    if answer is not None:
                        return answer
                elif not kwargs and len(args) == 2 and alone.stash.defer_scale(alone, func, args[1]):
                    return None if alone is not first else alone
        return super().__torch_dispatch__(func, types, args, kwargs)

    def stands_for(self, chunk: Chunk, slot: Slot) -> bool:
        """This is ``slot``'s whole gradient in ``chunk`` as exposed (not a view, not reshaped)."""
        return self.chunk is chunk and self.geometry == Geometry.of_slot(slot) and self.lease[0]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"StoredGradient(device={self.device}, chunk={self.chunk.index}, {self.geometry})"
