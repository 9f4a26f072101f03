"""Checkpoint formats on the same state: DCP's filesystem format against the zarr v3 format
(tensorstore), through ``rt.save(path, format=...)`` and ``rt.load(path)``.

Each measurement is a fresh process (A B A B ..., so a slow stretch of a noisy machine falls on
both formats): it manages a 16.8M-parameter model (16 x 1024 x 1024 Linear layers, AdamW) whose
192 MiB of parameters and optimizer states are homed on NVMe with a 32 MiB host tier, takes one
step, then saves and loads once, reporting:

- save and load wall time (a load after the checkpoint's pages were dropped from the page cache
  with ``posix_fadvise(DONTNEED)``, so it reads from the disk as a resumed run would);
- RSS added: the kernel's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
  just before) minus the resident set before. Exact, unlike sampling with psutil, which misses
  short peaks. glibc is told to return freed memory (``MALLOC_MMAP_THRESHOLD_``, TRAPS 8) and
  the libraries are imported first: what is left is what the save or load holds;
- bytes and files on disk.

    python bench/checkpoint.py --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path

FORMATS = ("dcp", "zarr")
WIDTH, LAYERS = 1024, 16


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(run: Any) -> tuple[float, int]:
    """Wall seconds and peak RSS added by ``run()`` (see the module docstring)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    start = time.perf_counter()
    run()
    return time.perf_counter() - start, _status("VmHWM") - before


def _on_disk(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _drop_cache(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child(fmt: str, directory: str) -> None:
    """One measurement, printed as one JSON line."""
    import tensorstore  # noqa: F401  (the libraries' code is not the save's data)
    import torch
    from torch import nn

    import tiermem
    import tiermem.checkpoint

    torch.set_num_threads(1)
    root = Path(directory)
    (root / "nvme").mkdir()
    config = {
        "device": {"capacity": "24MiB", "device": "cpu"},
        "host": {"capacity": "32MiB"},
        "nvme": {"paths": [str(root / "nvme")], "capacity": "1GiB", "block_size": "1MiB"},
        "scheduler": {"loop": "asyncio"},
    }
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    path = root / "ckpt"
    with tiermem.Runtime(config) as rt:
        plan = {"state_home": "nvme", "chunk_size": "4MiB"}
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, lr=1e-3, plan=plan, grad_accumulation_steps=1, keep_gradients=False
        )
        model(torch.randn(4, WIDTH)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        chunks = [c for states in rt._model_states for c in states.chunks]
        assert {c.home_tier for c in chunks if not c.persistent} == {"nvme"}
        save_s, save_rss = _measure(lambda: rt.save(path, format=fmt))
        size, count = _on_disk(path)
        _drop_cache(path)
        load_s, load_rss = _measure(lambda: rt.load(path))
        result = {
            "format": fmt,
            "state_bytes": sum(c.home_bytes for c in chunks),
            "save_s": save_s,
            "load_s": load_s,
            "save_rss": save_rss,
            "load_rss": load_rss,
            "bytes": size,
            "files": count,
        }
    print(json.dumps(result), flush=True)


def machine(directory: Path) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    real = os.path.realpath(directory)
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    best = max((m for m in mounts if real.startswith(m[1].rstrip("/") + "/") or real == m[1]), key=lambda m: len(m[1]))
    return {"cpu": cpu, "cores": os.cpu_count(), "path": str(directory), "filesystem": f"{best[2]} on {best[0]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs (fresh process each)")
    parser.add_argument(
        "--dir", type=arguments.directory, default=tempfile.gettempdir(), help="where the NVMe tier and checkpoints go"
    )
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between processes (throttling)")
    parser.add_argument("--child", choices=FORMATS, help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.child_dir)
        return
    base = Path(args.dir)
    print(json.dumps(machine(base)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    results: dict[str, list[dict[str, Any]]] = {fmt: [] for fmt in FORMATS}
    for _ in range(args.rounds):
        for fmt in FORMATS:
            work = Path(tempfile.mkdtemp(prefix="tiermem-bench-checkpoint-", dir=base))
            try:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", fmt, "--child-dir", str(work)],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            finally:
                shutil.rmtree(work, ignore_errors=True)
            results[fmt].append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[fmt][-1]), flush=True)
            time.sleep(args.pause)
    mib = 2**20
    print(f"\nmedian of {args.rounds} | save s | load s | save RSS +MiB | load RSS +MiB | on disk MiB | files")
    for fmt, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("save_s", "load_s", "save_rss", "load_rss")}
        print(
            f"{fmt:4} | {med['save_s']:.2f} | {med['load_s']:.2f} | {med['save_rss'] / mib:.1f} | "
            f"{med['load_rss'] / mib:.1f} | {runs[0]['bytes'] / mib:.1f} | {runs[0]['files']}"
        )
    print(f"states: {results['dcp'][0]['state_bytes'] / mib:.0f} MiB (params + AdamW), host tier 32 MiB")


if __name__ == "__main__":
    main()
