"""Planner benchmark (issue 6): the auto plan's predictions against measurements, and its step
time against hand-written plans.

Goals, on a GPT-style model on the CPU device at three device capacities (tight, middle,
roomy; fractions of what the model needs with nothing offloaded: 16 bytes a parameter plus
every saved activation):

1. the device tier's measured peak never exceeds the capacity;
2. the predicted device peak is within 10% of the measured one;
3. the predicted step time is within 15% of the measured median;
4. at the middle capacity, the auto plan's median step time is within 1.10x of the best of
   the hand-written plans (different chunk sizes, persistent chunks, buffers, homes and
   per-block activation policies), measured alternately in one run.

Each measurement is a fresh process (``--worker``); variants alternate in rounds (A B C ...
A B C ...) so the VM's throttling after ~20 s of load hits each alike. The profile is
measured once, by a first worker, into a private cache directory; every later worker takes
it from the cache (NOTE [ Profile cache ]), as a second run of a training job would. A
worker runs ``--steps`` steps and reports the median of all but the first (warm-up).

Usage::

    .venv/bin/python bench/planner.py                          # 4x256 GPT, seq 256, batch 4, 3 rounds
    .venv/bin/python bench/planner.py --rounds 1 --steps 3     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CAPACITIES = {"tight": 0.40, "middle": 0.65, "roomy": 1.15}
"""Device capacity as a fraction of what the model needs with nothing offloaded."""


def hand_plans(layers: int, chunk: int) -> dict[str, dict[str, Any]]:
    """Hand-written plans for the middle capacity: what a user tuning by hand would try.
    ``chunk``: the planner's chunk size at that capacity, so the sizes vary around it."""
    half = layers // 2
    return {
        "stream all, recompute": {"persistent_chunks": 0, "block_policy": ["recompute"] * layers},
        "stream all, host": {"persistent_chunks": 0, "block_policy": ["host"] * layers},
        "stream all, nvme": {"persistent_chunks": 0, "block_policy": ["nvme"] * layers},
        "stream all, half recompute": {
            "persistent_chunks": 0,
            "block_policy": ["recompute"] * half + ["keep"] * (layers - half),
        },
        "2 persistent, recompute": {"persistent_chunks": 2, "block_policy": ["recompute"] * layers},
        "big chunks x4, recompute": {
            "chunk_size": 4 * chunk,
            "persistent_chunks": 0,
            "block_policy": ["recompute"] * layers,
        },
        "small chunks /2, 6 buffers, recompute": {
            "chunk_size": max(chunk // 2, 1 << 20),
            "persistent_chunks": 0,
            "buffers": 6,
            "block_policy": ["recompute"] * layers,
        },
        "nvme homes, recompute": {
            "persistent_chunks": 0,
            "state_home": "nvme",
            "block_policy": ["recompute"] * layers,
        },
    }


def _model_config(args: argparse.Namespace) -> Any:
    from tiermem.app.models.gpt import GPTConfig

    return GPTConfig(
        n_layer=args.layers, d_model=args.d_model, n_head=args.heads, vocab_size=args.vocab, seq_len=args.seq
    )


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import tiermem
    from tiermem.app.models.data import MarkovChainData
    from tiermem.app.models.gpt import GPT
    from tiermem.app.train import train_step

    # TRAPS 7: on two shared cores OpenMP's spinning threads cost more than they give (measured
    # here under load ~8: a step of this model 1.5-3.8 s with 2 threads, 0.7-1.4 s with 1).
    torch.set_num_threads(args.threads)
    config = _model_config(args)
    torch.manual_seed(0)
    model = GPT(config)
    data = MarkovChainData(config.vocab_size, config.seq_len, seed=0)
    batches = [data.batch(args.batch) for _ in range(args.steps)]
    tiers = {
        "device": {"device": "cpu", "capacity": args.capacity},
        "host": {"capacity": "4GiB"},
        "nvme": {"paths": [args.path], "capacity": "8GiB"},
        "activations": {"min_bytes": args.min_bytes},
    }
    plan = json.loads(args.plan) if args.plan else "auto"
    started = time.perf_counter()
    with tiermem.Runtime(tiers) as rt:
        written = _profile_writes()
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan=plan, sample=batches[0], lr=1e-4)
        manage_s = time.perf_counter() - started
        for tier in rt.tiers.values():  # the steps' peaks, not the profiler's link probes
            tier.reset_peak()
        # A profile written now: this worker measured one (the cached one did not revalidate).
        profiled = _profile_writes() != written
        seconds = []
        for x, y in batches:
            # Policy auto: the plan's per-block policy (hand plans carry theirs too).
            _, elapsed = train_step(rt, model, optimizer, x, y, "auto")
            seconds.append(elapsed)
        stats = rt.stats().as_dict()
        result = rt.plan.as_dict()
        decision = rt.decision
    return {
        "plan": result,
        "family": decision.policies_family if decision is not None else None,
        "device_demand": decision.estimate.device_demand if decision is not None else None,
        "parts_s": dict(decision.estimate.parts_s) if decision is not None else None,
        "manage_s": manage_s,
        "step_seconds": seconds,
        "median_step_s": statistics.median(seconds[1:] if len(seconds) > 1 else seconds),
        "peak_bytes": {tier: stats["tiers"][tier]["peak_bytes"] for tier in ("device", "host", "nvme")},
        "capacity": stats["tiers"]["device"]["capacity"],
        "fallbacks": stats["activations"].get("fallbacks"),
        "threads": torch.get_num_threads(),
        "profiled": profiled,
    }


