"""``plan="auto"``: profile (or take the cached profile), then search. The one place where the
planner meets a live model and Runtime; everything it calls below is pure or measures.

::

    decision, profile = plan_model(rt.registry, rt.resolved, model, torch.optim.AdamW, {"lr": 1e-3}, (x, y))
    print(decision.plan.as_dict(), decision.reasons)
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tiermem.activations.blocks import BlockSpec
from tiermem.config import Config
from tiermem.errors import PlanError
from tiermem.layout.placement import PlanRequest
from tiermem.planner import cache
from tiermem.planner.calibrate import recent_calibration
from tiermem.planner.errors import ProfileError
from tiermem.planner.optimizer_probe import OPTIMIZER_SAMPLE_BYTES, optimizer_seconds_per_byte
from tiermem.planner.probes import PROBE_BYTES, probe_links, probe_size
from tiermem.planner.profile import Profile
from tiermem.planner.profiler import Sample, measure
from tiermem.planner.search import Decision, search
from tiermem.planner.streaming import STREAMED_OPTIMIZER_SAMPLE_BYTES, streamed
from tiermem.registry import Registry
from tiermem.states.optimizer import element_wise, learn_state

log = logging.getLogger("tiermem.planner")


def free_bytes(registry: Registry) -> dict[str, int]:
    """What each tier has free now (the capacities the search must respect); while the profiling
    step streams the chunks in force (NOTE [ Profiling step ] rule 8), also the bytes they hold:
    the plan replaces them."""
    info = streamed()
    held = info.held if info is not None else {}
    return {
        name: min(registry.free_bytes(name) + held.get(name, 0), registry.tier_statistics(name).capacity)
        for name in registry.tier_names
        if name in ("device", "host", "nvme")
    }


def _optimizer_facts(
    model: nn.Module, optimizer: Any, kwargs: Mapping[str, Any]
) -> tuple[type[torch.optim.Optimizer], dict[str, Any], list[dict[str, Any]]]:
    params = list(model.parameters())
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer), dict(optimizer.defaults), list(optimizer.param_groups)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, dict(kwargs), [{"params": [p for p in params if p.requires_grad], **kwargs}]
    raise ProfileError(f"tiermem planner: cannot profile the optimizer {optimizer!r}; pass a torch.optim optimizer")


def _optimizer_key(cls: type[torch.optim.Optimizer], defaults: Mapping[str, Any]) -> dict[str, Any]:
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "defaults": dict(defaults)}


def _tier_facts(resolved: Config) -> dict[str, Any]:
    """The resolved configuration without capacities (NOTE [ Profile cache ] rule 1)."""
    facts = resolved.to_dict()
    for section in facts.values():
        section.pop("capacity", None)
    return facts


def _optimizer_sample_bytes(registry: Registry, device: torch.device, sections: int) -> int | None:
    """NOTE [ Profiling step ] rule 8: streamed, the optimizer timing's parameter bytes: with
    their gradient and ``sections`` states, what the memory tiers have free (memory the
    capacities already allow), within the streamed floor and the plain sample. None: plain."""
    if streamed() is None:
        return None
    tiers = [t for t in ("device", "host") if registry.has_tier(t) and (t == "host" or device.type == "cpu")]
    room = sum(registry.free_bytes(t) for t in tiers) // (2 + sections)
    return max(STREAMED_OPTIMIZER_SAMPLE_BYTES, min(OPTIMIZER_SAMPLE_BYTES, room))


def profile_model(
    registry: Registry,
    resolved: Config,
    model: nn.Module,
    optimizer: Any,
    optimizer_kwargs: Mapping[str, Any],
    sample: Sample,
    *,
    blocks: BlockSpec = None,
    use_cache: bool = True,
) -> Profile:
    """The model's profile: from the cache when its key matches and it revalidates, else measured."""
    cls, defaults, groups = _optimizer_facts(model, optimizer, optimizer_kwargs)
    device = torch.device(resolved.device.device)
    facts = (str(device), _tier_facts(resolved), _optimizer_key(cls, defaults))
    key = cache.profile_key(model, sample, *facts)
    info = streamed()
    if use_cache and key is not None:
        cached = cache.load(key)
        # NOTE [ Profile cache ] rule 7: a streamed profile's times are estimates, taken only
        # where this run could not measure on plain parameters either
        usable = cached is not None and (info is not None or not cached.extra.get("streamed"))
        if cached is not None and usable and cache.still_valid(cached, registry):
            log.info("tiermem planner: using the cached profile %s", key)
            return cached
    start = time.perf_counter()
    params = list(model.parameters())
    # the real state bytes per parameter, learned from the optimizer (NOTE [ Exact optimizer step ] rule 3):
    # Adafactor's factored statistics and SGD without momentum need no sections, AdamW two
    state = learn_state(cls, defaults, groups)
    sections = [state.sections(p) for p in params]
    names = state.names
    stalled = info.stalled() if info is not None else 0.0
    blocks_stats, outside, param_stats, order, modules, shared, param_block = measure(
        model,
        sample,
        sections=lambda i: sections[i],
        min_bytes=resolved.activations.min_bytes,
        device=device,
        blocks=blocks,
    )
    extra: dict[str, Any] = {}
    if info is not None:  # rule 8: what was left out of the times; the device bytes back for the probes
        extra = {"streamed": True, "fetch_wait_s": info.stalled() - stalled}
        info.release()
    size = probe_size(registry)
    # each link at the room of the tiers it passes through (NOTE [ Profiling step ] rule 5)
    links = probe_links(registry, PROBE_BYTES)
    per_byte = optimizer_seconds_per_byte(
        cls, defaults, params, _optimizer_sample_bytes(registry, device, len(names)), device=device
    )
    copy_bw = min((links[k] for k in ("device->host", "host->device") if links.get(k)), default=0.0)
    overheads = recent_calibration(registry, cls, defaults, copy_bw)
    profile = Profile(
        blocks=tuple(blocks_stats),
        outside=outside,
        params=tuple(param_stats),
        order=tuple(order),
        modules=tuple(modules),
        shared=tuple(shared),
        links=links,
        optimizer_s_per_byte=per_byte,
        cpu=device.type == "cpu",
        device=str(device),
        threads=torch.get_num_threads(),
        min_bytes=resolved.activations.min_bytes,
        key=key or "",
        profiling_s=time.perf_counter() - start,
        extra={"probe_bytes": size, **extra},
        param_block=tuple(param_block),
        overheads=overheads,
        element_wise=element_wise(cls),
    )
    if use_cache and key is not None:  # streamed too, marked so (NOTE [ Profile cache ] rule 7)
        cache.store(profile, cache.model_key(model, *facts), cache.sample_signature(sample))
    return profile


