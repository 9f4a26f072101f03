"""Model-state benchmark (issue 5): a GPT trained with AdamW, plain PyTorch vs ``rt.manage``.

The issue's goal, on the CPU: the ~200M-parameter GPT (16 layers, d=1024, 16 heads, vocab
8192, seq 256, batch 2x256) with device and host capacities at 10% of the model-state bytes
(16 bytes a parameter for fp32 AdamW) each and the rest on NVMe reaches peak process RSS
<= 0.45x and median step time <= 1.15x of plain PyTorch. Also reported: bytes moved per step
on each link against the minimum the plan needs, and (``--scaling``) time and I/O per
parameter at 50M / 100M / 200M.

Each measurement is a fresh process (``--worker``: one mode, one size) so its RSS peak is its
own, and the modes alternate A B A B over ``--rounds`` so the VM's throttling after ~20 s of
load hits both alike. Per process: ``--warmup`` steps (the first ``optimizer.step()`` is what
arms the early chunk steps of NOTE [ Declared steps ]), then ``--steps`` measured steps.
Memory is measured three ways side by side: process RSS sampled every 2 ms during the
measured steps (absolute: the whole process, Python and torch included), ``ru_maxrss`` over
the whole process life (model construction included), and tiermem's own accounting (each
tier's ``peak_bytes``). ``MALLOC_MMAP_THRESHOLD_`` is set so glibc returns freed blocks
(TRAPS 8).

tiermem mode: ``rt.manage(model, torch.optim.AdamW, plan={"block_policy": --activations},
lr=..., grad_accumulation_steps=1, keep_gradients=False)`` (the planner plans the model states
at the first step around that activation policy, or the default rule carries on where no plan
fits: the worker reports which, ``planned``) (declaring the loop lets offloaded chunks step during backward; the
loop zeroes gradients after each step anyway, so they are dropped as soon as each chunk stepped
and the host holds only those on their way, ``--no-free-gradients`` keeps them until step()),
forward and backward inside
``rt.offload_activations(model, policy=--activations)``: the saved activations of a 200M GPT
at batch 2x256 (~560 MB) do not fit a device budget the chunks already fill. When the plan is
refused at the asked capacities, ``--fit`` (default) raises the refused tier to what the
planner says it needs (rounded up to a whole percent of the state bytes) and says so.

Usage::

    .venv/bin/python bench/states.py                         # the headline: 200M, 3 rounds
    .venv/bin/python bench/states.py --scaling --rounds 1    # 50M / 100M / 200M table
    .venv/bin/python bench/states.py --size tiny --rounds 1 --steps 2 --json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

# What the caller set, read before anything imports tiermem (which sets a default of 1):
# plain PyTorch runs with torch's own default (off) unless the caller chose, as a user's
# plain training script would; tiermem runs with whatever import tiermem leaves.
CALLER_THP = os.environ.get("THP_MEM_ALLOC_ENABLE")

#: name -> GPTConfig fields and batch size; the three scaling sizes differ only in depth, so
#: compute and bytes per parameter are comparable (the 32 MiB tied embedding is a fixed part).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "d_model": 128, "n_head": 4, "vocab_size": 512, "seq_len": 64, "batch": 2},
    "50M": {"n_layer": 3, "d_model": 1024, "n_head": 16, "vocab_size": 8192, "seq_len": 256, "batch": 2},
    "100M": {"n_layer": 7, "d_model": 1024, "n_head": 16, "vocab_size": 8192, "seq_len": 256, "batch": 2},
    "200M": {"n_layer": 16, "d_model": 1024, "n_head": 16, "vocab_size": 8192, "seq_len": 256, "batch": 2},
}
MODES = ("plain", "tiermem")
STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient and two AdamW states
GOAL_RSS, GOAL_TIME = 0.45, 1.15
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


# -- the worker: one process, one mode, one size -------------------------------------------------
class _RssSampler:
    """Peak RSS of this process, read from /proc/self/statm every 2 ms on a thread (cheaper
    than psutil, so the sampling itself steals little of the two cores)."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def stop(self) -> int:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, _rss())
        return self.peak


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _needed(message: str) -> dict[str, int]:
    """The bytes a refused plan says each tier needs ("the host needs 937.96MiB ..."), or, from the
    default rule's refusal, the smallest capacities with which it fits ("[host] 1.27MiB (1331200
    bytes)"): where a tier already has that much, raising it to that changes nothing."""
    needs: dict[str, int] = {}
    for tier, number, unit in re.findall(r"the (device|host) needs ([\d.]+)\s*(B|KiB|MiB|GiB|TiB)", message):
        needs[tier] = int(float(number) * _UNITS[unit]) + 1
    smallest = message.partition("The smallest capacities with which")[2]
    for tier, exact in re.findall(r"\[(device|host)\] \S+ \((\d+) bytes\)", smallest):
        needs[tier] = max(needs.get(tier, 0), int(exact))
    return needs


