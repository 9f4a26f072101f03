"""Ranks of a multi-process job: which rank this process is, its own NVMe directories and budgets,
the process group tiermem sets up under torchrun, and a dead peer turned into a clear error.

::

    owned = distributed.setup_process_group(config.distributed)   # torchrun's env, or nothing
    try:
        with distributed.peer_failures(), tiermem.Runtime(config) as rt:   # <path>/rank<R> per rank
            ...                                                            # the training loop
    finally:
        distributed.close_process_group(owned)

# NOTE [ Ranks ]
1. Who this process is: an initialized default process group wins (its rank and world size are
   the ones every collective uses); before one exists, torchrun's ``RANK`` and ``WORLD_SIZE``
   (both or neither; the program may make its group after the runtime starts); otherwise one
   process. ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (torchrun sets them) are this machine's ranks;
   a group made without them (``mp.spawn``) counts as one machine: local rank = rank, local world
   = world, which never overcommits a machine.
2. With a world size above 1 each configured NVMe path is used as ``<path>/rank<R>``, R the
   global rank (unique across machines, so a filesystem shared by machines is safe too):
   created on demand and removed again when empty (NOTE [ Run directory rules ] rule 5 in
   ``tiermem.tiers.rundir``: a dead rank's run directory is reclaimed by the next run on the same
   path, whatever its world size). ``rt.init()`` uses the rank directory too. One process
   (world size 1) is exactly as without this module: no rank directory.
3. Capacities in the configuration are per rank. ``auto`` shares this machine's RAM and disk
   space among its ``LOCAL_WORLD_SIZE`` ranks (``tiermem.config``); an explicit capacity is
   what each rank may use, and the machine must hold that many of them.
4. tiermem sets up a process group only when asked (:func:`setup_process_group`: ``tiermem
   train`` under torchrun), from torchrun's environment, with ``[distributed] timeout_s`` and
   ``backend``; never over a group the program made itself, which it uses as it is.
5. A collective that fails because a peer died (gloo: connection closed/reset by peer; NCCL:
   a backend error) or did not come within the timeout raises :class:`PeerFailureError` inside
   :func:`peer_failures`, naming this rank, the world size, the probable cause, the timeout in
   force and what to do; leaving ``with rt`` then removes this rank's files, and the next run
   reclaims the dead rank's.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from tiermem.errors import ConfigError, TiermemError
from tiermem.tiers.rundir import rank_directory_name

if TYPE_CHECKING:
    from tiermem.config import Config
    from tiermem.config_fields import DistributedConfig

__all__ = [
    "PeerFailureError",
    "PeerFailureGuard",
    "RankContext",
    "close_process_group",
    "detect",
    "is_collective_failure",
    "peer_failures",
    "resolve_backend",
    "setup_process_group",
]

log = logging.getLogger("tiermem")

#: The timeout of the group :func:`setup_process_group` made (None: not ours, or none).
_owned_timeout_s: float | None = None
_closings = itertools.count()


class PeerFailureError(TiermemError, RuntimeError):
    """A collective failed because another rank died or did not come within the timeout."""


@dataclass(frozen=True)
class RankContext:
    """This process's place in the job (NOTE [ Ranks ] rule 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    source: Literal["process group", "environment", "single process"] = "single process"

    @property
    def multi_process(self) -> bool:
        return self.world_size > 1

    @property
    def subdirectory(self) -> str | None:
        """``rank<R>`` under each NVMe path in a multi-process job, else None (rule 2)."""
        return rank_directory_name(self.rank) if self.multi_process else None

    def rank_paths(self, paths: tuple[str, ...]) -> tuple[str, ...]:
        """The directories this rank uses for ``paths`` (the paths themselves for one process)."""
        sub = self.subdirectory
        return paths if sub is None else tuple(os.path.join(p, sub) for p in paths)

    def for_rank(self, resolved: Config) -> Config:
        """``resolved`` with its NVMe paths made this rank's: what the runtime uses (``rt.init()``)."""
        nvme = dataclasses.replace(resolved.nvme, paths=self.rank_paths(resolved.nvme.paths))
        return dataclasses.replace(resolved, nvme=nvme)

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def _env_int(environ: Mapping[str, str], name: str, problems: list[str]) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit():
        problems.append(f"distributed: {name}={text!r} is not a non-negative integer (torchrun sets it)")
        return None
    return int(text)


