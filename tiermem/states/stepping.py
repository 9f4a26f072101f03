"""The optimizer step: at ``optimizer.step()``, or early, overlapped with the last backward of an
accumulation window the user declared (rule 5 of NOTE [ Model-state rules ] in ``manager.py``).

:class:`Stepper` owns the declarations and the counters of NOTE [ Declared steps ] (backwards
counted, chunks stepped early, gradient versions) and runs chunk steps: each is prepared and
finished here, on the training thread, and computed by :class:`~tiermem.states.chunk_step.ChunkStep`
inline or on the step thread (NOTE [ Step threads ] in ``step_thread.py``). It may touch: chunk
homes (staged through :class:`~tiermem.states.homes.Homes`), the store's optimizer records and
generation, the pool's residency (releases), and gradients through
:class:`~tiermem.states.gradients.Gradients`; a pending re-pack it hands to the relayout. The
copies of homes an undeclared loop's backward steps into are :class:`~tiermem.states.speculation.Shadows`'
(NOTE [ Speculative steps ]); when to make, keep or discard them is decided here.

# NOTE [ Declared steps ]
1. ``rt.manage(..., grad_accumulation_steps=N, clip_grad_norm=max_norm)`` declares the loop:
   ``optimizer.step()`` and ``optimizer.zero_grad()`` come after every N-th backward (N is 1
   when only ``clip_grad_norm`` is given), and user code does not edit gradients in between;
   the runtime clips. Undeclared, the step runs whole at ``optimizer.step()`` and user code
   may read, clip and edit ``.grad`` freely (TRAPS 4); backward may step NVMe chunks into
   copies of their homes that ``optimizer.step()`` keeps only when nothing changed (NOTE
   [ Speculative steps ] in ``speculation.py``).
2. Counting: a backward counts when it ends complete, every parameter the forward used with
   grad enabled having received its gradient. A reentrant checkpoint's nested backward that
   ends ours early does not count (NOTE rule 8 of the manager) and turns early steps off
   until the next ``optimizer.step()`` (it forgot which gradients are still to come); a
   backward that leaves a used parameter without gradient does not count either, which can
   only lose overlap, never step early. ``optimizer.step()`` resets the count.
3. Early steps, when no clipping is declared: in a backward that will complete the window,
   after exactly one forward with grad since the previous complete backward, and after the
   first window's ``optimizer.step()`` (which re-packs and shows whether gradients stay
   untouched between backward and step), each offloaded chunk steps as soon as every
   parameter of it that the forward used has its gradient and that gradient is home: its
   NVMe home is prefetched to the host when its backward begins (while no other home waits
   for its step and the plan's ``staged_homes`` room holds it beside the homes still being
   written back after theirs), so the state I/O hides behind the rest of backward. When that
   room is taken as its backward begins, every later hook of the backward asks again, and
   the read starts as soon as a write-back landed rather than when the step needs the home
   (on the 0.15x-RAM headline GPT nearly every early step of a chunk waited for its whole
   home read before: 0.8-3.1 s a step). The read is submitted before the next chunk's
   parameters are prefetched (both at the same priority, first come first served): the step
   needs its home before the next chunk's backward needs its parameters (210M HF GPT-2 on 2
   cores: every other home read queued 24-30 ms behind that fill). The step changes only the
   chunk's home (master and states); its device copy, which the rest of this backward may
   still hold for frozen parameters, is released when backward ends, so the next forward
   reads the new values. Persistent chunks
   (their device copy is the master, still saved by autograd), chunks that never completed and
   chunks whose device copy is newer than their home (``load_state_dict`` since the last step:
   the copy goes home when released) step at ``optimizer.step()``, which also waits for the early
   steps' write-backs.
4. Guard: gradient versions are recorded when a counted backward ends, with the count of writes
   to gradients held off the device (``GradientWrites`` in ``hostgrad.py``: a write through a
   stored gradient's ``.data`` or a deferred scaling moves no version). If ``optimizer.step()``
   finds them changed (``GradScaler.unscale_``, clipping or edits by hand), or more counted
   backwards than declared (a loop accumulating by hand), after early steps used them, it
   raises :class:`StatesUsageError`, never a silently different step; if no early step ran
   yet, it switches early steps off for this model and logs why.
5. Declared clipping: at ``optimizer.step()``, ``torch.nn.utils.clip_grad_norm_`` over the
   model's parameters (the real gradients, wherever they live), so the total norm is
   PyTorch's own, computed before any chunk steps; ``optimizer.grad_norm`` holds it. No early
   steps then: the norm needs every gradient.
6. ``keep_gradients=False`` (declared loops only): a chunk that stepped early frees its
   gradients at once, as the ``zero_grad()`` that follows would; their ``.grad`` is None
   after backward. With NVMe homes this keeps the host free of gradient bytes between
   steps (they otherwise wait there until ``zero_grad``, 4 bytes a parameter). The caller
   has promised not to touch gradients, so early steps start in the first window.
7. Staging an NVMe home for a chunk's step reads only its optimizer states when the chunk's
   device copy is the home's master (or working copy) as fetched: those bytes are copied
   from it (NOTE [ Managed object rules ] rule 6). In backward the copy is there (the
   chunk's backward just used it), so an early step reads 8 bytes a parameter from NVMe
   for fp32 Adam, not 12: the master was read moments before for the backward itself.
8. On the CPU device with ``keep_gradients=False``, an early step reads the gradients in
   the chunk's device gradient buffer, which the CPU addresses, and frees it: copying them
   to the host first (what rule 4 of the manager's NOTE does for gradients that are kept,
   and what a CUDA device needs for a CPU step) would cost a memory copy of 4 bytes a
   parameter on the cores that compute, and the training thread would wait for it.
9. Where a chunk's gradients went home (kept, or on CUDA, whose backward hooks run on
   autograd's device thread), backward does not wait for the step in flight or a home read:
   the chunk joins a queue; later hooks read the first queued home before any other (rule
   3's room) and start queued steps in order (speculative ones from every hook of backward:
   NOTE [ Speculative steps ] reads a shadow only for the head); the end of backward runs the
   rest. With ``keep_gradients=False`` (two chunks' gradients budgeted on the host) one step
   waits at most; under rule 8 steps run at once. Gradients stored on NVMe are staged first (NOTE
   [ Stored gradients ]). An error ending backward unmarks the queued chunks (none steps twice
   in a window, as for any chunk a failed step never reached) and sends their homes back.
10. Declaring later (``rt.declare``, which trainers' integrations call: ``tiermem.integrations.hf``):
    a declaration replaces the one in force where no chunk stepped early in the current window,
    so no gradient used by a step was promised under other terms; the count of backwards goes
    on. A loop that clips through its own call (a trainer's ``clip_grad_norm_``) has the runtime
    clip there, once per window (rule 5, run ahead: no chunk steps between that call and
    ``optimizer.step()`` under clipping), and ``optimizer.step()`` does not clip again; a
    backward after that call (its gradients would miss the clip) makes the step raise.
11. A backward that steps nothing early (an undeclared loop, declared clipping, or after a
    re-pack is due: none then) still uses the time it leaves the disk idle: once a chunk's
    gradients are complete, its NVMe home is staged on the host when it is one of the first
    ``staged_homes`` NVMe chunks ``optimizer.step()`` will stage (placement rule 3's room,
    which nothing else uses between steps). Backward reaches those chunks last, so the step
    starts with its first homes on the host or on their way instead of waiting for the first
    read. Backward ends by waiting for its gradients' write-backs (device to host), so the read
    stays off their way: at write-back priority, behind them, and the whole home from NVMe,
    which idles in backward, not its master copied from the device copy (rule 7) over their
    link (on the 0.15x-RAM headline GPT with a prefetch and that copy, backward waited 0.5-3.9 s
    for gradients, against under 0.3 s without staging: one machine shared by other jobs). A
    home whose write-back from the last step is still in flight, or with no room beside the
    homes off NVMe now, is not staged (the step stages it as before); ``optimizer.step()``
    sends back any staged home that will not step first (a chunk that got no gradient), so its
    room stays exactly the plan's. With declared accumulation, only in the window's last
    backward.
12. ``optimizer.step()`` reads homes ahead as deep as the host holds them: where every NVMe chunk
    it steps keeps its gradients on the host (nothing else of the step then asks the host for
    room: no stored gradient to stage, no slice, no asynchronous save copying homes) and the plan
    stages two homes, the next NVMe homes in step order are read (PREFETCH) while the host tier
    takes them, and while a chunk's own home is not on the host yet the step waits for the
    write-backs in flight, one at a time, reading the next home as each lands, rather than only
    after the chunk stepped. A chunk's step computes in milliseconds, so the step phase is its
    home reads and write-backs; read one home ahead, each read waited for the write-back of the
    home two chunks back and the disk idled between reads (on the 0.15x-RAM headline GPT in a
    plain loop on a loaded machine: 15 chunks, 1.9-2.1 s of a 2.7 s step phase waiting for
    reads). On a quiet machine the step phase is at the disk's rate either way (its reads and
    write-backs alone take its time). The host tier's capacity bounds the depth; a home read
    ahead for a step that will not run (an error) goes back.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from tiermem import tracing
from tiermem.errors import TierCapacityError
from tiermem.layout.chunks import Slot
from tiermem.registry import KnownBytes, ObjectState, Priority
from tiermem.states.chunk_step import ChunkStep, SlicedStep
from tiermem.states.chunks import Chunk
from tiermem.states.declarations import Declarations, clip_declared
from tiermem.states.errors import StatesUsageError
from tiermem.states.facts import ModelFacts
from tiermem.states.gradients import Gradients
from tiermem.states.homes import Homes
from tiermem.states.hostgrad import GradientWrites
from tiermem.states.optimizer import ManagedOptimizer
from tiermem.states.speculation import Shadow, Shadows, hyperparameters, same_hyperparameters
from tiermem.states.stateio import SaveGuard
from tiermem.states.step_order import StepOrder
from tiermem.states.step_thread import StepThread
from tiermem.states.store import ChunkStore

if TYPE_CHECKING:  # the relayout imports the backward tracker, which imports this module
    from tiermem.states.relayout import Relayout

log = logging.getLogger("tiermem.states")


class Stepper:
    """Chunk steps at ``optimizer.step()`` and, in declared loops, during backward."""

    def __init__(
        self,
        facts: ModelFacts,
        store: ChunkStore,
        gradients: Gradients,
        homes: Homes,
        relayout: Relayout,
        declared: Declarations,
        steps: StepThread,
        optimizer: ManagedOptimizer,
        shadows: Shadows,
        *,
        speculate: bool = True,
    ) -> None:
        self.facts = facts
        self.store = store
        self.gradients = gradients
        self.homes = homes
        self.relayout = relayout
        self.declared = declared
        #: the managed optimizer whose groups early steps use
        self.optimizer = optimizer
        #: rule 2: counted backwards since the last step; forwards with grad since the last one
        self._counted = 0
        self._grad_forwards = 0
        #: rule 3: whether this backward steps chunks early, which did, and whether early steps may run
        self._early = False
        self._early_allowed = declared.accumulation is not None and declared.max_norm is None
        self._windows = 0
        self._stepped: set[int] = set()
        #: rule 9: early steps (chunk, slots, groups) waiting for the step in flight or their home
        self._queued: list[tuple[Chunk, list[Slot], dict[int, int]]] = []
        self._partial_end = False
        #: a backward (counted or not) ended since the last optimizer.step(): its gradients wait for a step
        self._backward_since_step = False
        #: rule 4: (gradient tensor, version) per parameter when the last counted backward ended
        self._grad_versions: dict[int, tuple[torch.Tensor, int]] = {}
        #: rule 10: the norm of this window's declared clip, when the loop's own call ran it, and
        #: whether a backward ended after it
        self._clipped: torch.Tensor | None = None
        self._clipped_stale = False
        #: chunk steps run during backward / at optimizer.step(), cumulative (for stats)
        self.early_chunk_steps = 0
        self.chunk_steps = 0
        #: NVMe homes staged for optimizer.step() while backward ran (rule 11), cumulative
        self.homes_staged_in_backward = 0
        #: NVMe homes ``optimizer.step()`` read ahead as deep as the host held them (rule 12), cumulative
        self.homes_read_ahead = 0
        #: rule 3: the chunk whose home waits for room to be read ahead of its early step, and the
        #: homes read so, once room freed later in its backward (cumulative)
        self._home_wanted: Chunk | None = None
        self.homes_read_when_room_freed = 0
        #: NOTE [ Speculative steps ]: allowed for this model (rule 5 turns them off), the last window
        #: clean (rule 2), this backward steps into shadows, the shadows of this window by chunk
        #: index, the hyperparameters as the backward began and the store's version as it ended (rule 4)
        #: ``[model_states] speculative_steps``: off, none runs ahead whatever the loop
        self._speculate = speculate
        self._speculation_allowed = speculate and declared.accumulation is None and declared.max_norm is None
        self._clean_window = False
        self._speculative = False
        #: NOTE [ Speculative steps ] rule 2: the chunks this backward steps into shadows
        self._runs_ahead: frozenset[int] = frozenset()
        self.shadows = shadows
        self._shadow_hyperparameters: list[dict[str, Any]] = []
        self._shadow_version: tuple[int, int] | None = None
        self._gradient_writes = GradientWrites.count
        #: speculative chunk steps run in backward (cumulative; kept and discarded: ``_shadows``)
        self.speculative_chunk_steps = 0
        #: a pending asynchronous checkpoint: told before a chunk steps or its home moves, pumped here
        self.save_guard: SaveGuard | None = None
        #: where chunk steps compute (NOTE [ Step threads ]); homes and gradients wait on the same one
        self.steps = steps
        #: steps of chunks too large to stage whole (NOTE [ Sliced steps ] in ``chunk_step.py``)
        self.sliced = SlicedStep(facts, store, gradients, homes, steps)
        #: NOTE [ Speculative steps ] rule 2: shadows gave their NVMe room back to stored gradients (cumulative);
        #: while they do, a step in flight drops its shadow rather than write it; and the most chunks a
        #: backward runs ahead from then on (None: as many as the free bytes hold copies of)
        self.nvme_room_reclaimed = 0
        self._reclaiming = False
        self._runs_ahead_cap: int | None = None
        #: NOTE [ Tied homes read ahead ] (``step_order.py``): the last window's order of early steps,
        #: and the homes of tied chunks read by it once they are the next to step (cumulative)
        self.order = StepOrder(store)
        self._tied_ahead: list[tuple[Chunk, frozenset[int]]] = []
        self._tied_read: list[Chunk] = []
        self.tied_homes_read_ahead = 0
        if store.registry.has_tier("nvme"):
            store.registry.add_reclaimer("nvme", self._reclaim_nvme)

    @property
    def _speculation_allowed(self) -> bool:
        """NOTE [ Speculative steps ]: this model's loop may run ahead (the setting, no declaration
        against it, and rule 5 has not turned it off)."""
        return self._may_speculate

    @_speculation_allowed.setter
    def _speculation_allowed(self, allowed: bool) -> None:
        # NOTE [ Host gradients ] rule 1: host gradients are watched only while it can matter
        self._may_speculate = allowed
        self.gradients.observe_nvme_homes = allowed

    def close(self) -> None:
        """Finish the step in flight and stop the step thread."""
        self.abandon_queued()
        try:
            self.steps.close()
        finally:
            self._discard_shadows(None)

    # -- rule 2 and 3: told from forward and backward ------------------------------------------
    def forward_with_grad(self) -> None:
        self._grad_forwards += 1
        if self.save_guard is not None:
            self.save_guard.pump()

    def arm_early_steps(self) -> None:
        """At the start of a backward: will it step chunks early (rule 3), or into shadows (NOTE
        [ Speculative steps ] rule 2)?"""
        declared = self.declared
        if self.shadows:  # NOTE [ Speculative steps ] rule 5: their gradients are about to change
            self._stepped -= self._discard_shadows("a backward began before optimizer.step() after steps ran ahead")
        self._runs_ahead = frozenset()
        self._speculative = (
            self._speculation_allowed
            and self._clean_window
            and declared.accumulation is None
            and declared.max_norm is None
            and self._grad_forwards == 1
            and self._counted == 0
            and not self._stepped
            and not self.relayout.pending
            and not self._partial_end
            and self.save_guard is None
            and not any(c.dirty for c in self.store.chunks)  # a dirty device copy is newer than its home
        )
        if self._speculative:
            candidates = [c for c in self.store.chunks if c.trainable and self._observed(c)]
            # rule 2: after a reclaim, fewer than the shadows that took a gradient's room then
            fitting = self.shadows.fitting_on_nvme(candidates, most=self._runs_ahead_cap)
            self._runs_ahead = frozenset(c.index for c in fitting)
            self._speculative = bool(self._runs_ahead)
        if self._speculative:
            self._shadow_hyperparameters = hyperparameters(self.optimizer.param_groups)
            self._shadow_version = self.store.version()
        self._early = self._speculative or (
            self._early_allowed
            and declared.accumulation is not None
            and (self._windows > 0 or not declared.keep_gradients)
            and self._grad_forwards == 1
            and self._counted + 1 == declared.accumulation
            and (not self.relayout.pending or not declared.keep_gradients)  # see step()
            and not self._partial_end
        )
        self.order.backward_began()
        # NOTE [ Tied homes read ahead ] rule 2: tied chunks and the chunks that stepped before them
        self._tied_ahead, self._tied_read = [], []
        if self._early and not self._speculative:
            for index in self.order.last:
                chunk = self.store.chunks[index]
                if self.facts.tied(chunk.layout) and self._stages_early(chunk):
                    self._tied_ahead.append((chunk, self.order.stepped_before(index)))

    def backward_entered(self, chunk: Chunk) -> None:
        """A chunk's backward began: stage its NVMe home for an early step (rule 3). The plan keeps
        host room for ``plan.staged_homes`` homes (placement rule 3); at most one waits for its step, so
        a step whose home was not prefetched finds room once the write-backs in flight land; the
        rest of the room lets the next home be read while the last is written (measured: the
        training thread waited for homes 9% of a 100M step otherwise). Never a chunk holding
        shared parameters (tied weights step after the whole backward, and would hold the room)."""
        if self.save_guard is not None:
            self.save_guard.pump()
        self.steps.poll()  # a finished step's write-back starts now (NOTE [ Step threads ] rule 4)
        self._start_queued()
        if self._queued or not (self._early and chunk.home_tier == "nvme" and chunk.trainable):
            return  # rule 9: a queued step's home is read first
        self.backward_progress()  # an earlier chunk's wish first: it steps first
        if not self._prefetch_home(chunk) and self._home_wanted is None:
            self._home_wanted = chunk  # rule 3: read once the room frees (backward_progress)

    def backward_progress(self) -> None:
        """Rule 3, from every hook of backward: the home of a chunk whose backward began while the
        room was taken (the last homes' write-backs still in flight) is read as soon as one
        landed, not when its step asks for it (on the 0.15x-RAM headline GPT nearly every early
        step waited for its whole read otherwise). Speculative steps queued (rule 9) start here as
        soon as the head's shadow landed and the step in flight finished, not at the next chunk's
        backward: a shadow is read only for the queue's head (NOTE [ Speculative steps ] rule 3),
        so, advanced one step a chunk, the queue lagged six chunks behind backward and its last
        eight steps ran after backward one read at a time (210M HF GPT-2, plain loop: 0.6-1.0 s
        of waits a step, 0.05-0.17 s from every hook)."""
        if self._queued and self._speculative:
            self._start_queued()
        self._read_tied_ahead()
        chunk = self._home_wanted
        if chunk is None:
            return
        home = chunk.home
        if chunk.index in self._stepped or self._queued or home is None or home.tier != "nvme":
            self._home_wanted = None  # stepped, queued (rule 9 reads the head) or staged already
            return
        if home.state is ObjectState.MOVING:
            self._home_wanted = None  # on its way (its step's read)
            return
        if self._prefetch_home(chunk):
            self._home_wanted = None
            self.homes_read_when_room_freed += 1

    def _read_tied_ahead(self) -> None:
        """NOTE [ Tied homes read ahead ] rule 2: the home of a chunk of tied weights, once every
        chunk that stepped before it in the last window's order has stepped in this backward, and
        no other chunk whose backward began waits for its step (a chunk outside that order)."""
        if not self._early or self._queued or self._home_wanted is not None:
            return  # rule 9 reads the queue's head first; rule 3: a wish of this backward first
        for entry in list(self._tied_ahead):
            chunk, before = entry
            home = chunk.home
            if chunk.index in self._stepped or home is None or home.tier != "nvme":
                self._tied_ahead.remove(entry)  # stepped, or its home is staged already
                continue
            if home.state is not ObjectState.RESIDENT or not before <= self._stepped:
                continue  # on its way (its step's read), or a chunk before it still to step
            if any(
                c.entered and c.index not in self._stepped and not self.facts.tied(c.layout) and self._stages_early(c)
                for c in self.store.chunks
            ):
                return  # an entered chunk outside the order steps first: the room is its own
            # read: on its way, or (a small home on an idle link) landed already within the call
            if self._prefetch_home(chunk, tied=True) and (home.state is ObjectState.MOVING or home.tier != "nvme"):
                self.tied_homes_read_ahead += 1
                self._tied_ahead.remove(entry)
                self._tied_read.append(chunk)

    def _stages_early(self, chunk: Chunk) -> bool:
        """A chunk whose NVMe home an early step stages whole (rule 3)."""
        return (
            chunk.home_tier == "nvme"
            and chunk.trainable
            and not chunk.persistent
            and not chunk.dirty
            and chunk.slice_span is None
        )

    def _stage_for_step(self, chunk: Chunk) -> None:
        """Rule 10: a backward that steps nothing early stages the NVMe home of ``chunk``, one of
        the first chunks ``optimizer.step()`` will stage, once its gradients are complete."""
        if self._early or self.relayout.pending or chunk.slice_span is not None:
            return
        declared = self.declared.accumulation
        if declared is not None and self._counted + 1 != declared:
            return  # the step comes after a later backward of the window
        home = chunk.home
        if home is None or home.state is ObjectState.MOVING or home.tier != "nvme":
            return
        if chunk.index not in self._first_to_step():
            return
        if self._homes_off_nvme()[1] >= self.store.staged_homes:
            return  # the room is taken (a write-back of the last step still in flight)
        if self.save_guard is not None:
            self.save_guard.before_move(chunk)
        with contextlib.suppress(TierCapacityError):  # no room: the step stages it on demand
            # behind backward's own gradient write-backs, which backward waits for as it ends;
            # the whole home from the idle disk, no copy from the device copy over their link
            home.move_to("host", Priority.WRITEBACK)
            self.homes_staged_in_backward += 1

    def _first_to_step(self) -> list[int]:
        """Rule 10: the chunks whose NVMe homes ``optimizer.step()`` stages first, in its order:
        trainable chunks with NVMe homes, as many as the plan has room to stage, up to the first
        that steps in slices (its slices take that room)."""
        group_of = self._group_of(self.optimizer)
        params = self.facts.params
        first: list[int] = []
        for c in self.store.chunks:
            if len(first) == self.store.staged_homes:
                break
            if c.home_tier != "nvme" or not c.trainable:
                continue
            if not any(id(params[s.index]) in group_of for s in c.layout.slots):
                continue
            if c.slice_span is not None:
                break
            first.append(c.index)
        return first

    def _prefetch_home(self, chunk: Chunk, *, tied: bool = False) -> bool:
        """Rule 3: read ``chunk``'s NVMe home to the host ahead of its step, while no other home
        waits for its step and there is room. False when it could be read but there is no room
        now (the last homes' write-backs still hold it). ``tied``: a chunk of tied weights is read
        too (NOTE [ Tied homes read ahead ] rule 2: it is the next to step)."""
        if chunk.home is None or chunk.home.state is ObjectState.MOVING or chunk.home.tier != "nvme":
            return True
        if chunk.slice_span is not None:
            return True  # NOTE [ Sliced steps ] (``chunk_step.py``): never staged whole
        if chunk.dirty:
            return True  # its home is older than its device copy: it steps at optimizer.step()
        if self.facts.tied(chunk.layout) and not tied:
            return True  # tied weights step after the whole backward
        if chunk.index in self.shadows or (self._speculative and not self._speculates(chunk)):
            return True  # copied already, or it steps at optimizer.step()
        waiting, off_nvme = self._homes_off_nvme()
        if waiting or off_nvme >= self.store.staged_homes:
            return False  # the step stages it on demand unless the room frees first
        if self._speculative:  # NOTE [ Speculative steps ] rule 3: a copy; the home stays
            return self.shadows.make(chunk, Priority.PREFETCH, self._known_home_bytes(chunk) is not None) is not None
        if self.save_guard is not None:
            self.save_guard.before_move(chunk)
        try:
            chunk.home.move_to("host", Priority.PREFETCH, self._known_home_bytes(chunk))
        except TierCapacityError:
            return False  # no room yet
        return True

    def _finish_steps(self) -> None:
        """NOTE [ Step threads ] rules 2-4; a step's error leaves no NVMe home staged: homes
        prefetched for steps that will not run now go back first (their bytes are unchanged)."""
        try:
            self.steps.finish_all()
        except BaseException:
            self._send_back_staged(self.store.chunks)
            raise

    def _send_back_staged(self, chunks: Iterable[Chunk]) -> None:
        """Write back the NVMe homes of ``chunks`` staged for steps that will not run (their bytes
        are unchanged); after an error, which is the one to report."""
        for c in chunks:
            if c.home_tier == "nvme" and c.home is not None:
                with contextlib.suppress(Exception):
                    c.home.wait()
                    if c.home.tier != "nvme":
                        self.homes.send_back(c)

    def _homes_off_nvme(self) -> tuple[int, int]:
        """NVMe homes holding host bytes (staged, or moving): of chunks waiting for their step, and all.
        A shadow counts as its chunk's staged home (NOTE [ Speculative steps ] rule 3)."""
        waiting = off_nvme = 0
        queued = {c.index for c, _, _ in self._queued}
        for c in self.store.chunks:
            home = c.home
            if c.home_tier == "nvme" and home is not None and (home.state is ObjectState.MOVING or home.tier != "nvme"):
                off_nvme += 1
                waiting += c.index not in self._stepped or c.index in queued
        shadows_waiting, shadows_off_nvme = self.shadows.off_nvme()
        return waiting + shadows_waiting, off_nvme + shadows_off_nvme

    # -- NOTE [ Speculative steps ] -------------------------------------------------------------
    def _observed(self, chunk: Chunk) -> bool:
        """NOTE [ Speculative steps ] rule 3: an NVMe home, and gradients whose every write the
        runtime sees (stored on NVMe, or HostGradients on the host), never plain tensors a
        ``.data`` could write unseen."""
        observed = chunk.grad_home == "nvme" or self.gradients.observed_on_host(chunk)
        # a sliced chunk steps at optimizer.step() (NOTE [ Sliced steps ] rule 4), never into a
        # copy, so it takes no room for one
        return chunk.home_tier == "nvme" and observed and chunk.slice_span is None

    def _speculates(self, chunk: Chunk) -> bool:
        """NOTE [ Speculative steps ] rules 2-3: this backward steps ``chunk`` into a shadow."""
        return chunk.index in self._runs_ahead

    def _run_speculative_step(self, chunk: Chunk, slots: list[Slot], group_of: Mapping[int, int]) -> None:
        """Rule 3: ``chunk``'s step over its shadow, on the step thread; its records are kept aside.
        Without host room for a shadow the chunk steps at ``optimizer.step()`` instead."""
        self._finish_steps()  # one step in flight, its error before this one's shadow is made
        shadow = self.shadows.for_step(chunk, self._known_home_bytes(chunk) is not None)
        if shadow is None:
            self._stepped.discard(chunk.index)
            self.speculative_chunk_steps -= 1
            return
        traced = tracing.span("chunk step", "chunk_step", chunk.index)  # NOTE [ Timeline trace ]
        try:
            shadow.wait_filled()
            job = ChunkStep.prepare(
                self.facts,
                self.store,
                self.gradients,
                chunk,
                slots,
                shadow.handle.tensor("host"),
                self.optimizer,
                group_of,
                {},
                copy_small=True,
            )
        except BaseException:
            self._drop_shadow(chunk)
            raise
        finish = functools.partial(self._finish_speculative_step, shadow, job)
        compute = tracing.wrap(job.compute, f"chunk step {chunk.index} compute", "chunk_step")
        shadow.step_started = True  # the next chunk's shadow may be read now (Shadows.off_nvme)
        try:
            self.steps.run(chunk.index, compute, finish, inline=False)
        except BaseException:  # not handed over (no thread could start): no finish will run
            self._drop_shadow(chunk)
            self._abandon_speculation()
            raise
        if traced is not None:
            traced.end()

    def _finish_speculative_step(self, shadow: Shadow, job: ChunkStep, ok: bool) -> None:
        """Rule 3, on the training thread once ``job`` computed: the shadow goes to NVMe. A failed
        step, or no NVMe room for the shadow, leaves the chunk to ``optimizer.step()``."""
        chunk = shadow.chunk
        self.gradients.stash.release(chunk)
        if not ok:  # its error follows
            self._abandon_speculation()
            return
        if self._reclaiming or not self.shadows.send(shadow, job.records):
            self._drop_shadow(chunk)

    def _abandon_speculation(self) -> None:
        """Rule 5 after an error in this backward: nothing that ran ahead is kept, and nothing more
        runs ahead (nor steps early in place) in it; the chunks step at ``optimizer.step()``."""
        queued, self._queued = self._queued, []
        for chunk, _, _ in queued:
            if chunk.index not in self.shadows and chunk.index in self._stepped:
                self._stepped.discard(chunk.index)
                self.speculative_chunk_steps -= 1
        self._discard_shadows(None)
        self._speculative = self._early = False
        self._home_wanted = None

    def _reclaim_nvme(self) -> bool:
        """NOTE [ Speculative steps ] rule 2, on the training thread (``Gradients.flush``): the NVMe
        tier is short for something the plan counts on (a stored gradient): this backward's shadows
        go and their chunks step at ``optimizer.step()``; later backwards run fewer chunks ahead
        than had shadows now. True when one went."""
        if not self.shadows:
            return False
        shadows = len(self.shadows.chunks())
        self._reclaiming = True  # a step in flight drops its shadow rather than write it
        try:
            self._finish_steps()  # a step computing in a shadow ends before the shadow goes
        finally:
            self._reclaiming = False
        self.shadows.settle()
        self._abandon_speculation()
        self._runs_ahead_cap = shadows - 1  # they were at most the last cap, so it only falls
        self.nvme_room_reclaimed += 1
        log.info(
            "tiermem model states: the NVMe tier had no room for a stored gradient beside the steps run ahead; "
            "they step at optimizer.step() in this window (NOTE [ Speculative steps ] rule 2)"
        )
        return True

    def _drop_shadow(self, chunk: Chunk) -> None:
        """``chunk``'s shadow freed; the chunk steps at ``optimizer.step()``."""
        if self.shadows.drop(chunk) and chunk.index in self._stepped:
            self._stepped.discard(chunk.index)
            self.speculative_chunk_steps -= 1

    def _drop_unstepped_shadows(self) -> None:
        """Rule 3, as backward ends: shadows of chunks that did not step go, so no copy reads a home."""
        for chunk in self.shadows.unstepped():
            self._drop_shadow(chunk)

    def _discard_shadows(self, reason: str | None) -> set[int]:
        """Rule 5: every shadow freed; their chunks, returned, step at ``optimizer.step()``. With a
        ``reason`` (something the loop does), speculation is off for the model from now on."""
        chunks = self.shadows.chunks()
        self.shadows.discarded += self.shadows.stepped_count()
        for chunk in chunks:
            self._drop_shadow(chunk)
        if reason is not None and self._speculation_allowed:
            self._speculation_allowed = False
            log.info(
                "tiermem model states: %s; the optimizer step of this undeclared loop will not run ahead in "
                "backward (NOTE [ Speculative steps ] rule 5; rt.manage(grad_accumulation_steps=...) declares "
                "the loop)",
                reason,
            )
        return {c.index for c in chunks}

    def _window_unclean(self, counted: int, partial: bool, optimizer: ManagedOptimizer) -> str | None:
        """Rules 2 and 4: why the window that ends at this ``optimizer.step()`` is not one whose
        step can run ahead (None: it is). Consumes the gradient versions backward recorded."""
        changed = self._gradients_changed(counted)
        if counted != 1:
            return f"{counted} backwards before optimizer.step()"
        if partial:
            return "a nested backward ended one early"
        if changed:
            names = ", ".join(self.facts.param_names(changed[:3]))
            return f"gradients changed between backward and optimizer.step() ({names})"
        if any(hasattr(optimizer, name) for name in ("grad_scale", "found_inf")):
            return "the optimizer carries a gradient scaler's grad_scale/found_inf"
        if self.shadows and not same_hyperparameters(self._shadow_hyperparameters, optimizer.param_groups):
            return "the optimizer's hyperparameters changed between backward and optimizer.step()"
        if self.shadows and self._shadow_version != self.store.version():
            return "parameters or optimizer state were written between backward and optimizer.step()"
        return None

    def gradients_complete(self, chunk: Chunk) -> None:
        """Every used parameter of an offloaded chunk has its gradient: send them home, and step
        early (rule 3), from where they are when nothing keeps them (rule 8)."""
        keep = self.declared.keep_gradients
        early = self._early and chunk.index not in self._stepped and not chunk.persistent
        early = early and chunk.slice_span is None  # at optimizer.step(): NOTE [ Sliced steps ] rule 4
        early = early and (not self._speculative or self._speculates(chunk))
        early = early and not chunk.dirty  # its device copy is newer than its home (a state load)
        group_of = self._group_of(self.optimizer) if early else {}
        slots = self._steppable(chunk, group_of) if early else []
        went_home = not slots or keep or self.facts.device.type != "cpu"
        if slots and went_home and not keep and self._queued:
            self._run_head()  # rule 9: streamed gradients wait on the host for two chunks at most
        if went_home:
            self.gradients.flush(chunk, steps_next=bool(slots))
            if slots and not self._early:  # its flush took the shadows' room back (_reclaim_nvme)
                slots = []
        if not slots:
            self._start_queued()
            if not self._early:
                self._stage_for_step(chunk)
            return
        self._stepped.add(chunk.index)
        if self._speculative:
            self.speculative_chunk_steps += 1
        else:
            self.early_chunk_steps += 1
            self.order.stepped(chunk.index)
        if went_home and (self._queued or self.steps.busy or not self._ready(chunk)):
            self._queued.append((chunk, slots, group_of))  # backward never waits on a home read
            self._start_queued()
            return
        self._run_early_step(chunk, slots, group_of)  # rule 6 when it finishes

    def _run_early_step(self, chunk: Chunk, slots: list[Slot], group_of: Mapping[int, int]) -> None:
        if self._speculative:
            self._run_speculative_step(chunk, slots, group_of)
            return
        self._run_chunk_step(chunk, slots, self.optimizer, group_of, {}, self._known_home_bytes(chunk))

    def _ready(self, chunk: Chunk) -> bool:
        """Starting ``chunk``'s step would not wait: its home is in memory or landed on the host, and
        its gradients are where they go (staged, if stored on NVMe)."""
        home = chunk.home
        landed = home is not None and home.state is not ObjectState.MOVING and home.tier == "host"
        if self._speculative:  # NOTE [ Speculative steps ] rule 3: its shadow filled instead
            landed = self.shadows.landed(chunk)
        return self.gradients.stash.ready(chunk) and (chunk.home_tier != "nvme" or landed)

    def _start_queued(self) -> None:
        """Rule 9: start queued early steps in order while nothing holds them up; never waits.
        The head's home is read first, also while a step computes."""
        while self._queued:
            self.steps.poll()
            chunk, _, _ = self._queued[0]
            if not self._ready(chunk):
                self._prefetch_home(chunk)
                self.gradients.stash.prefetch(chunk)
                return
            if self.steps.busy:
                return
            self._run_head()

    def _run_head(self) -> None:
        """Rule 9: the first queued step, waiting as needed; it leaves the queue once handed over,
        so an error before that leaves it to :meth:`abandon_queued`."""
        chunk, slots, group_of = self._queued[0]
        self._run_early_step(chunk, slots, group_of)
        del self._queued[0]

    def _run_queued(self) -> None:  # rule 9, at the end of backward: waiting as needed
        try:
            while self._queued:
                self._run_head()
        except BaseException:
            self.abandon_queued()
            raise

    def abandon_queued(self) -> None:
        """Rule 9: queued steps that will not run in this backward (an error ended it) no longer
        count as stepped, so nothing steps twice; homes read for them go back, and tied homes read
        ahead of steps that did not run (NOTE [ Tied homes read ahead ] rule 1)."""
        queued, self._queued = self._queued, []
        self._home_wanted = None
        tied, self._tied_read = self._tied_read, []
        self._send_back_staged(c for c in tied if c.index not in self._stepped)
        for chunk, _, _ in queued:
            if chunk.index in self.shadows:
                self._drop_shadow(chunk)
                continue
            self._stepped.discard(chunk.index)
            if self._speculative:
                self.speculative_chunk_steps -= 1
            else:
                self.early_chunk_steps -= 1
        self._send_back_staged(chunk for chunk, _, _ in queued)

    def backward_ended(self, complete: bool) -> None:
        """Rule 2 and 4: count the backward, record gradient versions, release stepped copies."""
        self._home_wanted = None
        try:
            self._run_queued()  # steps backward queued rather than waited for
            self._finish_steps()  # NOTE [ Step threads ] rule 4: the next forward reads stepped homes
        except BaseException:
            if self._speculative:
                self._abandon_speculation()
            raise
        finally:
            self._drop_unstepped_shadows()
        # NOTE [ Tied homes read ahead ] rule 1: the order of the early steps this backward ran
        self.order.backward_ended(complete and self._early and not self._speculative)
        for index in sorted(self._stepped):
            chunk = self.store.chunks[index]
            if chunk.pins == 0:
                self.store.pool.release(chunk)
        self._early = False
        self._backward_since_step = True
        self._clipped_stale = self._clipped is not None
        if not complete:
            # A nested backward ended ours early and forgot which gradients are still to come
            # (rule 2): no early step until the next optimizer.step().
            self._partial_end = True
            return
        self._counted += 1
        self._grad_forwards = 0
        self._grad_versions = {
            i: (p.grad, p.grad._version) for i, p in enumerate(self.facts.params) if p.grad is not None
        }
        # NOTE [ Speculative steps ] rule 4: writes to stored gradients from here on spoil the window
        self._gradient_writes = GradientWrites.count

    def redeclare(self, declared: Declarations) -> None:
        """Rule 10: ``declared`` in force from now on, unless a chunk already stepped early in
        this window (its step used gradients promised under the old declaration). Speculative
        steps are dropped (NOTE [ Speculative steps ] rule 5, without turning them off)."""
        self._discard_shadows(None)
        if self._stepped:
            raise StatesUsageError(
                f"tiermem declare: {len(self._stepped)} chunk(s) already stepped during this window's backward under "
                f"grad_accumulation_steps={self.declared.accumulation}, clip_grad_norm={self.declared.max_norm}; "
                "declare the loop between optimizer.step() and the next backward"
            )
        self.declared = declared
        self._early_allowed = declared.accumulation is not None and declared.max_norm is None
        self._speculation_allowed = self._speculate and declared.accumulation is None and declared.max_norm is None
        self._clipped, self._clipped_stale = None, False

    def clip(self) -> torch.Tensor:
        """Rule 10: the declared clip of this window, run now at the loop's own clip call (once:
        a second call returns the same norm); the gradients it scales are recorded again, so
        rule 4 still sees any edit made after it."""
        max_norm = self.declared.max_norm
        if max_norm is None:
            raise StatesUsageError("tiermem: the runtime clips only a loop declared with clip_grad_norm=")
        if self._clipped is None:
            self._clipped = clip_declared(self.facts.params, max_norm, self.facts.device)
            self._grad_versions = {
                i: (p.grad, p.grad._version) for i, p in enumerate(self.facts.params) if p.grad is not None
            }
            self._gradient_writes = GradientWrites.count
        return self._clipped

    def stepped_early(self, chunk: Chunk) -> bool:
        """``chunk`` stepped during a backward of this window, before ``optimizer.step()``, into its
        home (a speculative step leaves the home as it was: NOTE [ Speculative steps ] rule 4)."""
        return chunk.index in self._stepped and chunk.index not in self.shadows

    # -- the loop's position, for checkpoints -------------------------------------------------
    def loop_position(self) -> dict[str, int]:
        """Where a declared loop stands (rule 2): windows stepped so far (early steps start after
        the first, rule 3) and backwards counted in the current one."""
        return {"windows": self._windows, "counted": self._counted}

    def gradients_unstepped(self) -> bool:
        """A checkpoint would lose gradients: a backward ended since the last optimizer.step() and
        a managed parameter still has a ``.grad`` (``zero_grad()`` since then leaves none)."""
        return self._backward_since_step and any(p.grad is not None for p in self.facts.params)

    def restore_loop_position(self, position: Mapping[str, Any]) -> None:
        """A checkpoint's position: taken at a window boundary, so no backward is counted yet."""
        self._windows = int(position.get("windows", 0))
        self._counted = self._grad_forwards = 0

    def plan_first_step(self) -> None:
        """NOTE [ Model-state rules ] rule 9: the first-step plan as the first forward with grad
        starts, before it runs: no chunk has stepped, and no gradient is kept yet, so the re-pack
        moves the parameters alone (the new NVMe homes' states are zeros, not written: NOTE
        [ Managed object rules ] rule 12) and the whole step runs on the planned chunks."""
        self._send_back_staged(self.store.chunks)  # homes read ahead (rule 11): every chunk is rebuilt
        if self.save_guard is not None:
            self.save_guard.before_rewrite()
        with tracing.traced("re-pack", "repack"):
            self.relayout.plan_at_forward()

    # -- the optimizer step over the chunks, one chunk at a time ----------------------------------
    def step(self, optimizer: ManagedOptimizer) -> None:
        """``optimizer.step()``, outside backward: every chunk not stepped early steps now."""
        self.abandon_queued()  # rule 9: none is left after a backward that ended well
        self._finish_steps()
        if self._clipped_stale:  # rule 10: gradients added after the clip would step unclipped
            self._clipped, self._clipped_stale = None, False
            raise StatesUsageError(
                "tiermem: a backward ran after the declared clip of this window (the loop's own clip call), so its "
                "gradients were not clipped; clip once per window, after its last backward"
            )
        stepped, self._stepped = self._stepped, set()
        counted, self._counted = self._counted, 0
        self._backward_since_step = False
        self._grad_forwards = 0
        partial, self._partial_end = self._partial_end, False
        if self.declared.accumulation is not None:
            self._check_gradients_untouched(stepped, counted)
            self._windows += 1
        else:  # whether the next window may run ahead, and whether this one's steps ahead are kept
            unclean = self._window_unclean(counted, partial, optimizer)
            self._clean_window = unclean is None
            if self.shadows and (unclean is not None or self.relayout.pending or self.save_guard is not None):
                stepped -= self._discard_shadows(unclean)
        self.gradients.reconcile()
        clipped, self._clipped = self._clipped, None
        if clipped is not None:  # rule 10: the loop's own clip call ran the declared clip already
            optimizer.grad_norm = clipped
        elif self.declared.max_norm is not None:
            optimizer.grad_norm = clip_declared(self.facts.params, self.declared.max_norm, self.facts.device)
        if self.relayout.pending:
            # homes staged in backward (rule 11) go back: the re-pack rebuilds every chunk
            self._send_back_staged(c for c in self.store.chunks if c.index not in stepped)
            if self.save_guard is not None:
                self.save_guard.before_rewrite()
            # Chunks stepped before a re-pack only with keep_gradients=False (rule 6): their
            # parameters hold no gradient now, so the new chunks step exactly the others.
            with tracing.traced("re-pack", "repack"):
                self.relayout.run()
            stepped = set()
        self.store.pool.release_all()
        if self.shadows:  # NOTE [ Speculative steps ] rule 4: no fetch reads an old home any more
            self.shadows.keep()
        self.store.generation += 1
        group_of = self._group_of(optimizer)
        attributes = {
            name: getattr(optimizer, name) for name in ("grad_scale", "found_inf") if hasattr(optimizer, name)
        }
        work = []
        for chunk in self.store.chunks:
            slots = self._steppable(chunk, group_of)
            if slots and chunk.index not in stepped:
                work.append((chunk, slots))
        staged = [chunk for chunk, _ in work if chunk.home_tier == "nvme"]
        # rule 11: a home staged in backward that does not step first goes back, so the room is the step's
        first = {chunk.index for chunk in staged[: self.store.staged_homes]}
        self._send_back_staged(c for c in self.store.chunks if c.index not in first and c.index not in stepped)
        deep = self._reads_ahead_deep(staged)
        # each NVMe chunk's next one, read while it steps where the plan has room for two homes
        # (with room for one, each home is read once the one before is written back); none beside
        # a sliced step, whose slices take that room (NOTE [ Sliced steps ] rule 2)
        next_staged = (
            {a: b for a, b in itertools.pairwise(staged) if a.slice_span is None and b.slice_span is None}
            if self.store.staged_homes > 1 and not deep
            else {}
        )
        ahead = list(staged) if deep else []  # rule 12: NVMe chunks still to step, in order
        try:
            for chunk, slots in work:
                following = next_staged.get(chunk)
                if following is not None:  # stage the next NVMe home while this one steps
                    if self.save_guard is not None:
                        self.save_guard.before_move(following)
                    with contextlib.suppress(TierCapacityError):
                        following.home.move_to("host", Priority.PREFETCH)  # type: ignore[union-attr]
                if ahead and ahead[0] is chunk:
                    self._read_ahead_while_read(chunk, ahead)
                    del ahead[0]
                self._run_chunk_step(chunk, slots, optimizer, group_of, attributes)
                if following is not None:  # and its stored gradients (NOTE [ Stored gradients ] rule 4)
                    self.gradients.stash.prefetch(following)
                self.chunk_steps += 1
        except BaseException:
            self._send_back_staged(ahead)  # homes read ahead for steps that will not run now
            raise
        self._finish_steps()  # the next forward reads stepped homes
        self.gradients.stash.release_all()
        for index in stepped:  # their write-backs: the next reader waits on them anyway; errors surface here
            home = self.store.chunks[index].home
            if home is not None:
                home.wait()

    def _reads_ahead_deep(self, staged: list[Chunk]) -> bool:
        """Rule 12: whether ``optimizer.step()`` reads the homes of ``staged`` (its NVMe chunks, in
        order) ahead as deep as the host tier holds them."""
        return (
            len(staged) > 1
            and self.store.staged_homes > 1
            and self.save_guard is None
            and all(c.slice_span is None and c.grad_home == "host" for c in staged)
        )

    def _read_ahead(self, ahead: list[Chunk]) -> bool:
        """Rule 12: start reading the homes of ``ahead`` (NVMe chunks still to step, in step order)
        that are not off NVMe yet, in order, while the host tier takes them; True when one is left
        for lack of room."""
        for chunk in ahead:
            home = chunk.home
            if home is None or (home.state is not ObjectState.MOVING and home.tier != "nvme"):
                continue  # staged already
            if home.state is ObjectState.MOVING and home.obj.target_tier != "nvme":
                continue  # on its way to the host
            try:  # no asynchronous save to tell: none reads ahead while one runs
                home.move_to("host", Priority.PREFETCH)
            except TierCapacityError:
                return True
            self.homes_read_ahead += 1
        return False

    def _read_ahead_while_read(self, chunk: Chunk, ahead: list[Chunk]) -> None:
        """Rule 12, before ``chunk`` (``ahead[0]``) steps: until ``chunk``'s home is on the host,
        the homes not read yet are read as each write-back in flight lands, one at a time
        (``chunk``'s own first); the step in flight finishes as soon as its compute is done, so
        its home's write-back starts while this thread waits for the others, not after."""
        home = chunk.home
        while True:
            self.steps.poll()
            if not (
                self._read_ahead(ahead)
                and home is not None
                and (home.state is ObjectState.MOVING or home.tier == "nvme")
                and self.homes.wait_write_back(skip=chunk)
            ):
                break

    def _check_gradients_untouched(self, stepped: set[int], counted: int) -> None:
        """Rule 4."""
        accumulation = self.declared.accumulation
        if accumulation is not None and counted > accumulation:
            # More backwards than declared: chunks that stepped after the declared count missed
            # the later gradients (an Accelerator or a manage() told one step per backward where
            # the loop accumulates by hand).
            if stepped:
                raise StatesUsageError(
                    f"tiermem: {counted} backwards before optimizer.step(), but the loop was declared with "
                    f"grad_accumulation_steps={accumulation} and {len(stepped)} chunk(s) stepped early in backward "
                    f"{accumulation}, without the later gradients. Declare the loop's real accumulation "
                    "(rt.declare, Accelerator(gradient_accumulation_steps=)) or leave it undeclared."
                )
            if self._early_allowed:
                self._early_allowed = False
                log.info(
                    "tiermem model states: %d backwards per step where %d were declared; the optimizer step will "
                    "not overlap backward (NOTE [ Declared steps ] rule 4)",
                    counted,
                    accumulation,
                )
        changed = self._gradients_changed(counted)
        if not changed:
            return
        if stepped:
            names = self.facts.param_names([i for i in changed][:3])
            raise StatesUsageError(
                f"tiermem: gradients changed between backward and optimizer.step() ({', '.join(names)}...), but "
                f"rt.manage(grad_accumulation_steps={self.declared.accumulation}) already stepped {len(stepped)} "
                "chunk(s) with them during backward. With declared accumulation the runtime clips (clip_grad_norm=) "
                "and nobody edits .grad; for GradScaler or hand-made gradient edits, leave the loop undeclared "
                "(rt.manage without grad_accumulation_steps; rt.declare(model) with none; declare_loop=False for the "
                "trainers of tiermem.integrations.hf)."
            )
        if self._early_allowed:
            self._early_allowed = False
            log.info(
                "tiermem model states: gradients change between backward and optimizer.step(); the optimizer "
                "step will not overlap backward (NOTE [ Declared steps ] rule 4)"
            )

    def _gradients_changed(self, counted: int) -> list[int]:
        """Rule 4: the parameters whose gradient changed since the last counted backward ended
        (another tensor, another version, or one that appeared); consumes the recorded versions.
        Writes the version counters miss (a stored gradient's ``.data``, a deferred scaling) are
        only counted, not placed, so then every gradient counts as changed."""
        params = self.facts.params
        changed = [
            i
            for i, (grad, version) in self._grad_versions.items()
            if params[i].grad is not grad or grad._version != version
        ] + [i for i, p in enumerate(params) if p.grad is not None and i not in self._grad_versions and counted]
        self._grad_versions = {}
        if not changed and GradientWrites.count != self._gradient_writes:
            changed = [i for i, p in enumerate(params) if p.grad is not None]
        return changed

    @staticmethod
    def _group_of(optimizer: ManagedOptimizer) -> dict[int, int]:
        return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}

    def _steppable(self, chunk: Chunk, group_of: Mapping[int, int]) -> list[Slot]:
        has_grad, params = self.store.has_grad, self.facts.params
        return [s for s in chunk.layout.slots if has_grad[s.index] and id(params[s.index]) in group_of]

    def _run_chunk_step(
        self,
        chunk: Chunk,
        slots: list[Slot],
        optimizer: ManagedOptimizer,
        group_of: Mapping[int, int],
        attributes: Mapping[str, Any],
        known: KnownBytes | None = None,
    ) -> None:
        """Stage the chunk's home and hand its step to the step thread (NOTE [ Step threads ]);
        :meth:`_finish_chunk_step` follows on this thread. A chunk that steps in slices steps so
        (NOTE [ Sliced steps ])."""
        if chunk.slice_span is not None and chunk.home is not None and chunk.home.tier == "nvme":
            self._run_sliced_step(chunk, slots, optimizer, group_of, attributes)
            return
        self._finish_steps()  # NOTE [ Step threads ] rule 2: its error surfaces before this home is staged
        traced = tracing.span("chunk step", "chunk_step", chunk.index)  # NOTE [ Timeline trace ]: this thread's part
        if self.save_guard is not None:
            self.save_guard.before_step(chunk)
        staged = chunk.home_tier == "nvme"
        if staged:
            self.homes.stage(chunk, known)
        handle = chunk.home
        home = None if handle is None else handle.tensor(handle.tier if chunk.has_master else "device")
        on_cpu = (home.device if home is not None else self.facts.device).type == "cpu"
        try:
            job = ChunkStep.prepare(
                self.facts, self.store, self.gradients, chunk, slots, home, optimizer, group_of, attributes
            )
        except BaseException:
            if staged:
                self.homes.send_back(chunk)
            raise
        del home  # the job's views are the home's only readers now, and end with its compute
        finish = functools.partial(self._finish_chunk_step, chunk, job, staged)
        compute = tracing.wrap(job.compute, f"chunk step {chunk.index} compute", "chunk_step")
        fused = self.steps.fused_inline and not staged and all(group.get("fused") for group, _ in job.groups)
        computing = self.steps.run(chunk.index, compute, finish, inline=not on_cpu or fused)  # one at a time
        if staged and computing is not None:  # NOTE [ Step threads ] rule 7: written back as the compute ends
            with contextlib.suppress(TierCapacityError):  # no extent now: the finish sends it back, as before
                self.homes.send_back(chunk, after=computing)
        if traced is not None:
            traced.end()

    def _finish_chunk_step(self, chunk: Chunk, job: ChunkStep, staged: bool, ok: bool) -> None:
        """NOTE [ Step threads ] rule 3, on the training thread once ``job`` computed."""
        try:
            if ok:
                job.commit(self.store)
        finally:
            self.gradients.stash.release(chunk)  # the staged gradient copy dies with its step
            if staged:
                self.homes.send_back(chunk)
        if ok:
            self._gradients_given_up(chunk)

    def _gradients_given_up(self, chunk: Chunk) -> None:
        """Rule 6, once ``chunk`` stepped."""
        if chunk.index in self._stepped and not self.declared.keep_gradients and chunk.grad is not None:
            # What zero_grad() would do next, now, so the host holds no gradient bytes.
            for slot in chunk.layout.slots:
                self.store.has_grad[slot.index] = False
                self.facts.params[slot.index].grad = None
            self.gradients.drop(chunk)

    def _run_sliced_step(
        self,
        chunk: Chunk,
        slots: list[Slot],
        optimizer: ManagedOptimizer,
        group_of: Mapping[int, int],
        attributes: Mapping[str, Any],
    ) -> None:
        """NOTE [ Sliced steps ] (in ``chunk_step.py``): ``chunk``'s step over slices; the optimizer
        records of the whole step are kept once every slice stepped (rule 3 there)."""
        self._finish_steps()  # its slices use the step thread alone
        traced = tracing.span("chunk step", "chunk_step", chunk.index)  # NOTE [ Timeline trace ]
        if self.save_guard is not None:
            self.save_guard.before_step(chunk)
        try:
            records = self.sliced.run(chunk, slots, optimizer, group_of, attributes)
        finally:
            if traced is not None:
                traced.end()
        self.store.pstate.update(records)
        self._gradients_given_up(chunk)

    def _known_home_bytes(self, chunk: Chunk) -> KnownBytes | None:
        """Rule 7: the part of ``chunk``'s home its device copy holds, when that copy is the home's
        as fetched: landed and not written to since (``dirty``). Only for a chunk whose step has
        not run (a chunk stepped in this window keeps its old copy until backward ends). Staging
        the home then reads only the optimizer states from NVMe (NOTE [ Managed object rules ] 6)."""
        dev = chunk.dev
        if dev is None or chunk.fetching is not None or chunk.dirty:
            return None
        if chunk.home_bytes <= chunk.nbytes:  # no state sections (SGD, Adafactor): nothing else to read
            return None
        return dev.known_bytes(chunk.working_base, chunk.nbytes)
