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
to ``rt.manage(model, optimizer, plan=states_plan, grad_accumulation_steps=1)`` unless
``manage_states`` is off (the declared loop lets offloaded chunks step during backward).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.models.data import MarkovChainData
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.runtime import Runtime

__all__ = ["ENDURANCE_ASSUMPTION", "PolicyLike", "TrainSummary", "drive_capacity", "train"]

PolicyLike = str | Mapping[int | str, str] | None
"""What ``rt.offload_activations(policy=...)`` takes: a policy name, a per-block mapping, or
None for the ``[activations] policy`` of the runtime's configuration."""

ENDURANCE_ASSUMPTION = (
    "drive writes per day = NVMe bytes written per second of training x 86400 / drive capacity; "
    "drive capacity is the total size of the filesystem(s) holding the NVMe path(s), taken to be "
    "one drive each; training runs around the clock at this run's pace; only bytes that reached "
    "the NVMe tier count (cancelled writes do not), not filesystem or flash write amplification"
)

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
        return {
            "model": dict(self.model),
            "device": self.device,
            "policy": self.policy,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "tokens_per_step": self.tokens_per_step,
            "lr": self.lr,
            "seed": self.seed,
            "losses": list(self.losses),
            "loss_first": self.losses[0] if self.losses else None,
            "loss_last": self.losses[-1] if self.losses else None,
            "loss_optimal": self.optimal_loss,
            "step_seconds": list(self.step_seconds),
            "median_step_s": self.median_step_s,
            "tokens_per_s": self.tokens_per_s,
            "tiers": {name: dict(values) for name, values in self.tiers.items()},
            "activations": dict(self.activations),
            "model_states": None if self.model_states is None else dict(self.model_states),
            "links": dict(self.links),
            "nvme": dict(self.nvme),
        }