def _minimum_bytes(
    chunks: list[dict[str, Any]], buffers: int, sections: int, early: bool, grads_in_place: bool
) -> dict[str, int]:
    """The bytes per step the plan cannot avoid moving, per link (formula in bench/README.md).

    Every streamed chunk's parameters are read home->device in forward and again in backward,
    except the last ``buffers`` streamed chunks of forward, which the pool can still hold when
    backward starts; each trainable streamed chunk's gradients go device->host once; each
    NVMe home (master + ``sections`` optimizer states) is read to the host and written back
    once for the step, except that a chunk stepping early (``early``: the loop steps every
    backward) gets its master from its device copy
    (device->host) instead of NVMe (NOTE [ Declared steps ] rule 7), and with
    ``grads_in_place`` (early steps of freed gradients on the CPU device, rule 8) reads its
    gradients where they are. Persistent chunks and host homes move nothing else."""
    streamed = [c for c in chunks if not c["persistent"]]
    held = {c["index"] for c in streamed[len(streamed) - buffers :]} if buffers else set()
    links = {"host->device": 0, "nvme->device": 0, "device->host": 0, "nvme->host": 0, "host->nvme": 0}
    for c in streamed:
        source = "nvme->device" if c["home"] == "nvme" else "host->device"
        links[source] += c["nbytes"] * (1 if c["index"] in held else 2)
        if c["trainable"] and not (early and grads_in_place):
            links["device->host"] += c["nbytes"]
        if c["home"] == "nvme":
            home = c["nbytes"] * (1 + (sections if c["trainable"] else 0))
            known = c["nbytes"] if early and c["trainable"] else 0
            links["nvme->host"] += home - known
            links["device->host"] += known
            links["host->nvme"] += home
    return links


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tiermem.app.models.gpt import GPT, GPTConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    config = GPTConfig(**{k: v for k, v in size.items() if k != "batch"})
    rss_start = _rss()
    torch.manual_seed(0)
    model = GPT(config)
    params = model.num_parameters()
    state_bytes = STATE_BYTES_PER_PARAM * params
    rss_model = _rss()
    generator = torch.Generator().manual_seed(1)
    total = args.warmup + args.steps
    batches = [
        torch.randint(0, config.vocab_size, (size["batch"], config.seq_len + 1), generator=generator)
        for _ in range(total)
    ]
    result: dict[str, Any] = {"mode": args.mode, "size": args.size, "params": params, "state_bytes": state_bytes}
    result["thp_mem_alloc_enable"] = os.environ.get("THP_MEM_ALLOC_ENABLE")

    cpu_times: list[float] = []
    #: kernel seconds and minor page faults a step (fresh pages the kernel zeroes and maps)
    kernel: list[tuple[float, int]] = []

    def run(step: Any) -> tuple[list[float], list[float], int]:
        losses, times = [], []
        sampler: _RssSampler | None = None
        for i, tokens in enumerate(batches):
            if i == args.warmup:
                sampler = _RssSampler()
                on_entry()
            start, cpu = time.perf_counter(), _cpu_s()
            before = resource.getrusage(resource.RUSAGE_SELF)
            losses.append(step(tokens[:, :-1], tokens[:, 1:]))
            times.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            kernel.append((after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt))
            # CPU seconds of every thread of the process: the work a step costs, which other
            # processes on a shared machine inflate far less than they inflate wall time
            cpu_times.append(_cpu_s() - cpu)
        assert sampler is not None
        return losses, times[args.warmup :], sampler.stop()

    entry: dict[str, Any] = {}
    if args.mode == "plain":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def on_entry() -> None:
            pass

        def plain_step(x: torch.Tensor, y: torch.Tensor) -> float:
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        losses, times, rss_peak = run(plain_step)
    else:
        import logging

        import tiermem
        from tiermem.states import StatesMemoryError

        class _Record(logging.Handler):  # the planner's and the manager's warnings, for the summary
            def emit(self, record: logging.LogRecord) -> None:
                result.setdefault("log", []).append(record.getMessage())

        logging.getLogger("tiermem").addHandler(_Record(logging.INFO))

        capacities = {"device": int(state_bytes * args.device_fraction), "host": int(state_bytes * args.host_fraction)}
        refused: list[str] = []
        while True:
            tier_config = {
                "device": {"device": "cpu", "capacity": capacities["device"]},
                "host": {"capacity": capacities["host"]},
                # NVMe homes hold 12 of the 16 bytes a parameter; activations come on top.
                "nvme": {"paths": [args.nvme_path], "capacity": 2 * state_bytes + (1 << 30)},
                "activations": {"min_bytes": "1MiB"},
            }
            rt = tiermem.Runtime(tier_config).start()
            try:
                # The planner plans at the first step (NOTE [ Model-state rules ] rule 9) around
                # the activation policy the loop runs; with none managed, it plans freely.
                fixed = args.activations in ("keep", "recompute", "host", "nvme")
                model, optimizer = rt.manage(
                    model,
                    torch.optim.AdamW,
                    plan={"block_policy": args.activations} if fixed else "auto",
                    lr=1e-4,
                    grad_accumulation_steps=1,
                    keep_gradients=not args.free_gradients,
                )
                break
            except StatesMemoryError as exc:
                rt.close()
                refused.append(str(exc))
                needs = _needed(str(exc))
                if not args.fit or not needs or len(refused) > 4:
                    return {**result, "error": str(exc), "refused": refused}
                percent = state_bytes / 100  # raise to the next whole percent of the state bytes
                for tier, need in needs.items():
                    capacities[tier] = max(capacities[tier], int(-(-need // percent) * percent))
        try:
            policy = None if args.activations == "none" else args.activations

            def on_entry() -> None:
                entry["stats"] = rt.stats().as_dict()

            def managed_step(x: torch.Tensor, y: torch.Tensor) -> float:
                if policy is None:
                    _, loss = model(x, y)
                    assert loss is not None
                    loss.backward()
                else:
                    with rt.offload_activations(model, policy=policy):
                        _, loss = model(x, y)
                        assert loss is not None
                        loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.item()

            losses, times, rss_peak = run(managed_step)
            after = rt.stats().as_dict()
            described = rt._model_states[0].describe()  # the chunks the plan made (sizes, homes)
        finally:
            rt.close()
        before = entry["stats"]
        steps = args.steps
        links = {
            name: (link["bytes"] - before["links"].get(name, {}).get("bytes", 0)) // steps
            for name, link in after["links"].items()
        }
        act_w = {
            t: (after["activations"]["bytes_written"].get(t, 0) - before["activations"]["bytes_written"].get(t, 0))
            // steps
            for t in ("host", "nvme")
        }
        act_r = {
            t: (after["activations"]["bytes_read"].get(t, 0) - before["activations"]["bytes_read"].get(t, 0)) // steps
            for t in ("host", "nvme")
        }
        activation_links = {
            "device->nvme": act_w["nvme"],
            "nvme->device": act_r["nvme"],
            "device->host": act_w["host"],
            "host->device": act_r["host"],
        }
        plan = described["plan"]
        chunks = described["chunks"]
        minimum = _minimum_bytes(
            chunks, plan["buffers"], 2, early=described["early_chunk_steps"] > 0, grads_in_place=args.free_gradients
        )
        result.update(
            capacities=capacities,
            fractions={tier: capacities[tier] / state_bytes for tier in capacities},
            refused=refused,
            plan={
                "chunk_size": plan["chunk_size"],
                "chunks": len(chunks),
                "persistent_chunks": plan["persistent_chunks"],
                "buffers": plan["buffers"],
                "homes": {home: plan["state_home"].count(home) for home in ("device", "host", "nvme")},
                "planned": (plan.get("predicted") or {}).get("step_s") is not None,
                "predicted": plan.get("predicted"),
                "streamed_bytes": sum(c["nbytes"] for c in chunks if not c["persistent"]),
            },
            tiers={n: {"capacity": t["capacity"], "peak_bytes": t["peak_bytes"]} for n, t in after["tiers"].items()},
            links_per_step=links,
            activation_links_per_step={k: v for k, v in activation_links.items() if v},
            state_links_per_step={name: links.get(name, 0) - activation_links.get(name, 0) for name in links},
            minimum_links_per_step=minimum,
            activations={
                "policy": args.activations,
                "captured_per_step": (after["activations"]["captured_bytes"] - before["activations"]["captured_bytes"])
                // steps,
                "peak_resident_bytes": after["activations"]["peak_resident_bytes"],
                "backward_wait_s": (after["activations"]["backward_wait_s"] - before["activations"]["backward_wait_s"])
                / steps,
                "fallbacks": after["activations"].get("fallbacks", 0),
            },
            early_chunk_steps=described["early_chunk_steps"],
            chunk_steps=described["chunk_steps"],
        )
    result.update(
        losses=losses,
        step_s=times,
        cpu_s=cpu_times[args.warmup :],
        sys_s=[s for s, _ in kernel[args.warmup :]],
        minor_faults=[f for _, f in kernel[args.warmup :]],
        rss_start=rss_start,
        rss_after_model=rss_model,
        rss_peak_steps=rss_peak,
        ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        threads=torch.get_num_threads(),
    )
    return result


# -- the driver ----------------------------------------------------------------------------------
def _machine(path: str) -> dict[str, Any]:
    import psutil
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mounts = sorted(psutil.disk_partitions(all=True), key=lambda p: -len(p.mountpoint))
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        # Huge, page-aligned large tensors (TRAPS 22): the caller's choice for both modes;
        # otherwise torch's default (off) for plain and tiermem's (on, set at import).
        "thp_mem_alloc_enable": CALLER_THP or "plain: torch default (off), tiermem: on (import tiermem)",
        "nvme_path": path,
        "filesystem": next((p.fstype for p in mounts if path.startswith(p.mountpoint)), "unknown"),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }


def _params(size: str) -> int:
    import torch

    from tiermem.app.models.gpt import GPT, GPTConfig

    with torch.device("meta"):  # shapes only: no bytes, no init time
        model = GPT(GPTConfig(**{k: v for k, v in SIZES[size].items() if k != "batch"}))
    return model.num_parameters()


def _run_worker(args: argparse.Namespace, mode: str, size: str, path: str) -> dict[str, Any]:
    # glibc: return freed blocks to the kernel, so RSS shows what is really held (TRAPS 8)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # the driver's own import of tiermem set it
    if CALLER_THP is not None or mode == "plain":
        env["THP_MEM_ALLOC_ENABLE"] = CALLER_THP if CALLER_THP is not None else "0"
    command = [
        sys.executable, os.path.abspath(__file__), "--worker", f"--mode={mode}", f"--size={size}",
        f"--steps={args.steps}", f"--warmup={args.warmup}", f"--nvme-path={path}",
        f"--device-fraction={args.device_fraction}", f"--host-fraction={args.host_fraction}",
        f"--activations={args.activations}", f"--threads={args.threads}", "--fit" if args.fit else "--no-fit",
        "--free-gradients" if args.free_gradients else "--no-free-gradients",
    ]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench/states.py: worker {mode} {size} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            summary[mode] = {"error": results[0]["error"] if results else "no runs"}
            continue
        last = ok[-1]
        s: dict[str, Any] = {
            "params": last["params"],
            "median_step_s": statistics.median(t for r in ok for t in r["step_s"]),
            "step_s_samples": [t for r in ok for t in r["step_s"]],
            "min_step_s": min(t for r in ok for t in r["step_s"]),
            "median_cpu_s": statistics.median(t for r in ok for t in r["cpu_s"]),
            "rss_peak_steps": int(statistics.median(r["rss_peak_steps"] for r in ok)),
            "ru_maxrss": int(statistics.median(r["ru_maxrss"] for r in ok)),
            "rss_start": int(statistics.median(r["rss_start"] for r in ok)),
            "losses": last["losses"],
        }
        s["step_s_per_param"] = s["median_step_s"] / s["params"]
        for key in (
            "capacities", "fractions", "refused", "plan", "tiers", "links_per_step", "state_links_per_step",
            "activation_links_per_step", "minimum_links_per_step", "activations", "early_chunk_steps",
        ):  # fmt: skip
            if key in last:
                s[key] = last[key]
        s["planned_runs"] = [bool(r.get("plan", {}).get("planned")) for r in ok]
        s["log"] = sorted({line for r in ok for line in r.get("log", []) if "plan" in line})
        if "state_links_per_step" in s:
            moved = sum(s["state_links_per_step"].values())
            minimum = sum(s["minimum_links_per_step"].values())
            s["state_bytes_per_step"] = moved
            s["minimum_bytes_per_step"] = minimum
            s["state_bytes_per_param"] = moved / s["params"]
        summary[mode] = s
    plain, managed = summary.get("plain", {}), summary.get("tiermem", {})
    if "median_step_s" in plain and "median_step_s" in managed:
        summary["ratios"] = {
            "step_time": managed["median_step_s"] / plain["median_step_s"],
            "min_step_time": managed["min_step_s"] / plain["min_step_s"],
            "cpu_time": managed["median_cpu_s"] / plain["median_cpu_s"],
            "rss_peak_steps": managed["rss_peak_steps"] / plain["rss_peak_steps"],
            "ru_maxrss": managed["ru_maxrss"] / plain["ru_maxrss"],
        }
        summary["same_losses"] = plain["losses"] == managed["losses"]
    return summary


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _print_size(size: str, summary: dict[str, Any], args: argparse.Namespace) -> None:
    plain, managed = summary.get("plain", {}), summary.get("tiermem", {})
    print(f"\n== {size}: {managed.get('params', plain.get('params', 0)) / 1e6:.1f}M parameters ==")
    for mode in MODES:
        s = summary.get(mode, {})
        if "error" in s:
            print(f"{mode:<8} REFUSED: {s['error']}")
            continue
        samples = ", ".join(f"{t:.2f}" for t in s["step_s_samples"])
        print(
            f"{mode:<8} median step {s['median_step_s']:.2f}s ({samples}; min {s['min_step_s']:.2f}s)  "
            f"CPU {s['median_cpu_s']:.2f}s/step  "
            f"RSS peak in steps {_mib(s['rss_peak_steps'])}  ru_maxrss {_mib(s['ru_maxrss'])}  "
            f"RSS at start {_mib(s['rss_start'])}"
        )
    if "error" in managed:
        return
    if managed.get("refused"):
        print(f"asked capacities refused by the planner: {managed['refused'][0]}")
    fractions = ", ".join(
        f"{tier} {managed['capacities'][tier] / 2**20:,.0f} MiB ({f:.0%})" for tier, f in managed["fractions"].items()
    )
    print(f"tiermem capacities: {fractions} of {_mib(managed['params'] * STATE_BYTES_PER_PARAM)} state bytes")
    p = managed["plan"]
    print(
        f"plan: {p['chunks']} chunks of <= {_mib(p['chunk_size'])}, {p['persistent_chunks']} persistent, "
        f"{p['buffers']} buffers, homes {p['homes']}, streamed {_mib(p['streamed_bytes'])}; "
        f"early chunk steps so far {managed['early_chunk_steps']}; "
        + (
            f"planned at the first step, predicted step {p['predicted']['step_s']:.2f}s"
            if p.get("planned")
            else "default placement rule (no plan fitted)"
        )
    )
    print(f"planned at the first step, per run: {managed.get('planned_runs')}")
    for line in managed.get("log", []):
        print(f"  log: {line[:400]}")
    tiers = ", ".join(f"{n} {_mib(t['peak_bytes'])} of {_mib(t['capacity'])}" for n, t in managed["tiers"].items())
    print(f"tiermem accounting, peak: {tiers}")
    a = managed["activations"]
    print(
        f"activations ({a['policy']}): captured {_mib(a['captured_per_step'])}/step, peak resident "
        f"{_mib(a['peak_resident_bytes'])}, backward wait {a['backward_wait_s']:.3f}s/step, fallbacks {a['fallbacks']}"
    )
    print("bytes per step     link            moved (states)   activations   minimum   moved/min")
    for link, minimum in managed["minimum_links_per_step"].items():
        moved = managed["state_links_per_step"].get(link, 0)
        act = managed["activation_links_per_step"].get(link, 0)
        ratio = f"{moved / minimum:.3f}" if minimum else "-"
        print(f"                   {link:<14} {_mib(moved):>14} {_mib(act):>13} {_mib(minimum):>10} {ratio:>9}")
    print(
        f"                   {'total':<14} {_mib(managed['state_bytes_per_step']):>14} "
        f"{_mib(sum(managed['activation_links_per_step'].values())):>13} {_mib(managed['minimum_bytes_per_step']):>10}"
        f" {managed['state_bytes_per_step'] / max(managed['minimum_bytes_per_step'], 1):>9.3f}"
    )
    r = summary.get("ratios")
    if r:
        print(
            f"ratios tiermem/plain: step time {r['step_time']:.2f}x (goal <= {GOAL_TIME}x: "
            f"{'met' if r['step_time'] <= GOAL_TIME else 'NOT met'}), RSS peak in steps {r['rss_peak_steps']:.2f}x "
            f"(goal <= {GOAL_RSS}x: {'met' if r['rss_peak_steps'] <= GOAL_RSS else 'NOT met'}), "
            f"ru_maxrss {r['ru_maxrss']:.2f}x; fastest step {r['min_step_time']:.2f}x, CPU seconds per step "
            f"{r['cpu_time']:.2f}x; losses bitwise equal: {summary['same_losses']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="200M")
    parser.add_argument("--scaling", action="store_true", help="run 50M, 100M and 200M and print the scaling table")
    parser.add_argument("--sizes", default="50M,100M,200M", help="the sizes --scaling runs (comma list)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="steps before measuring (>= 1 arms early steps)")
    parser.add_argument("--rounds", type=int, default=3, help="A B A B rounds of plain / tiermem")
    parser.add_argument("--device-fraction", type=float, default=0.10, help="device capacity / state bytes")
    parser.add_argument("--host-fraction", type=float, default=0.10, help="host capacity / state bytes")
    parser.add_argument(
        "--fit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="raise a capacity the planner refuses to what it needs (default: on)",
    )
    parser.add_argument(
        "--activations",
        default="nvme",
        choices=["none", "auto", "keep", "nvme", "recompute", "host"],
        help="rt.offload_activations policy in tiermem mode ('none': not used)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    (
        parser.add_argument(
            "--free-gradients",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="rt.manage(keep_gradients=False): offloaded chunks drop their gradients once they "
            "stepped during backward, as the loop's zero_grad() would next (default: on; the host then "
            "only holds gradients on their way home)",
        ),
    )
    parser.add_argument(
        "--nvme-path",
        type=arguments.directory,
        default=None,
        help="directory for NVMe files (default: a temp dir in $TMPDIR)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds must be >= 1")
    sizes = args.sizes.split(",") if args.scaling else [args.size]
    if any(s not in SIZES for s in sizes):
        parser.error(f"--sizes: each of {sorted(SIZES)}")
    base = args.nvme_path or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    # NVMe homes: 12 bytes a parameter (master + two AdamW states); activations: ~1 GiB at 200M.
    need = max(12 * _params(s) for s in sizes) + (1 << 30)
    free = shutil.disk_usage(base).free
    if free < need:
        raise SystemExit(f"bench/states.py: {base} has {_mib(free)} free; this run needs about {_mib(need)}")
    path = tempfile.mkdtemp(prefix="tiermem-bench-states-", dir=base)
    machine = _machine(path)
    log = sys.stderr
    print(f"machine: {json.dumps(machine)}", file=log)
    print(f"disk: {base} has {_mib(free)} free, this run needs about {_mib(need)}", file=log)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {m: [] for m in MODES} for s in sizes}
    started = time.perf_counter()
    try:
        for round_ in range(args.rounds):
            for size in sizes:
                for mode in MODES:
                    r = _run_worker(args, mode, size, path)
                    results[size][mode].append(r)
                    if "error" in r:
                        print(f"round {round_ + 1} {size} {mode:<8} REFUSED: {r['error']}", file=log)
                        continue
                    times = ", ".join(f"{t:.2f}" for t in r["step_s"])
                    cpu = ", ".join(f"{t:.2f}" for t in r["cpu_s"])
                    kernel = ", ".join(f"{t:.2f}" for t in r["sys_s"])
                    faults = statistics.median(r["minor_faults"]) / 1000
                    print(
                        f"round {round_ + 1} {size} {mode:<8} steps {times}s (CPU {cpu}s, of it kernel {kernel}s; "
                        f"{faults:,.0f}k minor faults a step)  "
                        f"load {os.getloadavg()[0]:.1f}  RSS peak {_mib(r['rss_peak_steps'])}  "
                        f"ru_maxrss {_mib(r['ru_maxrss'])}  ({time.perf_counter() - started:.0f}s)",
                        file=log,
                    )
    finally:
        leftovers = os.listdir(path)
        shutil.rmtree(path, ignore_errors=True)
        if leftovers:
            print(f"warning: tiermem left {leftovers} in {path} (removed)", file=log)
    machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    machine["elapsed_s"] = round(time.perf_counter() - started, 1)
    summaries = {size: _summarize(results[size]) for size in sizes}
    settings = {
        k: getattr(args, k)
        for k in (
            "steps",
            "warmup",
            "rounds",
            "device_fraction",
            "host_fraction",
            "fit",
            "activations",
            "threads",
            "free_gradients",
        )
    }
    if args.json:
        print(
            json.dumps(
                {"machine": machine, "settings": settings, "sizes": summaries, "left_behind": leftovers}, indent=2
            )
        )
        return 0
    print(f"machine: {machine}")
    print(f"settings: {settings}")
    for size in sizes:
        _print_size(size, summaries[size], args)
    if args.scaling:
        print("\nscaling, per parameter: median wall and CPU time of a step (ns), bytes moved per step")
        print(
            f"{'size':<6} {'params':>8} {'plain wall':>11} {'tiermem wall':>13} {'plain CPU':>10} "
            f"{'tiermem CPU':>12} {'CPU x':>6} {'state B':>8} {'minimum B':>10} {'act B':>6} {'chunks d/h/n':>13}"
        )
        for size in sizes:
            s = summaries[size]
            p, m = s.get("plain", {}), s.get("tiermem", {})
            if "error" in m or "error" in p:
                print(f"{size:<6} refused")
                continue
            act = sum(m["activation_links_per_step"].values()) / m["params"]
            homes = m["plan"]["homes"]
            print(
                f"{size:<6} {m['params'] / 1e6:>7.1f}M {p['step_s_per_param'] * 1e9:>11.1f} "
                f"{m['step_s_per_param'] * 1e9:>13.1f} {p['median_cpu_s'] / p['params'] * 1e9:>10.1f} "
                f"{m['median_cpu_s'] / m['params'] * 1e9:>12.1f} {s['ratios']['cpu_time']:>6.2f} "
                f"{m['state_bytes_per_param']:>8.2f} {m['minimum_bytes_per_step'] / m['params']:>10.2f} "
                f"{act:>6.2f} {homes['device']:>6}/{homes['host']}/{homes['nvme']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