def plan_model(
    registry: Registry,
    resolved: Config,
    model: nn.Module,
    optimizer: Any,
    optimizer_kwargs: Mapping[str, Any],
    sample: Sample,
    *,
    blocks: BlockSpec = None,
    use_cache: bool = True,
    capacities: Mapping[str, int] | None = None,
    block_policy: str | Sequence[str] | None = None,
    grads_stream: bool = False,
    chunk_sizes: Sequence[int] | None = None,
) -> tuple[Decision, Profile]:
    """Profile, then search under ``capacities`` (default: what the tiers have free now);
    ``block_policy`` fixes the activation policy (NOTE [ Plan search ] rule 1); ``grads_stream``:
    the loop frees NVMe chunks' gradients as they step (NOTE [ Default placement rule ] rule 3);
    ``chunk_sizes``: the only sizes searched (``[model_states] chunk_size``; None: the planner's)."""
    profile = profile_model(
        registry, resolved, model, optimizer, optimizer_kwargs, sample, blocks=blocks, use_cache=use_cache
    )
    caps = dict(capacities) if capacities is not None else free_bytes(registry)
    decision = search(profile, caps, chunk_sizes=chunk_sizes, block_policy=block_policy, grads_stream=grads_stream)
    log.info("tiermem planner: %s; %s", decision.plan.as_dict(), "; ".join(decision.reasons))
    return decision, profile


def last_plan_request(
    registry: Registry,
    resolved: Config,
    model: nn.Module,
    optimizer: Any,
    optimizer_kwargs: Mapping[str, Any],
    block_policy: str | Sequence[str] | None,
    grads_stream: bool,
    chunk_sizes: Sequence[int] | None,
) -> tuple[PlanRequest, Decision, Callable[[tuple[Any, ...], dict[str, Any]], bool]] | None:
    """NOTE [ Profile cache ] rule 6: :func:`plan_request` from the profile of the model's last
    profiled sample, when it is cached and revalidates now, and whether a first forward's
    arguments are of that sample's shapes; None when there is none to plan from."""
    try:
        cls, defaults, _ = _optimizer_facts(model, optimizer, optimizer_kwargs)
    except ProfileError:  # not an optimizer: the model states refuse it, with their own error
        return None
    facts = (str(torch.device(resolved.device.device)), _tier_facts(resolved), _optimizer_key(cls, defaults))
    found = cache.last_profile(cache.model_key(model, *facts))
    if found is None:
        return None
    profile, sample = found
    if not cache.still_valid(profile, registry):
        return None
    try:
        decision = search(
            profile, free_bytes(registry), chunk_sizes=chunk_sizes, block_policy=block_policy, grads_stream=grads_stream
        )
    except PlanError as exc:  # the capacities changed since: the first step plans, as without a cache
        log.info("tiermem planner: the cached profile %s of the last sample plans nothing now: %s", profile.key, exc)
        return None
    log.info("tiermem planner: planning at rt.manage from the cached profile %s of the last sample", profile.key)
    log.info("tiermem planner: %s; %s", decision.plan.as_dict(), "; ".join(decision.reasons))
    return _request(decision, profile), decision, functools.partial(cache.same_batch, sample)


def plan_request(
    registry: Registry,
    resolved: Config,
    model: nn.Module,
    optimizer: Any,
    optimizer_kwargs: Mapping[str, Any],
    sample: Sample,
    *,
    block_policy: str | Sequence[str] | None,
    grads_stream: bool,
    chunk_sizes: Sequence[int] | None = None,
) -> tuple[PlanRequest, Decision]:
    """What ``rt.manage`` builds: :func:`plan_model`'s plan as a request packed in the profiled
    execution order, and the decision (its reasons and predictions)."""
    decision, profile = plan_model(
        registry,
        resolved,
        model,
        optimizer,
        optimizer_kwargs,
        sample,
        block_policy=block_policy,
        grads_stream=grads_stream,
        chunk_sizes=chunk_sizes,
    )
    return _request(decision, profile), decision


def _request(decision: Decision, profile: Profile) -> PlanRequest:
    """The decision's plan as a request packed in the profiled execution order."""
    chosen = decision.plan
    return PlanRequest(
        chosen.chunk_size,
        chosen.persistent_chunks,
        chosen.buffers,
        chosen.state_home,
        chosen.block_policy,
        chosen.predicted,
        order=profile.order,
        slice_bytes=chosen.slice_bytes,  # the slices its host prediction counts
        # where gradients wait and how many homes the host stages: what its host prediction counts too
        grad_home=chosen.grad_home,
        staged_homes=chosen.staged_homes,
    )
