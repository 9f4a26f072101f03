"""Checkpoints of tiered training state: ``rt.save(path, extra=...)`` / ``extra = rt.load(path)``.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) checkpoint of ``{"model":
<model.state_dict() names>, "optimizer": <get_optimizer_state_dict's form>}``, in DCP's own
filesystem format (the default) or as zarr v3 arrays (``format="zarr"``, NOTE [ Zarr checkpoint
rules ] in :mod:`tiermem.checkpoint.zarr_storage`), plus ``tiermem-state.pkl`` (``extra``, RNG
states, the declared loop's position) and ``tiermem-manifest.json`` (a digest per file). A
plain PyTorch model loads its weights with ``dcp.load({"model": m.state_dict()},
checkpoint_id=path, storage_reader=storage_reader(path))`` in either format.

# NOTE [ Checkpoint rules ]
1. The registry is the only door: a checkpoint reads and writes chunk bytes through each
   model's :class:`~tiermem.states.stateio.StateIO` (homes through their handles, NOTE
   [ Managed object rules ] rules 1 and 9), never a tier or the scheduler, and only between
   steps (``ModelStates.checkpoint_io`` refuses during forward and backward).
2. Streamed save: DCP plans from stand-ins (shape and dtype, one element of storage); each
   tensor's bytes are read from where they live (device copy, host home, or an NVMe home read
   once per chunk) only when DCP's writer resolves it, one tensor in flight (DCP's serial
   loader: ``per_thread_copy_ahead=0``, one writer thread). Items are ordered chunk by chunk,
   so the RSS a save adds is about one chunk's home plus one tensor, not the model.
3. Streamed load: DCP's reader fills a temporary per tensor; complete, it is written into its
   chunk (the home, staged on the host for NVMe, one chunk at a time and written back before
   the next; a persistent chunk's device copy too). A streamed chunk's device copy is released
   first, so the next fetch reads the loaded values. Gradients are not part of a checkpoint.
4. Exact: values are the full-precision masters (fp32 under ``param_dtype``), optimizer states
   bitwise with their scalars (``step``), param groups' hyper-parameters (an LR schedule's lr),
   and every RNG; a declared loop is saved at a window boundary only (no counted backward
   pending, whose gradients a checkpoint would lose), and any loop only after the step: a save
   refuses gradients accumulated since the last ``optimizer.step()`` (``Stepper.gradients_unstepped``).
5. On disk: NOTE [ Checkpoint commit rules ] in ``files.py`` (written beside ``path``,
   committed atomically, digests verified before anything is loaded, and the directory locked
   from that verification to the last read, so a concurrent save cannot mix in its files).
6. A load checks everything it can before the first write: digests, the architecture, each
   tensor's shape and dtype (DCP's metadata), the param groups (read in a first pass of only
   those) and the state file. A failure after writes began (an I/O error half-way) raises a
   :class:`CheckpointError` saying the managed states are partly overwritten: load again.
7. Two storage formats, one checkpoint: ``"dcp"`` (DCP's ``FileSystemWriter``: one data file,
   one tensor in flight) and ``"zarr"`` (:class:`~tiermem.checkpoint.zarr_storage.ZarrWriter`: an
   array per tensor, readable by any zarr v3 reader without torch). Same planners, same commit
   and digests; a load and :func:`storage_reader` find the format on disk (a root ``zarr.json``).
   The default is ``"dcp"``, from bench/checkpoint.py (bench/README.md, "Checkpoints"): on
   192 MiB of NVMe-homed states DCP saved 1.6-7x and loaded 1.9-4x faster than zarr in every
   pair, added half the RSS on a save (one tensor in flight against zarr's bounded writes in
   flight) and wrote 4 files against 284, for the same bytes. Choose zarr to read the states
   from outside PyTorch.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from tiermem.checkpoint import files, ranks
from tiermem.checkpoint.content import LoadTree, rng_state, save_tree, set_rng_state
from tiermem.checkpoint.dcp_planners import StreamingLoadPlanner, StreamingSavePlanner
from tiermem.checkpoint.room import bytes_to_write
from tiermem.errors import CheckpointError, TiermemError
from tiermem.states import ModelStates, StatesUsageError
from tiermem.states.sharded.manager import ShardedModelStates

__all__ = ["CheckpointError", "load", "read_extra", "save", "storage_reader"]

T = TypeVar("T")

#: DCP warns at every single-process save and load; one process is what this step supports.
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


#: the storage formats a save can write (rule 7)
FORMATS = ("dcp", "zarr")
#: what ``rt.save`` writes unless told (rule 7: chosen from bench/checkpoint.py's numbers)
DEFAULT_FORMAT = "dcp"


def storage_reader(path: str | os.PathLike[str]) -> StorageReader:
    """A DCP ``StorageReader`` for the checkpoint at ``path``, in the format found on disk:
    ``FileSystemReader`` for DCP's own filesystem format, :class:`ZarrReader` for the zarr one."""
    where = Path(os.fspath(path))
    if files.storage_of(where) == "zarr":
        from tiermem.checkpoint.zarr_storage import ZarrReader  # tensorstore only when asked

        return ZarrReader(where)
    return FileSystemReader(os.fspath(path))


