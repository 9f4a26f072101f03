"""What a disk running at full rate costs the compute beside it: plain PyTorch's step alone, and
while fio reads and writes the disk, side by side.

An offloading step's floor is max(compute, disk time of its bytes), with the compute measured on an
idle disk. But I/O is not free to the cores that compute: each request costs CPU time in the guest
(the submitting process, the kernel's block layer and interrupts), which on 2 cores a step that
uses both cannot hide. This bench measures that cost with code
that is not tiermem's: the HF GPT-2 of ``bench/hf_states.py`` (``--size``, default 210M) trained
with plain PyTorch, everything in RAM, each round once alone and once while fio runs a mixed
read/write load on ``--path`` (O_DIRECT, libaio, 1 MiB blocks, ``--iodepth`` deep, ``--read-share``
of the requests reads: about the declared 210M step's mix), each a fresh process, the order reversed
every round (A B, B A, ...).

Per round, each phase's median (forward, backward, optimizer step) and the loaded / alone ratio;
the ratios' medians over the rounds; what fio moved (MiB/s read and written) and its own CPU; and
the compute lost per GiB fio moved: (loaded step - alone step) / (GiB moved during a loaded step).
The machine's CPU time by kind (``/proc/stat``: user, system, irq, softirq, steal, idle) over each
process's timed steps shows where the lost time went. No goal: a measurement that bounds others
(bench/README.md's 210M row). fio is required (``apt-get install fio``).

    .venv/bin/python bench/compute_under_io.py                      # 210M, 3 rounds
    .venv/bin/python bench/compute_under_io.py --size 30M --rounds 1 --steps 2 --warmup 1  # smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path
import machine
from first_step import SIZES, hf_gpt2

MODES = ("alone", "loaded")
PHASES = ("forward", "backward", "optimizer.step")
#: ``/proc/stat``'s first eight columns, in its order
CPU_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_ticks() -> list[int]:
    """The machine's CPU time so far by kind (:data:`CPU_KINDS`), all CPUs together, in clock ticks."""
    with open("/proc/stat", encoding="ascii") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Plain PyTorch steps in this process: per timed step each phase's wall seconds and the step's
    process CPU seconds, the losses, and the machine's CPU seconds by kind over the timed steps."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    model = hf_gpt2(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    step_s: list[float] = []
    cpu_s: list[float] = []
    losses: list[float] = []
    before: list[int] = []
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            before = machine_ticks()
        tokens = torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]), generator=generator)
        cpu, marks = time.process_time(), [time.perf_counter()]
        loss = model(input_ids=tokens, labels=tokens).loss
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        losses.append(loss.item())
        if index >= args.warmup:
            for phase, (start, end) in zip(PHASES, itertools.pairwise(marks), strict=True):
                phases[phase].append(end - start)
            step_s.append(marks[-1] - marks[0])
            cpu_s.append(time.process_time() - cpu)
    after = machine_ticks()
    hertz = os.sysconf("SC_CLK_TCK")
    machine_s = {kind: (b - a) / hertz / args.steps for kind, a, b in zip(CPU_KINDS, before, after, strict=True)}
    return {"phases": phases, "step_s": step_s, "cpu_s": cpu_s, "losses": losses, "machine_cpu_s": machine_s}


def fio_command(fio: str, directory: str, args: argparse.Namespace) -> list[str]:
    """The load: fio's mixed read/write on a file under ``directory`` until it is interrupted."""
    return [
        fio,
        "--name=load",
        f"--directory={directory}",
        "--ioengine=libaio",
        "--direct=1",
        "--bs=1m",
        f"--size={args.fio_size}",
        f"--iodepth={args.iodepth}",
        "--rw=randrw",
        f"--rwmixread={args.read_share}",
        "--time_based",
        "--runtime=86400",
        "--output-format=json",
    ]


