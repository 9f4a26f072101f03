"""The engine of ``tiermem bench io``: what to measure, running it, and the results.

:func:`run_benchmark` takes a :class:`BenchSpec` and returns a :class:`BenchReport`
whose :meth:`~BenchReport.as_dict` is the JSON scripts read::

    {"machine": {...},
     "results": [{"tier", "backend", "op", "size", "block_size", "queue_depth", "repeats",
                  "bytes_per_s": {"median", "min", "max"}, "requests_per_s",
                  "latency_s": {"p50", "p99"}}]}

Sizes are int bytes. ``requests_per_s`` counts blocks, the requests the device sees however
many of them one call carries; it is the median over passes, like ``bytes_per_s``.
Latencies are per *call* to the tier, from issuing it to its completion, over every pass
of a case; they are per request only where a call is one block. On the NVMe tier a raw
call carries a run of up to ``run_blocks`` contiguous blocks (``--run-blocks``; by default
a quarter of the queue depth, as the scheduler's runs, its rule 7) and completes with its
last block; ``run_blocks=1`` makes a call one request, as it always is on the memory
tiers. Through the scheduler a call is what the scheduler issued: a run on the NVMe tier,
one block (at least 8 MiB) on a memory tier. The invocation's settings (``through``,
``verify``, ``run_blocks``) and page-cache handling are in ``machine``, next to the facts
they qualify. How the I/O itself is done is in :mod:`tiermem.app.benchio.passes`.
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from tiermem.app.benchio.passes import CaseEnv, VerificationError
from tiermem.interrupts import DeferredInterrupts
from tiermem.units import format_size

__all__ = [
    "BENCH_TIERS",
    "OPS",
    "SWEEP_BLOCK_SIZES",
    "SWEEP_QUEUE_DEPTHS",
    "THROUGH",
    "BenchReport",
    "BenchSpec",
    "CaseResult",
    "VerificationError",
    "machine_facts",
    "run_benchmark",
]

BENCH_TIERS = ("nvme", "host", "device")
OPS = ("write", "read")
THROUGH = ("raw", "scheduler")
#: ``--sweep`` defaults: 64 KiB .. 16 MiB by powers of two, queue depths 1 .. 64.
SWEEP_BLOCK_SIZES = tuple((64 << 10) << i for i in range(9))
SWEEP_QUEUE_DEPTHS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class BenchSpec:
    """One invocation: every (block size, queue depth) pair is a case, each op is timed
    ``repeats`` times per case. ``backend`` is a backend name, or a StorageBackend
    instance (tests pass a fault-injecting one)."""

    tier: str = "nvme"
    backend: Any = "auto"
    paths: tuple[str, ...] = ()
    size: int = 1 << 30
    block_sizes: tuple[int, ...] = (1 << 20,)
    queue_depths: tuple[int, ...] = (32,)
    ops: tuple[str, ...] = OPS
    repeats: int = 3
    through: str = "raw"
    verify: bool = False
    #: Raw passes: the most blocks per call to the tier; None: as the scheduler runs them
    #: (a quarter of the queue depth on the nvme tier, 1 elsewhere). See ``passes``.
    run_blocks: int | None = None
    #: Raw NVMe passes: the memory moved to and from, "host" or "device" (CUDA memory).
    buffer: str = "host"

    def cases(self) -> list[tuple[int, int]]:
        return list(itertools.product(self.block_sizes, self.queue_depths))

    @property
    def passes(self) -> int:
        """Timed passes in the whole run (what the progress bar counts)."""
        return len(self.cases()) * len(self.ops) * self.repeats


@dataclass
class CaseResult:
    """The timed passes of one op of one case."""

    tier: str
    backend: str
    op: str
    size: int
    block_size: int
    queue_depth: int
    seconds: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    @property
    def repeats(self) -> int:
        return len(self.seconds)

    def bytes_per_s(self) -> dict[str, float]:
        rates = [self.size / s for s in self.seconds]
        return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}

    def requests_per_s(self) -> float:
        # The median of per-pass rates, like bytes/s, so the two agree pass for pass.
        return statistics.median(n / s for n, s in zip(self.requests, self.seconds, strict=True))

    def latency_s(self) -> dict[str, float]:
        return {"p50": _percentile(self.latencies, 50), "p99": _percentile(self.latencies, 99)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "backend": self.backend,
            "op": self.op,
            "size": int(self.size),
            "block_size": int(self.block_size),
            "queue_depth": int(self.queue_depth),
            "repeats": self.repeats,
            "bytes_per_s": self.bytes_per_s(),
            "requests_per_s": self.requests_per_s(),
            "latency_s": self.latency_s(),
        }


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a latency some request really had, not an interpolation."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass
class BenchReport:
    machine: dict[str, Any]
    results: list[CaseResult]

    def as_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "results": [r.as_dict() for r in self.results]}


# -- machine facts ----------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _block_device_facts(device: str) -> dict[str, Any]:
    """Model and rotational flag of a block device like ``/dev/nvme0n1p2`` (Linux sysfs)."""
    name = os.path.basename(device)
    try:
        sys_path = os.path.realpath(os.path.join("/sys/class/block", name))
    except OSError:
        return {}
    if not os.path.isdir(sys_path):
        return {}
    # A partition's queue/ and device/ live on its parent disk.
    disk = sys_path if os.path.isdir(os.path.join(sys_path, "queue")) else os.path.dirname(sys_path)
    facts: dict[str, Any] = {}
    for key, rel in (("model", "device/model"), ("rotational", "queue/rotational")):
        try:
            with open(os.path.join(disk, rel), encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            continue
        facts[key] = bool(int(text)) if key == "rotational" and text.isdigit() else text
    return facts


def _page_cache_note(facts: dict[str, Any]) -> str:
    if facts.get("tier") != "nvme":
        return "not involved (memory tier)"
    if facts.get("direct"):
        return "bypassed: O_DIRECT"
    fstypes = {fs.get("fstype") for fs in facts.get("filesystems", [])}
    if "tmpfs" in fstypes:
        return "NOT bypassed: files on tmpfs live in RAM, so reads and writes measure memory, not a disk"
    return (
        f"NOT bypassed: buffered I/O ({facts.get('direct_reason', 'O_DIRECT unavailable')}); "
        "cached pages are dropped with posix_fadvise(DONTNEED) before every read pass"
    )


def machine_facts(
    spec: BenchSpec, tier_facts: dict[str, Any], notes: Sequence[str] = (), buffer_path: str = ""
) -> dict[str, Any]:
    """The header: this machine, and how the tier under test reaches its bytes."""
    memory = psutil.virtual_memory()
    facts: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_total": int(memory.total),
        "memory_available": int(memory.available),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "tier": spec.tier,
        "through": spec.through,
        "verify": spec.verify,
        # Raw passes: most blocks per tier call ("auto": a quarter of the queue depth on the
        # nvme tier, as the scheduler's runs; 1 elsewhere). The device sees block-sized I/Os.
        "run_blocks": "auto" if spec.run_blocks is None else spec.run_blocks,
    }
    if spec.tier == "nvme":
        filesystems = []
        for fs in tier_facts.get("filesystems", []):
            filesystems.append({**fs, **_block_device_facts(str(fs.get("device", "")))})
        facts.update(
            backend=tier_facts.get("backend"),
            backend_reason=tier_facts.get("backend_reason"),
            direct=bool(tier_facts.get("direct")),
            direct_reason=tier_facts.get("direct_reason"),
            filesystems=filesystems,
            buffer=spec.buffer,
            buffer_path=buffer_path,
        )
    else:
        facts["tier_facts"] = tier_facts
    facts["page_cache"] = _page_cache_note(tier_facts)
    facts["notes"] = list(dict.fromkeys(notes))
    return facts


# -- running ------------------------------------------------------------------------------------------
def run_benchmark(
    spec: BenchSpec,
    *,
    on_machine: Callable[[dict[str, Any]], None] | None = None,
    on_pass: Callable[[str], None] | None = None,
) -> BenchReport:
    """Run every case of ``spec``. ``on_machine`` gets the header once the first case's tier
    is up (so it can be shown before the long part); ``on_pass`` is called after every timed
    pass with a short description (for a progress bar). Every tier is closed, and its files
    removed, before this returns or raises (KeyboardInterrupt included)."""
    results: list[CaseResult] = []
    machine: dict[str, Any] | None = None
    # Ctrl-C and SIGTERM are held and acted on between two calls to a tier (TRAPS 25); a
    # second one interrupts at once, wherever it lands.
    with DeferredInterrupts() as interrupts:
        for block_size, queue_depth in spec.cases():
            with CaseEnv(
                spec.tier,
                size=spec.size,
                block_size=block_size,
                queue_depth=queue_depth,
                through=spec.through,
                paths=list(spec.paths),
                backend=spec.backend,
                run_blocks=spec.run_blocks,
                interrupts=interrupts,
                buffer=spec.buffer,
            ) as env:
                if machine is None:
                    machine = machine_facts(spec, env.describe(), env.notes, env.buffer_path)
                    if on_machine is not None:
                        on_machine(machine)
                results += _run_case(spec, env, on_pass)
    assert machine is not None  # spec.cases() is never empty
    return BenchReport(machine, results)


def _run_case(spec: BenchSpec, env: CaseEnv, on_pass: Callable[[str], None] | None) -> list[CaseResult]:
    env.prepare()
    out = []
    for op in spec.ops:
        result = CaseResult(spec.tier, env.backend_name, op, spec.size, env.block_size, env.queue_depth)
        for repeat in range(spec.repeats):
            if op == "read" and spec.verify:
                env.scribble()
            timed = env.run_pass(op)
            result.seconds.append(timed.seconds)
            result.requests.append(timed.requests)
            result.latencies += timed.latencies
            if spec.verify:
                _verify_pass(env, op, repeat, reads_follow="read" in spec.ops)
            if on_pass is not None:
                on_pass(f"{op} {format_size(env.block_size)} QD{env.queue_depth}")
        out.append(result)
    return out


def _verify_pass(env: CaseEnv, op: str, repeat: int, *, reads_follow: bool) -> None:
    if op == "read":
        env.verify(f"read pass {repeat + 1}")
    elif not reads_follow:
        # Only writes are timed: read the bytes back untimed to check what landed.
        env.scribble()
        env.run_pass("read")
        env.verify(f"write pass {repeat + 1} (read back)")