def _group() -> tuple[int, int] | None:
    """(rank, world size) of the initialized default process group, or None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def detect(environ: Mapping[str, str] | None = None) -> RankContext:
    """This process's rank and world (NOTE [ Ranks ] rule 1); a malformed or half-set torchrun
    environment is a ConfigError naming the variables."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    rank, world = _env_int(environ, "RANK", problems), _env_int(environ, "WORLD_SIZE", problems)
    local_rank = _env_int(environ, "LOCAL_RANK", problems)
    local_world = _env_int(environ, "LOCAL_WORLD_SIZE", problems)
    group = _group()
    if local_world == 0:
        problems.append("distributed: LOCAL_WORLD_SIZE=0; it counts this machine's ranks, at least 1")
    if group is None and not problems and (rank is None) != (world is None):
        problems.append(
            f"distributed: RANK={environ.get('RANK')!r} and WORLD_SIZE={environ.get('WORLD_SIZE')!r}: set both "
            "(torchrun does) or neither"
        )
    if group is None and not problems and world is not None and not (world >= 1 and rank is not None and rank < world):
        problems.append(f"distributed: RANK={rank} is not below WORLD_SIZE={world}; launch with torchrun")
    if problems:
        raise ConfigError(problems, "the environment")
    if group is not None:
        rank, world = group
        source: Literal["process group", "environment", "single process"] = "process group"
    elif world is not None:
        source = "environment"  # torchrun, before the group exists (one process included)
    else:
        return RankContext(local_rank=local_rank or 0, local_world_size=local_world or 1)
    assert rank is not None
    return RankContext(
        rank=rank,
        world_size=world,
        local_rank=rank if local_rank is None else local_rank,
        local_world_size=world if local_world is None else local_world,
        source=source,
    )


def resolve_backend(backend: str, cuda_available: bool) -> str:
    """``auto``: gloo without CUDA, ``cpu:gloo,cuda:nccl`` with it (FSDP2's collectives on the GPU,
    CPU tensors such as offloaded gradient norms through gloo). ``nccl`` needs CUDA."""
    if backend == "auto":
        return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"
    if "nccl" in backend and not cuda_available:
        raise ConfigError(
            [f'distributed.backend: "{backend}" needs CUDA and torch sees no CUDA device here; use "auto" or "gloo"'],
            "[distributed]",
        )
    return backend


def setup_process_group(settings: DistributedConfig) -> bool:
    """Make the default process group from torchrun's environment (rule 4), a one-process launch
    included (FSDP2 needs a group even then); True when it did (the caller then calls
    :func:`close_process_group`). False, doing nothing, without torchrun's environment or when
    the program already made a group. Reads ``os.environ``: ``env://`` reuses the store torchrun's
    agent serves at ``MASTER_ADDR:MASTER_PORT``."""
    global _owned_timeout_s
    import torch
    import torch.distributed as dist

    environ = os.environ
    ranks = detect(environ)
    if ranks.source != "environment":
        return False  # not launched by torchrun, or the program's own group (kept as it is)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        raise ConfigError(
            [f"distributed: WORLD_SIZE={ranks.world_size} but {' and '.join(missing)} unset; launch with torchrun"],
            "the environment",
        )
    cuda = torch.cuda.is_available()
    backend = resolve_backend(settings.backend, cuda)
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=datetime.timedelta(seconds=settings.timeout_s),
    )
    _owned_timeout_s = settings.timeout_s
    log.info("tiermem: process group %s, %s, timeout %gs", backend, ranks.describe(), settings.timeout_s)
    return True


def close_process_group(owned: bool, *, wait_for_peers: bool = True) -> None:
    """Destroy the group :func:`setup_process_group` made (nothing when ``owned`` is False).

    ``wait_for_peers`` meets the other ranks first: gloo aborts a process whose peer tears its
    connections down while it still holds them. Skipped after a :class:`PeerFailureError` (no
    peer will come); a failed barrier is logged, not raised, so the first error stays the one
    reported."""
    global _owned_timeout_s
    import torch.distributed as dist

    if not owned or not dist.is_initialized():
        return
    try:
        if wait_for_peers:
            dist.barrier()
            _all_left_the_barrier(dist)
    except RuntimeError as exc:
        log.warning("tiermem: the ranks did not meet before closing the process group: %s", exc)
    finally:
        dist.destroy_process_group()
        _owned_timeout_s = None


