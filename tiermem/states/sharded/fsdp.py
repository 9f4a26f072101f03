"""What tiermem reads of FSDP2 and ``torch.distributed`` for sharded model states: which models
are sharded, each parameter's shard geometry and offload, and the one collective agreement on
a plan (rules 1-3 of NOTE [ Sharded model states ] in :mod:`tiermem.states.sharded.manager`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiermem.layout.placement import Budgets, Plan
from tiermem.states.errors import PlanError, StatesMemoryError, StatesUsageError
from tiermem.states.sharded.layout import budgets_of_all, padded_shard_shape
from tiermem.states.sharded.step import local_of

__all__ = ["agree", "cpu_offloaded", "is_sharded", "padded_shape", "sharded_params", "staging_tier"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2's ``fully_shard``)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def sharded_params(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters, every one an FSDP2 shard (a DTensor of Shard/Replicate placements)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    params = list(model.parameters())
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise StatesUsageError(
            f"tiermem manage: {len(plain)} parameter(s) of this model are not sharded ({', '.join(plain[:3])}...) "
            "while others are DTensors; apply fully_shard to the root module too, so FSDP2 shards every parameter"
        )
    for name, p in model.named_parameters():
        odd = [pl for pl in p.placements if type(pl) not in (Shard, Replicate)]  # type: ignore[attr-defined]
        if odd:
            raise StatesUsageError(
                f"tiermem manage: parameter {name} is placed {odd}; tiermem packs Shard and Replicate placements "
                "(FSDP2 data parallel and HSDP) only"
            )
    devices = {local_of(p).device.type for p in params}
    if len(devices) > 1:
        raise StatesUsageError(
            f"tiermem manage: the shards of this model live on {sorted(devices)}; apply the same offload_policy to "
            "every fully_shard call of one managed model"
        )
    return params


def padded_shape(p: torch.Tensor) -> tuple[int, ...]:
    """Rule 2: the shard shape of ``p`` on every rank (``layout.padded_shard_shape``)."""
    mesh = p.device_mesh  # type: ignore[attr-defined]
    shards = [(pl.dim, mesh.size(m)) for m, pl in enumerate(p.placements) if pl.is_shard()]  # type: ignore[attr-defined]
    return padded_shard_shape(tuple(p.shape), shards)


def staging_tier(params: list[nn.Parameter]) -> str:
    """Rule 5: the memory tier the step runs in, where the shards are."""
    device = local_of(params[0]).device if params else torch.device("cpu")
    return "host" if device.type == "cpu" else "device"


def cpu_offloaded(model: nn.Module) -> set[int]:
    """Rule 1: ids of the parameters FSDP2 keeps offloaded to the host (``CPUOffloadPolicy``).
    FSDP2 has no public getter for it, so this reads its per-module state (``offload_to_cpu`` of
    each ``FSDPParam``); where that is missing the answer is "none", which on a CPU device only
    chooses the device tier's budget over the host's for counting a shard."""
    found: set[int] = set()
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        groups = getattr(get_state(), "_fsdp_param_groups", None) if callable(get_state) else None
        for group in groups or ():
            for fsdp_param in getattr(group, "fsdp_params", ()):
                if getattr(fsdp_param, "offload_to_cpu", False):
                    found.add(id(fsdp_param.sharded_param))
    return found


def agree(digest: str | PlanError, budgets: Budgets, decide: Callable[[Budgets], Plan]) -> Plan:
    """Rules 2 and 3: one all_gather of (digest, free bytes), rank 0 decides, one broadcast.
    ``digest`` is this rank's refusal where it could not pack at all (its chunk size below its
    largest shard): it still joins the gather, so the other ranks raise too instead of waiting
    for it in the collective, and it raises its own error."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise StatesUsageError(
            "tiermem manage: the model is FSDP2-sharded but torch.distributed has no process group; "
            "call torch.distributed.init_process_group first (torchrun sets its environment)"
        )
    gathered: list[Any] = [None] * dist.get_world_size()
    mine = (str(digest), None) if isinstance(digest, PlanError) else (None, digest)  # (why refused, digest)
    dist.all_gather_object(gathered, (*mine, budgets))
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        refused = [(r, why) for r, (why, _, _) in enumerate(gathered) if why is not None]
        digests = [d for _, d, _ in gathered]
        if refused:
            ranks = [r for r, _ in refused]
            outcome[0] = ("error", f"tiermem manage: rank(s) {ranks} refused the plan: {refused[0][1]}")
        elif len(set(digests)) > 1:
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            outcome[0] = (
                "error",
                f"tiermem manage: the optimizer-state packing of rank(s) {differ} differs from "
                "rank 0's: every rank must manage the same model (same parameters, shapes, dtypes and "
                "optimizer groups) with the same plan= and the same [model_states] chunk_size",
            )
        else:
            try:
                outcome[0] = ("plan", decide(budgets_of_all([b for _, _, b in gathered])))
            except (PlanError, StatesMemoryError) as exc:  # every rank raises it, none waits forever
                outcome[0] = ("raise", exc)
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(digest, PlanError):
        raise digest  # this rank's own refusal, with its own words
    kind, value = outcome[0]
    if kind == "error":
        raise PlanError(value)
    if kind == "raise":
        raise value
    return value  # type: ignore[no-any-return]
