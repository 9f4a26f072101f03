#!/usr/bin/env python3
"""tiermem's NVMe tier against fio, side by side on the same file size, block size and queue depth.

Every measurement runs in a fresh process, alternating A B A B (tiermem, fio, tiermem,
fio, ...), so throttling of a shared VM or a noisy neighbour hits both sides alike
(see bench/README.md). Per round, for each tiermem backend asked for (``--backends``,
default ``auto,posix``: auto picks ``aio`` where Linux AIO works, so the batched kernel
queue and the thread pool are measured side by side):

1. ``tiermem bench io --through raw``        (the tier's own read/write, 1 MiB, QD 32)
2. fio                                        (same size, block size, queue depth)
3. ``tiermem bench io --through scheduler``  (end to end: store/fetch of a managed tensor)
4. fio
5. and 6.-8.: the same four at 64 KiB, QD 32 (the small-request case: requests/s)

``--cases small`` runs only 5.-8. (the 64 KiB comparison), ``--cases large`` only 1.-4.

Both sides first write the whole file untimed, then time one overwrite (durable at the
end: tiermem ``fdatasync``, fio ``--end_fsync=1``) and one read, with ``O_DIRECT``
(fio ``--ioengine=libaio --direct=1``). Each side uses a fresh file, removed afterwards.
Then the scheduler's added latency per request is measured (QD 1, alternating raw and
scheduler requests in one process, see ``tiermem.app.benchio.latency``).

It prints the machine's facts, the exact commands, every sample, the medians and the
ratios tiermem/fio. Without fio installed it prints tiermem's numbers only.

    python bench/io_vs_fio.py [--path DIR] [--size 1GiB] [--rounds 3] [--backends auto,posix]
                              [--cases all|small|large]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path

from tiermem.units import format_size, parse_size

#: Ratio goals of the issue: bandwidth >= 0.95x fio; small requests/s >= 0.8x fio.
BANDWIDTH_GOAL = 0.95
SMALL_GOAL = 0.8


@dataclass
class Samples:
    """Per-run measurements of one side of one case: bytes/s, requests/s, p50 latency."""

    bytes_per_s: list[float] = field(default_factory=list)
    requests_per_s: list[float] = field(default_factory=list)
    p50_s: list[float] = field(default_factory=list)

    def add(self, bytes_per_s: float, requests_per_s: float, p50_s: float) -> None:
        self.bytes_per_s.append(bytes_per_s)
        self.requests_per_s.append(requests_per_s)
        self.p50_s.append(p50_s)


def run(cmd: list[str], *, timeout: float = 600) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        sys.exit(f"io_vs_fio: command failed ({done.returncode}): {shlex.join(cmd)}\n{done.stderr.strip()}")
    return done.stdout


def tiermem_cmd(args: argparse.Namespace, backend: str, through: str, block_size: int, queue_depth: int) -> list[str]:
    return [
        sys.executable, "-m", "tiermem", "bench", "io", "--json", "--tier", "nvme", "--backend", backend,
        "--path", args.path, "--size", str(args.size), "--block-size", str(block_size),
        "--queue-depth", str(queue_depth), "--op", "both", "--repeats", "1", "--through", through,
    ]  # fmt: skip


def fio_cmd(args: argparse.Namespace, filename: str, block_size: int, queue_depth: int) -> list[str]:
    # One invocation, three jobs run one after the other (stonewall): an untimed write that
    # lays the file out (so the timed write overwrites written blocks, as tiermem's does),
    # the timed write (durable at its end), the timed read.
    common = [
        f"--filename={filename}", f"--size={args.size}", f"--bs={block_size}", f"--iodepth={queue_depth}",
        "--ioengine=libaio", "--direct=1", "--numjobs=1", "--thread=0", "--group_reporting=0",
    ]  # fmt: skip
    return [
        args.fio, "--output-format=json", *common,
        "--name=prep", "--rw=write", "--end_fsync=1",
        "--name=write", "--stonewall", "--rw=write", "--end_fsync=1",
        "--name=read", "--stonewall", "--rw=read",
    ]  # fmt: skip


# The tiermem child imports torch and tiermem first, says "ready" and waits for "go": its
# interpreter start-up then happens while the disk is still in its idle gap, not in it.
_CHILD = (
    "import sys; import tiermem.app.benchio, tiermem.tiers.nvme, tiermem.cli.bench_cmd; "
    "from tiermem.cli import main; sys.stderr.write('ready\\n'); sys.stderr.flush(); "
    "sys.stdin.readline(); sys.exit(main(sys.argv[1:]))"
)


# The latency probe: one process, raw and scheduler requests alternating (tiermem.app.benchio.latency).
_PROBE = (
    "import json, sys; from tiermem.app.benchio.latency import added_latency; "
    "print(json.dumps([added_latency([sys.argv[1]], backend=sys.argv[2], block_size=int(b), "
    "samples=int(sys.argv[3])) for b in sys.argv[4:]]))"
)


class Pacer:
    """Starts every run's I/O the same ``gap`` seconds after the previous run's I/O ended.

    Virtual disks often throttle with a credit bucket that refills while idle: a side that
    always starts after a longer pause (tiermem, whose interpreter takes seconds to import
    torch) would get burst credit the other side never sees. Equal gaps remove that bias.
    """

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.last_end = 0.0
        self.late: list[float] = []

    def wait(self) -> None:
        delay = self.last_end + self.gap - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif self.last_end:
            self.late.append(-delay)

    def ended(self) -> None:
        self.last_end = time.monotonic()


def run_tiermem(
    args: argparse.Namespace, pacer: Pacer, backend: str, through: str, block_size: int, queue_depth: int
) -> dict[str, Any]:
    argv = tiermem_cmd(args, backend, through, block_size, queue_depth)[3:]  # after "python -m tiermem"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stderr is not None
    ready = child.stderr.readline()
    if ready.strip() != "ready":
        out, err = child.communicate()
        sys.exit(f"io_vs_fio: tiermem child failed to start: {ready}{err}")
    pacer.wait()
    child.stdin.write("go\n")
    child.stdin.flush()
    out, err = child.communicate(timeout=600)
    pacer.ended()
    if child.returncode != 0:
        sys.exit(f"io_vs_fio: tiermem failed ({child.returncode}): {shlex.join(argv)}\n{err.strip()}")
    return json.loads(out)


def run_fio(args: argparse.Namespace, pacer: Pacer, block_size: int, queue_depth: int) -> dict[str, dict[str, float]]:
    filename = os.path.join(args.path, f"fio-bench-{os.getpid()}.dat")
    try:
        pacer.wait()
        try:
            report = json.loads(run(fio_cmd(args, filename, block_size, queue_depth)))
        finally:
            pacer.ended()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(filename)
    out: dict[str, dict[str, float]] = {}
    for job in report["jobs"]:
        name = job["jobname"]
        if name not in ("write", "read"):
            continue
        side = job[name]
        # Bandwidth from bytes and the job's runtime, which includes the end_fsync of a write job.
        seconds = side["runtime"] / 1e3
        out[name] = {
            "bytes_per_s": side["io_bytes"] / seconds,
            "requests_per_s": side["total_ios"] / seconds,
            "p50_s": side["clat_ns"]["percentile"]["50.000000"] / 1e9,
        }
    return out


@contextlib.contextmanager
def work_dir(path: str | None) -> Iterator[str]:
    if path is not None:
        yield os.path.abspath(path)
        return
    private = tempfile.mkdtemp(prefix="tiermem-io-vs-fio-")
    try:
        yield private
    finally:
        shutil.rmtree(private, ignore_errors=True)


def ratio_line(label: str, tm: list[float], fio: list[float] | None, unit: str, goal: float) -> str:
    scale, fmt = (1 / (1 << 20), "{:,.0f} MiB/s") if unit == "bytes" else (1.0, "{:,.0f} req/s")
    tm_med = statistics.median(tm)
    left = fmt.format(tm_med * scale)
    if not fio:
        return f"  {label:<34} tiermem {left:>14}"
    fio_med = statistics.median(fio)
    ratio = tm_med / fio_med
    verdict = "ok" if ratio >= goal else f"SHORT of {goal:.2f}x"
    return f"  {label:<34} tiermem {left:>14}   fio {fmt.format(fio_med * scale):>14}   {ratio:5.2f}x  {verdict}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--path", type=arguments.directory, help="directory for both sides' files (default: a private temp dir)"
    )
    parser.add_argument("--size", default="1GiB", help="file size (default 1GiB)")
    parser.add_argument("--block-size", default="1MiB", help="large-request block size (default 1MiB)")
    parser.add_argument("--queue-depth", type=int, default=32, help="queue depth (default 32)")
    parser.add_argument("--small-block-size", default="64KiB", help="small-request block size (default 64KiB)")
    parser.add_argument("--small-queue-depth", type=int, default=32, help="small-request queue depth (default 32)")
    parser.add_argument("--cases", choices=("all", "small", "large"), default="all", help="which block sizes to run")
    parser.add_argument("--rounds", type=int, default=3, help="A B A B rounds (default 3)")
    parser.add_argument(
        "--gap", type=float, default=4.0, help="idle seconds before every run's I/O, both sides (default 4)"
    )
    parser.add_argument("--latency-samples", type=int, default=300, help="requests per side in the latency probe")
    parser.add_argument(
        "--backends", default="auto,posix",
        help="tiermem NVMe backends, comma-separated (default auto,posix; auto picks aio where it works)",
    )  # fmt: skip
    parser.add_argument("--fio", default=shutil.which("fio"), help="the fio binary (default: fio on PATH)")
    args = parser.parse_args()
    args.size = parse_size(args.size)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    big, small = parse_size(args.block_size), parse_size(args.small_block_size)
    qd, small_qd = args.queue_depth, args.small_queue_depth
    fio_version = run([args.fio, "--version"]).strip() if args.fio else None

    started = time.monotonic()
    with work_dir(args.path) as path:
        args.path = path
        cases = []
        if args.cases in ("all", "large"):
            cases += [("raw", big, qd), ("scheduler", big, qd)]
        if args.cases in ("all", "small"):
            cases += [("raw", small, small_qd), ("scheduler", small, small_qd)]
        tm: dict[tuple[str, str, int, str], Samples] = {}
        fio: dict[tuple[int, str], Samples] = {}
        machines: dict[str, dict[str, Any]] = {}
        pacer = Pacer(args.gap)
        any_backend = "{" + "|".join(backends) + "}"
        for block, depth in dict.fromkeys((b, d) for _t, b, d in cases):
            print(f"tiermem command: {shlex.join(tiermem_cmd(args, any_backend, '{raw|scheduler}', block, depth))}")
            if args.fio:
                fio_file = os.path.join(path, "fio-bench-PID.dat")
                print(f"fio command:     {shlex.join(fio_cmd(args, fio_file, block, depth))}")
        if not args.fio:
            print("fio: not installed (apt-get install fio); tiermem's numbers only")
        for round_no in range(args.rounds):
            for through, block, depth in cases:
                for backend in backends:
                    report = run_tiermem(args, pacer, backend, through, block, depth)
                    machines.setdefault(backend, report["machine"])
                    for result in report["results"]:
                        tm.setdefault((backend, through, block, result["op"]), Samples()).add(
                            result["bytes_per_s"]["median"], result["requests_per_s"], result["latency_s"]["p50"]
                        )
                    if args.fio:  # B after every A
                        for op, numbers in run_fio(args, pacer, block, depth).items():
                            fio.setdefault((block, op), Samples()).add(
                                numbers["bytes_per_s"], numbers["requests_per_s"], numbers["p50_s"]
                            )
            print(f"round {round_no + 1}/{args.rounds} done ({time.monotonic() - started:.0f}s)", flush=True)
        probes: dict[str, Any] = {}
        for backend in backends:
            # The probe runs the engine directly, so it takes the name auto resolved to.
            name = machines[backend]["backend"] if backend == "auto" else backend
            blocks = [str(b) for b in dict.fromkeys(b for _t, b, _d in cases)]
            probe_cmd = [sys.executable, "-c", _PROBE, path, name, str(args.latency_samples), *blocks]
            pacer.wait()
            probes[backend] = json.loads(run(probe_cmd))
            pacer.ended()

    machine = machines[backends[0]]
    print()
    print("machine")
    print(f"  {machine['cpu_count']} CPUs ({machine['cpu_model']}), {format_size(machine['memory_total'])} RAM")
    print(f"  {machine['platform']}, python {machine['python']}, torch {machine['torch']}")
    for fs in machine.get("filesystems", []):
        print(f"  path {fs['path']}: {fs['fstype']} on {fs['device']} (mounted at {fs['mountpoint']})")
    for backend in backends:
        facts = machines[backend]
        print(f"  tiermem --backend {backend}: {facts['backend']} ({facts['backend_reason']})")
    print(f"  O_DIRECT: {machine['direct']} ({machine['direct_reason']}); page cache: {machine['page_cache']}")
    print(f"  fio: {fio_version or 'not installed'}; host kernel {platform.release()}")
    print(
        f"  file size {format_size(args.size)}, {args.rounds} rounds, fresh process per run, "
        f"{args.gap:g}s idle before each run"
        + (f" (exceeded {len(pacer.late)} time(s), by up to {max(pacer.late):.1f}s)" if pacer.late else "")
    )
    print()
    print("samples (MiB/s per run, in run order)")
    for (backend, through, block, op), samples in tm.items():
        mib = ", ".join(f"{v / (1 << 20):,.0f}" for v in samples.bytes_per_s)
        label = machines[backend]["backend"]
        print(f"  tiermem {label:<5} {through:<9} {op:<5} {format_size(block):>6}: {mib}")
    for (block, op), samples in fio.items():
        mib = ", ".join(f"{v / (1 << 20):,.0f}" for v in samples.bytes_per_s)
        print(f"  fio                     {op:<5} {format_size(block):>6}: {mib}")
    print()
    print(f"medians and ratios tiermem/fio (goal: bandwidth >= {BANDWIDTH_GOAL}x, small requests/s >= {SMALL_GOAL}x)")
    for through, block, depth in cases:
        is_small = block == small and (block != big or depth != qd)
        for op in ("write", "read"):
            for backend in backends:
                ours = tm[(backend, through, block, op)]
                theirs = fio.get((block, op))
                label = f"{machines[backend]['backend']} {through} {op} {format_size(block)} QD{depth}"
                if is_small:
                    line = ratio_line(
                        label, ours.requests_per_s, theirs.requests_per_s if theirs else None, "req", SMALL_GOAL
                    )
                else:
                    line = ratio_line(
                        label, ours.bytes_per_s, theirs.bytes_per_s if theirs else None, "bytes", BANDWIDTH_GOAL
                    )
                print(line)
    print()
    print("p50 latency per request (ms): tiermem (issue to completion) vs fio (clat)")
    for through, block, depth in cases:
        for op in ("write", "read"):
            theirs = fio.get((block, op))
            other = f"{statistics.median(theirs.p50_s) * 1e3:.2f}" if theirs else "-"
            for backend in backends:
                ours = statistics.median(tm[(backend, through, block, op)].p50_s) * 1e3
                label = machines[backend]["backend"]
                case = f"{label:<5} {through:<9} {op:<5} {format_size(block):>6} QD{depth}"
                print(f"  {case}: tiermem {ours:.2f}   fio {other}")
    print()
    print("scheduler's added latency per request (QD 1, median of alternating samples)")
    for backend in backends:
        for entry in probes[backend]:
            for op in ("read", "write"):
                numbers = entry[op]
                print(
                    f"  {machines[backend]['backend']:<5} {op:<5} {format_size(entry['block_size']):>6}: "
                    f"raw {numbers['raw_s'] * 1e6:,.0f} µs, "
                    f"through the scheduler {numbers['scheduler_s'] * 1e6:,.0f} µs, "
                    f"added {numbers['added_s'] * 1e6:,.0f} µs ({entry['samples']} samples each)"
                )
    print(f"\ntotal {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
