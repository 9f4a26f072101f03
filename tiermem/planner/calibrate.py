"""What a managed step costs beyond plain PyTorch, measured on the real machinery.

# NOTE [ Overhead calibration ]
1. Why: the profiling step runs the model in plain PyTorch, so it never sees the work a
   tiermem step adds on the training thread: the manager's module hooks and per-parameter
   optimizer calls, the offloader registering every saved tensor, and per streamed chunk the
   fetches, evictions, pins, gradient write-back and optimizer staging, each a move handed to
   the scheduler's thread and waited for. On two shared cores that per-move cost grows with
   the machine's load (a thread wake-up waits for a time slice): ~23 ms a chunk at load ~13
   here, well under 1 ms on a quiet machine (bench/README.md, Planner). A cost model pricing
   bytes alone then predicts every plan too fast and prefers many small chunks.
2. How: a small stack of ``LAYERS`` blocks (``Linear(WIDTH, WIDTH)`` then GELU, two saved
   tensors a block) is trained in the same registry the real model will use, with the
   user's optimizer class, in seven configurations: plain PyTorch; managed with every chunk
   persistent (one chunk a layer); the same under the offloader keeping every saved tensor;
   the same offloading every saved tensor to the host; the same recomputing every block;
   managed with the whole model in one streamed chunk (host home, one buffer); and one
   streamed chunk a layer (two buffers); an eighth runs the plain model's forward alone.
   They alternate step by step (A B C ... A B C ...), so a change of load hits each alike;
   each takes the median of its steps after one warm-up round. On a CUDA device each step is
   timed from and to an idle current stream (NOTE [ Profiling step ] rule 17), so it counts
   its own kernels, not those the step before it queued.
3. What: differences of those medians, each per unit of the work it adds (never below 0):
   ``param_s`` (persistent minus plain, per parameter), ``saved_s`` (keep minus persistent,
   per saved tensor), ``offload_s`` (host minus keep, per saved tensor, less the bytes'
   copies at the measured device<->host bandwidth), ``recompute_s`` (recompute minus
   persistent minus the forward it runs again, per saved tensor of the recomputed blocks:
   checkpoint's own hooks and bookkeeping), ``chunk_s`` (one chunk a layer minus one
   chunk, per extra chunk, less the extra bytes refetched). The calibration model's tensors
   are small (16 KiB), so what it measures is the per-object cost; bytes are priced by the
   links (NOTE [ Cost model ] rule 5).
4. It changes nothing training depends on (TRAPS 10): the RNG is forked, the real model is
   not touched, and every chunk and saved tensor it made is freed before it returns. When
   the tiers have no room for it (small device or host budgets: the LoRA tests' 10% of a
   22 MiB base left 2 MiB of each, and the calibration charged 0 ms per chunk), it is freed and
   runs again at half the width, down to ``MIN_WIDTH`` (what it measures is per object, and
   16 x 16 layers' chunks still take a page each: ~0.3 MiB of device and host at the least).
   Only when even that does not fit is the fallback ``Overheads()``: nothing measured, nothing
   charged (``measured`` False), and the planner prices bytes only.
5. How many steps: as many as the spread asks for, ``MIN_STEPS`` to ``STEPS``. After an odd
   count of timed rounds (3, 5, 7) it stops when, for every configuration, the three steps
   around the median lie within ``SPREAD`` of it: one more step moves the median at most to
   one of those neighbours, so the median is known to about that much. A steady machine
   stops early (three timed rounds of eight are half the calibration's steps); a loaded one,
   whose steps scatter by 2-5x (measured here at load ~7), runs all ``STEPS``, as before,
   because its medians need them.
6. Once per process and a while: the planner takes a calibration made in this process less
   than ``REUSE_S`` ago on the same device, for the same optimizer and settings, where the tiers
   have at least the room they had then (:func:`recent_calibration`): the per-object costs it
   measures are this machine's at about this load, and a second ``rt.manage`` (a teacher and a
   student, a reference and a policy, a quick experiment run again) need not pay 1-3 s for them
   again. Older ones are measured afresh, since the load they price moves. :func:`calibrate`
   itself always measures.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tiermem.activations.offloader import ActivationCounters, ActivationOffloader
from tiermem.errors import PlanError
from tiermem.planner.profile import Overheads
from tiermem.planner.streaming import finish_queued_compute
from tiermem.registry import Registry
from tiermem.states.manager import ModelStates
from tiermem.states.optimizer import SUPPORTED
from tiermem.units import ALIGNMENT

log = logging.getLogger("tiermem.planner")

LAYERS = 16
WIDTH = 64
MIN_WIDTH = 16
"""Rule 4: the narrowest calibration model tried when the tiers have no room for a wider one."""
BATCH = 64
STEPS = 7
"""Rule 5: the most timed steps per configuration (after one warm-up round)."""
MIN_STEPS = 3
"""Rule 5: the fewest timed steps per configuration, the fewest a median can drop an outlier from."""
SPREAD = 0.2
"""Rule 5: how far (relative to the median) the three steps around it may lie for the median to be kept."""
REUSE_S = 120.0
"""Rule 6: how long a calibration serves the planner again in the same process."""

#: rule 6: (device, optimizer, its settings) -> (when, device and host room then, what was measured)
_recent: dict[tuple[str, type, tuple[tuple[str, str], ...]], tuple[float, int, int, Overheads]] = {}
_recent_lock = threading.Lock()


class _Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _kwargs(optimizer_class: type[torch.optim.Optimizer], defaults: Mapping[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(optimizer_class.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: v for k, v in defaults.items() if takes_any or k in accepted}


def _saved_count(model: nn.Module, x: torch.Tensor) -> int:
    """Distinct storages autograd saves, parameters left out (as the offloader counts them)."""
    protected = {id(p.untyped_storage()) for p in model.parameters()}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        if key not in protected:
            seen.add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    del loss
    return len(seen)


def calibrate(
    registry: Registry,
    optimizer_class: type[torch.optim.Optimizer],
    defaults: Mapping[str, Any],
    memcpy_bw: float = 0.0,
) -> Overheads:
    """Rules 2-4: the per-unit overheads of a managed step on this machine, now."""
    if optimizer_class not in SUPPORTED:
        optimizer_class, defaults = torch.optim.AdamW, {"lr": 1e-3}
    kwargs = _kwargs(optimizer_class, defaults)
    width = WIDTH
    while True:
        try:
            return _measure(registry, optimizer_class, kwargs, memcpy_bw, width)
        except (MemoryError, PlanError) as exc:  # the tiers have no room for it (rule 4)
            if width // 2 < MIN_WIDTH:
                log.info("tiermem planner: no room to calibrate the managed step's overheads (%s); not charged", exc)
                return Overheads()
            width //= 2


def recent_calibration(
    registry: Registry,
    optimizer_class: type[torch.optim.Optimizer],
    defaults: Mapping[str, Any],
    memcpy_bw: float = 0.0,
) -> Overheads:
    """Rule 6: :func:`calibrate`'s result, taken from one made in this process less than
    ``REUSE_S`` ago where it applies here."""
    key = (str(registry.device), optimizer_class, tuple(sorted((k, repr(v)) for k, v in defaults.items())))
    room = (registry.free_bytes("device"), registry.free_bytes("host"))
    now = time.monotonic()
    with _recent_lock:
        entry = _recent.get(key)
    # A measurement that found room then finds it again where the tiers have at least as much free.
    if entry is not None and now - entry[0] < REUSE_S and room[0] >= entry[1] and room[1] >= entry[2]:
        log.info("tiermem planner: overheads calibrated %.0f s ago in this process reused", now - entry[0])
        return entry[3]
    overheads = calibrate(registry, optimizer_class, defaults, memcpy_bw)
    if overheads.measured:
        with _recent_lock:
            _recent[key] = (time.monotonic(), *room, overheads)
    return overheads


def _measure(
    registry: Registry,
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    memcpy_bw: float,
    width: int,
) -> Overheads:
    """Rules 2 and 3 with a calibration model of ``width``; raises when the tiers have no room
    for it, everything it made freed."""
    device = registry.device
    layer_bytes = (width * width + width) * 4
    per_layer = -(-(layer_bytes + 64) // ALIGNMENT) * ALIGNMENT  # one layer's parameters a chunk
    whole = per_layer * LAYERS
    persistent = {"chunk_size": per_layer, "persistent_chunks": LAYERS, "buffers": 0}
    plans: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "persistent": persistent,
        "one_chunk": {"chunk_size": whole, "persistent_chunks": 0, "buffers": 1, "state_home": "host"},
        "chunks": {"chunk_size": per_layer, "persistent_chunks": 0, "buffers": 2, "state_home": "host"},
    }
    # (configuration, model, offloader policy): the persistent model serves three (rule 2)
    configs = [
        ("plain", "plain", None),
        ("persistent", "persistent", None),
        ("keep", "persistent", "keep"),
        ("host", "persistent", "host"),
        ("recompute", "persistent", "recompute"),
        ("forward", "plain", "forward only"),
        ("one_chunk", "one_chunk", None),
        ("chunks", "chunks", None),
    ]
    counters = ActivationCounters()
    managed: list[ModelStates] = []
    with contextlib.ExitStack() as stack, torch.random.fork_rng(devices=[]):
        stack.callback(lambda: [states.close() for states in managed])
        torch.manual_seed(0)
        x = torch.randn(BATCH, width, device=device)
        saved = 0
        built: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
        for name, plan in plans.items():
            model = _Net(width).to(device)
            if plan is None:
                saved = _saved_count(model, x)
                built[name] = (model, optimizer_class(model.parameters(), **kwargs))
            else:
                states = ModelStates(registry, model, optimizer_class, plan=plan, optimizer_kwargs=kwargs)
                managed.append(states)
                built[name] = (model, states.optimizer)
        steps = {name: _step(registry, counters, *built[model], x, policy) for name, model, policy in configs}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for round_ in range(STEPS + 1):
            for name, step in steps.items():
                finish_queued_compute(device)  # CUDA: each step's own kernels, not the last one's
                start = time.perf_counter()
                step()
                finish_queued_compute(device)
                if round_:
                    times[name].append(time.perf_counter() - start)
            if MIN_STEPS <= round_ < STEPS and round_ % 2 and all(_settled(values) for values in times.values()):
                break
    median = {name: statistics.median(values) for name, values in times.items()}
    params = 2 * LAYERS
    bw = memcpy_bw or float("inf")
    offload_bytes = 2 * saved * BATCH * width * 4  # to the host and back
    # With two buffers, backward refetches all but the two chunks still cached.
    refetch_bytes = (LAYERS - 2) * per_layer
    return Overheads(
        param_s=max(0.0, median["persistent"] - median["plain"]) / params,
        saved_s=max(0.0, median["keep"] - median["persistent"]) / max(saved, 1),
        offload_s=max(0.0, median["host"] - median["keep"] - offload_bytes / bw) / max(saved, 1),
        recompute_s=max(0.0, median["recompute"] - median["persistent"] - median["forward"]) / max(saved, 1),
        chunk_s=max(0.0, median["chunks"] - median["one_chunk"] - refetch_bytes / bw) / (LAYERS - 1),
        measured=True,
        steps_s=median,
    )


def _settled(values: list[float]) -> bool:
    """Rule 5: whether the three timed steps around the median of ``values`` (an odd count) lie
    within ``SPREAD`` of it, so that more steps would not move the median further than that."""
    middle = sorted(values)[len(values) // 2 - 1 : len(values) // 2 + 2]
    return middle[2] - middle[0] <= SPREAD * middle[1]


def _step(
    registry: Registry,
    counters: ActivationCounters,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    policy: str | None,
) -> Callable[[], None]:
    """One training step as ``tiermem.app.train.train_step`` runs it (an offloader per step)."""

    def step() -> None:
        if policy == "forward only":  # the forward a recomputed block runs again
            model(x)
            return
        context: Any = contextlib.nullcontext()
        if policy is not None:
            context = ActivationOffloader(registry, model, counters, policy=policy, default_policy=policy, min_bytes=1)
        with context:
            loss = model(x)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step
