"""What the profiling step is told when it runs on streamed chunks, not on plain parameters
(NOTE [ Profiling step ] rule 8, in :mod:`tiermem.planner.profiler`; the mechanism is NOTE
[ Streamed first-step profiling ] in :mod:`tiermem.states.streamed_profile`).

Pure: a context variable and the clock the profiler reads through it (on CUDA, after the device's
current stream ran its queued kernels). The model-state manager sets it around the planner call;
the profiler, the optimizer timing and the search's capacities read it. Nothing here imports the
registry, a tier or the manager.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

STREAMED_OPTIMIZER_SAMPLE_BYTES = 4 << 20
"""The fewest parameter bytes the optimizer timing steps over when the states are streamed
(synthetic tensors: the parameters' bytes are in chunks, not readable as plain tensors); more
where the memory tiers have the room free. Four times this in memory with a gradient and two
AdamW states: part of the stated constant of the memory promise."""


@dataclass(frozen=True)
class Streaming:
    """The profiling step runs with the model's chunks in place, streamed through the device
    budget by the manager's pool."""

    #: cumulative seconds the training thread has waited for chunk fetches (DEMAND) so far
    stalled: Callable[[], float]
    #: bytes per tier the chunks in force hold: free for the plan, which replaces them
    held: Mapping[str, int] = field(default_factory=dict)
    #: give the streamed chunks' device bytes back (after the passes, before the link probes)
    release: Callable[[], None] = lambda: None
    #: whether the pass may recompute its blocks: False where the device cannot hold a recomputed
    #: block's chunk beside the ones backward pins (NOTE [ Profiling step ] rule 14)
    recompute: bool = True


_STREAMING: ContextVar[Streaming | None] = ContextVar("tiermem_streamed_profiling", default=None)


@contextlib.contextmanager
def streaming(info: Streaming) -> Iterator[Streaming]:
    """Profile (and plan) under streamed chunks inside this block."""
    token = _STREAMING.set(info)
    try:
        yield info
    finally:
        _STREAMING.reset(token)


def streamed() -> Streaming | None:
    """The streamed profiling in force, or None (plain parameters)."""
    return _STREAMING.get()


def finish_queued_compute(device: torch.device | None) -> None:
    """Wait for the kernels queued on ``device``'s current stream where it is a CUDA device (NOTE
    [ Profiling step ] rule 17): a time read after this covers the work, not its queueing. Nothing
    on the CPU, where an op has run when it returns. The device is named, not taken as the current
    one: a rank's device need not be current where it was never set."""
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def profiling_clock(device: torch.device | None = None) -> Callable[[], float]:
    """A clock for one profiling pass: ``time.perf_counter()`` less the fetch waits so far, so its
    differences are compute time, the I/O waits of streamed chunks left out (rule 8; plain
    profiling has none). On a CUDA ``device`` each reading first waits for its current stream's
    queued kernels (rule 17). The streamed profiling in force is taken where the clock is made, not
    at each reading: on CUDA backward's marks are read on autograd's device threads, which do not
    see the context variable."""
    info = _STREAMING.get()

    def clock() -> float:
        finish_queued_compute(device)
        now = time.perf_counter()
        return now - info.stalled() if info is not None else now

    return clock
