"""The training loop behind ``tiermem train``: the built-in GPT on generated data, with its
parameters, gradients and AdamW states in chunks under ``rt.manage`` and its activations under
``rt.offload_activations``, and a summary of what each tier held and moved.

::

    with tiermem.Runtime(config) as rt:
        summary = train(rt, GPTConfig(n_layer=2), steps=30, batch_size=8, lr=1e-3, policy="nvme", seed=0)
    print(summary.as_dict())

The loop is plain PyTorch (AdamW, no clipping, no scheduler) so that, with the same seed, a
run under tiermem can be compared bit for bit with the same loop without it. Seeding, which
such a comparison must reproduce: ``torch.manual_seed(seed)`` then ``GPT(config)`` on the
CPU, moved to the device; data from ``MarkovChainData(vocab_size, seq_len, seed=seed)``,
one ``batch(batch_size)`` per step; ``torch.optim.AdamW(model.parameters(), lr=lr)``, handed
to ``rt.manage(model, optimizer, plan=..., sample=..., grad_accumulation_steps=1)`` unless
``manage_states`` is off (the declared loop lets offloaded chunks step during backward).

With ``states_plan="auto"`` (the default) the planner profiles the first batch (drawn from a
second ``MarkovChainData`` with the same seed, so the loop's data is untouched; the profiling
step leaves the RNG and the model as they were, NOTE [ Profiling step ]) and chooses chunk
size, persistent chunks, buffers, homes and, under activation policy ``auto``, each block's
policy; a fixed activation policy (``policy="nvme"``, or the configuration's) is planned
around instead. The summary's ``plan`` block puts the plan's predictions next to what the run
measured (NOTE [ Predicted and measured ] in :mod:`tiermem.app.train_summary`).

"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiermem import distributed, tracing
from tiermem.app import train_ranks
from tiermem.app.models.data import MarkovChainData
from tiermem.app.models.gpt import GPT, GPTConfig
from tiermem.app.train_resume import TrainCheckpoints, run_settings
from tiermem.app.train_summary import (
    ENDURANCE_ASSUMPTION,
    drive_capacity,
    nvme_summary,
    plan_summary,
    split_peaks,
    states_summary,
)
from tiermem.interrupts import DeferredInterrupts
from tiermem.planner.errors import NoPlanFitsError
from tiermem.runtime import Runtime

__all__ = ["ENDURANCE_ASSUMPTION", "PolicyLike", "TrainSummary", "drive_capacity", "train"]

PolicyLike = str | Mapping[int | str, str] | None
"""What ``rt.offload_activations(policy=...)`` takes: a policy name, a per-block mapping, or
None for the ``[activations] policy`` of the runtime's configuration."""


log = logging.getLogger("tiermem.app.train")

_TIER_KEYS = ("capacity", "peak_bytes", "bytes_written", "bytes_read")


@dataclass(frozen=True)
class TrainSummary:
    """What one training run did. ``as_dict()`` is the ``tiermem train --json`` shape."""

    model: dict[str, Any]
    device: str
    policy: Any
    steps: int
    batch_size: int
    lr: float
    seed: int
    losses: list[float]
    step_seconds: list[float]
    optimal_loss: float
    tiers: dict[str, dict[str, int]]
    activations: dict[str, Any]
    nvme: dict[str, Any]
    model_states: dict[str, Any] | None = None
    links: dict[str, int] = dataclasses.field(default_factory=dict)
    #: NOTE [ Predicted and measured ]: the plan, its predictions and what was measured
    plan: dict[str, Any] | None = None
    #: the steps done before this run (a resume, NOTE [ Resuming a train run ]); ``losses`` are this run's
    start_step: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * int(self.model["seq_len"])

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Throughput at the median step time (the first steps' warm-up does not skew it)."""
        median = self.median_step_s
        return self.tokens_per_step / median if median > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)  # copies every list and dict
        out["loss_optimal"] = out.pop("optimal_loss")
        return {
            **out,
            "tokens_per_step": self.tokens_per_step,
            "loss_first": self.losses[0] if self.losses else None,
            "loss_last": self.losses[-1] if self.losses else None,
            "median_step_s": self.median_step_s,
            "tokens_per_s": self.tokens_per_s,
        }


