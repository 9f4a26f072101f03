"""What ``Runtime.manage`` asks of the planner and of the sharded manager, apart from the
``Runtime`` class: the plan request built from a profile, the first-step planner's sample, and
``manage`` of an FSDP2-sharded model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tiermem.config import Config
from tiermem.layout.placement import PlanRequest
from tiermem.registry import Registry
from tiermem.states import StatesUsageError
from tiermem.states.sharded import ShardedModelStates

__all__ = ["manage_sharded", "plan_first_step", "plan_request"]


def plan_request(
    registry: Registry,
    resolved: Config,
    optimizer: Any,
    optimizer_kwargs: Mapping[str, Any],
    block_policy: Any,
    streams: bool,
    model: torch.nn.Module,
    sample: Any,
) -> tuple[PlanRequest, Any]:
    """Profile ``model`` on ``sample`` (or its cached profile) and search: the plan to build, and
    the planner's decision (its reasons and predictions)."""
    from tiermem.planner.auto import plan_model  # the planner only when asked

    decision, profile = plan_model(
        registry,
        resolved,
        model,
        optimizer,
        optimizer_kwargs,
        sample,
        block_policy=block_policy,
        grads_stream=streams,
    )
    chosen = decision.plan
    request = PlanRequest(
        chosen.chunk_size,
        chosen.persistent_chunks,
        chosen.buffers,
        chosen.state_home,
        chosen.block_policy,
        chosen.predicted,
        order=profile.order,
    )
    return request, decision


def plan_first_step(
    planner: Callable[[torch.nn.Module, Any], PlanRequest],
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> PlanRequest:
    """NOTE [ Model-state rules ] rule 9: the first forward's arguments as the sample."""
    from tiermem.planner.profiler import Batch

    return planner(model, Batch(args, kwargs) if kwargs else args)


def manage_sharded(
    registry: Registry,
    resolved: Config,
    model: torch.nn.Module,
    optimizer: Any,
    plan: Any,
    sample: Any,
    optimizer_kwargs: Mapping[str, Any],
    declared: tuple[int | None, float | None, bool, torch.dtype | None],
) -> ShardedModelStates:
    """``manage`` of a model whose parameters FSDP2's ``fully_shard`` made DTensors: each rank's
    optimizer states in chunks, the parameters left to FSDP2 (NOTE [ Sharded model states ] in
    ``tiermem.states.sharded``). Collective: every rank calls it for the same model."""
    if sample is not None:
        raise StatesUsageError(
            "tiermem manage: sample= (profiling a step to plan) is not yet for FSDP2-sharded models; leave it "
            "out: their optimizer states are placed from each rank's free bytes"
        )
    grad_accumulation_steps, clip_grad_norm, keep_gradients, param_dtype = declared
    return ShardedModelStates(
        registry,
        model,
        optimizer,
        plan=None if plan == "auto" else plan,
        optimizer_kwargs=optimizer_kwargs,
        keep_gradients=keep_gradients,
        param_dtype=param_dtype,
        grad_accumulation_steps=grad_accumulation_steps,
        clip_grad_norm=clip_grad_norm,
        host_adopts_pageable=not resolved.host.pinned,
    )
