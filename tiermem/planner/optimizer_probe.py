"""The optimizer's time per parameter byte (rule 5 of NOTE [ Profiling step ] in
:mod:`tiermem.planner.profiler`): torch's own step over CPU copies of a sample of the
trainable parameters, or synthetic tensors of their shapes when the profile is streamed."""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tiermem.planner.streaming import STREAMED_OPTIMIZER_SAMPLE_BYTES, streamed
from tiermem.states.cpu_step import for_cpu_step

__all__ = [
    "OPTIMIZER_SAMPLE_BYTES",
    "OPTIMIZER_TIMING_BUDGET_S",
    "OPTIMIZER_TIMING_STEPS",
    "optimizer_seconds_per_byte",
]

OPTIMIZER_SAMPLE_BYTES = 32 << 20
"""Parameter bytes the optimizer timing steps over (then scaled to the model's)."""
OPTIMIZER_TIMING_STEPS = 16
OPTIMIZER_TIMING_BUDGET_S = 1.0
"""NOTE [ Profiling step ] rule 5: warm optimizer steps timed (at least two), while under this budget."""


def optimizer_seconds_per_byte(
    optimizer_class: type[torch.optim.Optimizer],
    defaults: Mapping[str, Any],
    params: Sequence[nn.Parameter],
    sample_bytes: int | None = None,
    device: torch.device | None = None,
) -> float:
    """Rule 5: the fastest warm step of ``optimizer_class`` over CPU copies of (a sample of) the
    trainable parameters, per byte: offloaded chunks step on the CPU, also beside a GPU.
    Copies: the model's own parameters and states stay untouched. Streamed (rule 8): synthetic
    tensors of the parameters' shapes and dtypes. ``sample_bytes``: the parameter bytes to time
    (default ``OPTIMIZER_SAMPLE_BYTES``; ``STREAMED_OPTIMIZER_SAMPLE_BYTES`` streamed). ``device``: the
    model's device (default the CPU); beside a GPU the settings are cleaned as an offloaded chunk's CPU
    step cleans them (NOTE [ CPU steps of offloaded chunks ]), so ``capturable=True`` is timed as the
    ``capturable=False`` step the chunks will take."""
    synthetic = streamed() is not None
    limit = sample_bytes or (STREAMED_OPTIMIZER_SAMPLE_BYTES if synthetic else OPTIMIZER_SAMPLE_BYTES)
    sample: list[torch.Tensor] = []
    total = 0
    generator = torch.Generator().manual_seed(0)  # the caller's RNG stays as it was
    for p in params:
        if not p.requires_grad:
            continue
        # a parameter larger than what is left of the sample is timed on its first rows, its other
        # dimensions kept: a factored optimizer (Adafactor) keeps other state for a matrix than
        # for a vector (NOTE [ Exact optimizer step ] rule 3)
        left = limit - total
        row = p.numel() // p.shape[0] if p.dim() > 0 and p.shape[0] else max(p.numel(), 1)
        rows = p.shape[0] if p.numel() * p.element_size() <= left else max(left // (row * p.element_size()), 1)
        shape = (rows, *p.shape[1:]) if p.dim() > 0 else p.shape
        if synthetic:
            copy = torch.randn(shape, generator=generator).to(p.dtype)
        else:
            source = p.detach()[:rows] if p.dim() > 0 else p.detach()
            copy = source.to("cpu", copy=True)
        sample.append(copy.requires_grad_(True))
        total += copy.numel() * copy.element_size()
        if total >= limit:
            break
    if not sample:
        return 0.0
    for t in sample:
        t.grad = torch.full_like(t, 1e-3)
    # A constructed optimizer's ``defaults`` can hold keys its constructor does not take (AdamW
    # records ``decoupled_weight_decay``, which only Adam accepts): pass the ones it takes.
    accepted = inspect.signature(optimizer_class.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in defaults.items() if takes_any or k in accepted}
    groups, _, _ = for_cpu_step(
        device or torch.device("cpu"), [(kwargs, sample)], {}, {}, optimizer_class=optimizer_class
    )
    settings = groups[0][0]
    optimizer = optimizer_class(sample, **settings)
    optimizer.step()  # creates the states
    # Rule 5 (TRAPS 38): the fastest of warm steps within a budget. The first steps of a process over
    # fresh memory run up to 5x slower than the steady state (torch's large temporaries are
    # new huge-page mappings each step; measured on one 32 MiB AdamW tensor: 2.4-2.5 ns/byte
    # for 7-9 steps, then 0.41-0.6), and the best of two predicted a GPT-2's 0.1 s step as 0.5 s.
    best = float("inf")
    deadline = time.perf_counter() + OPTIMIZER_TIMING_BUDGET_S
    for timed in range(OPTIMIZER_TIMING_STEPS):
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
        if timed >= 1 and time.perf_counter() >= deadline:
            break
    return best / total
