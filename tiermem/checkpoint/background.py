"""Asynchronous checkpoints: ``rt.save(path, blocking=False)`` returns at once and training goes
on while the checkpoint is written (issue 19 item 5).

# NOTE [ Asynchronous saves ]
1. Threads. The training thread (the one that drives the models, NOTE [ Model-state rules ]
   rule 7) does everything that touches the registry or a chunk. At ``rt.save`` it checks what
   a blocking save checks, pickles ``extra``, RNG states and loop positions, copies every value
   outside chunks (buffers, scalar states such as ``step``, param groups) and starts a writer
   thread; at safe points it copies chunks (:mod:`tiermem.checkpoint.capture`). The writer runs
   DCP's save over those copies, with the blocking save's planner, formats and commit (NOTE
   [ Checkpoint rules ], [ Checkpoint commit rules ]): it only waits for copies to land, reads
   them and writes files; it never calls the registry, a handle or a chunk.
2. Snapshot. The checkpoint holds the states as they were when ``rt.save`` returned. A chunk's
   home (master and optimizer states) and a persistent chunk's device copy change only in its
   step (at ``optimizer.step()``, or early in a declared loop's last backward: NOTE [ Declared
   steps ]) and in whole-model rewrites (a re-pack, ``load_state_dict``, closing). The stepper
   and the state I/O tell the save before each (``SaveGuard``): a chunk not copied yet is
   copied first and its copy waited for; a rewrite first copies every chunk left. A home never
   moves (staged or prefetched for a step) while a copy reads it.
3. Priority. Copies are ``Handle.fill_from`` copies into a host buffer registered for the save,
   at WRITEBACK priority, so demand fetches of training go first; a copy a step waits for is
   promoted to DEMAND. Safe points copy more: each forward with grad, each chunk's backward,
   each chunk step, ``done()`` and ``wait()``.
4. Bound. Copies are made in the writer's order (chunk by chunk, as DCP writes them); the
   writer's chunk may always be copied, chunks ahead of it hold at most ``AHEAD_CHUNKS`` (2)
   times the largest chunk's saved bytes. An async save so holds at most three of the largest
   chunk's saved bytes (``PendingSave.bound_bytes``), plus the one tensor in flight of rule 2
   of [ Checkpoint rules ]. A step whose chunk finds no room waits for the writer to finish
   the chunk it is on; that chunk is always copied first, so the writer never waits for the
   step (no deadlock).
5. Host room. A buffer is registered on the host tier only where the host keeps room after it
   for ``STAGED_HOMES`` of the largest NVMe homes (the step stages homes there); otherwise the
   chunk is copied synchronously on the training thread into memory of its own (an NVMe home
   read where it lives, as a blocking save reads it), within the same bound.
6. One save at a time: ``rt.save`` waits for a pending one first; ``rt.load`` and
   ``rt.close()`` wait for it. An error is never lost: it is raised by ``wait()``, else by
   the next ``rt.save`` / ``rt.load``, else by ``rt.close()`` (logged instead when the ``with``
   block is raising already). A failed or killed save leaves the previous checkpoint and at
   most its temporary sibling, which the next save of the path removes (commit rules 1, 5).
7. ``wait()`` and ``done()`` are called on the training thread (they copy). The writer is a
   daemon thread: a process that exits without ``rt.close()`` leaves a temporary sibling.
8. One process: models sharded over ranks (FSDP2) save blocking (a collective save).
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tiermem import tracing
from tiermem.checkpoint import _SINGLE_PROCESS, DEFAULT_FORMAT, FORMATS, _unwrap, _writer, files
from tiermem.checkpoint.capture import Capture
from tiermem.checkpoint.content import rng_state, save_tree
from tiermem.checkpoint.dcp_planners import ObjPath, Source, StreamingSavePlanner
from tiermem.checkpoint.room import bytes_to_write, check_room
from tiermem.errors import CheckpointError, TiermemError
from tiermem.registry import Registry
from tiermem.states import ModelStates, StatesUsageError
from tiermem.states.chunks import Chunk
from tiermem.states.stateio import StateTensor


class _ModelGuard:
    """Model ``m``'s :class:`~tiermem.states.stateio.SaveGuard` (rule 2)."""

    def __init__(self, capture: Capture, m: int) -> None:
        self.capture = capture
        self.m = m

    def pump(self) -> None:
        self.capture.pump()

    def before_step(self, chunk: Chunk) -> None:
        self.capture.before_step((self.m, chunk.index))

    def before_move(self, chunk: Chunk) -> None:
        self.capture.before_move((self.m, chunk.index))

    def before_rewrite(self) -> None:
        self.capture.before_rewrite()

    def copied(self, tensor: StateTensor) -> torch.Tensor:
        """The writer thread's read of ``tensor`` (``StateIO.copied``)."""
        return self.capture.read((self.m, tensor.chunk), tensor)


