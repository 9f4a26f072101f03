"""Gradients in gradient chunks: routing each accumulated gradient into its chunk's buffer,
sending offloaded chunks' buffers home, and what ``p.grad`` is between backward and step (rule 4
of NOTE [ Model-state rules ] in ``manager.py``; NOTE [ Host gradients ] in ``hostgrad.py``).

:class:`Gradients` owns the leases of the HostGradients it exposed. It may touch: each chunk's
gradient buffer (``chunk.grad``, through its handle and the registry), ``p.grad`` of the managed
parameters, the store's ``has_grad`` flags, and the device tier's room through the pool's retry
ladder. It never touches parameter values or homes. Before it moves, reads, brings back or frees a
chunk's gradient buffer it calls ``fence`` with the chunk, so a step of that chunk still in flight
finishes first (NOTE [ Step threads ] rule 4).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future

import torch

from tiermem.errors import TierCapacityError
from tiermem.layout.chunks import Slot
from tiermem.registry import Handle, ObjectState, Priority, Registry
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesMemoryError, StatesUsageError
from tiermem.states.facts import ModelFacts, same
from tiermem.states.homes import Homes, HomeSlice
from tiermem.states.hostgrad import HostGradient
from tiermem.states.optimizer import ManagedOptimizer
from tiermem.states.store import ChunkStore
from tiermem.states.stored_grads import Geometry, GradientStash, StoredGradient


class Gradients:
    """The gradient buffers of ``store``'s chunks and the ``.grad`` of its parameters."""

    def __init__(
        self,
        registry: Registry,
        facts: ModelFacts,
        store: ChunkStore,
        homes: Homes,
        *,
        proxy_host_gradients: bool,
        wait_write_backs: Callable[[], None],
    ) -> None:
        self.registry = registry
        self.facts = facts
        self.store = store
        self.homes = homes
        #: NOTE [ Host gradients ] rule 9: HostGradients for every chunk on the CPU device too (tests)
        self.proxy_host_gradients = proxy_host_gradients
        #: NOTE [ Host gradients ] rule 1: on the CPU device, HostGradients for chunks with NVMe homes
        #: while the loop may run ahead (the stepper keeps it so)
        self.observe_nvme_homes = False
        #: NOTE [ Host gradients ] rule 5: per chunk, the lease of the HostGradients exposed now
        self._leases: dict[int, list[bool]] = {}
        #: NOTE [ Step threads ] rule 4: finishes a chunk's step in flight
        self.fence: Callable[[Chunk], None] = homes.fence
        #: chunks whose gradients :meth:`flush` sent home since the last fresh gradient buffer
        self._sent: list[Chunk] = []
        #: fresh gradient buffers made beside write-backs still in flight (rule 6 of the manager)
        self.buffers_beside_writebacks = 0
        #: NOTE [ Stored gradients ]: host copies of the gradients that wait on NVMe
        #: ``wait_write_backs``: every write-back to NVMe in flight (homes', shadows') lands, freeing
        #: the host bytes the stash reads stored gradients into when it is short of room
        self.stash = GradientStash(store, wait_write_backs, homes.fence)

    # -- in backward ---------------------------------------------------------------------------
    def device_grads(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's gradient buffer on the device (allocated, or brought back to accumulate).
        Without room, offloaded chunks whose gradients no module's backward is waiting for (a
        loss over parameters used outside any forward: an L2 penalty by hand, NOTE [ Parameter
        access ] rule 5) go where they wait first; a later gradient brings them back to add."""
        try:
            return self._device_grads(chunk)
        except StatesMemoryError:
            idle = [
                c
                for c in self.store.chunks
                if c is not chunk and c.offloaded and c.pins == 0 and not c.entered and not c.pending
            ]
            if not idle:
                raise
            for other in idle:
                self.flush(other)
            return self._device_grads(chunk)

    def _device_grads(self, chunk: Chunk) -> torch.Tensor:
        self.fence(chunk)
        handle = chunk.grad
        pool = self.store.pool
        if handle is None:
            # Made by the device tier: on the CPU a block it kept (NOTE [ Spare tier blocks ]), not
            # a fresh mapping whose pages the kernel zeroes again as backward first writes them.
            # Nothing here keeps a reference, so the write-back frees the block and the tier may
            # keep it again (rule 3 there; TRAPS 14).
            # Its block holds the room the store gave every streamed untied chunk (rule 6 there),
            # so the block kept after one chunk's write-back serves the next whatever its size.
            def make() -> Handle:
                return self.registry.make("device", chunk.nbytes, kind="chunk", label="gradient", room=chunk.grad_room)

            made = None
            if self._room_beside_writebacks(max(chunk.nbytes, chunk.grad_room)):
                with contextlib.suppress(TierCapacityError):  # another thread took the room first
                    made = make()
                    self.buffers_beside_writebacks += 1
            if made is None:
                # The earlier chunks' write-backs land first, so the device holds no gradients
                # beyond the ones being filled and the plan's peak (rule 6 of the manager).
                self._land_writebacks()
                made = pool.device_room(make, (chunk,), demand=True, what=f"the gradients of chunk {chunk.index}")
            chunk.grad = made
            return chunk.grad.tensor("device")
        if handle.tier != "device" or handle.state is ObjectState.MOVING or self.stash.staged(chunk):
            # edits (and deferred scalings) of stored gradients land on NVMe before they move; a
            # copy staged as they went (NOTE [ Stored gradients ] rule 7) goes before autograd adds
            # to the buffer (its write-back failed, and the buffer stayed on the device)
            self.stash.settle(chunk)
            pool.device_room(lambda: handle.move_to("device", Priority.DEMAND), (chunk,), demand=True, what="gradients")
            handle.wait()
        return handle.tensor("device")

    def _room_beside_writebacks(self, nbytes: int) -> bool:
        """Rule 6 of the manager: gradient write-backs :meth:`flush` started are still in flight,
        and a fresh buffer of ``nbytes`` beside them keeps the device's bytes within the peak the
        plan predicted (none predicted: never)."""
        self._sent = [c for c in self._sent if c.grad is not None and c.grad.state is ObjectState.MOVING]
        plan = self.store.plan
        predicted = None if plan is None else plan.predicted.peak_bytes.get("device")
        if not self._sent or predicted is None:
            return False
        held = self.registry.tier_statistics("device").current_bytes
        return held + self.registry.reserved_size("device", nbytes) <= predicted

    def _land_writebacks(self) -> None:
        """Wait for the gradient write-backs :meth:`flush` started that are still in flight."""
        sent, self._sent = self._sent, []
        for chunk in sent:
            if chunk.grad is not None and chunk.grad.state is ObjectState.MOVING:
                chunk.grad.wait()

    def accumulate(self, i: int, p: torch.Tensor) -> Chunk | None:
        """Rule 4, after autograd accumulated ``p.grad``: into its chunk's buffer; the chunk, or
        None when ``p`` has no gradient."""
        grad = p.grad
        if grad is None:
            return None
        if grad.layout != torch.strided:
            raise StatesUsageError("tiermem: sparse gradients are not supported for managed parameters")
        chunk, slot = self.store.slots[i]
        view = slot.view(self.device_grads(chunk))
        if not same(grad, view):
            if self.store.has_grad[i]:
                view.add_(grad)  # what AccumulateGrad does: `variable.grad += new_grad`
            else:
                view.copy_(grad)
            p.grad = view
        if chunk.offloaded:
            # TRAPS 28: this node's stream (autograd's, on CUDA) wrote the buffer; the write-back
            # of the whole chunk, submitted later from another node's hook, must wait for it too.
            self.registry.fence("device")
        self.store.has_grad[i] = True
        return chunk

    def send_offloaded_back(self) -> None:
        """At a backward's start: offloaded chunks' gradients wait on the host; autograd must not
        add into those views (rule 4), they come back to the device to accumulate."""
        for chunk in self.store.chunks:
            if chunk.offloaded and chunk.trainable:
                for slot in chunk.layout.slots:
                    self.facts.params[slot.index].grad = None
                self.retire(chunk)

    def enter(self, chunk: Chunk) -> None:
        """A chunk's backward began: its parameters' earlier gradients view its device buffer."""
        if chunk.offloaded and chunk.grad is not None:
            have = [slot for slot in chunk.layout.slots if self.store.has_grad[slot.index]]
            if have:
                data = self.device_grads(chunk)
                for slot in have:
                    self.facts.params[slot.index].grad = slot.view(data)

    def flush(self, chunk: Chunk, *, steps_next: bool = False) -> None:
        """Send an offloaded chunk's gradients where they wait for the step (rule 4; NVMe:
        NOTE [ Stored gradients ] rule 1); ``steps_next``: its step reads them in this backward,
        so on their way to NVMe they are staged on the host too (rule 7 there)."""
        self.fence(chunk)
        handle = chunk.grad
        if handle is None or handle.tier != "device" or handle.state is not ObjectState.RESIDENT:
            return
        for slot in chunk.layout.slots:
            self.facts.params[slot.index].grad = None  # views would keep the device buffer alive (TRAPS 14)
        self._sent.append(chunk)  # the next fresh buffer waits for its write-back
        if chunk.grad_home == "nvme":
            slots = [slot for slot in chunk.layout.slots if self.store.has_grad[slot.index]]
            # their norms, kept for clipping by hand (NOTE [ Stored gradients ] rule 6a)
            self.stash.land(chunk, handle.tensor("device"), slots)
            self.registry.fence("device")  # the write-back starts after the norms read the buffer
            copied = self.stash.stage_on_the_way(chunk) if steps_next else None
            try:
                self._store_on_nvme(chunk, handle, copied)
            except BaseException:
                # the gradients stay on the device, where the next backward adds to them: a copy
                # of them now would go stale
                self.stash.drop_copy(chunk)
                raise
            return
        try:
            handle.move_to("host", Priority.WRITEBACK)
        except TierCapacityError:
            # Staged NVMe homes free host bytes as their write-backs land (early steps).
            self.homes.wait_moves()
            try:
                handle.move_to("host", Priority.WRITEBACK)
            except TierCapacityError as exc:
                raise StatesMemoryError.tier_full(
                    exc,
                    f"chunk {chunk.index}'s gradients, held on the host until the optimizer steps,",
                    " (a plan made for streaming gradients, keep_gradients=False, needs every chunk to step as its "
                    "backward ends: a nested reentrant backward or accumulation keeps them all)",
                ) from exc

    def _store_on_nvme(self, chunk: Chunk, handle: Handle, after: Future[None] | None) -> None:
        """Start ``chunk``'s gradient buffer's write-back to NVMe (once ``after`` is done)."""
        while True:
            try:
                handle.move_to("nvme", Priority.WRITEBACK, after=after)
                return
            except TierCapacityError as exc:
                # copies run ahead give their room back first (NOTE [ Speculative steps ] rule 2)
                if self.registry.reclaim("nvme", exc.requested):
                    continue
                why = "it steps in slices" if chunk.slice_span is not None else "grad_home 'nvme'"
                what = f"chunk {chunk.index}'s gradients, waiting on NVMe until the step ({why}),"
                raise StatesMemoryError.tier_full(exc, what) from exc

    # -- what p.grad is ------------------------------------------------------------------------
    def grad_bytes(self, chunk: Chunk, *, write: bool = False) -> torch.Tensor:
        """The chunk's gradient buffer where it is resident now (host or device), or its copy
        staged on the host when it waits on NVMe (``write``: the caller writes it; NOTE
        [ Stored gradients ] rule 2). To read a chunk that steps in slices, its stored gradients
        are read out into a copy outside the tiers, as an NVMe home read for export is: the host
        stages only slices of them (NOTE [ Sliced steps ] rule 4)."""
        self.fence(chunk)
        assert chunk.grad is not None
        if self.stash.staged(chunk):  # perhaps staged on its way to NVMe: the copy, as it lands
            return self.stash.buffer(chunk, write=write)
        chunk.grad.wait()
        if self.stash.stored(chunk):
            if chunk.slice_span is not None and not write:
                return chunk.grad.copy_out()[: chunk.nbytes]
            return self.stash.buffer(chunk, write=write)
        return chunk.grad.tensor(chunk.grad.tier)

    def addressable(self, chunk: Chunk) -> bool:
        """``chunk``'s gradients are in memory the CPU addresses (the host, or the CPU device)."""
        assert chunk.grad is not None
        tier = chunk.grad.tier
        return tier == "host" or (tier == "device" and self.facts.device.type == "cpu")

    def grad_range(self, chunk: Chunk, piece: HomeSlice) -> torch.Tensor:
        """Bytes ``[piece.lo, piece.hi)`` of ``chunk``'s gradients for a sliced step (NOTE
        [ Sliced steps ] rule 2): a view where the CPU addresses them, else copied into
        ``piece``'s room (from NVMe or a CUDA device; :meth:`Homes.wait_slice` waits). The caller
        released the chunk's staged copy, if any, and finished its steps but its own earlier slices
        (no fence here: one of them computes while the next is read)."""
        handle = chunk.grad
        assert handle is not None
        handle.wait()
        if self.addressable(chunk):
            return handle.tensor(handle.tier)[piece.lo : piece.hi]
        self.registry.fence("device")  # bytes a kernel wrote are copied after it ran (TRAPS 28)
        room = piece.grads()
        piece.transfers.append(
            piece.handle.fill_from(handle, nbytes=piece.span, source_offset=piece.lo, offset=piece.home_bytes)
        )
        return room

    def expose(self) -> None:
        """``p.grad`` views the real gradient wherever it lives (rule 4, TRAPS 4)."""
        for chunk in self.store.chunks:
            self.expose_chunk(chunk)

    def expose_chunk(self, chunk: Chunk) -> None:
        """Rule 4 for one chunk; a stored chunk's gradients are not read to expose them."""
        if chunk.grad is not None:
            chunk.grad.wait()
        stored = self.stash.stored(chunk)
        data = self.grad_bytes(chunk) if chunk.grad is not None and not stored else None
        for slot in chunk.layout.slots:
            p = self.facts.params[slot.index]
            if not self.store.has_grad[slot.index] or chunk.grad is None:
                p.grad = None
            elif stored:
                p.grad = self._stored(chunk, slot)
            else:
                p.grad = self.exposed(chunk, slot.view(data))  # type: ignore[arg-type]

    def _stored(self, chunk: Chunk, slot: Slot) -> StoredGradient:
        lease = self._leases.setdefault(chunk.index, [True])
        return StoredGradient(self.stash, chunk, Geometry.of_slot(slot), self.facts.device, lease)

    def exposed(self, chunk: Chunk, view: torch.Tensor) -> torch.Tensor:
        """What ``p.grad`` is for ``view``, a gradient in ``chunk``'s buffer: the view itself, or a
        :class:`HostGradient` standing for it on the device (NOTE [ Host gradients ] rule 1)."""
        assert chunk.grad is not None
        on_host = chunk.grad.tier == "host" and self.observed_on_host(chunk)
        if not on_host:
            return view
        lease = self._leases.setdefault(chunk.index, [True])
        return HostGradient(view, self.facts.device, lease)

    def observed_on_host(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s gradients, while they wait on the host, are exposed through
        HostGradients, whose every write the runtime sees (NOTE [ Host gradients ] rule 1)."""
        if self.facts.device.type != "cpu" or self.proxy_host_gradients:
            return True
        return self.observe_nvme_homes and chunk.home_tier == "nvme"

    def retire(self, chunk: Chunk | None = None) -> None:
        """NOTE [ Host gradients ] rule 5: ``chunk``'s (every chunk's) host gradient bytes move or
        are freed; HostGradients of them refuse ops from now on."""
        if chunk is None:
            self.stash.discard_all()  # the chunks are rebuilt from a snapshot of them
        for index in [chunk.index] if chunk is not None else list(self._leases):
            lease = self._leases.pop(index, None)
            if lease is not None:
                lease[0] = False

    def drop(self, chunk: Chunk) -> None:
        """Free ``chunk``'s gradient buffer (no parameter of it has a gradient any more)."""
        self.fence(chunk)
        assert chunk.grad is not None
        self.stash.discard(chunk)
        self.retire(chunk)
        chunk.grad.free()
        chunk.grad = None

    @staticmethod
    def _is_exposed(grad: torch.Tensor, view: torch.Tensor) -> bool:
        """``grad`` is what :meth:`exposed` made of ``view`` (or the view itself)."""
        if isinstance(grad, HostGradient):
            return same(grad.host, view)
        return same(grad, view)

    def reconcile(self) -> None:
        """Rule 4: take in what user code did to ``p.grad`` since we exposed it."""
        has_grad = self.store.has_grad
        for chunk in self.store.chunks:
            if not chunk.trainable:
                continue
            data: torch.Tensor | None = None
            created = False
            for slot in chunk.layout.slots:
                i = slot.index
                p = self.facts.params[i]
                grad = p.grad
                if not has_grad[i] and grad is None:
                    continue
                if has_grad[i] and grad is None:
                    has_grad[i] = False  # model.zero_grad() or `p.grad = None`
                    continue
                if has_grad[i] and isinstance(grad, StoredGradient) and grad.stands_for(chunk, slot):
                    continue  # as exposed: its bytes are on NVMe, nothing to read
                if data is None:
                    created = chunk.grad is None
                    data = self._new_grads(chunk) if created else self.grad_bytes(chunk, write=True)
                view = slot.view(data)
                if not self._is_exposed(grad, view):
                    view.copy_(grad)  # a HostGradient of another view copies through its own bytes
                    p.grad = self._stored(chunk, slot) if self.stash.stored(chunk) else self.exposed(chunk, view)
                has_grad[i] = True
            if chunk.grad is not None and not any(has_grad[s.index] for s in chunk.layout.slots):
                self.drop(chunk)
            elif created and chunk.grad_home == "nvme":
                self._store(chunk)

    def _new_grads(self, chunk: Chunk) -> torch.Tensor:
        tier = "host" if chunk.offloaded else "device"
        device = "cpu" if chunk.offloaded else self.facts.device
        chunk.grad = self.store.register(torch.zeros(chunk.nbytes, dtype=torch.uint8, device=device), tier, "gradient")
        return chunk.grad.tensor(tier)

    def _store(self, chunk: Chunk) -> None:
        """Gradients made on the host for a chunk whose gradients wait on NVMe go there (NOTE
        [ Stored gradients ] rule 1): hand-made ``.grad`` of parameters that had none."""
        assert chunk.grad is not None
        self.retire(chunk)
        chunk.grad.move_to("nvme", Priority.WRITEBACK)
        chunk.grad.wait()
        self.expose_chunk(chunk)

    def zero_grad(self, optimizer: ManagedOptimizer, set_to_none: bool) -> None:
        """``optimizer.zero_grad()`` over the real gradients, once :meth:`reconcile` took them in."""
        self.reconcile()
        has_grad = self.store.has_grad
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = self.facts.index[id(p)]
                if not has_grad[i] or p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    has_grad[i] = False
                elif isinstance(p.grad, HostGradient):
                    p.grad.zero_host_()  # in place on the host: no round trip through the device
                else:  # what torch.optim.Optimizer.zero_grad does
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
        for chunk in self.store.chunks:
            if chunk.grad is not None and not any(has_grad[s.index] for s in chunk.layout.slots):
                self.drop(chunk)