def _writer(directory: Path, format: str) -> StorageWriter:
    if format == "zarr":
        from tiermem.checkpoint.zarr_storage import ZarrWriter

        return ZarrWriter(directory)
    return FileSystemWriter(directory, sync_files=True, thread_count=1, per_thread_copy_ahead=0)


def _unwrap(exc: CheckpointException, path: Path, what: str, staging: files.Staging | None = None) -> BaseException:
    """DCP wraps every failure; ours (tiermem's, Ctrl-C) come out as they were, a disk that filled
    during a save as such (NOTE [ Checkpoint commit rules ] rule 8)."""
    failures = [failure[0] for failure in exc.failures.values()]
    first = failures[0] if failures else exc
    if isinstance(first, (TiermemError, KeyboardInterrupt)):
        return first
    full = None if staging is None else staging.no_room(first)
    if full is not None:
        return full
    return CheckpointError(f"tiermem checkpoint: {what} {path} failed: {first}", str(path))


def _prepare(all_states: Sequence[ModelStates], extra: Any) -> tuple[dict[str, Any], dict[Any, Any], dict[str, Any]]:
    """Rule 4's checks, then what a save writes: the tree to plan, each tensor's source, and this
    process's own values (extra, RNG states, loop positions; checked picklable)."""
    loops = [states.loop_position() for states in all_states]
    if any(loop is not None and loop["counted"] for loop in loops):
        raise StatesUsageError(
            "tiermem checkpoint: rt.save() was called inside a declared accumulation window (backwards counted "
            "since the last optimizer.step()); their gradients are not saved. Save after optimizer.step()."
        )
    if any(_gradients_unstepped(states) for states in all_states):
        raise StatesUsageError(
            "tiermem checkpoint: rt.save() was called with gradients accumulated since the last optimizer.step() "
            "(a backward ended and .grad is set); a checkpoint does not hold gradients, so the resumed run would "
            "step without them. Save after optimizer.step() and optimizer.zero_grad()."
        )
    own = {"extra": extra, "rng": rng_state(), "loops": loops}
    try:
        pickle.dumps(own)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"tiermem checkpoint: extra= cannot be pickled ({exc}); pass picklable values") from exc
    tree, sources = save_tree(all_states)
    return tree, sources, own


def _gradients_unstepped(states: ModelStates) -> bool:
    if isinstance(states, ShardedModelStates):
        return states.gradients_unstepped()
    return states.stepper.gradients_unstepped()


def _write_state(directory: Path, state: dict[str, Any]) -> None:
    with open(directory / files.STATE_FILE, "wb") as f:
        f.write(pickle.dumps({"version": files.FORMAT_VERSION, **state}))
        f.flush()
        os.fsync(f.fileno())


