"""FSDP2 benchmark (issue 18): 2 ranks vs 1, and tiermem under FSDP2 vs FSDP2's own CPU offload.

The built-in GPT trained with AdamW on the CPU, each mode in a fresh process tree, the modes
alternating A B A B over ``--rounds`` (the VM throttles sustained load after ~20 s and its
speed differs from machine to machine, so only side-by-side ratios mean anything):

- ``plain1``: one process, plain PyTorch, the global batch (``world x --batch``);
- ``tiermem1``: one process, ``rt.manage`` with the optimizer states homed on NVMe, the global batch;
- ``fsdp2``: 2 gloo ranks, ``fully_shard`` per block and at the root, ``--batch`` each;
- ``fsdp2_cpuoffload``: the same plus FSDP2's ``CPUOffloadPolicy`` (on a CPU-only machine it
  moves nothing: parameters are on the CPU already, so it shows FSDP2's own cost of the policy);
- ``tiermem2``: 2 ranks, ``fully_shard`` + ``rt.manage`` with each rank's optimizer states in
  chunks homed on NVMe (``<path>/rank<R>``).

Per rank: median step time over ``--steps`` after ``--warmup``, peak RSS (``ru_maxrss``: the
whole rank process from model construction to exit: every rank builds the full model before
``fully_shard`` shards it), RSS after each measured step (what training holds), and tiermem's NVMe
bytes written/read.
Both process counts share the machine's cores: a rank runs ``cores / world`` threads.

Usage::

    .venv/bin/python bench/fsdp.py                       # 3 rounds, every mode
    .venv/bin/python bench/fsdp.py --rounds 1 --steps 2 --size tiny --json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import psutil

MODES = ("plain1", "tiermem1", "fsdp2", "fsdp2_cpuoffload", "tiermem2")
SIZES = {
    "tiny": {"n_layer": 2, "d_model": 64, "n_head": 2, "vocab_size": 256, "seq_len": 32},
    "small": {"n_layer": 4, "d_model": 384, "n_head": 6, "vocab_size": 4096, "seq_len": 128},
    # A small vocabulary: the data generator's vocab x vocab tables would dominate the RSS otherwise.
    "medium": {"n_layer": 8, "d_model": 768, "n_head": 12, "vocab_size": 2048, "seq_len": 128},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(mode: str) -> int:
    return 2 if mode.endswith("2") or mode.startswith("fsdp2") else 1


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    """One rank (or the single process) of one mode: train and write its measurements."""
    import torch

    import tiermem
    from tiermem.app.models.data import MarkovChainData
    from tiermem.app.models.gpt import GPT, GPTConfig

    warnings.simplefilter("ignore", FutureWarning)  # FSDP2/gloo deprecations in torch 2.13
    mode = args["mode"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = GPTConfig(**SIZES[args["size"]])
    model = GPT(config)
    if mode.startswith("fsdp2") or mode == "tiermem2":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        extra = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if mode == "fsdp2_cpuoffload" else {}
        for block in model.blocks:
            fully_shard(block, **extra)
        fully_shard(model, **extra)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = MarkovChainData(config.vocab_size, config.seq_len, seed=1 + rank)
    batch = args["batch"] * (2 if world == 1 else 1)  # the same global batch either way
    runtime = None
    if mode.startswith("tiermem"):
        # Each rank's files go to <path>/rank<R> (NOTE [ Ranks ] in tiermem.distributed). Capacities
        # as a user short of memory sets them: the device holds what FSDP2 keeps there (or the
        # streamed chunks), the host stages NVMe homes; the states live on NVMe.
        config = {
            "device": {"capacity": args["device"]},
            "host": {"capacity": args["host"]},
            "nvme": {"paths": [args["nvme"]]},
        }
        runtime = tiermem.Runtime(config).start()
        plan = {"persistent_chunks": 0, "state_home": "nvme", "chunk_size": args["chunk"]}
        # the declared loop: chunks step during backward and drop their gradients (NOTE [ Declared steps ])
        model, optimizer = runtime.manage(model, optimizer, plan=plan, grad_accumulation_steps=1, keep_gradients=False)
    times = []
    step_rss = 0
    process = psutil.Process()
    try:
        for step in range(args["warmup"] + args["steps"]):
            x, y = data.batch(batch)
            start = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if world > 1:
                dist.barrier()
            if step >= args["warmup"]:
                times.append(time.perf_counter() - start)
                step_rss = max(step_rss, process.memory_info().rss)
        nvme = {}
        if runtime is not None:
            tiers = runtime.stats().as_dict()["tiers"]
            nvme = {k: tiers["nvme"][k] for k in ("bytes_written", "bytes_read")}
    finally:
        if runtime is not None:
            runtime.close()
    result = {
        "rank": rank,
        "median_step_s": statistics.median(times),
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_rss_mib": step_rss / 2**20,  # RSS after each measured step: what training holds
        "params": sum(p.numel() for p in model.parameters()),
        "nvme": nvme,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    if world > 1:
        dist.barrier()  # leave together (gloo aborts a peer whose connections vanish)
        dist.destroy_process_group()


def _worker(args: argparse.Namespace) -> None:
    """One mode in this fresh process: spawn its ranks, print their measurements as JSON."""
    import torch.multiprocessing as mp

    world = _world(args.worker)
    settings = {
        "mode": args.worker,
        "size": args.size,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "nvme": args.nvme,
        "device": args.device,
        "host": args.host,
        "chunk": args.chunk,
    }
    with tempfile.TemporaryDirectory() as out:
        if world == 1:
            _rank_main(0, 1, 0, settings, out)
        else:
            mp.spawn(_rank_main, args=(world, _free_port(), settings, out), nprocs=world, join=True)
        ranks = [_read_json(os.path.join(out, f"rank{r}.json")) for r in range(world)]
    print(json.dumps({"mode": args.worker, "world": world, "ranks": ranks}))


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _machine(path: str) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    from tiermem.tiers.fsinfo import filesystem_of

    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "nvme_fs": filesystem_of(path).fstype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch (one process runs twice that)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--nvme", default=None, help="directory for NVMe tiers (default: a temporary one)")
    parser.add_argument("--device", default="320MiB", help="tiermem modes: [device] capacity per rank")
    parser.add_argument("--host", default="160MiB", help="tiermem modes: [host] capacity per rank")
    parser.add_argument("--chunk", default="16MiB", help="tiermem modes: chunk size")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    # glibc returns freed blocks to the system (TRAPS 8), so RSS shows what each mode holds, not
    # what malloc kept of staging buffers freed long ago; the same for every mode.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    with tempfile.TemporaryDirectory(dir=args.nvme) as nvme:
        for _ in range(args.rounds):
            for mode in modes:  # A B A B: every mode once per round, in a fresh process tree
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    mode,
                    "--size",
                    args.size,
                    "--batch",
                    str(args.batch),
                    "--warmup",
                    str(args.warmup),
                    "--steps",
                    str(args.steps),
                    "--nvme",
                    nvme,
                    "--device",
                    args.device,
                    "--host",
                    args.host,
                    "--chunk",
                    args.chunk,
                ]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
        machine = _machine(nvme)
    summary = _summarize(results)
    if args.json:
        print(json.dumps({"machine": machine, "summary": summary, "runs": results}, indent=2))
        return
    print(f"machine: {machine}")
    print(
        f"{'mode':<18}{'ranks':>6}{'step s':>10}{'vs plain1':>11}{'maxrss/rank':>13}{'step RSS/rank':>15}"
        f"{'NVMe W/rank MiB':>17}"
    )
    for mode, row in summary.items():
        print(
            f"{mode:<18}{row['world']:>6}{row['median_step_s']:>10.3f}{row['step_vs_plain1'] or float('nan'):>11.2f}"
            f"{row['median_rss_mib']:>13.0f}{row['median_step_rss_mib']:>15.0f}{row['nvme_written_mib']:>17.1f}"
        )


def _summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians over rounds of the slowest rank's step and the largest rank's RSS."""
    summary: dict[str, dict[str, Any]] = {}
    for mode, runs in results.items():
        steps = [max(r["median_step_s"] for r in run["ranks"]) for run in runs]
        rss = [max(r["ru_maxrss_mib"] for r in run["ranks"]) for run in runs]
        step_rss = [max(r["step_rss_mib"] for r in run["ranks"]) for run in runs]
        written = [max(r["nvme"].get("bytes_written", 0) for r in run["ranks"]) / 2**20 for run in runs]
        summary[mode] = {
            "world": runs[0]["world"],
            "median_step_s": statistics.median(steps),
            "median_rss_mib": statistics.median(rss),
            "median_step_rss_mib": statistics.median(step_rss),
            "nvme_written_mib": statistics.median(written),
        }
    base = summary.get("plain1", {}).get("median_step_s")
    for row in summary.values():
        row["step_vs_plain1"] = row["median_step_s"] / base if base else None
    return summary


if __name__ == "__main__":
    main()
