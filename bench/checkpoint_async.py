"""The pause a checkpoint costs the training loop: a blocking ``rt.save(path)`` against an
asynchronous ``rt.save(path, blocking=False)`` (NOTE [ Asynchronous saves ]).

Each measurement is a fresh process (A B A B ..., so a slow stretch of a noisy machine falls on
both modes). It manages an 8.4M-parameter model (8 x 1024 x 1024 Linear layers, AdamW) whose
parameters and optimizer states (96 MiB) are homed on NVMe, takes warm-up steps and measures
the median of a few normal steps, then saves once and trains on:

- blocking: the pause is the time ``rt.save`` takes;
- async: the pause is the time ``rt.save(blocking=False)`` takes to return plus, for every step
  that overlaps the save (until ``done()``), its time minus a normal step. Also reported: the
  steps overlapped and the time until the checkpoint was committed.

    python bench/checkpoint_async.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path

MODES = ("blocking", "async")
WIDTH, LAYERS = 1024, 8


def _child(mode: str, directory: Path) -> dict[str, Any]:
    import torch
    from torch import nn

    import tiermem

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    (directory / "nvme").mkdir()
    config = {
        "device": {"capacity": "48MiB", "device": "cpu"},
        "host": {"capacity": "96MiB"},
        "nvme": {"paths": [str(directory / "nvme")], "capacity": "1GiB", "block_size": "1MiB"},
        "scheduler": {"loop": "asyncio"},
    }
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
    with tiermem.Runtime(config) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, lr=1e-3, plan={"state_home": "nvme", "chunk_size": "4MiB"}
        )

        def step() -> float:
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            return time.perf_counter() - start

        for _ in range(3):
            step()
        normal = statistics.median(step() for _ in range(5))
        path = directory / "ckpt"
        start = time.perf_counter()
        if mode == "blocking":
            rt.save(path)
            returned = time.perf_counter() - start
            return {"mode": mode, "normal_step_s": normal, "returned_s": returned, "pause_s": returned}
        pending = rt.save(path, blocking=False)
        returned = time.perf_counter() - start
        overlapped = []
        while not pending.done():
            overlapped.append(step())
        pending.wait()
        assert pending.committed_at is not None
        extra = sum(t - normal for t in overlapped)
        return {
            "mode": mode,
            "normal_step_s": normal,
            "returned_s": returned,
            "pause_s": returned + extra,
            "steps_overlapped": len(overlapped),
            "committed_after_s": pending.committed_at - start,
            "peak_copy_bytes": pending.peak_bytes,
            "bound_bytes": pending.bound_bytes,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--dir", type=arguments.directory_path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.dir)))
        return
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            directory = Path(tempfile.mkdtemp(prefix="tiermem-bench-async-"))
            try:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, "--dir", str(directory)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(result)
            print(json.dumps(result), flush=True)
    for mode in MODES:
        keys = [k for k in results[mode][0] if k != "mode"]
        medians = {k: statistics.median(r[k] for r in results[mode]) for k in keys}
        print(mode, "median:", json.dumps({k: round(v, 4) for k, v in medians.items()}))


if __name__ == "__main__":
    main()