class PendingSave:
    """An asynchronous save in progress, as ``rt.save(path, blocking=False)`` returns it."""

    def __init__(
        self,
        all_states: Sequence[ModelStates],
        registry: Registry,
        where: Path,
        format: str,
        planned: tuple[dict[str, Any], dict[ObjPath, Source], bytes],
    ) -> None:
        self.path = where
        self.format = format
        tree, sources, payload = planned
        self._states = list(all_states)
        self._capture = Capture(all_states, registry, sorted({source.chunk for source in sources.values()}))
        #: rule 4: the most bytes this save's copies may hold at once, and the most they held
        self.bound_bytes = self._capture.bound
        self._error: BaseException | None = None
        self._reported = False
        self._ended = False
        self._finished = threading.Event()
        self._guards = [_ModelGuard(self._capture, m) for m in range(len(all_states))]
        for states, stateio, guard in zip(all_states, self._capture.stateios, self._guards, strict=True):
            states.stepper.save_guard = stateio.save_guard = guard
            stateio.copied = guard.copied
        #: when the writer committed (``time.perf_counter()``), for measurements
        self.committed_at: float | None = None
        self._thread = threading.Thread(
            target=self._write, args=(tree, sources, payload), name=f"tiermem-save:{where.name}", daemon=True
        )
        self._thread.start()
        self._capture.pump()

    @property
    def peak_bytes(self) -> int:
        """The most bytes this save's copies held at once (at most :attr:`bound_bytes`)."""
        return self._capture.peak_bytes

    def _write(self, tree: dict[str, Any], sources: dict[ObjPath, Source], payload: bytes) -> None:
        """The writer thread (rule 1)."""
        try:
            with files.staged(self.path, bytes_to_write(tree, len(payload))) as staging:
                staging.storage, staging.room.what = self.format, "the asynchronous save to"
                planner = StreamingSavePlanner(sources)
                try:
                    dcp.save(tree, storage_writer=_writer(staging.dir, self.format), planner=planner, no_dist=True)
                except CheckpointException as exc:
                    raise _unwrap(exc, self.path, "saving", staging) from None
                finally:
                    planner.release()
                with open(staging.dir / files.STATE_FILE, "wb") as f:
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
            self.committed_at = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - every error is reported on the training thread (rule 6)
            self._capture.fail(exc)
        finally:
            self._capture.writer_ended()
            self._finished.set()

    def done(self) -> bool:
        """Whether the save ended (committed or failed); copies more on the way (rule 3)."""
        if self._finished.is_set():
            self._end()
            return True
        self._capture.pump()
        return False

    def wait(self) -> None:
        """Copy what is left, wait for the writer to commit; raise the save's error (once)."""
        self._settle()
        self._raise_once()

    def finish(self, *, raising: bool = True) -> BaseException | None:
        """Wait; an error nobody was told of yet is raised, or returned (``raising=False``)."""
        self._settle()
        if raising:
            self._raise_once()
        elif self.error is not None and not self._reported:
            self._reported = True
            return self.error
        return None

    @property
    def error(self) -> BaseException | None:
        """The save's error once it ended (None while it runs, or after a commit)."""
        if not self._finished.is_set() or self._capture.failed is None:
            return None
        if self._error is None:
            failed = self._capture.failed
            if isinstance(failed, (TiermemError, KeyboardInterrupt)):
                self._error = failed
            else:
                self._error = CheckpointError(
                    f"tiermem checkpoint: the asynchronous save to {self.path} failed: {failed!r}; the previous "
                    "checkpoint there is intact",
                    str(self.path),
                )
                self._error.__cause__ = failed
        return self._error

    def _settle(self) -> None:
        if not self._finished.is_set():
            self._capture.before_rewrite()  # copies everything, waiting for the writer within the bound
            with tracing.traced("wait checkpoint save", "wait", {"path": str(self.path)}):  # NOTE [ Timeline trace ]
                self._finished.wait()
        self._thread.join()
        self._end()

    def _end(self) -> None:
        """Free the copies and stop guarding the models (training thread)."""
        if self._ended:
            return
        self._ended = True
        self._capture.free_written(everything=True)
        for states, stateio, guard in zip(self._states, self._capture.stateios, self._guards, strict=True):
            if states.stepper.save_guard is guard:
                states.stepper.save_guard = None
            if stateio.save_guard is guard:
                stateio.save_guard = None
                stateio.copied = None

    def _raise_once(self) -> None:
        error = self.error
        if error is not None and not self._reported:
            self._reported = True
            raise error


