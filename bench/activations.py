"""Activation offload benchmark: keep vs nvme vs auto vs recompute vs host on one GPT.

Issue 4's goals, measured side by side: the ``nvme`` policy's activation peak <= 0.5x of
``keep`` at median step time <= 1.05x of ``keep``; ``auto`` no slower than ``nvme``;
``nvme`` faster than ``recompute`` at a lower peak.

Each measurement is a fresh process (``--worker``), and the policies alternate in rounds
(keep, nvme, auto, recompute, host, keep, nvme, ...) so the VM's throttling after ~20 s of
load hits every policy alike. Peak memory is measured two ways side by side:

- process RSS: the peak during the measured steps minus RSS before the first step, sampled
  every millisecond, with ``MALLOC_MMAP_THRESHOLD_`` set so glibc returns freed blocks
  (TRAPS 8);
- tiermem's own accounting: the peak bytes of saved activations resident on the device.

Usage::

    .venv/bin/python bench/activations.py                      # the issue's model (8x512, seq 512, batch 4)
    .venv/bin/python bench/activations.py --layers 2 --seq 128 --rounds 1 --steps 2   # a quick look
    .venv/bin/python bench/activations.py --hf --policies keep,nvme   # issue 33: HF GPT-2, same sizes
    python3 bench/activations.py --device cuda --policies keep,nvme,auto   # on a GPU (bench/gpu_check.sh)

On ``--device cuda`` the device's own peak (``torch.cuda.max_memory_allocated`` over the measured
steps) is printed per policy beside the host RSS, which offloading to NVMe does not change much.
That peak holds the model, its gradients and AdamW's states besides the activations, so its ratio
to ``keep`` is above the activations' own; tiermem's peak of resident activations is the column
beside it.

Besides step time and peaks it prints CPU seconds per step by thread (the training thread,
tiermem's own threads with their kernel share, torch's workers) and, for each offloading
policy, that CPU per GiB moved (written plus read back) against ``keep``: what the offload path
costs where compute already fills every core (TRAPS 7).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path

POLICIES = ["keep", "nvme", "auto", "recompute", "host"]


def _worker(args: argparse.Namespace) -> dict:
    import psutil
    import torch

    import tiermem
    from tiermem.app.models.gpt import GPT, GPTConfig
    from tiermem.app.train import train_step

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(args.device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    cuda = args.device == "cuda"
    model: torch.nn.Module
    if args.hf:
        # Issue 33's case: Hugging Face GPT-2 built from a config (no download), its loss
        # computed inside from ``labels``, its GPT2Block layers the offloader's blocks.
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_config = GPT2Config(
            n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, n_positions=args.seq, vocab_size=args.vocab
        )
        model = GPT2LMHeadModel(hf_config)
    else:
        model = GPT(
            GPTConfig(
                n_layer=args.layers, d_model=args.d_model, n_head=args.heads, vocab_size=args.vocab, seq_len=args.seq
            )
        )
    model.to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    process = psutil.Process()
    main_tid = threading.get_native_id()
    tier_config = {
        "device": {"device": args.device, "capacity": "8GiB"},
        "host": {"capacity": "4GiB"},
        "nvme": {"paths": [args.path], "capacity": "32GiB"},
        "activations": {"min_bytes": "1MiB"},
    }
    if args.block_size:
        tier_config["nvme"]["block_size"] = args.block_size
    with tiermem.Runtime(tier_config) as rt:

        def step() -> float:
            if not args.hf:
                return train_step(rt, model, optimizer, x, y, args.policy)[1]
            start = time.perf_counter()
            with rt.offload_activations(model, policy=args.policy):
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # also waits for the device, so the time covers the whole step
            return time.perf_counter() - start

        step()  # warm-up: allocator, thread pools, and auto's first measurement
        base_rss = process.memory_info().rss
        peak = [base_rss]
        running = True

        def sample() -> None:
            while running:
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.001)

        if cuda:  # the device's own peak over the measured steps: what activation offload saves there
            torch.cuda.reset_peak_memory_stats()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        before = rt.stats().as_dict()["activations"]
        threads_before = _thread_cpu(process, main_tid)
        cpu_before = process.cpu_times()
        faults_before = resource.getrusage(resource.RUSAGE_SELF)
        times = [step() for _ in range(args.steps)]
        faults_after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_after = process.cpu_times()
        threads_after = _thread_cpu(process, main_tid)
        running = False
        sampler.join()
        after = rt.stats().as_dict()
    activations = after["activations"]
    # CPU seconds per step by thread group over the measured steps (a thread that ended
    # meanwhile drops out: tiermem's threads live as long as the Runtime).
    threads = {k: (threads_after[k] - threads_before[k]) / args.steps for k in threads_after}
    return {
        "policy": args.policy,
        "step_s": times,
        # CPU seconds of the whole process (every thread) per step: the work offloading adds,
        # less sensitive than wall time to other processes sharing the cores (TRAPS 7).
        "cpu_s_per_step": (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / args.steps,
        # The kernel's share of it (I/O submission, page faults on fresh allocations) and the
        # minor page faults taken: where the CPU that offloading adds goes.
        "sys_s_per_step": (cpu_after.system - cpu_before.system) / args.steps,
        "minor_faults_per_step": (faults_after.ru_minflt - faults_before.ru_minflt) // args.steps,
        "rss_peak_delta": peak[0] - base_rss,
        # on CUDA: the caching allocator's peak over the measured steps (model, optimizer and activations)
        "device_peak": torch.cuda.max_memory_allocated() if cuda else None,
        "tiermem_peak_resident": activations["peak_resident_bytes"],
        "captured_per_step": (activations["captured_bytes"] - before["captured_bytes"]) // args.steps,
        "nvme_written_per_step": (activations["bytes_written"]["nvme"] - before["bytes_written"]["nvme"]) // args.steps,
        # Every tier's bytes written and read back: what the per-GiB CPU cost divides by.
        "moved_per_step": sum(
            activations[key][tier] - before[key].get(tier, 0)
            for key in ("bytes_written", "bytes_read")
            for tier in activations[key]
        )
        // args.steps,
        "thread_cpu_s_per_step": threads,
        "backward_wait_s": activations["backward_wait_s"] - before["backward_wait_s"],
        "fallbacks": activations["fallbacks"] - before["fallbacks"],
        "write_link": after["links"].get("device->nvme", {}),
    }


def _thread_cpu(process: object, main_tid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``process``'s threads by group: ``training`` (the calling
    thread: compute plus the saved-tensor hooks), ``tiermem`` (its I/O, scheduler and copy
    threads, named ``tiermem-*``), ``other`` (torch's intra-op workers: native threads Python
    does not know, which the keep run has too); ``tiermem_sys``: the kernel's share of the
    tiermem threads (O_DIRECT submission, pinning and faulting the pages it moves)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups = {"training": 0.0, "tiermem": 0.0, "tiermem_sys": 0.0, "other": 0.0}
    for thread in process.threads():  # type: ignore[attr-defined]
        cpu = thread.user_time + thread.system_time
        if thread.id == main_tid:
            groups["training"] += cpu
        elif names.get(thread.id, "").startswith("tiermem"):
            groups["tiermem"] += cpu
            groups["tiermem_sys"] += thread.system_time
        else:
            groups["other"] += cpu
    return groups


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def _machine(path: str) -> dict:
    import psutil

    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "load_at_start": round(os.getloadavg()[0], 1),  # other processes sharing the cores
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nvme_path": path,
        "filesystem": next(
            (
                p.fstype
                for p in sorted(psutil.disk_partitions(all=True), key=lambda p: -len(p.mountpoint))
                if path.startswith(p.mountpoint)
            ),
            "unknown",
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per process")
    parser.add_argument("--rounds", type=int, default=3, help="A B A B rounds over the policies")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--path", type=arguments.directory, default=None, help="NVMe directory (default: a temp dir)")
    parser.add_argument(
        "--block-size", default=None, help="[nvme] block_size, also the scheduler's request size (default: config's)"
    )
    parser.add_argument(
        "--hf", action="store_true", help="Hugging Face GPT-2 from a config (issue 33's case) instead of tiermem's GPT"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model trains (default cpu: the device tier is the CPU under a byte budget); cuda on a GPU",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    path = args.path or tempfile.mkdtemp(prefix="tiermem-bench-")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    passthrough = [
        f"--layers={args.layers}",
        f"--d-model={args.d_model}",
        f"--heads={args.heads}",
        f"--vocab={args.vocab}",
        f"--seq={args.seq}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--path={path}",
        *(["--hf"] if args.hf else []),
        f"--device={args.device}",
        *([f"--block-size={args.block_size}"] if args.block_size else []),
    ]
    policies = args.policies.split(",")
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    machine = _machine(path)
    print(f"machine: {json.dumps(machine)}", file=sys.stderr)
    for round_ in range(args.rounds):
        for policy in policies:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", f"--policy={policy}", *passthrough],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:  # the worker's own error, not only its exit status
                print(out.stderr, file=sys.stderr)
                raise SystemExit(f"bench/activations.py: the {policy} worker failed (exit {out.returncode}), above")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[policy].append(result)
            print(
                f"round {round_ + 1} {policy:<9} median step {statistics.median(result['step_s']):.3f}s  "
                f"CPU {result['cpu_s_per_step']:.2f}s/step (sys {result['sys_s_per_step']:.2f})  "
                f"faults {result['minor_faults_per_step'] / 1000:.0f}k/step  "
                f"RSS peak +{result['rss_peak_delta'] / 2**20:.0f}MiB  "
                f"tiermem peak {result['tiermem_peak_resident'] / 2**20:.0f}MiB  "
                f"load {os.getloadavg()[0]:.1f}",  # other processes on the machine (2 cores here)
                file=sys.stderr,
            )
    if not args.path:
        os.rmdir(path)
    summary = {}
    for policy, results in runs.items():
        summary[policy] = {
            "median_step_s": statistics.median(t for r in results for t in r["step_s"]),
            "cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in results),
            "sys_s_per_step": statistics.median(r["sys_s_per_step"] for r in results),
            "minor_faults_per_step": int(statistics.median(r["minor_faults_per_step"] for r in results)),
            "rss_peak_delta_bytes": int(statistics.median(r["rss_peak_delta"] for r in results)),
            **(
                {"device_peak_bytes": int(statistics.median(r["device_peak"] for r in results))}
                if args.device == "cuda"
                else {}
            ),
            "tiermem_peak_resident_bytes": int(statistics.median(r["tiermem_peak_resident"] for r in results)),
            "captured_bytes_per_step": results[-1]["captured_per_step"],
            "nvme_written_per_step": results[-1]["nvme_written_per_step"],
            "backward_wait_s": statistics.median(r["backward_wait_s"] / args.steps for r in results),
            "moved_per_step": results[-1]["moved_per_step"],
            **{
                f"{group}_cpu_s": statistics.median(r["thread_cpu_s_per_step"][group] for r in results)
                for group in ("training", "tiermem", "tiermem_sys", "other")
            },
            "fallbacks": sum(r.get("fallbacks", 0) for r in results),
        }
    keep = summary.get("keep")
    if args.json:
        print(json.dumps({"machine": machine, "args": passthrough, "policies": summary}, indent=2))
        return 0
    print(f"machine: {machine}")
    print(
        f"model: {args.layers} layers, d={args.d_model}, {args.heads} heads, vocab {args.vocab}, "
        f"seq {args.seq}, batch {args.batch}; {args.rounds} rounds x {args.steps} steps per policy"
    )
    header = (
        f"{'policy':<10} {'step s':>8} {'x keep':>7} {'CPU s':>6} {'x keep':>7} {'RSS peak':>10} {'x keep':>7} "
        f"{'tiermem peak':>13} {'x keep':>7} {'nvme/step':>10} {'bwd wait':>9} {'fallbacks':>9}"
    )
    print(header)
    for policy, s in summary.items():

        def ratio(key: str, s: dict = s) -> str:
            return f"{s[key] / keep[key]:.2f}" if keep and keep[key] else "-"

        print(
            f"{policy:<10} {s['median_step_s']:>8.3f} {ratio('median_step_s'):>7} "
            f"{s['cpu_s_per_step']:>6.2f} {ratio('cpu_s_per_step'):>7} "
            f"{s['rss_peak_delta_bytes'] / 2**20:>8.0f}Mi {ratio('rss_peak_delta_bytes'):>7} "
            f"{s['tiermem_peak_resident_bytes'] / 2**20:>11.0f}Mi {ratio('tiermem_peak_resident_bytes'):>7} "
            f"{s['nvme_written_per_step'] / 2**20:>8.0f}Mi {s['backward_wait_s']:>9.3f} {s['fallbacks']:>9}"
        )
    if args.device == "cuda":
        for policy, s in summary.items():
            share = f" = {s['device_peak_bytes'] / keep['device_peak_bytes']:.2f}x keep" if keep else ""
            peak = s["device_peak_bytes"] / 2**20
            print(f"{policy:<10} GPU memory peak (torch.cuda.max_memory_allocated) {peak:.0f}Mi{share}")
    _print_cpu_cost(summary)
    return 0


def _print_cpu_cost(summary: dict[str, dict]) -> None:
    """Where the offload path's CPU goes, per GiB moved (written + read back): the training
    thread's extra over keep (the saved-tensor hooks), tiermem's own threads (scheduler, I/O
    submission and reaping, copies; their kernel share apart) and the whole process's extra
    over keep. CPU seconds, not wall: less sensitive to other processes on the cores, and on
    a machine whose compute fills every core each CPU second of the I/O path displaces compute."""
    keep = summary.get("keep")
    print("CPU s per step by thread: training | tiermem threads (kernel) | other (torch workers)")
    for policy, s in summary.items():
        line = (
            f"{policy:<10} {s['training_cpu_s']:>6.2f} | {s['tiermem_cpu_s']:>5.2f} ({s['tiermem_sys_cpu_s']:.2f}) "
            f"| {s['other_cpu_s']:>6.2f}"
        )
        gib = s["moved_per_step"] / 2**30
        if gib > 0:
            line += f"   moved {gib:.2f} GiB/step: tiermem threads {s['tiermem_cpu_s'] / gib:.3f} CPU s/GiB"
            if keep:
                extra = s["cpu_s_per_step"] - keep["cpu_s_per_step"]
                training = s["training_cpu_s"] - keep["training_cpu_s"]
                line += f", training thread {training / gib:+.3f}, process {extra / gib:+.3f} over keep"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