def fio_report(output: str) -> dict[str, float]:
    """fio's JSON (after the line fio prints as it stops on a signal): MiB/s read and written over
    its run, and its CPU as a share of one CPU (user + system)."""
    start = output.find("{")
    if start < 0:
        raise SystemExit(f"bench/compute_under_io.py: fio printed no report:\n{output[-2000:]}")
    jobs = json.loads(output[start:])["jobs"]
    return {
        "read_mib_s": sum(j["read"]["bw_bytes"] for j in jobs) / 2**20,
        "write_mib_s": sum(j["write"]["bw_bytes"] for j in jobs) / 2**20,
        "cpu_share": sum(j["usr_cpu"] + j["sys_cpu"] for j in jobs) / 100,
    }


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", *_passed(args)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench/compute_under_io.py: a training worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh training process; under ``loaded``, fio runs from before its start to its end, on
    a private folder under ``--path`` that goes with it."""
    if mode == "alone":
        return _worker(args)
    directory = tempfile.mkdtemp(prefix="tiermem-bench-load-", dir=args.path)
    try:
        fio = subprocess.Popen(
            fio_command(args.fio, directory, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            time.sleep(args.settle)  # fio lays out its file and reaches its rate
            if fio.poll() is not None:
                raise SystemExit(f"bench/compute_under_io.py: fio stopped at once:\n{fio.communicate()[0][-2000:]}")
            result = _worker(args)
        finally:
            if fio.poll() is None:
                fio.send_signal(signal.SIGINT)  # fio stops and prints its report
            try:
                output = fio.communicate(timeout=60)[0]
            except subprocess.TimeoutExpired:
                fio.kill()  # never left running: its file goes with the folder below
                output = fio.communicate()[0]
        result["fio"] = fio_report(output)
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _passed(args: argparse.Namespace) -> list[str]:
    return [f"--{name}={getattr(args, name)}" for name in ("size", "steps", "warmup", "threads")]


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per round each mode's phase medians and loaded / alone ratios, and their medians over the
    rounds; refuses runs whose losses differ (the load must not change what is computed)."""
    reference = rounds[0]["alone"]["losses"]
    for r in rounds:
        for mode in MODES:
            if r[mode]["losses"] != reference:
                raise SystemExit(
                    f"bench/compute_under_io.py: {mode} losses {r[mode]['losses']} differ from {reference}"
                )
    per_round = []
    for r in rounds:
        loaded = r["loaded"]
        medians = {
            mode: {
                "step_s": statistics.median(r[mode]["step_s"]),
                "cpu_s": statistics.median(r[mode]["cpu_s"]),
                **{p: statistics.median(r[mode]["phases"][p]) for p in PHASES},
            }
            for mode in MODES
        }
        ratios = {name: medians["loaded"][name] / medians["alone"][name] for name in ("step_s", "cpu_s", *PHASES)}
        fio = loaded["fio"]
        moved_gib = (fio["read_mib_s"] + fio["write_mib_s"]) / 1024 * medians["loaded"]["step_s"]
        per_round.append(
            {
                "medians": medians,
                "ratios": ratios,
                "fio": fio,
                "lost_s_per_gib": (medians["loaded"]["step_s"] - medians["alone"]["step_s"]) / moved_gib,
                "machine_cpu_s": {mode: r[mode]["machine_cpu_s"] for mode in MODES},
            }
        )
    return {
        "rounds": per_round,
        "ratios": {name: statistics.median(p["ratios"][name] for p in per_round) for name in per_round[0]["ratios"]},
        "lost_s_per_gib": statistics.median(p["lost_s_per_gib"] for p in per_round),
        "losses_equal": True,
    }


def _report(summary: dict[str, Any], say: Any) -> None:
    for index, r in enumerate(summary["rounds"], 1):
        for mode in MODES:
            m = r["medians"][mode]
            kinds = r["machine_cpu_s"][mode]
            say(
                f"round {index} {mode:6s}: step {m['step_s']:.3f} s (forward {m['forward']:.3f}, backward "
                f"{m['backward']:.3f}, optimizer.step {m['optimizer.step']:.3f}), process CPU {m['cpu_s']:.2f} s; "
                "machine CPU s a step: "
                + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items() if k in ("user", "system", "softirq", "steal"))
                + f", idle {kinds['idle'] + kinds['iowait']:.2f}"
            )
        fio = r["fio"]
        say(
            f"round {index} fio: read {fio['read_mib_s']:,.0f} MiB/s, write {fio['write_mib_s']:,.0f} MiB/s, "
            f"its CPU {fio['cpu_share']:.0%} of one; loaded / alone: step {r['ratios']['step_s']:.3f}x "
            f"(forward {r['ratios']['forward']:.3f}x, backward {r['ratios']['backward']:.3f}x, optimizer.step "
            f"{r['ratios']['optimizer.step']:.3f}x); {r['lost_s_per_gib']:.3f} s of the step lost per GiB fio moved"
        )
    ratios = summary["ratios"]
    say(
        f"medians over the rounds, loaded / alone: step {ratios['step_s']:.3f}x, forward {ratios['forward']:.3f}x, "
        f"backward {ratios['backward']:.3f}x, optimizer.step {ratios['optimizer.step']:.3f}x, process CPU "
        f"{ratios['cpu_s']:.3f}x; {summary['lost_s_per_gib']:.3f} s lost per GiB moved; losses equal"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="210M")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (plain PyTorch settles by its third)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--path", type=arguments.directory, default=None, help="the disk fio loads (default: under $TMPDIR)"
    )
    parser.add_argument("--read-share", type=int, default=55, help="percent of fio's requests that read")
    parser.add_argument("--iodepth", type=int, default=16)
    parser.add_argument("--fio-size", default="1GiB", help="fio's file")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds fio runs before training starts")
    parser.add_argument("--fio", default=shutil.which("fio"), help="the fio binary (default: fio on PATH)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(train(args)))
        return 0
    if not args.fio:
        parser.error("fio is not installed (apt-get install fio), or name it with --fio")
    if not 0 <= args.read_share <= 100:
        parser.error(f"--read-share {args.read_share}: a percentage, 0 to 100")
    say = (lambda *a: None) if args.json else print
    facts = machine.facts()
    say(f"machine: {facts}")
    say(f"fio: {subprocess.run([args.fio, '--version'], capture_output=True, text=True).stdout.strip()}")
    rounds = []
    for index in range(args.rounds):
        runs = {}
        for mode in MODES if index % 2 == 0 else MODES[::-1]:
            runs[mode] = run_mode(mode, args)
            say(f"round {index + 1} {mode}: steps {', '.join(f'{t:.2f}' for t in runs[mode]['step_s'])} s")
        rounds.append(runs)
    summary = {"machine": facts, "settings": {k: v for k, v in vars(args).items() if k != "worker"}}
    summary.update(summarize(rounds))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _report(summary, say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