def _profile_writes() -> dict[str, float]:
    """The cached profiles' files and modification times (XDG_CACHE_HOME is the private cache)."""
    from tiermem.planner import cache

    directory = cache.cache_dir()
    if not directory.is_dir():
        return {}
    return {e.name: e.stat().st_mtime for e in os.scandir(directory) if e.name.endswith(".json")}


def _spawn(
    args: argparse.Namespace, capacity: int, plan: dict[str, Any] | None, env: dict[str, str], nvme: str
) -> dict[str, Any]:
    """One worker. ``nvme``: the NVMe path every worker shares (each Runtime makes and removes
    its own run directory there): the path is part of the profile's cache key, so a fresh
    path per worker would make every auto worker profile again instead of using the cache."""
    command = [sys.executable, __file__, "--worker", "--capacity", str(capacity), "--path", nvme]
    command += ["--layers", str(args.layers), "--d-model", str(args.d_model), "--heads", str(args.heads)]
    command += ["--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch)]
    command += ["--steps", str(args.steps), "--min-bytes", args.min_bytes, "--threads", str(args.threads)]
    if plan is not None:
        command += ["--plan", json.dumps(plan)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _machine() -> dict[str, Any]:
    import torch

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(pages / (1 << 30), 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }


OVERHEADS = ("param_s", "saved_s", "offload_s", "recompute_s", "chunk_s")
"""Per-unit costs of a managed step the profile records (NOTE [ Overhead calibration ])."""


def _first_profile(cache: str) -> dict[str, Any] | None:
    """The profile the first worker cached (the oldest, should a worker have profiled again)."""
    entries = [e for e in os.scandir(os.path.join(cache, "tiermem", "profiles")) if e.name.endswith(".json")]
    for entry in sorted(entries, key=lambda e: e.stat().st_mtime):
        with open(entry.path, encoding="utf-8") as f:
            return json.load(f)
    return None


def _predict(profile: dict[str, Any], plan: dict[str, Any]) -> float | None:
    """The cost model's step time for a plan the manager carried out (hand plans included)."""
    from tiermem.planner import Profile
    from tiermem.planner.costmodel import StatesChoice, predict
    from tiermem.planner.search import packings

    try:
        known = Profile.from_dict(profile)
        packing = packings(known, [plan["chunk_size"]])[0]
        homes = plan["state_home"]
        host_end = next((i for i, home in enumerate(homes) if home == "nvme"), len(homes))
        if packing.chunks != len(homes):
            return None  # the manager packed differently (another order): not comparable
        choice = StatesChoice(packing, plan["persistent_chunks"], plan["buffers"], host_end)
        return predict(known, choice, tuple(plan["block_policy"])).step_s
    except (ValueError, KeyError, IndexError):
        return None


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.2f}"


def _need(args: argparse.Namespace) -> tuple[int, int, int]:
    from tiermem.app.models.gpt import GPT, measure_activations

    config = _model_config(args)
    states = 16 * GPT(config).num_parameters()
    activations = measure_activations(config, args.batch).total
    return states + activations, states, activations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps per worker; the first is warm-up (default: 6)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--min-bytes", default="64KiB", help="[activations] min_bytes (default: 64KiB)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: 1, TRAPS 7)")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0

    cache = tempfile.mkdtemp(prefix="tiermem-bench-planner-cache-")
    nvme = tempfile.mkdtemp(prefix="tiermem-bench-planner-nvme-")
    try:
        return _bench(args, cache, nvme)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(nvme, ignore_errors=True)