def _policy_for_summary(policy: PolicyLike, rt: Runtime) -> Any:
    """The policy as JSON can hold it: a name, or a mapping with string keys."""
    if policy is None:
        return rt.config.activations.policy
    if isinstance(policy, Mapping):
        return {str(block): value for block, value in policy.items()}
    return policy


def _progress_bar() -> Any:
    """A rich progress bar on stderr (stdout stays for the summary); imported only when shown."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def train(
    rt: Runtime,
    model_config: GPTConfig,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    policy: PolicyLike = None,
    seed: int = 0,
    progress: bool = True,
    on_step: Callable[[int, float, float], None] | None = None,
    manage_states: bool = True,
    states_plan: Any = "auto",
    checkpoints: TrainCheckpoints | None = None,
) -> TrainSummary:
    """Train ``GPT(model_config)`` for ``steps`` AdamW steps on generated data.

    Forward and backward of every step run inside ``rt.offload_activations(model,
    policy=policy)``; the optimizer step runs outside it (it saves no activations).
    ``rt`` may be started or not; one that is not is started here and closed at the end.
    ``on_step(step, loss, seconds)`` is called after each step; ``progress`` draws a bar on
    stderr. The caller's global RNG state is restored afterwards. ``manage_states`` puts the
    model's states in chunks (``states_plan``: ``"auto"`` asks the planner, with the first
    batch as its sample; anything else is what ``rt.manage(plan=)`` takes, a hand plan).
    ``checkpoints`` saves the run and resumes one (``steps`` is then the total, counting the
    saved steps; NOTE [ Resuming a train run ]); they need ``manage_states``.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"train: steps and batch_size must be at least 1, got {steps} and {batch_size}")
    checkpoints = checkpoints or TrainCheckpoints()
    if checkpoints.active and not manage_states:
        raise ValueError("train: checkpoints save the managed states; they need manage_states=True (no --no-states)")
    # A signal stops the run at the next safe point (TRAPS 18): before planning, after it,
    # between steps; leaving ``with rt`` then removes every file the run made. Installed
    # before anything starts: planning's profiling step releases saved activations in
    # __del__ too, where a raised KeyboardInterrupt would be lost.
    with DeferredInterrupts() as stop, contextlib.nullcontext() if rt.running else rt:
        run = (steps, batch_size, lr, policy, seed)
        return _train(rt, model_config, run, progress, on_step, manage_states, states_plan, checkpoints, stop)


