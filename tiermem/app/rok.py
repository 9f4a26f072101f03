"""The recompute-offload-keep (ROK) curve of TBA: step time against peak activation memory.

For each batch size, each policy (keep, recompute, host, nvme) trains the built-in GPT for a
few steps in a fresh Runtime and records the median step time and the peak bytes of saved
activations resident on the device (tiermem's own accounting, so the points are comparable
in one process). Policies alternate within a batch size in rotating order, so throttling
on a small shared machine does not favour whichever runs first.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tiermem.app.models.gpt import GPT, GPTConfig
from tiermem.app.train import train_step
from tiermem.config import Config
from tiermem.interrupts import DeferredInterrupts
from tiermem.runtime import Runtime

ROK_POLICIES = ("keep", "recompute", "host", "nvme")


@dataclass(frozen=True)
class RokPoint:
    policy: str
    batch_size: int
    step_s: float
    peak_activation_bytes: int
    captured_bytes_per_step: int
    nvme_written_per_step: int


def measure_point(
    config: Config,
    model_config: GPTConfig,
    policy: str,
    batch_size: int,
    steps: int,
    seed: int = 0,
    stop: DeferredInterrupts | None = None,
) -> RokPoint:
    """Train ``steps`` steps (after one warm-up) under ``policy`` in a fresh Runtime; ``stop``
    (open) is checked between steps, so a Ctrl-C that lands in a step is not lost."""
    torch.manual_seed(seed)
    model = GPT(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, model_config.vocab_size, (batch_size, model_config.seq_len + 1), generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with Runtime(config) as rt:

        def step() -> float:
            if stop is not None:
                stop.check()
            return train_step(rt, model, optimizer, x, y, policy)[1]

        step()
        _settle(rt)
        before = rt.stats().as_dict()["activations"]
        times = [step() for _ in range(steps)]
        _settle(rt)  # bytes_written counts landed writes: let the last ones land
        after = rt.stats().as_dict()["activations"]
    return RokPoint(
        policy=policy,
        batch_size=batch_size,
        step_s=statistics.median(times),
        peak_activation_bytes=after["peak_resident_bytes"],
        captured_bytes_per_step=(after["captured_bytes"] - before["captured_bytes"]) // steps,
        nvme_written_per_step=(after["bytes_written"]["nvme"] - before["bytes_written"]["nvme"]) // steps,
    )


def _settle(rt: Runtime, timeout_s: float = 30.0) -> None:
    """Wait until no move is queued or in flight (bounded: a hang is not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        scheduler = rt.scheduler.statistics()
        if not any(scheduler.inflight_bytes.values()) and not any(scheduler.queued.values()):
            return
        time.sleep(0.001)


def sweep(
    config: Config,
    model_config: GPTConfig,
    batch_sizes: Sequence[int],
    *,
    policies: Sequence[str] = ROK_POLICIES,
    steps: int = 2,
    on_point: Callable[[RokPoint], None] | None = None,
) -> list[RokPoint]:
    """Every (policy, batch size) point, policies rotating within each batch size. Ctrl-C or
    SIGTERM stops the sweep between steps (TRAPS 18) with a KeyboardInterrupt."""
    points = []
    with DeferredInterrupts() as stop:
        for index, batch_size in enumerate(batch_sizes):
            shift = index % len(policies)
            for policy in [*policies[shift:], *policies[:shift]]:
                point = measure_point(config, model_config, policy, batch_size, steps, stop=stop)
                points.append(point)
                if on_point is not None:
                    on_point(point)
    return points


def write_csv(points: Sequence[RokPoint], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(RokPoint)])
        writer.writeheader()
        for point in points:
            writer.writerow(dataclasses.asdict(point))


def plot(points: Sequence[RokPoint], path: Path, title: str) -> None:
    """Step time (y) against peak activation memory (x), one series per policy."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here or in CI
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for policy in sorted({p.policy for p in points}):
        series = sorted((p for p in points if p.policy == policy), key=lambda p: p.batch_size)
        xs = [p.peak_activation_bytes / 2**20 for p in series]
        ys = [p.step_s for p in series]
        axes.plot(xs, ys, marker="o", label=policy)
        for point, x, y in zip(series, xs, ys, strict=True):
            axes.annotate(f"b{point.batch_size}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    axes.set_xlabel("peak saved activations on the device (MiB)")
    axes.set_ylabel("median step time (s)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