def _detached(value: Any, path: ObjPath, sources: dict[ObjPath, Source]) -> Any:
    """Rule 1: a copy of what the tree holds outside chunks (buffers, scalars, param groups), so
    training that goes on does not change the checkpoint; stand-ins of chunk tensors as they are."""
    if path in sources:
        return value
    if isinstance(value, dict):
        return {k: _detached(v, (*path, k), sources) for k, v in value.items()}
    if isinstance(value, list):
        return [_detached(v, (*path, n), sources) for n, v in enumerate(value)]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _check(all_states: Sequence[ModelStates], where: Path, format: str) -> None:
    if format not in FORMATS:
        raise CheckpointError(
            f"tiermem checkpoint: rt.save(format={format!r}) is not a checkpoint format; give one of {FORMATS} "
            "(or None for the default). Nothing was written.",
            str(where),
        )
    if (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1) or any(
        type(states) is not ModelStates for states in all_states
    ):
        raise CheckpointError(
            "tiermem checkpoint: rt.save(blocking=False) saves one process's models; a save over several ranks is "
            "collective: call rt.save(path) (blocking) there (NOTE [ Asynchronous saves ] rule 8).",
            str(where),
        )
    loops = [states.loop_position() for states in all_states]
    if any(loop is not None and loop["counted"] for loop in loops):
        raise StatesUsageError(
            "tiermem checkpoint: rt.save() was called inside a declared accumulation window (backwards counted "
            "since the last optimizer.step()); their gradients are not saved. Save after optimizer.step()."
        )
    if any(states.stepper.gradients_unstepped() for states in all_states):
        raise StatesUsageError(
            "tiermem checkpoint: rt.save() was called with gradients accumulated since the last optimizer.step() "
            "(a backward ended and .grad is set); a checkpoint does not hold gradients, so the resumed run would "
            "step without them. Save after optimizer.step() and optimizer.zero_grad()."
        )
    if where.parent.exists():
        files.recover(where)
    files.check_replaceable(where)  # at once, not from the writer thread later


def start(
    all_states: Sequence[ModelStates],
    registry: Registry,
    path: str | os.PathLike[str],
    *,
    extra: Any = None,
    format: str | None = None,
) -> PendingSave:
    """Rules 1-8: check and plan on the calling (training) thread, then write in the background."""
    where = Path(os.path.abspath(os.fspath(path)))
    format = DEFAULT_FORMAT if format is None else format
    _check(all_states, where, format)
    loops = [states.loop_position() for states in all_states]
    try:
        payload = pickle.dumps({"version": files.FORMAT_VERSION, "extra": extra, "rng": rng_state(), "loops": loops})
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"tiermem checkpoint: extra= cannot be pickled ({exc}); pass picklable values") from exc
    tree, sources = save_tree(all_states)
    check_room(where, bytes_to_write(tree, len(payload)))  # NOTE [ Checkpoint commit rules ] rule 8: at the call
    tree = _detached(tree, (), sources)
    # DCP warns at every single-process save; the writer thread cannot scope a filter
    # (warnings filters are process-wide), so this one message is ignored from now on.
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
    return PendingSave(all_states, registry, where, format, (tree, sources, payload))