def _train(
    rt: Runtime,
    model_config: GPTConfig,
    run: tuple[int, int, float, PolicyLike, int],
    progress: bool,
    on_step: Callable[[int, float, float], None] | None,
    manage_states: bool,
    states_plan: Any,
    checkpoints: TrainCheckpoints,
    stop: DeferredInterrupts,
) -> TrainSummary:
    """``train`` on a started ``rt`` (``run``: steps, batch size, lr, policy, seed), stopping where
    ``stop`` was asked to at the next safe point."""
    steps, batch_size, lr, policy, seed = run
    stop.check()
    assert rt.resolved is not None  # set by start()
    device = torch.device(rt.resolved.device.device)
    fork_devices = [device] if device.type == "cuda" else []
    ranks = distributed.detect()  # NOTE [ Training on ranks ] in tiermem.app.train_ranks
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = GPT(model_config).to(device)
        parameters = model.num_parameters()
        sharded = train_ranks.shard(model, ranks)
        data = MarkovChainData(model_config.vocab_size, model_config.seq_len, seed=seed, stream=ranks.rank)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        checkpoints.check_before_planning(model)
        planned = manage_states and (states_plan is None or states_plan == "auto") and not sharded
        fixed_fits = True
        if planned:
            sample = _first_batch(model_config, seed, batch_size, device)
            model, optimizer, fixed_fits = _manage_planned(rt, model, optimizer, policy, sample)
        elif manage_states:
            model, optimizer = rt.manage(model, optimizer, plan=states_plan, grad_accumulation_steps=1)
        settings = run_settings(model_config, batch_size, lr, seed)
        start = checkpoints.resume_from(rt, settings, data, steps)  # refuses a checkpoint of other settings

        def after_step(done: int, losses: list[float]) -> None:
            if checkpoints.saves_after(done, steps):
                checkpoints.save(rt, settings, done, data, start.losses + losses)

        # After rt.manage (and a resume's load): the profiling step's link probes and the chunks'
        # first placement are not this run's steps; nor are they in the steps' peaks (NOTE
        # [ Predicted and measured ] rule 2).
        stop.check()
        with tracing.traced("read statistics", "phase"):  # a wait on the scheduler's thread: in a phase
            before = rt.stats().as_dict()
        for tier in rt.tiers.values():
            tier.reset_peak()
        steps_run = range(start.step, steps)
        losses, seconds = _loop(
            rt, model, data, optimizer, device, steps_run, batch_size, policy, progress, on_step, after_step, stop
        )
        with tracing.traced("read statistics", "phase"):
            after = rt.stats().as_dict()
        step_peaks = split_peaks(before, after)
        states = states_summary(rt, parameters) if manage_states else None
        as_planned = fixed_fits and not isinstance(policy, Mapping)
        plan_block = plan_summary(rt, after, step_peaks, seconds, planned, as_planned) if manage_states else None
    return TrainSummary(
        model={**dataclasses.asdict(model_config), "parameters": parameters},
        device=str(device),
        policy=_policy_for_summary(policy, rt),
        steps=len(steps_run),
        start_step=start.step,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        losses=losses,
        step_seconds=seconds,
        optimal_loss=data.optimal_loss(),
        tiers={name: {key: int(tier[key]) for key in _TIER_KEYS} for name, tier in after["tiers"].items()},
        activations=dict(after["activations"]),
        model_states=states,
        # Bytes over each link during this run's steps (chunks and activations together).
        links={
            name: int(link["bytes"] - before["links"].get(name, {}).get("bytes", 0))
            for name, link in after["links"].items()
        },
        nvme=nvme_summary(rt, before, after, seconds, len(steps_run)),
        plan=plan_block,
    )


def _first_batch(model_config: GPTConfig, seed: int, batch_size: int, device: torch.device) -> Any:
    """The planner's sample: the loop's first batch, from a twin of its data stream (same seed,
    own generator); the loop still draws that batch itself, so its data and losses are unchanged."""
    return MarkovChainData(model_config.vocab_size, model_config.seq_len, seed=seed).batch(batch_size, device)


def _manage_planned(
    rt: Runtime, model: GPT, optimizer: torch.optim.Optimizer, policy: PolicyLike, sample: Any
) -> tuple[GPT, torch.optim.Optimizer, bool]:
    """``rt.manage`` with the planner choosing (``states_plan="auto"``), around a fixed activation
    policy where one is given; the bool is whether that policy fit a plan (NOTE [ Predicted and
    measured ] rule 3)."""
    fixed = _fixed_policy(policy, rt)
    plan: Any = "auto" if fixed is None else {"block_policy": fixed}
    try:
        model, optimizer = rt.manage(model, optimizer, plan=plan, sample=sample, grad_accumulation_steps=1)
    except NoPlanFitsError as exc:
        if fixed is None:
            raise
        # Rule 3: the fixed policy fits no plan (its writes in flight need room the budget
        # lacks); plan around the fallbacks the offloader will take, run the policy asked
        # for, and let those fallbacks keep it within the capacity.
        log.warning("tiermem train: no plan fits policy %r (%s); planning around its fallbacks", fixed, exc)
        model, optimizer = _manage_around_fallbacks(rt, model, optimizer, fixed, sample)
        return model, optimizer, False
    return model, optimizer, True


