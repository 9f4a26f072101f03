"""Checkpoints of FSDP2-sharded models on several ranks: who takes part, the agreement every
step of a save or load ends in, the shared-filesystem probe, and the per-rank values.

# NOTE [ Checkpoints on ranks ]
1. Collective: with FSDP2-sharded models under management, ``rt.save`` and ``rt.load`` are
   called by every rank of the default process group, in the same order, as ``dcp.save`` is.
   Every managed model must then be sharded (a plain model beside them is refused: its ranks'
   copies would race for one checkpoint).
2. One DCP checkpoint in ``get_state_dict``'s layout for plain FSDP2: the parameters are FSDP2's
   DTensors, saved and loaded in place; the optimizer states stand in as DTensors placed like
   their parameters, and each rank streams its own local shards from its chunks (NOTE
   [ Checkpoint rules ] rule 2). Each rank writes its own data file (``__<rank>_0.distcp``),
   rank 0 (DCP's coordinator) the ``.metadata``. Any world size loads it through DCP's
   resharding: one process into a plain model under ``rt.manage`` or plain PyTorch, N ranks into
   FSDP2 + ``rt.manage``; and a one-process checkpoint loads on N ranks the same way.
3. A shared filesystem: ``path`` must be one every rank sees (one machine's disk, NFS, Lustre).
   Rank 0 makes the temporary sibling with a probe file in it, and every rank must read the
   probe back; after the write rank 0 must see every file DCP's metadata names. Otherwise every
   rank raises :class:`CheckpointError` saying so, and the temporary directory is removed.
4. Atomic across ranks: every rank writes into rank 0's temporary sibling; once all wrote (DCP's
   final gather), rank 0 writes the state file, digests every file and commits (NOTE
   [ Checkpoint commit rules ]), and tells the others. Every step ends in an agreement: one
   ``all_gather_object`` of each rank's outcome (or one broadcast of rank 0's), after which every
   rank raises the first failing rank's error, the same error everywhere (DCP's own steps gather
   failures the same way). No rank waits on one that gave up; a rank that died is the process
   group's timeout's (NOTE [ Ranks ] rule 5).
5. Per-rank values: each rank's RNG states, declared-loop positions and ``extra`` are gathered to
   rank 0 and kept in the state file by rank (rank 0's also at the top level, where one process
   reads them). A load gives rank r its own, or rank 0's where the checkpoint has no rank r
   (loaded on more ranks than saved it), and returns rank r's ``extra``.
6. A load verifies before anything is read: rank 0 recovers an interrupted commit, verifies
   every digest and broadcasts the verdict; each check made before writing (metadata,
   architecture, shapes, param groups, the state file) is agreed as in rule 4; DCP's reads are
   collective.
7. The zarr format is one process's: refused on several ranks, for a save and a load, before
   anything is written.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tiermem.errors import CheckpointError
from tiermem.states import ModelStates
from tiermem.states.sharded.manager import ShardedModelStates

T = TypeVar("T")

#: the file rank 0 puts in the temporary sibling for every rank to read back (rule 3)
PROBE = "tiermem-probe"


class Group:
    """This process's place in a collective save or load (rule 1)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def agreed(self, step: Callable[[], T]) -> T:
        """Rule 4: run ``step`` on this rank; if any rank failed, every rank raises the error of the
        first that did (this rank's own, traceback and all, where it is that one)."""
        import torch.distributed as dist

        failure: BaseException | None = None
        value: Any = None
        try:
            value = step()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or they wait forever
            failure = exc
        outcomes: list[Any] = [None] * self.world_size
        dist.all_gather_object(outcomes, None if failure is None else _portable(failure))
        for rank, outcome in enumerate(outcomes):
            if outcome is not None:
                if rank == self.rank and failure is not None:
                    raise failure
                raise _on_rank(outcome, rank) from None
        return value  # type: ignore[no-any-return]

    def from_rank0(self, step: Callable[[], T]) -> T:
        """Rules 4 and 6: rank 0 runs ``step``; every rank returns its value or raises its error."""
        import torch.distributed as dist

        outcome: list[Any] = [None]
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                outcome[0] = ("value", step())
            except Exception as exc:  # noqa: BLE001 - broadcast to every rank, then raised
                failure = exc
                outcome[0] = ("error", _portable(exc))
        dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind == "error":
            if failure is not None:
                raise failure
            raise _on_rank(value, 0) from None
        return value  # type: ignore[no-any-return]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (rule 5)."""
        import torch.distributed as dist

        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def group_of(all_states: Sequence[ModelStates]) -> Group | None:
    """Rule 1: the group a save or load of ``all_states`` is collective over, or None (one process)."""
    sharded = [isinstance(states, ShardedModelStates) for states in all_states]
    if not any(sharded):
        return None
    if not all(sharded):
        plain = [m for m, is_sharded in enumerate(sharded) if not is_sharded]
        raise CheckpointError(
            f"tiermem checkpoint: model(s) {plain} of this runtime are not FSDP2-sharded while others are; a "
            "checkpoint on several ranks holds sharded models only (every rank's copy of a plain model would race "
            "for one file). Shard every managed model with fully_shard, or save the plain one with its own runtime."
        )
    return Group()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` as it can travel to the other ranks (pickled), or a CheckpointError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return CheckpointError(f"tiermem checkpoint: {type(exc).__name__}: {exc}")


def _on_rank(exc: BaseException, rank: int) -> BaseException:
    exc.add_note(f"(raised on rank {rank}; every rank raises it)")
    return exc


def refuse_zarr(what: str, where: Path) -> CheckpointError:
    """Rule 7."""
    return CheckpointError(
        f"tiermem checkpoint: {what} {where} in the zarr format on several ranks is not supported (its arrays are "
        "written by one process); use the default format (DCP's filesystem format), which every world size loads.",
        str(where),
    )


def write_probe(directory: Path) -> str:
    """Rule 3: a file only a rank on the same filesystem can read back; returns its token."""
    token = uuid.uuid4().hex
    with open(directory / PROBE, "w", encoding="utf-8") as f:
        f.write(token)
    return token


def check_probe(directory: Path, token: str, rank: int) -> None:
    """Rule 3: this rank sees the temporary directory rank 0 made."""
    try:
        seen = (directory / PROBE).read_text(encoding="utf-8")
    except OSError as exc:
        seen = f"unreadable ({exc.strerror})"
    if seen != token:
        raise CheckpointError(
            f"tiermem checkpoint: rank {rank} cannot see {directory}, which rank 0 made for the save (its probe file "
            f"is {seen if seen.startswith('unreadable') else 'another'}): rt.save on several ranks needs a path on a "
            "filesystem every rank sees (a shared filesystem such as NFS or Lustre, or one machine's disk). Nothing "
            "was saved.",
            str(directory),
        )


def check_files_seen(directory: Path, metadata: Any) -> None:
    """Rule 3: rank 0 sees every data file the ranks wrote (as DCP's metadata names them)."""
    named = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [name for name in named if not os.path.exists(directory / name)]
    if missing:
        raise CheckpointError(
            f"tiermem checkpoint: rank 0 cannot see {missing[:4]} in {directory}, which other ranks wrote: rt.save "
            "on several ranks needs a path on a filesystem every rank sees (a shared filesystem such as NFS or "
            "Lustre, or one machine's disk). Nothing was saved.",
            str(directory),
        )


def own_state(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rule 5: rank ``rank``'s extra, RNG states and loop positions (rank 0's where none were saved)."""
    by_rank = state.get("ranks")
    if isinstance(by_rank, list) and rank < len(by_rank):
        return by_rank[rank]  # type: ignore[no-any-return]
    return state
