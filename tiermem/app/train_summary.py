"""What a ``tiermem train`` run reports beside its losses: the plan against what was measured,
where the chunks lived, and what the NVMe writes mean for the drive's endurance.

# NOTE [ Predicted and measured ]
1. ``predicted``: the planner's step time and peak bytes per tier (``rt.plan.predicted``);
   ``null`` for a hand plan (nothing predicted it).
2. ``measured``: the median step time, and each tier's peak bytes over the training steps
   alone, as the plan predicts them: the tiers' peaks are reset (``Tier.reset_peak``) once
   ``rt.manage`` has placed the chunks. The ``tiers`` block keeps each tier's peak over the
   Runtime's whole life, which includes the profiling step's link probes and the profile
   cache's check (32 MiB, or a quarter of the least free tier when less): on a tier the plan
   leaves empty that is the probes' bytes.
3. ``ratios``: predicted / measured (1.0 is exact; ``null`` where either is missing or 0).
   The planner predicts the plan's activation policy; with a per-block mapping given by hand
   the loop runs another one, and ``activations_as_planned`` is false. So it is when a fixed
   policy (``policy="nvme"``) fits no plan under the budget: the planner then plans around
   what the offloader's own fallbacks will run (the fixed policy for as many leading blocks
   as fit, recompute from there on, as NOTE [ Activation fallbacks ] does when the device is
   full), or freely when not even one block fits; the loop runs the fixed policy, and those
   fallbacks keep it within the capacity. (A free plan may keep every chunk persistent for a
   policy that needs no device room, leaving none for the policy the loop runs.)
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
from collections.abc import Mapping
from typing import Any

from tiermem.runtime import Runtime

__all__ = ["ENDURANCE_ASSUMPTION", "drive_capacity", "finite"]

ENDURANCE_ASSUMPTION = (
    "drive writes per day = NVMe bytes written per second of training x 86400 / drive capacity; "
    "drive capacity is the total size of the filesystem(s) holding the NVMe path(s), taken to be "
    "one drive each; training runs around the clock at this run's pace; only bytes that reached "
    "the NVMe tier count (cancelled writes do not), not filesystem or flash write amplification"
)


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


def split_peaks(before: Mapping[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Each tier's peak bytes over the training steps alone (the tiers were reset before them),
    returned; ``after``'s tiers block gets back the Runtime's whole-life peak (NOTE [ Predicted
    and measured ] rule 2)."""
    step_peaks = {name: int(tier["peak_bytes"]) for name, tier in after["tiers"].items()}
    for name, tier in after["tiers"].items():  # the tiers block keeps the Runtime's whole life
        tier["peak_bytes"] = max(tier["peak_bytes"], before["tiers"][name]["peak_bytes"])
    return step_peaks


def nvme_summary(
    rt: Runtime, before: Mapping[str, Any], after: Mapping[str, Any], seconds: list[float], steps: int
) -> dict[str, Any]:
    """The NVMe tier's writes over this run's steps and what they mean for the drive's endurance."""
    assert rt.resolved is not None
    nvme_written = after["tiers"]["nvme"]["bytes_written"] - before["tiers"]["nvme"]["bytes_written"]
    train_s = sum(seconds)
    drive = drive_capacity(rt.resolved.nvme.paths)
    per_s = nvme_written / train_s if train_s > 0 else 0.0
    return {
        "paths": list(rt.resolved.nvme.paths),
        # Deltas over this run's steps, so a runtime used before does not inflate them.
        "bytes_written": nvme_written,
        "bytes_written_per_step": nvme_written / steps,
        "bytes_written_per_s": per_s,
        "drive_bytes": drive,
        "drive_writes_per_day": per_s * 86400 / drive if drive else None,
        "assumption": ENDURANCE_ASSUMPTION,
    }


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured if predicted is not None and measured else None


def plan_summary(
    rt: Runtime,
    stats: Mapping[str, Any],
    step_peaks: Mapping[str, int],
    seconds: list[float],
    planned: bool,
    as_planned: bool,
) -> dict[str, Any]:
    """NOTE [ Predicted and measured ]: the plan's decisions, predictions, measurements, ratios.
    ``step_peaks``: each tier's peak bytes over the training steps (rule 2)."""
    assert rt.plan is not None  # rt.manage ran
    plan = rt.plan.as_dict()
    predicted = plan.pop("predicted")
    decision = rt.decision if planned else None
    measured_step = statistics.median(seconds) if seconds else None
    measured_peaks = {tier: int(step_peaks[tier]) for tier in ("device", "host", "nvme")}
    predicted_peaks = predicted.get("peak_bytes") or {}
    return {
        "source": "planner" if decision is not None else "hand",
        **plan,
        "activations_as_planned": as_planned,
        "reasons": list(decision.reasons) if decision is not None else [],
        "capacities": {tier: int(stats["tiers"][tier]["capacity"]) for tier in ("device", "host", "nvme")},
        "predicted": predicted,
        "measured": {"step_s": measured_step, "peak_bytes": measured_peaks},
        "ratios": {
            "step_s": _ratio(predicted.get("step_s"), measured_step),
            "peak_bytes": {tier: _ratio(predicted_peaks.get(tier), measured_peaks[tier]) for tier in measured_peaks},
        },
    }


def states_summary(rt: Runtime, parameters: int) -> dict[str, Any]:
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


def finite(value: Any) -> Any:
    """``value`` (a summary) as strict JSON holds it: a diverged (NaN, infinite) number becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
