"""The optimizer step under ``rt.manage`` against plain PyTorch, per AdamW flag: the default
(single-tensor on the CPU), ``foreach=True`` and ``fused=True`` (NOTE [ Exact optimizer step ],
NOTE [ Step threads ]).

Each measurement is a fresh process, modes alternating A B A B over rounds so a slow stretch of a
noisy machine falls on all of them; medians are reported. The model: ``--layers`` Linear layers of
``--width`` (GELU between), ``--rows`` rows a batch, AdamW(lr=1e-3, weight_decay=0.01); after
``--warmup`` steps, ``--steps`` steps are timed. Modes, per flag:

- ``plain``: plain PyTorch;
- ``host`` / ``nvme``: ``rt.manage`` with every chunk's states homed on the host / on NVMe (device
  capacity a quarter of the parameters' bytes), a plain loop: the step runs whole at
  ``optimizer.step()`` (step thread at its default, ``TIERMEM_MODEL_STATES_STEP_THREAD`` unset);
- ``host-declared`` / ``nvme-declared`` with ``-off`` / ``-on``: the declared loop
  (``grad_accumulation_steps=1, keep_gradients=False``): chunks step during backward, on the
  training thread (``TIERMEM_MODEL_STATES_STEP_THREAD=off``) or on the step thread (``on``).

Reported per mode: ``step_ns_per_param`` (the median ``optimizer.step()`` time over the parameter
count; for declared loops only what is left at ``optimizer.step()``), ``train_step_s`` (median of
forward + backward + step + zero_grad) and ``cpu_s_per_step`` (process CPU time per step). Every
mode of a flag must end with bitwise the same parameters as plain PyTorch: the run fails otherwise.

    .venv/bin/python bench/optimizer_step.py --rounds 2
    .venv/bin/python bench/optimizer_step.py --flags fused --modes plain,host-declared-off,host-declared-on
"""

from __future__ import annotations

import argparse
import hashlib
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
import machine  # bench/machine.py: run as `python bench/NAME.py`, the folder is on sys.path

FLAGS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
MODES = (
    "plain",
    "host",
    "nvme",
    "host-declared-off",
    "host-declared-on",
    "nvme-declared-off",
    "nvme-declared-on",
)


def _config(directory: Path, param_bytes: int, home: str) -> dict[str, Any]:
    (directory / "nvme").mkdir(exist_ok=True)
    host = 4 * param_bytes if home == "host" else 2 * param_bytes  # NVMe homes: gradients and two staged homes
    return {
        "device": {"capacity": param_bytes // 4 + (8 << 20), "device": "cpu"},
        "host": {"capacity": host + (16 << 20)},
        "nvme": {"paths": [str(directory / "nvme")], "capacity": 8 * param_bytes, "block_size": "1MiB"},
        "scheduler": {"loop": "asyncio"},
    }


# long: one timed loop per mode, kept in one place so every mode is measured alike
def _child(flag: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    if mode.endswith(("-on", "-off")):
        os.environ["TIERMEM_MODEL_STATES_STEP_THREAD"] = mode.rsplit("-", 1)[1]
    import resource

    import torch
    from torch import nn

    import tiermem

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers)
    params = sum(p.numel() for p in model.parameters())
    param_bytes = params * 4
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(args.rows, args.width, generator=data) for _ in range(args.warmup + args.steps)]
    kwargs = {"lr": 1e-3, "weight_decay": 0.01, **FLAGS[flag]}
    runtime = None
    if mode == "plain":
        optimizer = torch.optim.AdamW(model.parameters(), **kwargs)
    else:
        runtime = tiermem.Runtime(_config(args.dir, param_bytes, mode.split("-")[0])).__enter__()
        declared = {"grad_accumulation_steps": 1, "keep_gradients": False} if "declared" in mode else {}
        chunk = max(p.numel() * 4 for p in model.parameters()) + (1 << 20)  # a layer a chunk
        plan = {"state_home": mode.split("-")[0], "chunk_size": chunk}
        model, optimizer = runtime.manage(model, torch.optim.AdamW, plan=plan, **declared, **kwargs)
    steps, totals = [], []
    cpu_start, faults_start = 0.0, 0
    try:
        for i, x in enumerate(batches):
            if i == args.warmup:
                cpu_start = time.process_time()
                faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            before_step = time.perf_counter()
            optimizer.step()
            stepped = time.perf_counter()
            optimizer.zero_grad()
            if i >= args.warmup:
                steps.append(stepped - before_step)
                totals.append(time.perf_counter() - start)
        cpu = (time.process_time() - cpu_start) / args.steps
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start) / args.steps
    finally:
        if runtime is not None:
            runtime.__exit__(None, None, None)
    digest = hashlib.sha256()
    for p in model.parameters():  # ordinary tensors again once the runtime closed
        digest.update(p.detach().clone().numpy().tobytes())
    return {
        "flag": flag,
        "mode": mode,
        "params": params,
        "step_ns_per_param": statistics.median(steps) / params * 1e9,
        "train_step_s": statistics.median(totals),
        "cpu_s_per_step": cpu,
        "page_faults_per_step": faults,
        "sha256": digest.hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flags", default=",".join(FLAGS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--dir", type=arguments.directory_path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--child", nargs=2, metavar=("FLAG", "MODE"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], args)))
        return
    flags, modes = args.flags.split(","), args.modes.split(",")
    unknown = [f for f in flags if f not in FLAGS] + [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown flags/modes {unknown}; flags: {', '.join(FLAGS)}; modes: {', '.join(MODES)}")
    print(json.dumps({"machine": machine.facts(), "args": {k: str(v) for k, v in vars(args).items()}}), flush=True)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "rows", "warmup", "steps", "threads")]
    for _ in range(args.rounds):
        for flag in flags:
            for mode in modes:
                directory = Path(tempfile.mkdtemp(prefix="tiermem-bench-step-", dir=args.dir))
                try:
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", flag, mode, f"--dir={directory}", *passthrough],
                        capture_output=True,
                        text=True,
                    )
                    if out.returncode:
                        sys.exit(f"bench optimizer_step: {flag} {mode} failed:\n{out.stderr[-3000:]}")
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((flag, mode), []).append(result)
                print(json.dumps(result), flush=True)
    _summarise(results, flags, modes)


def _summarise(results: dict[tuple[str, str], list[dict[str, Any]]], flags: list[str], modes: list[str]) -> None:
    keys = ("step_ns_per_param", "train_step_s", "cpu_s_per_step")
    header = f"{'flag':8} {'mode':18} {'step ns/param':>13} {'train step s':>12} {'cpu s/step':>10} {'x plain':>7}"
    print(header, " bitwise")
    failed = []
    for flag in flags:
        plain = results.get((flag, "plain"))
        base = statistics.median(r["train_step_s"] for r in plain) if plain else None
        hashes = {r["sha256"] for mode in modes for r in results[flag, mode]}
        for mode in modes:
            med = {k: statistics.median(r[k] for r in results[flag, mode]) for k in keys}
            ratio = f"{med['train_step_s'] / base:7.3f}" if base else "      -"
            same = len(hashes) == 1
            print(
                f"{flag:8} {mode:18} {med['step_ns_per_param']:13.2f} {med['train_step_s']:12.3f} "
                f"{med['cpu_s_per_step']:10.3f} {ratio}  {'yes' if same else 'NO'}"
            )
        if len(hashes) != 1:
            failed.append(flag)
    if failed:
        sys.exit(f"bench optimizer_step: parameters differ between modes for {failed}: not bitwise plain PyTorch")


if __name__ == "__main__":
    main()
