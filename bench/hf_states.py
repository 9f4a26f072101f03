"""Hugging Face GPT-2 at a tenth of its state bytes: plain PyTorch, tiermem's declared loop and the
plain (undeclared) loop, side by side, with where each second of the step goes.

The case users bring: ``GPT2LMHeadModel`` built from a config (no download; 210M parameters, 3.2
GiB of fp32 AdamW state at ``--size 210M``), ``rt.manage(model, torch.optim.AdamW)`` alone (the
plan ``"auto"``: the first step profiles and plans, the plan's activation policy applied by
``rt.manage``), device and host capacities each ``--fraction`` (default 10% at 210M) of the state bytes, the
rest on NVMe under ``--path``. Modes, each a fresh process, the order reversed every round (A B C,
C B A, ...):

- ``plain``: plain PyTorch, everything in RAM; the reference losses and the compute floor;
- ``declared``: ``rt.manage(..., grad_accumulation_steps=1, keep_gradients=False)``: each chunk
  steps as its backward ends (NOTE [ Declared steps ]);
- ``undeclared``: ``rt.manage(...)`` and the README loop as written (``.grad`` readable between
  backward and the step, NOTE [ Stored gradients ]).

The model is built as users build it (whole in RAM, then managed), so ``ru_maxrss`` is the whole
process's from construction to exit. The tiermem processes share one private profile cache, so
the first one profiles and the others plan from its profile; ``--warmup`` steps (the first one
plans) are not timed. Three by default: plain PyTorch's own steps settle only by its third (glibc
raises its mmap threshold as large blocks are freed, so its early steps map and zero their
gradients afresh: 6.4, 4.2 then 3.2 s at 210M on a 2-vCPU Intel VM, and 3.0-3.5 s after), and
timing its second step made plain's median a second slower than its steady step. The timed
steps run inside ``rt.trace``: each step's compute, waits by cause, busy links, the share of
moves hidden, the share of each phase the disk was busy and the bytes it moved come from
``tiermem trace summary`` (a phase whose disk is busy nearly throughout is bound by it; the disk
time of its bytes at the rates measured around the process, against its length, says whether the
busy disk ran at that speed); the CPU seconds of each kind of thread
(training, the step thread, the I/O pools, OpenMP's workers) from ``/proc``; and where the CPUs
and the training thread were during the steps (``/proc/stat``, ``/proc/thread-self/schedstat``):
the share of the machine's CPU time left idle, and the training thread's seconds a step on a CPU,
ready but waiting for one, and asleep; over the steps and per phase (forward, backward, the
optimizer step, with each kind of thread's CPU seconds in it). On 2 cores a loop that is slower
than plain PyTorch while no move is waited for shows it there: plain PyTorch's training thread
barely sleeps, and every second it sleeps in a parallel region its OpenMP partner idles too.

The floor is max(plain PyTorch's step, the disk time of the mode's NVMe bytes per step at the
read and write bandwidth ``tiermem bench io`` measures on ``--path``), each process against its own:
plain PyTorch's step in that round, and the mean of a ``tiermem bench io`` run just before the
process and one just after it. A shared VM's disk drifts more than the goals' margins within a run
(``tiermem bench io`` before one run's three rounds read 2,452, 1,977 and 1,692 MiB/s; fio's reads
30 s apart 1,355 and 1,796 MiB/s), so a floor measured once, or once a round, judges a process
against a disk it did not have, either way. A mode's ratio is the median of its rounds'.
Goals: declared <= 1.25x the floor, undeclared <= 1.35x, ``ru_maxrss`` <= 0.45x plain's; the
losses of every process bitwise equal (the run fails otherwise).

    .venv/bin/python bench/hf_states.py                                   # 210M, 3 rounds
    .venv/bin/python bench/hf_states.py --size tiny --rounds 1 --steps 2 --io-size 64MiB  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path
import first_step
import machine  # bench/machine.py: run as `python bench/NAME.py`, the folder is on sys.path
from first_step import STATE_BYTES_PER_PARAM, hf_gpt2
from states_headline import disk_around, nvme_moved

#: the sizes of bench/first_step.py (the same models), and one for a smoke run
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "seq": 32, "batch": 2},
    **first_step.SIZES,
}
#: device and host capacity each, as a fraction of the state bytes: the issue's 10%, and for the
#: small models what their default placement needs (chunks are at least 64 KiB, 16 MiB at 30M)
FRACTIONS = {"tiny": 0.30, "30M": 0.30, "210M": 0.10}
MODES = ("plain", "declared", "undeclared")
GOALS = {"declared": 1.25, "undeclared": 1.35}
RSS_GOAL = 0.45


def _clock() -> tuple[float, float]:
    """Wall seconds and CPU seconds of the whole process (the I/O and step threads' included)."""
    return time.perf_counter(), time.process_time()


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each live thread of this process, by native thread id (``/proc``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return seconds


def machine_cpu() -> tuple[int, int]:
    """The machine's CPU time so far in clock ticks, all CPUs together: (idle, total). Idle counts
    ``idle`` and ``iowait`` of ``/proc/stat`` (a CPU with nothing to run, waiting on I/O or not)."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks[:8])  # guest time is already in user and nice


def training_schedule() -> tuple[float, float, float, float]:
    """Seconds the calling thread has so far run on a CPU (its CPU clock) and waited, ready, for
    one (``/proc/thread-self/schedstat``); wall time less both is the time it slept. Then the wall
    clock read right after, and how long the reading took: a window starting at that clock counts
    a preemption inside the reading as ready time it does not span, so its three figures add up to
    its wall time within that much (:func:`schedule_between`'s ``reading_s``). The run time is not
    schedstat's: for the thread reading it, that lags by up to a scheduler tick."""
    start = time.perf_counter()
    with open("/proc/thread-self/schedstat", encoding="ascii") as f:
        wait_ns = int(f.read().split()[1])
    run = time.thread_time()
    clock = time.perf_counter()
    return run, wait_ns / 1e9, clock, clock - start


def schedule_between(
    wall: float,
    machine: tuple[tuple[int, int], tuple[int, int]],
    training: tuple[tuple[float, float, float, float], tuple[float, float, float, float]],
) -> dict[str, float]:
    """Where ``wall`` seconds of steps went for the CPUs and the training thread: the share of the
    machine's CPU time left idle, and the training thread's seconds on a CPU, ready but waiting for
    one, and asleep (waiting for the GIL, for OpenMP's other thread at the end of a parallel
    region, for a move); ``reading_s``: how far the three may add up beyond ``wall`` (the start's
    reading, :func:`training_schedule`)."""
    (idle0, total0), (idle1, total1) = machine
    (run0, ready0, _, reading), (run1, ready1, _, _) = training
    run, ready = run1 - run0, ready1 - ready0
    return {
        "wall_s": wall,
        "cpu_idle": (idle1 - idle0) / max(total1 - total0, 1),
        "on_cpu_s": run,
        "ready_s": ready,
        "asleep_s": max(wall - run - ready, 0.0),
        "reading_s": reading,
    }


#: the phases of a step, as the timed steps mark them
PHASES = ("forward", "backward", "optimizer.step")


Snapshot = tuple[dict[int, float], tuple[int, int], tuple[float, float, float, float]]


def snapshot() -> Snapshot:
    """What a phase's figures are read between: each thread's CPU seconds, the machine's idle and
    total ticks and the training thread's :func:`training_schedule`, whose clock is the phase's
    (read right after its figures, so that its seconds add up to the wall time within the reading)."""
    threads, machine_ticks = thread_cpu(), machine_cpu()
    return threads, machine_ticks, training_schedule()


class PhaseSchedule:
    """:func:`schedule_between` and :func:`cpu_by_thread` per phase of the timed steps: each phase
    summed over the steps from the snapshots taken at its start and end, read out a step's."""

    def __init__(self) -> None:
        self._sums: dict[str, dict[str, Any]] = {}

    def add(self, marks: list[Snapshot]) -> None:
        """One step's snapshots: at its start and at the end of each of :data:`PHASES`."""
        for name, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
            total = self._sums.setdefault(
                name, {"wall": 0.0, "idle": 0, "ticks": 0, "run": 0.0, "ready": 0.0, "reading": 0.0, "threads": {}}
            )
            (threads0, machine0, training0), (threads1, machine1, training1) = start, end
            total["reading"] += training0[3]
            total["wall"] += training1[2] - training0[2]
            total["idle"] += machine1[0] - machine0[0]
            total["ticks"] += machine1[1] - machine0[1]
            total["run"] += training1[0] - training0[0]
            total["ready"] += training1[1] - training0[1]
            for thread, spent in cpu_by_thread(threads0, threads1).items():
                total["threads"][thread] = total["threads"].get(thread, 0.0) + spent

    def per_step(self, steps: int) -> dict[str, dict[str, Any]]:
        """Per phase: the schedule figures (seconds a step; the idle share over all its steps) and
        the CPU seconds a step of each kind of thread."""
        phases: dict[str, dict[str, Any]] = {}
        for name, total in self._sums.items():
            figures = schedule_between(
                total["wall"],
                ((0, 0), (total["idle"], total["ticks"])),
                ((0.0, 0.0, 0.0, total["reading"]), (total["run"], total["ready"], 0.0, 0.0)),
            )
            phases[name] = {k: v / steps if k.endswith("_s") else v for k, v in figures.items()}
            threads = sorted(total["threads"].items(), key=lambda kv: -kv[1])
            phases[name]["cpu_by_thread"] = {thread: spent / steps for thread, spent in threads}
        return phases


def cpu_by_thread(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds each kind of thread spent between ``before`` and ``after``: the training
    thread, each named Python thread pool (its number dropped), and threads Python does not know
    (OpenMP's workers); threads that ended in between are in neither (the process total is)."""
    main = threading.main_thread().native_id
    names = {t.native_id: t.name for t in threading.enumerate()}
    spent: dict[str, float] = {}
    for tid, total in after.items():
        name = "training" if tid == main else re.sub(r"[_-]?\d+(_\d+)?$", "", names.get(tid, "")) or "native"
        spent[name] = spent.get(name, 0.0) + total - before.get(tid, 0.0)
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def _huge_faults() -> int:
    """Transparent huge pages the kernel has allocated at a fault so far, machine-wide (``/proc/vmstat``
    counts them for no single process; 0 where it has no such counter)."""
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                name, _, value = line.partition(" ")
                if name == "thp_fault_alloc":
                    return int(value)
    except OSError:
        pass
    return 0


def _faulted_bytes() -> int:
    """Bytes of fresh anonymous pages the kernel zeroed and mapped at a fault so far (memory handed back to the system
    and taken again): the process's minor faults, each huge page's fault counted at its 2 MiB (huge pages are
    counted machine-wide: read on an otherwise idle machine). With transparent huge pages on, one fault of
    ``ru_minflt`` can be 512 small pages' worth: counted as small pages, a 210M GPT-2 step's faults read 445 MiB
    where ``clear_page_erms`` took 17-22% of the steady steps' CPU samples."""
    huge = _huge_faults()
    small = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return huge * (2 << 20) + max(small - huge, 0) * resource.getpagesize()


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's steps in this process: step and CPU seconds, losses, NVMe bytes per step, the
    trace's breakdown per timed step and ``ru_maxrss``."""
    import torch

    import tiermem
    from tiermem import tracing
    from tiermem.app import trace_report

    if args.threads:
        torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    model = hf_gpt2(size)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = STATE_BYTES_PER_PARAM * params
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]), generator=generator)
        for _ in range(args.warmup + args.steps)
    ]
    result: dict[str, Any] = {"mode": mode, "params": params, "state_bytes": state_bytes}
    walls: list[float] = []
    cpus: list[float] = []
    losses: list[float] = []
    phases = PhaseSchedule()

    def step(model: Any, optimizer: Any, tokens: torch.Tensor) -> None:
        timed = len(walls) >= args.warmup
        wall, cpu = _clock()
        marks = [snapshot()] if timed else []
        with tracing.traced("step", "step"):
            with tracing.traced("forward pass", "phase"):
                loss = model(input_ids=tokens, labels=tokens).loss
            marks += [snapshot()] if timed else []
            with tracing.traced("backward pass", "phase"):  # a declared loop steps its chunks in here
                loss.backward()
            marks += [snapshot()] if timed else []
            with tracing.traced("optimizer.step", "phase"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        marks += [snapshot()] if timed else []
        now_wall, now_cpu = _clock()
        if timed:
            phases.add(marks)
        walls.append(now_wall - wall)
        cpus.append(now_cpu - cpu)
        losses.append(loss.item())

    if mode == "plain":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for tokens in batches[: args.warmup]:
            step(model, optimizer, tokens)
        cpu_before, faults_before = thread_cpu(), _faulted_bytes()
        machine_before, training_before = machine_cpu(), training_schedule()
        for tokens in batches[args.warmup :]:
            step(model, optimizer, tokens)
        machine_after, training_after = machine_cpu(), training_schedule()
        threads, faults = cpu_by_thread(cpu_before, thread_cpu()), _faulted_bytes() - faults_before
    else:
        capacity = int(state_bytes * (args.fraction or FRACTIONS[args.size]))
        tiers = {
            "device": {"device": "cpu", "capacity": capacity},
            "host": {"capacity": capacity},
            "nvme": {"paths": [args.path], "capacity": 2 * state_bytes + (1 << 30)},
        }
        declared = {"grad_accumulation_steps": 1, "keep_gradients": False} if mode == "declared" else {}
        trace_path = os.path.join(args.path, f"{mode}.trace.json")
        with tiermem.Runtime(tiers) as rt:
            model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-4, **declared)
            for tokens in batches[: args.warmup]:  # the first step profiles, plans and re-packs
                step(model, optimizer, tokens)
            before = rt.stats().as_dict()["links"]
            cpu_before, faults_before = thread_cpu(), _faulted_bytes()
            machine_before, training_before = machine_cpu(), training_schedule()
            with rt.trace(trace_path):
                for tokens in batches[args.warmup :]:
                    step(model, optimizer, tokens)
            machine_after, training_after = machine_cpu(), training_schedule()
            threads, faults = cpu_by_thread(cpu_before, thread_cpu()), _faulted_bytes() - faults_before
            after = rt.stats().as_dict()["links"]
            steps = [s.as_dict() for s in trace_report.summarize(trace_report.load(trace_path))]
            os.remove(trace_path)
            plan = rt.plan.as_dict() if rt.plan is not None else {}
            tier_stats = rt.stats().as_dict()["tiers"]
            states = rt.stats().as_dict()["model_states"]
        moved = {k: (v["bytes"] - before.get(k, {"bytes": 0})["bytes"]) // args.steps for k, v in after.items()}
        read, written = nvme_moved(moved)
        result.update(
            capacity=capacity,
            nvme_read=read,
            nvme_written=written,
            moved=moved,
            where_the_time_goes=steps,
            plan={k: plan.get(k) for k in ("chunk_size", "persistent_chunks", "buffers", "block_policy")},
            homes={h: (plan.get("state_home") or []).count(h) for h in ("device", "host", "nvme")},
            predicted_step_s=(plan.get("predicted") or {}).get("step_s"),
            tier_peaks={k: v["peak_bytes"] for k, v in tier_stats.items()},
            chunk_steps={k: states[k] for k in states if "steps" in k},
        )
    result.update(
        step_s=walls[args.warmup :],
        cpu_s=cpus[args.warmup :],
        cpu_by_thread={name: spent / args.steps for name, spent in threads.items()},  # a step's
        fault_mib=faults / args.steps / (1 << 20),  # a step's
        schedule={  # the training thread's seconds a step; the machine's idle share of the steps
            name: value / args.steps if name.endswith("_s") else value
            for name, value in schedule_between(
                training_after[2] - training_before[2],
                (machine_before, machine_after),
                (training_before, training_after),
            ).items()
        },
        phase_schedule=phases.per_step(args.steps),
        first_step_s=walls[0],
        losses=losses,
        ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    return result


def _run(mode: str, args: argparse.Namespace, cache_home: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", mode, *_passed(args)]
    env = {**os.environ, "XDG_CACHE_HOME": cache_home}
    out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    for entry in os.listdir(args.path):  # a failed worker's files too
        target = os.path.join(args.path, entry)
        shutil.rmtree(target, ignore_errors=True) if os.path.isdir(target) else os.remove(target)
    if out.returncode != 0:
        raise SystemExit(f"bench/hf_states.py: the {mode} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_on_measured_disk(mode: str, args: argparse.Namespace, cache_home: str) -> dict[str, Any]:
    """A tiermem mode's process between two ``tiermem bench io`` runs on its path; ``disk``: the
    disk it had, their mean read and write bytes/s (the floor, see above), and both runs."""
    result, result_disk = disk_around(args.path, args.io_size, lambda: _run(mode, args, cache_home))
    result["disk"] = result_disk
    return result


def _passed(args: argparse.Namespace) -> list[str]:
    names = ("size", "steps", "warmup", "fraction", "threads", "path")
    return [f"--{name}={getattr(args, name)}" for name in names]


def _median_threads(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per kind of thread, the median over ``runs`` of its CPU seconds a step."""
    names = sorted({name for r in runs for name in r["cpu_by_thread"]})
    medians = {name: statistics.median(r["cpu_by_thread"].get(name, 0.0) for r in runs) for name in names}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))


def _median_schedule(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per figure of :func:`schedule_between`, its median over ``runs``."""
    return {name: statistics.median(r["schedule"][name] for r in runs) for name in runs[0]["schedule"]}


def _median_phases(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per phase of :data:`PHASES`, its schedule figures and threads' CPU seconds, medians over ``runs``."""
    medians: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        figures = [r["phase_schedule"][phase] for r in runs]
        medians[phase] = {
            name: statistics.median(f[name] for f in figures) for name in figures[0] if name != "cpu_by_thread"
        }
        medians[phase]["cpu_by_thread"] = _median_threads([{"cpu_by_thread": f["cpu_by_thread"]} for f in figures])
    return medians


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per mode against the floor and plain PyTorch's RSS; refuses runs whose losses differ.
    ``runs[mode][i]`` ran in round ``i``; a tiermem mode's run holds the disk it had (``disk``:
    :func:`run_on_measured_disk`)."""
    reference = runs["plain"][0]["losses"]
    for mode, mode_runs in runs.items():
        for r in mode_runs:
            if r["losses"] != reference:
                raise SystemExit(
                    f"bench/hf_states.py: the {mode} losses {r['losses']} differ from plain PyTorch's {reference}"
                )
    plain_s = statistics.median(t for r in runs["plain"] for t in r["step_s"])
    plain_rss = statistics.median(r["ru_maxrss"] for r in runs["plain"])
    modes: dict[str, Any] = {
        "plain": {
            "step_s": plain_s,
            "cpu_s": statistics.median(t for r in runs["plain"] for t in r["cpu_s"]),
            "cpu_by_thread": _median_threads(runs["plain"]),
            "fault_mib": statistics.median(r["fault_mib"] for r in runs["plain"]),
            "schedule": _median_schedule(runs["plain"]),
            "phase_schedule": _median_phases(runs["plain"]),
            "ru_maxrss": plain_rss,
        }
    }
    for mode in MODES[1:]:
        mode_runs = runs[mode]
        step_s = statistics.median(t for r in mode_runs for t in r["step_s"])
        read = statistics.median(r["nvme_read"] for r in mode_runs)
        written = statistics.median(r["nvme_written"] for r in mode_runs)
        rounds = [_against_floor(r, plain, r["disk"]) for r, plain in zip(mode_runs, runs["plain"], strict=True)]
        steps = [s for r in mode_runs for s in r["where_the_time_goes"]]
        causes = sorted({cause for s in steps for cause in s["waits"]})
        rss = statistics.median(r["ru_maxrss"] for r in mode_runs)
        modes[mode] = {
            "step_s": step_s,
            "cpu_s": statistics.median(t for r in mode_runs for t in r["cpu_s"]),
            "cpu_by_thread": _median_threads(mode_runs),
            "fault_mib": statistics.median(r["fault_mib"] for r in mode_runs),
            "schedule": _median_schedule(mode_runs),
            "phase_schedule": _median_phases(mode_runs),
            "nvme_read": read,
            "nvme_written": written,
            "rounds": rounds,
            "disk_s": statistics.median(r["disk_s"] for r in rounds),
            "floor_s": statistics.median(r["floor_s"] for r in rounds),
            "step_over_floor": statistics.median(r["step_over_floor"] for r in rounds),
            "goal": GOALS[mode],
            "compute_s": statistics.median(s["compute_s"] for s in steps) if steps else None,
            "wait_s": statistics.median(s["wait_s"] for s in steps) if steps else None,
            "waits": {c: statistics.median(s["waits"].get(c, 0.0) for s in steps) for c in causes},
            "phases": {
                p: statistics.median(s["phases"].get(p, 0.0) for s in steps)
                for p in sorted({p for s in steps for p in s["phases"]})
            },
            # per phase, the share of it some move read or wrote the disk (tiermem trace summary)
            "disk_busy": {
                p: statistics.median(
                    s["storage_busy"].get(p, 0.0) / s["phases"][p] for s in steps if s["phases"].get(p)
                )
                for p in sorted({p for s in steps for p in s["phases"] if s["phases"][p]})
            },
            # per phase, the disk time of the bytes it moved (at the rates of the disk its process
            # had) over its length: near its disk busy share, the disk ran at its measured speed
            "disk_time_share": _disk_time_share(mode_runs),
            "hidden": statistics.median(s["overlap"] for s in steps if s["overlap"] is not None)
            if any(s["overlap"] is not None for s in steps)
            else None,
            "ru_maxrss": rss,
            "rss_over_plain": rss / plain_rss,
            "plan": mode_runs[-1]["plan"],
            "homes": mode_runs[-1]["homes"],
            "predicted_step_s": mode_runs[-1]["predicted_step_s"],
            "tier_peaks": mode_runs[-1]["tier_peaks"],
            "capacity": mode_runs[-1]["capacity"],
        }
    disks = {mode: [r["disk"] for r in runs[mode]] for mode in MODES[1:]}
    return {"disk_bytes_per_s": disks, "modes": modes, "losses_bitwise_equal": True}


def _disk_time_share(mode_runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per phase, the median over the timed steps of the disk time of the storage bytes the phase
    moved, at the read and write rates of the disk its process had, over the phase's length."""
    shares: dict[str, list[float]] = {}
    for run in mode_runs:
        disk = run["disk"]
        for step in run["where_the_time_goes"]:
            for phase, seconds in step["phases"].items():
                if seconds:
                    disk_s = step["storage_read"].get(phase, 0) / disk["read"]
                    disk_s += step["storage_written"].get(phase, 0) / disk["write"]
                    shares.setdefault(phase, []).append(disk_s / seconds)
    return {phase: statistics.median(values) for phase, values in sorted(shares.items())}


def _against_floor(run: dict[str, Any], plain: dict[str, Any], disk: dict[str, float]) -> dict[str, float]:
    """One round of a mode against its floor: that round's plain PyTorch step, and the disk the
    mode's process had."""
    step_s, plain_s = statistics.median(run["step_s"]), statistics.median(plain["step_s"])
    disk_s = run["nvme_read"] / disk["read"] + run["nvme_written"] / disk["write"]
    floor = max(plain_s, disk_s)
    return {"step_s": step_s, "plain_s": plain_s, "disk_s": disk_s, "floor_s": floor, "step_over_floor": step_s / floor}


def _report(summary: dict[str, Any], say: Any) -> None:
    mib = 2**20
    modes = summary["modes"]
    plain = modes["plain"]
    for mode, disks in summary["disk_bytes_per_s"].items():
        reads = " / ".join(f"{d['read'] / mib:.0f}" for d in disks)
        writes = " / ".join(f"{d['write'] / mib:.0f}" for d in disks)
        say(f"bench io around each {mode} process (mean of before and after): read {reads} MiB/s, write {writes} MiB/s")
    say(
        "plain PyTorch "
        f"{plain['step_s']:.2f} s a step ({plain['cpu_s']:.1f} CPU s: {_threads(plain)}), ru_maxrss "
        f"{plain['ru_maxrss'] / mib:.0f} MiB, {plain['fault_mib']:.0f} MiB of pages faulted in a step; "
        f"{_schedule(plain)}"
    )
    _report_phases(plain, say)
    for mode in MODES[1:]:
        m = modes[mode]
        say(
            f"{mode}: {m['step_s']:.2f} s a step ({m['cpu_s']:.1f} CPU s); floor {m['floor_s']:.2f} s (disk "
            f"{m['disk_s']:.2f} s for {m['nvme_read'] / mib:.0f} MiB read + {m['nvme_written'] / mib:.0f} MiB "
            f"written): {m['step_over_floor']:.2f}x (goal <= {m['goal']}x; rounds "
            f"{', '.join(_round(r) for r in m['rounds'])}); ru_maxrss {m['ru_maxrss'] / mib:.0f} MiB "
            f"= {m['rss_over_plain']:.2f}x plain (goal <= {RSS_GOAL}x)"
        )
        if m["compute_s"] is not None:
            waits = ", ".join(f"{c} {s:.2f}" for c, s in sorted(m["waits"].items(), key=lambda kv: -kv[1])[:4])
            phases = ", ".join(
                f"{p.split()[0]} {s:.2f} (disk busy {m['disk_busy'].get(p, 0.0):.0%}, its bytes' disk time "
                f"{m['disk_time_share'].get(p, 0.0):.0%})"
                for p, s in m["phases"].items()
            )
            hidden = "-" if m["hidden"] is None else f"{m['hidden']:.0%}"
            say(
                f"  where it goes (medians): compute {m['compute_s']:.2f} s + waits {m['wait_s']:.2f} s ({waits}); "
                f"{phases}; {hidden} of the moves hidden"
            )
        say(f"  CPU s a step by thread: {_threads(m)}; {m['fault_mib']:.0f} MiB of pages faulted in (zeroed) a step")
        say(f"  {_schedule(m)}")
        _report_phases(m, say)
        say(f"  plan {m['plan']}, homes {m['homes']}, predicted step {m['predicted_step_s']}")
    say("losses bitwise equal in every process")


def _round(r: dict[str, float]) -> str:
    """A round against its floor: the ratio, and the floor's bound (plain PyTorch's step or the disk)."""
    bound = "disk" if r["disk_s"] >= r["plain_s"] else "plain"
    return f"{r['step_over_floor']:.2f}x of {r['floor_s']:.2f} s ({bound})"


def _schedule(mode: dict[str, Any]) -> str:
    sched = mode["schedule"]
    return (
        f"CPUs idle {sched['cpu_idle']:.1%} of the steps; the training thread a step on a CPU "
        f"{sched['on_cpu_s']:.2f} s, ready for one {sched['ready_s']:.2f} s, asleep {sched['asleep_s']:.2f} s"
    )


def _report_phases(mode: dict[str, Any], say: Any) -> None:
    for phase, figures in mode["phase_schedule"].items():
        say(
            f"  {phase} {figures['wall_s']:.2f} s a step: CPUs idle {figures['cpu_idle']:.1%}; the training "
            f"thread on a CPU {figures['on_cpu_s']:.2f} s, ready {figures['ready_s']:.2f} s, asleep "
            f"{figures['asleep_s']:.2f} s; CPU s by thread: {_threads(figures)}"
        )


def _threads(mode: dict[str, Any]) -> str:
    return ", ".join(f"{name} {s:.2f}" for name, s in mode["cpu_by_thread"].items() if s >= 0.005) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="210M")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps (the first plans; plain PyTorch settles by its third)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--fraction", type=float, default=0.0, help="device and host capacity / state bytes (0: 10%% at 210M)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--path", type=arguments.directory, default=None, help="NVMe directory (default: a private one under $TMPDIR)"
    )
    parser.add_argument("--io-size", default="1GiB", help="bytes per tiermem bench io pass for the floor")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_mode(args.worker, args)))
        return 0
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the first step of a managed model profiles and plans")
    args.path = tempfile.mkdtemp(prefix="tiermem-bench-hf-states-", dir=args.path)
    cache_home = tempfile.mkdtemp(prefix="tiermem-bench-hf-states-cache-")
    say = (lambda *a: None) if args.json else print
    facts = machine.facts()
    say(f"machine: {facts}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    try:
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                r = _run(mode, args, cache_home) if mode == "plain" else run_on_measured_disk(mode, args, cache_home)
                runs[mode].append(r)
                say(
                    f"round {round_ + 1} {mode}: first step {r['first_step_s']:.1f} s, steps "
                    f"{', '.join(f'{t:.2f}' for t in r['step_s'])} s, ru_maxrss {r['ru_maxrss'] / 2**20:.0f} MiB"
                )
    finally:
        shutil.rmtree(args.path, ignore_errors=True)
        shutil.rmtree(cache_home, ignore_errors=True)
    summary = {"machine": facts, "settings": {k: v for k, v in vars(args).items() if k != "worker"}}
    summary.update(summarize(runs))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _report(summary, say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
