"""``tiermem bench io``: how fast a tier moves bytes, through tiermem's own tiers and backends.

Every option is read here rather than by argparse, so a bad value gets one line naming
the option and what is wrong (exit status 2), not a usage dump. The run is in
:mod:`tiermem.app.benchio`; this module turns its report into a table or JSON, shows a
progress bar on long runs, and makes sure Ctrl-C (or SIGTERM) still removes every file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from tiermem.cli.output import stdout_closed
from tiermem.tiers.backends import BACKEND_NAMES
from tiermem.units import format_size, parse_size

if TYPE_CHECKING:  # the engine imports torch: only when a benchmark actually runs
    from tiermem.app.benchio import BenchReport, BenchSpec

_BACKENDS = BACKEND_NAMES
_OPS = {"read": ("read",), "write": ("write",), "both": ("write", "read")}
_BUFFERS = ("host", "device")
_MAX_QUEUE_DEPTH = 1024
#: Show the progress bar only once a run has taken this long (short runs stay quiet).
_PROGRESS_AFTER_S = 2.0


class UsageError(Exception):
    """A bad option value: printed as one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``io`` action and its options to the ``bench`` parser."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    io = actions.add_parser(
        "io",
        help="read/write bandwidth of a tier (nvme, host, device)",
        description=(
            "Measure read and write bandwidth through tiermem's own tiers and backends. Reads bypass "
            "the page cache (O_DIRECT), writes are durable (fdatasync) when the clock stops, and no "
            "file is left behind, also on Ctrl-C."
        ),
    )
    io.add_argument("--tier", default="nvme", metavar="{nvme,host,device}", help="tier to measure (default nvme)")
    io.add_argument(
        "--backend",
        default="auto",
        metavar="{" + ",".join(BACKEND_NAMES) + "}",
        help="NVMe storage backend (default auto)",
    )
    io.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="DIR",
        help="directory for the NVMe tier's files; repeat to stripe (default: a private temp dir, removed after)",
    )
    io.add_argument("--size", default="1GiB", help="bytes moved per pass, e.g. 1GiB (default 1GiB)")
    io.add_argument(
        "--block-size",
        default=None,
        metavar="SIZE[,SIZE...]",
        help="request size, a multiple of 4KiB; a comma list runs each (default 1MiB; --sweep: 64KiB..16MiB)",
    )
    io.add_argument(
        "--queue-depth",
        default=None,
        metavar="N[,N...]",
        help="requests in flight; a comma list runs each (default 32; --sweep: 1,2,4,...,64)",
    )
    io.add_argument("--op", default="both", metavar="{read,write,both}", help="what to time (default both)")
    io.add_argument("--repeats", default="3", metavar="N", help="timed passes per case and op (default 3)")
    io.add_argument(
        "--sweep",
        action="store_true",
        help="every block size x queue depth (64KiB..16MiB x 1..64, or the lists given)",
    )
    io.add_argument(
        "--through",
        default="raw",
        metavar="{raw,scheduler}",
        help="raw: the tier's own read/write; scheduler: end to end, a managed tensor's store/fetch (default raw)",
    )
    io.add_argument(
        "--run-blocks",
        default="auto",
        metavar="{auto,N}",
        help=(
            "raw, nvme: most blocks per call to the tier, which splits each call into block-sized I/Os "
            "(default auto: a quarter of the queue depth, as the scheduler's runs; 1: a call per block)"
        ),
    )
    io.add_argument(
        "--buffer",
        default="host",
        metavar="{host,device}",
        help=(
            "raw, nvme: the memory the I/O moves to and from: host (default) or device (CUDA memory: "
            "kvikio hands it to cuFile, other backends stage it through page-locked bounce buffers)"
        ),
    )
    io.add_argument("--verify", action="store_true", help="check every byte read back; mismatches fail the run")
    io.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")