def _manage_around_fallbacks(
    rt: Runtime, model: GPT, optimizer: torch.optim.Optimizer, fixed: str, sample: Any
) -> tuple[GPT, torch.optim.Optimizer]:
    """NOTE [ Predicted and measured ] rule 3: plan for ``fixed`` on the most leading blocks
    that fit and recompute on the rest (a binary search: fewer fixed blocks need less room),
    else freely."""
    from tiermem.planner.auto import plan_model  # the profile is cached: each search is cheap

    assert rt.resolved is not None
    count = len(model.blocks)
    low, high = 0, count - 1  # the plan for `count` blocks did not fit
    chosen: int | None = None
    while low <= high:  # the largest k whose plan fits
        k = (low + high) // 2
        policies = [fixed] * k + ["recompute"] * (count - k)
        try:
            plan_model(rt.registry, rt.resolved, model, optimizer, {}, sample, block_policy=policies)
            chosen, low = k, k + 1
        except NoPlanFitsError:
            high = k - 1
    plan: Any = "auto" if chosen is None else {"block_policy": [fixed] * chosen + ["recompute"] * (count - chosen)}
    return rt.manage(model, optimizer, plan=plan, sample=sample, grad_accumulation_steps=1)


def _fixed_policy(policy: PolicyLike, rt: Runtime) -> str | None:
    """The activation policy the planner must plan around: a fixed name given here or by the
    configuration; None where the planner chooses (``auto``) or a per-block mapping decides
    (NOTE [ Predicted and measured ] rule 3)."""
    name = rt.config.activations.policy if policy is None else policy
    return name if isinstance(name, str) and name != "auto" else None


def train_step(
    rt: Runtime, model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, policy: PolicyLike
) -> tuple[float, float]:
    """One optimizer step with forward and backward under ``policy``: (loss, wall seconds)."""
    start = time.perf_counter()
    traced = tracing.span("step", "step")  # the steps of `tiermem trace summary` (NOTE [ Timeline trace ])
    with rt.offload_activations(model, policy=policy):
        with tracing.traced("forward pass", "phase"):
            _, loss = model(x, y)
        assert loss is not None
        with tracing.traced("backward pass", "phase"):
            loss.backward()
    with tracing.traced("optimizer.step", "phase"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    value = loss.item()  # also waits for the device, so the time covers the whole step
    if traced is not None:
        traced.end()
    return value, time.perf_counter() - start


def _loop(
    rt: Runtime,
    model: GPT,
    data: MarkovChainData,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    steps: range,
    batch_size: int,
    policy: PolicyLike,
    progress: bool,
    on_step: Callable[[int, float, float], None] | None,
    after_step: Callable[[int, list[float]], None],
    stop: DeferredInterrupts,
) -> tuple[list[float], list[float]]:
    """The steps themselves (numbered from ``steps.start``); returns the loss and the wall seconds
    of each. ``after_step(steps done, losses)`` runs outside the timed region (a checkpoint)."""
    ranks = distributed.detect()
    losses: list[float] = []
    seconds: list[float] = []
    bar = _progress_bar() if progress else None
    task = bar.add_task("train", total=steps.stop, completed=steps.start, loss="-") if bar is not None else None
    if bar is not None:
        bar.start()
    try:
        for step in steps:
            stop.check()
            # Data generation is outside the timed region: it is not what tiermem changes.
            x, y = data.batch(batch_size, device)
            value, elapsed = train_step(rt, model, optimizer, x, y, policy)
            value = train_ranks.mean_over_ranks(value, ranks)
            losses.append(value)
            seconds.append(elapsed)
            if on_step is not None:
                on_step(step, value, elapsed)
            after_step(step + 1, losses)
            if bar is not None and task is not None:
                bar.update(task, advance=1, loss=f"{value:.4f}")
    finally:
        if bar is not None:
            bar.stop()
    return losses, seconds