def save(
    all_states: Sequence[ModelStates], path: str | os.PathLike[str], *, extra: Any = None, format: str | None = None
) -> None:
    """Rules 2, 4, 5 and 7: stream every managed model and optimizer to a new checkpoint at
    ``path``, in ``format`` (``"dcp"`` or ``"zarr"``; None: :data:`DEFAULT_FORMAT`); collective
    over the ranks for FSDP2-sharded models (NOTE [ Checkpoints on ranks ])."""
    where = Path(os.path.abspath(os.fspath(path)))
    format = DEFAULT_FORMAT if format is None else format
    if format not in FORMATS:
        raise CheckpointError(
            f"tiermem checkpoint: rt.save(format={format!r}) is not a checkpoint format; give one of {FORMATS} "
            "(or None for the default). Nothing was written.",
            str(where),
        )
    group = ranks.group_of(all_states)
    if group is not None:
        if format == "zarr":
            raise ranks.refuse_zarr("saving", where)
        _save_on_ranks(group, all_states, where, extra)
        return
    tree, sources, own = _prepare(all_states, extra)
    needed = bytes_to_write(tree, len(pickle.dumps(own)))
    with files.staged(where, needed) as staging:  # refused here, before writing, where it cannot fit
        staging.storage = format
        writer = _writer(staging.dir, format)
        planner = StreamingSavePlanner(sources)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
                dcp.save(tree, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as exc:
            raise _unwrap(exc, where, "saving", staging) from None
        finally:
            planner.release()
        _write_state(staging.dir, own)


def _save_on_ranks(group: ranks.Group, all_states: Sequence[ModelStates], where: Path, extra: Any) -> None:
    """NOTE [ Checkpoints on ranks ] rules 2-5: every rank writes its shards into rank 0's
    temporary sibling; rank 0 commits once all wrote; every step agreed."""
    tree, sources, own = group.agreed(lambda: _prepare(all_states, extra))
    staging: files.Staging | None = None

    def stage() -> tuple[Path, str]:
        nonlocal staging
        staging = files.Staging(where)
        return staging.dir, ranks.write_probe(staging.dir)

    try:
        directory, token = group.from_rank0(stage)
        group.agreed(lambda: ranks.check_probe(directory, token, group.rank))
        if staging is not None:
            os.unlink(directory / ranks.PROBE)
        planner = StreamingSavePlanner(sources)
        try:
            dcp.save(tree, storage_writer=_writer(directory, "dcp"), planner=planner)
        except CheckpointException as exc:
            raise _unwrap(exc, where, "saving") from None
        finally:
            planner.release()
        every = group.gather(own)

        def commit() -> None:
            assert staging is not None
            ranks.check_files_seen(directory, FileSystemReader(directory).read_metadata())
            _write_state(directory, {**every[0], "world_size": group.world_size, "ranks": every})
            staging.commit()

        group.from_rank0(commit)
    except BaseException:
        if staging is not None:
            staging.discard()
        raise


def _read(
    tree: dict[str, Any], reader: StorageReader, planner: StreamingLoadPlanner, where: Path, collective: bool
) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            dcp.load(tree, storage_reader=reader, planner=planner, no_dist=not collective)
    except CheckpointException as exc:
        raise _unwrap(exc, where, "loading") from None
    finally:
        planner.close()
    if planner.pending():
        raise CheckpointError(f"tiermem checkpoint: {where} did not provide {planner.pending()[:5]}", str(where))


def _no_writes(key: Any) -> Any:
    raise AssertionError(f"tiermem checkpoint: the param-group read opened chunk {key}")


def _read_state(where: Path) -> dict[str, Any]:
    try:
        with open(where / files.STATE_FILE, "rb") as f:
            state = pickle.load(f)
        _ = state["rng"], state["loops"], state["extra"]
    except Exception as exc:
        raise CheckpointError(
            f"tiermem checkpoint: cannot read {where / files.STATE_FILE} ({exc!r}); nothing was loaded. Load it "
            "with the tiermem version that saved it, or an earlier checkpoint.",
            str(where / files.STATE_FILE),
        ) from exc
    return state


def _recover(where: Path, group: ranks.Group | None) -> None:
    """NOTE [ Checkpoint commit rules ] rule 3, on rank 0 only where there are ranks."""
    if group is None:
        files.recover(where)
    else:
        group.from_rank0(lambda: files.recover(where))


def _verify(where: Path, group: ranks.Group | None) -> bool:
    """Rule 5 (NOTE [ Checkpoint commit rules ] rule 4): verify every digest; True for a
    tiermem checkpoint. On ranks rank 0 does it and every rank gets its verdict (NOTE
    [ Checkpoints on ranks ] rule 6)."""

    def verified() -> bool:
        ours = files.verify(where)
        if group is not None and files.storage_of(where) == "zarr":
            raise ranks.refuse_zarr("loading", where)
        return ours

    return verified() if group is None else group.from_rank0(verified)


def read_extra(path: str | os.PathLike[str], *, rank: int = 0) -> Any:
    """The ``extra`` the checkpoint at ``path`` was saved with (rank ``rank``'s where several ranks
    saved it, NOTE [ Checkpoints on ranks ] rule 5), loading nothing: its state file is read once
    it matches its digest (the other files are not read; a load verifies every one). None for a
    plain DCP checkpoint. The state file is unpickled: read only checkpoints you trust."""
    where = Path(os.path.abspath(os.fspath(path)))
    with files.reading(where):
        if not files.verify(where, only=(files.STATE_FILE,)):
            return None
        state = _read_state(where)
    return ranks.own_state(state, rank)["extra"]


def _metadata(reader: StorageReader, where: Path) -> Any:
    try:
        return reader.read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
        raise CheckpointError(
            f"tiermem checkpoint: cannot read the DCP metadata of {where}: {exc}; the checkpoint is damaged",
            str(where),
        ) from exc


def _read_into_chunks(tree: LoadTree, reader: StorageReader, where: Path, group: ranks.Group | None) -> None:
    """Rules 3 and 6: stream every tensor into its chunk; a failure once writes began says so."""
    planner = StreamingLoadPlanner(tree.targets, lambda key: tree.stateios[key[0]].chunk_writer(key[1]))
    planner.written = group is not None  # FSDP2's shards are loaded in place from the first read
    try:
        _read(tree.tree, reader, planner, where, group is not None)
        if group is None:
            tree.finish(planner.loaded)
        else:
            group.agreed(lambda: tree.finish(planner.loaded))
    except Exception as exc:
        if not planner.written:
            raise
        raise CheckpointError(
            f"tiermem checkpoint: loading {where} failed after it began writing the managed states ({exc}); they "
            "are partly overwritten. Load a checkpoint again before training (or restart the run).",
            str(where),
        ) from exc


def load(all_states: Sequence[ModelStates], path: str | os.PathLike[str]) -> Any:
    """Rules 3-6: verify the checkpoint at ``path``, check what can be checked before writing
    (architecture, shapes and dtypes, param groups, the state file), stream it into the managed
    models and optimizers, restore RNG states and loop positions; returns the ``extra`` it was
    saved with (None for a plain DCP checkpoint). Collective over the ranks for FSDP2-sharded
    models, every check agreed (NOTE [ Checkpoints on ranks ])."""
    where = Path(os.path.abspath(os.fspath(path)))
    group = ranks.group_of(all_states)

    def every(step: Callable[[], T]) -> T:
        return step() if group is None else group.agreed(step)

    _recover(where, group)
    with files.reading(where):  # NOTE [ Checkpoint commit rules ] rule 7: one checkpoint, verified and read
        ours = _verify(where, group)
        reader = storage_reader(where)
        metadata = every(lambda: _metadata(reader, where))
        tree = every(lambda: LoadTree(all_states, metadata, str(where)))
        groups = StreamingLoadPlanner({}, _no_writes)
        _read(tree.groups_tree(), reader, groups, where, group is not None)
        every(lambda: tree.check_groups(groups.loaded))
        state = every(lambda: _read_state(where)) if ours else None
        _read_into_chunks(tree, reader, where, group)
    if state is None:
        return None
    own = ranks.own_state(state, 0 if group is None else group.rank)
    set_rng_state(own["rng"])
    for states, loop in zip(all_states, own["loops"], strict=False):
        if loop is not None and states.loop_position() is not None:
            states.restore_loop_position(loop)
    return own["extra"]