# -- option parsing -----------------------------------------------------------------------------------
def _choice(option: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise UsageError(f"{option} {value!r}: expected one of {', '.join(choices)}")
    return value


def _size(option: str, text: str) -> int:
    try:
        value = parse_size(text.strip())
    except ValueError as exc:
        raise UsageError(f"{option} {text!r}: {exc}") from None
    if value <= 0:
        raise UsageError(f"{option} {text!r}: must be more than 0 bytes")
    return value


def _block_sizes(text: str) -> tuple[int, ...]:
    from tiermem.tiers.base import ALIGNMENT

    sizes = []
    for item in text.split(","):
        value = _size("--block-size", item)
        if value % ALIGNMENT:
            raise UsageError(
                f"--block-size {item.strip()!r}: {value} bytes is not a multiple of {ALIGNMENT} "
                "(direct I/O needs 4KiB-aligned requests)"
            )
        sizes.append(value)
    return tuple(dict.fromkeys(sizes))


def _int(option: str, text: str, low: int, high: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise UsageError(f"{option} {text.strip()!r}: not a whole number") from None
    if not low <= value <= high:
        raise UsageError(f"{option} {value}: must be between {low} and {high}")
    return value


def _paths(paths: list[str]) -> tuple[str, ...]:
    seen: set[str] = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"--path {path}: given twice (each path is one stripe)")
        seen.add(real)
        if not os.path.exists(path):
            raise UsageError(f"--path {path}: no such directory")
        if not os.path.isdir(path):
            raise UsageError(f"--path {path}: not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--path {path}: not writable by this user")
    return tuple(os.path.abspath(p) for p in paths)


def build_spec(args: argparse.Namespace) -> BenchSpec:
    """The :class:`~tiermem.app.benchio.BenchSpec` the options describe; raises UsageError."""
    from tiermem.app.benchio import BENCH_TIERS, SWEEP_BLOCK_SIZES, SWEEP_QUEUE_DEPTHS, THROUGH, BenchSpec

    if args.action != "io":
        raise UsageError(f"unknown bench {args.action!r}; only 'io' exists")
    tier = _choice("--tier", args.tier, BENCH_TIERS)
    backend = _choice("--backend", args.backend, _BACKENDS)
    if tier != "nvme" and backend != "auto":
        raise UsageError(f"--backend {backend}: backends are for --tier nvme; the {tier} tier copies memory")
    if tier != "nvme" and args.path:
        raise UsageError(f"--path: paths are for --tier nvme; the {tier} tier has no files")
    size = _size("--size", args.size)
    if args.block_size is not None:
        block_sizes = _block_sizes(args.block_size)
    else:
        # A sweep's default grid stops at the size: a block bigger than the data is not a case.
        block_sizes = tuple(b for b in SWEEP_BLOCK_SIZES if b <= size) or (SWEEP_BLOCK_SIZES[0],)
        block_sizes = block_sizes if args.sweep else (1 << 20,)
    too_big = [b for b in block_sizes if b > size]
    if too_big:
        raise UsageError(
            f"--block-size {format_size(too_big[0])} is larger than --size {format_size(size)}; "
            "a pass must hold at least one block"
        )
    if args.queue_depth is not None:
        depths = tuple(
            dict.fromkeys(_int("--queue-depth", item, 1, _MAX_QUEUE_DEPTH) for item in args.queue_depth.split(","))
        )
    else:
        depths = SWEEP_QUEUE_DEPTHS if args.sweep else (32,)
    through = _choice("--through", args.through, THROUGH)
    run_blocks: int | None = None
    if args.run_blocks != "auto":
        run_blocks = _int("--run-blocks", args.run_blocks, 1, _MAX_QUEUE_DEPTH)
        if through != "raw":
            raise UsageError("--run-blocks: only for --through raw; the scheduler sizes its own runs")
        if tier != "nvme" and run_blocks > 1:
            raise UsageError(
                f"--run-blocks {run_blocks}: only the nvme tier splits a call into block-sized I/Os; "
                f"the {tier} tier would do one larger copy"
            )
    buffer = _buffer(args.buffer, tier, through)
    return BenchSpec(
        tier=tier,
        buffer=buffer,
        backend=backend,
        paths=_paths(args.path),
        size=size,
        block_sizes=block_sizes,
        queue_depths=depths,
        ops=_OPS[_choice("--op", args.op, tuple(_OPS))],
        repeats=_int("--repeats", args.repeats, 1, 10_000),
        through=through,
        verify=args.verify,
        run_blocks=run_blocks,
    )


def _buffer(text: str, tier: str, through: str) -> str:
    """``--buffer``: device memory only for raw NVMe passes, and only where CUDA is."""
    buffer = _choice("--buffer", text, _BUFFERS)
    if buffer == "host":
        return buffer
    if tier != "nvme":
        raise UsageError(f"--buffer device: only for --tier nvme; the {tier} tier copies memory")
    if through != "raw":
        raise UsageError(
            "--buffer device: only for --through raw; through the scheduler the NVMe tier's peer is the "
            "device tier already (device memory where CUDA is)"
        )
    missing = cuda_missing()
    if missing:
        raise UsageError(f"--buffer device: needs a CUDA device, and this machine has none usable: {missing}")
    return buffer


def cuda_missing() -> str:
    """Why torch cannot use a CUDA device here, or "" when it can."""
    import torch

    if torch.cuda.is_available():
        return ""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    return (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but torch.cuda.is_available() is "
        "false (no GPU, no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides every device)"
    )


def _check_resources(spec: BenchSpec, paths: tuple[str, ...]) -> None:
    """Refuse a size this machine cannot hold, before any byte is written."""
    import psutil

    # Every case holds two buffers of `size` bytes (one for nvme raw): the host buffer or
    # peer allocation, and the memory tier's own allocation. Device-tier ones are not RAM
    # with CUDA.
    import torch

    if spec.through == "raw":
        sides = ["device" if spec.buffer == "device" else "host", "nvme"]
    else:
        sides = [spec.tier, "host" if spec.tier == "device" else "device"]
    in_ram = [s for s in sides if s != "nvme" and not (s == "device" and torch.cuda.is_available())]
    need_ram = spec.size * len(in_ram)
    available = psutil.virtual_memory().available
    if need_ram > 0.9 * available:
        raise UsageError(
            f"--size {format_size(spec.size)}: needs {format_size(need_ram)} of RAM for buffers, "
            f"{format_size(available)} available"
        )
    if spec.tier == "nvme":
        share = -(-spec.size // len(paths)) + (64 << 20)  # plus the tier's growth step
        for path in paths:
            free = shutil.disk_usage(path).free
            if share > free:
                raise UsageError(
                    f"--path {path}: needs {format_size(share)} free for a {format_size(spec.size)} pass, "
                    f"{format_size(free)} free"
                )


# -- output -----------------------------------------------------------------------------------------
def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / (1 << 20):,.0f}"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f}s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f}ms"
    return f"{value * 1e6:.0f}µs"


def _header_lines(machine: dict[str, Any], spec: BenchSpec) -> list[str]:
    lines = [
        f"tiermem bench io: {spec.tier} tier, through {spec.through}, {format_size(spec.size)} per pass, "
        f"{spec.repeats} repeat(s){', verified' if spec.verify else ''}",
        f"machine: {machine['cpu_count']} CPUs ({machine['cpu_model']}), "
        f"{format_size(machine['memory_total'])} RAM ({format_size(machine['memory_available'])} available), "
        f"{machine['platform']}, python {machine['python']}, torch {machine['torch']}"
        + (f", GPU {machine['cuda_device']}" if machine.get("cuda_device") else ""),
    ]
    for fs in machine.get("filesystems", []):
        disk = ", ".join(
            part
            for part in (
                fs.get("model") and f"model {fs['model']}",
                "rotational" in fs and ("rotational" if fs["rotational"] else "non-rotational"),
            )
            if part
        )
        lines.append(
            f"path {fs['path']}: {fs['fstype']} on {fs['device']} (mounted at {fs['mountpoint']})"
            + (f", {disk}" if disk else "")
        )
    if spec.tier == "nvme":
        lines.append(f"backend: {machine['backend']} ({machine['backend_reason']})")
        lines.append(f"buffer: {machine['buffer']} ({machine['buffer_path']})")
        lines.append(f"O_DIRECT: {'yes' if machine['direct'] else 'no'} ({machine['direct_reason']})")
    else:
        facts = machine.get("tier_facts", {})
        pinned = f", pinned: {'yes' if facts['pinned'] else 'no'}" if "pinned" in facts else ""
        lines.append(f"tier: {facts.get('tier')} memory on {facts.get('device')}{pinned}")
    lines.append(f"page cache: {machine['page_cache']}")
    if spec.tier == "nvme":
        runs = spec.run_blocks
        how = (
            "one call per block"
            if runs == 1
            else f"calls of up to {'QD/4' if runs is None else runs} contiguous blocks each, which the tier "
            "splits into block-sized I/Os and submits together"
        )
        who = "raw" if spec.through == "raw" else "the scheduler (its rule 7)"
        lines.append(f"requests: {who} issues {how}; at most the queue depth of blocks in flight")
    lines += [f"note: {note}" for note in machine.get("notes", [])]
    return lines


def _print_table(report: BenchReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=None, box=None, header_style="bold", pad_edge=False)
    for name in ("op", "block", "QD", "MiB/s", "min", "max", "req/s", "p50 lat", "p99 lat"):
        table.add_column(name, justify="left" if name == "op" else "right")
    for result in report.results:
        rate, latency = result.bytes_per_s(), result.latency_s()
        table.add_row(
            result.op,
            format_size(result.block_size),
            str(result.queue_depth),
            _rate(rate["median"]),
            _rate(rate["min"]),
            _rate(rate["max"]),
            f"{result.requests_per_s():,.0f}",
            _seconds(latency["p50"]),
            _seconds(latency["p99"]),
        )
    # Piped output gets a fixed width, so a table saved to a file does not wrap at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 120, soft_wrap=False)
    console.print(table)
    print(
        "MiB/s: median (min, max) over the repeats; req/s: blocks, median; "
        "latency per call to the tier (a run: its last block), over all repeats"
    )


class _Progress:
    """A rich progress bar on stderr, shown only on a terminal and once the run has taken a
    few seconds, so short runs and piped output stay clean."""

    def __init__(self, total: int) -> None:
        self._enabled = sys.stderr.isatty() and total > 1
        self._started = False
        self._t0 = time.monotonic()
        if not self._enabled:
            return  # rich.progress costs a noticeable import: not for piped or one-pass runs
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task("bench io", total=total)

    def advance(self, what: str) -> None:
        if not self._enabled:
            return
        self._progress.update(self._task, advance=1, description=what)
        if not self._started and time.monotonic() - self._t0 > _PROGRESS_AFTER_S:
            self._progress.start()
            self._started = True

    def stop(self) -> None:
        if self._started:
            self._progress.stop()
            self._started = False


# -- the command ------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run ``tiermem bench io``. Exit status 0, 1 on a tiermem error (verification failure,
    storage error), 2 on a bad option, 130 when interrupted (by ``tiermem.cli.main``)."""
    try:
        spec = build_spec(args)
    except UsageError as exc:
        print(f"tiermem bench {args.action}: error: {exc}", file=sys.stderr)
        return 2
    from dataclasses import replace

    from tiermem.app.benchio import run_benchmark

    private: str | None = None
    progress: _Progress | None = None
    try:
        if spec.tier == "nvme" and not spec.paths:
            private = tempfile.mkdtemp(prefix="tiermem-bench-")
            spec = replace(spec, paths=(private,))
        try:
            _check_resources(spec, spec.paths)
        except UsageError as exc:
            print(f"tiermem bench io: error: {exc}", file=sys.stderr)
            return 2
        progress = _Progress(spec.passes)

        def show_header(machine: dict[str, Any]) -> None:
            if not args.json:
                print("\n".join(_header_lines(machine, spec)), flush=True)
            else:
                for note in machine.get("notes", []):
                    print(f"tiermem bench io: note: {note}", file=sys.stderr)

        report = run_benchmark(spec, on_machine=show_header, on_pass=progress.advance)
    finally:
        if progress is not None:
            progress.stop()
        if private is not None:
            # The tier removed its run directory already; this removes the private parent
            # (and anything a crash mid-setup could have left in it).
            shutil.rmtree(private, ignore_errors=True)
    try:
        if args.json:
            print(json.dumps(report.as_dict(), indent=2), flush=True)
        else:
            _print_table(report)
            sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``| head``): not an error of the benchmark
        return stdout_closed()
    return 0