def _all_left_the_barrier(dist: Any) -> None:
    """A rank leaves gloo's barrier once it received its peers' bytes, not once they received
    its own: destroying the group then can tear a connection down under a peer still receiving
    the barrier, and gloo aborts that peer (``terminate called without an active exception``).
    So the ranks also count themselves out on the rendezvous store, which is no gloo
    connection, and destroy the group only when every rank has left the barrier."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        return
    store, world = get_store(), dist.get_world_size()
    key = f"tiermem/left-barrier/{next(_closings)}"  # every rank closes its groups in the same order
    deadline = time.monotonic() + (_owned_timeout_s or 60.0)
    store.add(key, 1)
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            log.warning("tiermem: not every rank left the closing barrier within the timeout")
            return
        time.sleep(0.005)


_PEER_SIGNS = ("connection closed by peer", "connection reset by peer")
_TIMEOUT_SIGNS = ("timed out", "timeout")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective failing for a peer: torch's
    ``DistError`` family, or gloo's RuntimeError for a lost connection or a timeout."""
    import torch.distributed as dist

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        text = str(current).lower()
        backend_error = "gloo" in text or "nccl" in text or any(sign in text for sign in _PEER_SIGNS)
        if isinstance(current, RuntimeError) and backend_error:
            return True
        current = current.__cause__ or current.__context__
    return False


def _timeout_in_force() -> str:
    if _owned_timeout_s is not None:
        return f"{_owned_timeout_s:g} s ([distributed] timeout_s)"
    try:  # the program's own group: torch keeps its timeout on the backend's options (private)
        import torch
        import torch.distributed as dist

        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        seconds = backend.options._timeout.total_seconds()
        return f"{seconds:g} s (the program's init_process_group(timeout=...))"
    except (AttributeError, RuntimeError, ValueError):
        return "the process group's (set by the program's init_process_group(timeout=...))"


def peer_failure_message(ranks: RankContext, exc: BaseException) -> str:
    """What :class:`PeerFailureError` says: who, the probable cause, the timeout, what to do."""
    text = str(exc).lower()
    timed_out = any(sign in text for sign in _TIMEOUT_SIGNS) and not any(sign in text for sign in _PEER_SIGNS)
    cause = (
        "another rank did not reach the same collective within the timeout (it hangs, works alone longer "
        "than the timeout, or its machine was lost)"
        if timed_out
        else "another rank died (killed, out of memory, or an error of its own) and its connections closed"
    )
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"tiermem distributed: {ranks.describe()}: a collective failed: {first_line[:300]}. "
        f"Probable cause: {cause}. Timeout in force: {_timeout_in_force()}. "
        "What to do: read the other ranks' output for the first error (that rank's own failure is the "
        "cause); if one rank legitimately works alone longer (planning, a checkpoint), raise [distributed] "
        "timeout_s; then restart the job: this rank's NVMe files are removed as it exits and the next run "
        "on the same paths reclaims the dead rank's."
    )


class PeerFailureGuard:
    """Around a training loop: a collective failure (:func:`is_collective_failure`) in a
    multi-process job leaves as :class:`PeerFailureError` (NOTE [ Ranks ] rule 5), chained to the
    original; every other exception, and everything in one process, passes unchanged."""

    def __enter__(self) -> PeerFailureGuard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        if exc is None or isinstance(exc, PeerFailureError) or not isinstance(exc, Exception):
            return
        try:
            ranks = detect()
        except ConfigError:
            return
        if ranks.multi_process and is_collective_failure(exc):
            raise PeerFailureError(peer_failure_message(ranks, exc)) from exc


def peer_failures() -> PeerFailureGuard:
    """``with peer_failures():`` around a training loop (NOTE [ Ranks ] rule 5)."""
    return PeerFailureGuard()