def _bench(args: argparse.Namespace, cache: str, nvme: str) -> int:
    env = {**os.environ, "XDG_CACHE_HOME": cache, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    need, states, activations = _need(args)
    capacities = {name: int(need * fraction) for name, fraction in CAPACITIES.items()}
    machine = _machine()
    print(f"machine: {json.dumps(machine)}")
    print(
        f"model: GPT {args.layers}x{args.d_model}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, batch "
        f"{args.batch}; needs {_mib(need)} MiB with nothing offloaded (states {_mib(states)} MiB, activations "
        f"{_mib(activations)} MiB); min_bytes {args.min_bytes}; {args.steps} steps/worker, {args.rounds} rounds, "
        f"{args.threads} torch thread(s) per worker"
    )
    print("capacities: " + ", ".join(f"{k} {_mib(v)} MiB ({CAPACITIES[k]:.0%})" for k, v in capacities.items()))
    started = time.perf_counter()
    # The profile, measured once into the private cache (the later workers revalidate it).
    first = _spawn(args, capacities["middle"], None, env, nvme)
    if "error" in first:
        print(f"profiling worker failed: {first['error']}")
        return 1
    chunk = first["plan"]["chunk_size"]
    profile = _first_profile(cache)
    overheads = profile.get("overheads") if profile else None
    if overheads:
        costs = ", ".join(f"{k} {overheads[k] * 1e3:.3f} ms" for k in OVERHEADS if k in overheads)
        print(f"measured overheads (the profile's calibration): {costs}")
        steps_ms = {k: round(v * 1e3, 2) for k, v in overheads["steps_s"].items()}
        print(f"  calibration steps (median ms): {json.dumps(steps_ms)}")
    hands = hand_plans(args.layers, chunk)
    variants: list[tuple[str, str, int, dict[str, Any] | None]] = [
        (cap, "auto", capacities[cap], None) for cap in capacities
    ]
    variants += [("middle", name, capacities["middle"], plan) for name, plan in hands.items()]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(c, n): [] for c, n, _, _ in variants}
    for round_ in range(args.rounds):
        for cap, name, capacity, plan in variants:
            result = _spawn(args, capacity, plan, env, nvme)
            runs[(cap, name)].append(result)
            shown = result.get("error") or f"{result['median_step_s']:.3f}s"
            print(f"  round {round_ + 1} {cap:<6} {name:<40} {shown}", flush=True)
    total = time.perf_counter() - started
    machine_after = os.getloadavg()

    print("\n## Predicted vs measured (auto plan)")
    print(
        "| capacity | MiB | plan | device peak MiB: measured (max over runs) | predicted | pred/meas "
        "| step s: measured (median) | predicted | pred/meas | max peak <= capacity |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    differing: list[str] = []
    for cap, capacity in capacities.items():
        good = [r for r in runs[(cap, "auto")] if "error" not in r]
        if not good:
            print(f"| {cap} | {_mib(capacity)} | failed: {runs[(cap, 'auto')][0]['error']} |")
            continue
        plan = good[0]["plan"]
        if any(r["plan"] != plan for r in good):
            differing.append(cap)
        peaks = [r["peak_bytes"]["device"] for r in good]
        steps = [r["median_step_s"] for r in good]
        predicted = plan["predicted"]
        measured_peak = max(peaks)
        measured_step = statistics.median(steps)
        homes = plan["state_home"]
        described = (
            f"chunk {_mib(plan['chunk_size'])} MiB, {plan['persistent_chunks']}/{len(homes)} persistent, "
            f"{plan['buffers']} buffers, {' '.join(p[0] for p in plan['block_policy'])}"
        )
        print(
            f"| {cap} | {_mib(capacity)} | {described} | {_mib(measured_peak)} ({', '.join(_mib(p) for p in peaks)}) "
            f"| {_mib(predicted['peak_bytes']['device'])} | {predicted['peak_bytes']['device'] / measured_peak:.3f} "
            f"| {measured_step:.3f} ({', '.join(f'{s:.3f}' for s in steps)}) | {predicted['step_s']:.3f} "
            f"| {predicted['step_s'] / measured_step:.3f} | {all(p <= capacity for p in peaks)} |"
        )
    if differing:
        print(
            f"plans differ between runs at {', '.join(differing)} (a worker profiled again): per run, "
            "step s predicted / measured: "
            + "; ".join(
                f"{cap} "
                + ", ".join(
                    f"chunk {_mib(r['plan']['chunk_size'])} MiB {r['plan']['persistent_chunks']}/"
                    f"{len(r['plan']['state_home'])} {''.join(p[0] for p in r['plan']['block_policy'])} "
                    f"{r['plan']['predicted']['step_s']:.3f}/{r['median_step_s']:.3f}"
                    for r in runs[(cap, "auto")]
                    if "error" not in r
                )
                for cap in differing
            )
        )
    print("\nPredicted parts of the auto plans (ms, first run): ")
    for cap in capacities:
        good = [r for r in runs[(cap, "auto")] if "error" not in r and r.get("parts_s")]
        if good:
            print(f"  {cap}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in good[0]["parts_s"].items()))
    print("\n## Auto vs hand-written plans at the middle capacity (median of per-run medians)")
    print(
        "| plan | chunks (persistent) | step s (median) | per run | vs auto | predicted s (first profile) "
        "| pred/meas | device peak MiB (max) | fallbacks |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    auto_step = statistics.median(r["median_step_s"] for r in runs[("middle", "auto")] if "error" not in r)
    rows = []
    for cap, name, _, _ in variants:
        if cap != "middle":
            continue
        good = [r for r in runs[(cap, name)] if "error" not in r]
        if not good:
            rows.append((float("inf"), f"| {name} | failed: {runs[(cap, name)][0]['error'][:120]} | | | | | | | |"))
            continue
        median = statistics.median(r["median_step_s"] for r in good)
        per_run = ", ".join(f"{r['median_step_s']:.3f}" for r in good)
        peak = max(r["peak_bytes"]["device"] for r in good)
        fallbacks = sum(r.get("fallbacks") or 0 for r in good)
        plan = good[0]["plan"]
        chunks = f"{len(plan['state_home'])} ({plan['persistent_chunks']})"
        predicted = _predict(profile, plan) if profile else None
        shown = "- | -" if predicted is None else f"{predicted:.3f} | {predicted / median:.3f}"
        row = (
            f"| {name} | {chunks} | {median:.3f} | {per_run} | {median / auto_step:.3f} | {shown} | {_mib(peak)} "
            f"| {fallbacks} |"
        )
        rows.append((median, row))
    for _, row in sorted(rows, key=lambda r: r[0]):
        print(row)
    best_hand = min(m for (m, row) in rows if not row.startswith("| auto "))
    print(f"\nauto / best hand-written: {auto_step / best_hand:.3f}")
    print(f"wall time {total:.0f} s; load average before {machine['load_average']}, after {machine_after}")
    again = [
        f"{c} round {i + 1}"
        for (c, n), rs in runs.items()
        if n == "auto"
        for i, r in enumerate(rs)
        if r.get("profiled")
    ]
    print(
        "auto workers that profiled again (the cached profile did not revalidate, NOTE [ Profile cache ] rule 2): "
        + (", ".join(again) or "none")
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            measured = {f"{c}/{n}": v for (c, n), v in runs.items()}
            json.dump({"machine": machine, "capacities": capacities, "profile": profile, "runs": measured}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