def drive_capacity(paths: tuple[str, ...] | list[str]) -> int:
    """Total bytes of the distinct filesystems holding ``paths`` (two paths on one count once).

    A path that does not exist (any more) is measured at its nearest existing ancestor, which
    is where its files would live.
    """
    totals: dict[int, int] = {}
    for path in paths:
        probe = os.path.abspath(path)
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        totals.setdefault(os.stat(probe).st_dev, shutil.disk_usage(probe).total)
    return sum(totals.values())


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
    states_plan: Any = None,
) -> TrainSummary:
    """Train ``GPT(model_config)`` for ``steps`` AdamW steps on generated data.

    Forward and backward of every step run inside ``rt.offload_activations(model,
    policy=policy)``; the optimizer step runs outside it (it saves no activations).
    ``rt`` may be started or not; one that is not is started here and closed at the end.
    ``on_step(step, loss, seconds)`` is called after each step; ``progress`` draws a bar on
    stderr. The caller's global RNG state is restored afterwards. ``manage_states`` puts the
    model's states in chunks (``states_plan``: what ``rt.manage(plan=)`` takes).
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"train: steps and batch_size must be at least 1, got {steps} and {batch_size}")
    if not rt.running:
        with rt:
            return train(
                rt,
                model_config,
                steps=steps,
                batch_size=batch_size,
                lr=lr,
                policy=policy,
                seed=seed,
                progress=progress,
                on_step=on_step,
                manage_states=manage_states,
                states_plan=states_plan,
            )
    assert rt.resolved is not None  # set by start()
    device = torch.device(rt.resolved.device.device)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = GPT(model_config).to(device)
        data = MarkovChainData(model_config.vocab_size, model_config.seq_len, seed=seed)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        parameters = model.num_parameters()
        before = rt.stats().as_dict()
        if manage_states:
            model, optimizer = rt.manage(model, optimizer, plan=states_plan, grad_accumulation_steps=1)
        losses, seconds = _loop(rt, model, data, optimizer, device, steps, batch_size, policy, progress, on_step)
        after = rt.stats().as_dict()
        states = _states_summary(rt, parameters) if manage_states else None
    nvme_written = after["tiers"]["nvme"]["bytes_written"] - before["tiers"]["nvme"]["bytes_written"]
    train_s = sum(seconds)
    drive = drive_capacity(rt.resolved.nvme.paths)
    per_s = nvme_written / train_s if train_s > 0 else 0.0
    return TrainSummary(
        model={**dataclasses.asdict(model_config), "parameters": parameters},
        device=str(device),
        policy=_policy_for_summary(policy, rt),
        steps=steps,
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
        nvme={
            "paths": list(rt.resolved.nvme.paths),
            # Deltas over this run's steps, so a runtime used before does not inflate them.
            "bytes_written": nvme_written,
            "bytes_written_per_step": nvme_written / steps,
            "bytes_written_per_s": per_s,
            "drive_bytes": drive,
            "drive_writes_per_day": per_s * 86400 / drive if drive else None,
            "assumption": ENDURANCE_ASSUMPTION,
        },
    )


def _states_summary(rt: Runtime, parameters: int) -> dict[str, Any]:
    """Where the chunks lived: the plan in force and the homes of its chunks."""
    plan = rt.plan.as_dict()
    homes = plan["state_home"]
    persistent = plan["persistent_chunks"]
    return {
        "parameters": parameters,
        "state_bytes": parameters * 16,  # fp32 parameter, gradient, AdamW exp_avg and exp_avg_sq
        "chunks": len(homes),
        "chunk_size": plan["chunk_size"],
        "persistent_chunks": persistent,
        "buffers": plan["buffers"],
        "homes": {tier: homes[persistent:].count(tier) for tier in ("host", "nvme") if tier in homes[persistent:]},
        "peak_device_chunk_bytes": rt.registry.peak_resident_bytes("chunk", "device"),
    }


def train_step(
    rt: Runtime, model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, policy: PolicyLike
) -> tuple[float, float]:
    """One optimizer step with forward and backward under ``policy``: (loss, wall seconds)."""
    start = time.perf_counter()
    with rt.offload_activations(model, policy=policy):
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.item()  # also waits for the device, so the time covers the whole step
    return value, time.perf_counter() - start


def _loop(
    rt: Runtime,
    model: GPT,
    data: MarkovChainData,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    steps: int,
    batch_size: int,
    policy: PolicyLike,
    progress: bool,
    on_step: Callable[[int, float, float], None] | None,
) -> tuple[list[float], list[float]]:
    """The steps themselves; returns the loss and the wall seconds of each."""
    losses: list[float] = []
    seconds: list[float] = []
    bar = _progress_bar() if progress else None
    task = bar.add_task("train", total=steps, loss="-") if bar is not None else None
    if bar is not None:
        bar.start()
    stop = _StopBetweenSteps()
    try:
        for step in range(steps):
            if stop.requested:
                # Raised here, between steps, where nothing is half-done: leaving ``with rt``
                # then removes every file the run made.
                raise KeyboardInterrupt
            # Data generation is outside the timed region: it is not what tiermem changes.
            x, y = data.batch(batch_size, device)
            value, elapsed = train_step(rt, model, optimizer, x, y, policy)
            losses.append(value)
            seconds.append(elapsed)
            if on_step is not None:
                on_step(step, value, elapsed)
            if bar is not None and task is not None:
                bar.update(task, advance=1, loss=f"{value:.4f}")
    finally:
        stop.restore()
        if bar is not None:
            bar.stop()
    return losses, seconds


class _StopBetweenSteps:
    """Ctrl-C and SIGTERM ask the loop to stop after the current step.

    A KeyboardInterrupt raised wherever the signal lands can be lost: inside a
    ``__del__`` (a saved activation released by autograd) Python only prints it. So the
    first signal sets a flag the loop checks between steps; a second one interrupts at
    once. Main thread only (where Python runs signal handlers).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, _signum: int, _frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
