"""Headline: train a GPT whose full training state is larger than this machine's RAM, near the floor.

Issue 20 item 4: a GPT whose fp32 AdamW training state is >= 2.5x this machine's RAM (check
free disk first and say what is needed), once with the loop declared and once plain. Targets:
peak RSS <= 0.25x RAM for the whole process (``ru_maxrss``, build included), and median step
time <= 1.25x the step's floor declared, 1.35x plain (issue 33), the floor being max(disk time =
the NVMe bytes moved per step / ``tiermem bench io``'s bandwidth on the same path, the mean of a
run just before training and one just after, compute time = plain PyTorch's
forward+backward+step time per parameter on a model that fits x the parameters).

The model is built inside ``rt.init()`` (file-backed pages, NOTE [ Materialising under
rt.init() ]), every chunk's home (fp32 master + AdamW states) on NVMe:

- ``--loop declared``: ``grad_accumulation_steps=1, keep_gradients=False``: each chunk steps as
  its backward ends, gradients only pass through the host (NOTE [ Declared steps ]);
- ``--loop plain``: a plain loop; ``.grad`` is readable, the gradients wait on the host or on
  NVMe (``grad_home``, the default rule's choice: NOTE [ Stored gradients ]), and from the second
  step the backward steps chunks ahead (NOTE [ Speculative steps ]).

Where the time goes is ``tiermem trace summary``'s: the steps run inside ``rt.trace`` (``--trace
FILE`` keeps the file; by default it is written beside the NVMe files and removed with them), each
step and its forward, backward and optimizer step marked as in ``tiermem train``; every step's
phases, compute, waits by cause, link busy fractions and overlap come from the summary.

What is needed, printed before anything is built: NVMe space for the homes (12 bytes a
parameter) plus the file-backed build while it is managed or the plain loop's gradients
(4 bytes a parameter); the host capacity given (default 1.5 GiB) and a 2 GiB device. The NVMe
tier is given up to 12 bytes a parameter more where the disk has them (all but 1 GiB of its free
space): the plain loop's backward steps chunks ahead into copies of their homes, written beside
the homes until ``optimizer.step()`` keeps them (NOTE [ Speculative steps ] rule 2: as many
chunks run ahead as the tier holds copies of; ``--nvme-capacity`` sets the tier's size).

Usage::

    .venv/bin/python bench/states_headline.py --ratio 2.5 --loop declared
    .venv/bin/python bench/states_headline.py --ratio 0.05 --steps 2 --loop plain   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path

T = TypeVar("T")

STATE_BYTES = 16  # fp32 parameter, gradient, AdamW exp_avg and exp_avg_sq
STEP_GOALS = {"declared": 1.25, "plain": 1.35}
"""Median step over the floor, per loop (issue 20 item 4; the plain loop's from issue 33)."""


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Peak RSS and peak anonymous RSS, sampled every 5 ms (the kernel's VmHWM as a cross-check)."""

    def __init__(self) -> None:
        self.rss = self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.rss = max(self.rss, _status_kib("VmRSS"))
            self.anon = max(self.anon, _status_kib("RssAnon"))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"peak_rss": self.rss, "peak_rss_anon": self.anon, "vm_hwm": _status_kib("VmHWM")}


def size_model(target_params: int, vocab: int, seq: int) -> Any:
    """A GPT near ``target_params``: d_model a multiple of 128, 12 d^2 per layer, 24-40 layers."""
    from tiermem.app.models.gpt import GPTConfig

    best = None
    for layers in range(24, 41, 2):
        d = int(math.sqrt(max(target_params - vocab * 1024, 1) / (12 * layers)) / 128 + 1) * 128
        params = 12 * layers * d * d + (vocab + seq) * d
        if params >= target_params and (best is None or params < best[0]):
            best = (params, layers, d)
    assert best is not None
    _, layers, d = best
    return GPTConfig(n_layer=layers, d_model=d, n_head=d // 128, vocab_size=vocab, seq_len=seq)


def measure_disk(path: str, size: str) -> dict[str, float]:
    """``tiermem bench io`` on ``path`` (a fresh process): median read and write bytes/s."""
    out = subprocess.run(
        [sys.executable, "-m", "tiermem", "bench", "io", "--path", path, "--size", size, "--repeats", "3", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    results = json.loads(out.stdout)["results"]
    return {r["op"]: r["bytes_per_s"]["median"] for r in results}


def disk_around(path: str, size: str, work: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """``work`` between two :func:`measure_disk` runs on ``path``: its result, and the disk it had,
    the mean of the two runs' read and write bytes/s (both runs in ``runs``). A shared VM's disk
    drifts within minutes (fio's reads 30 s apart: 1,355 and 1,796 MiB/s), so a floor measured only
    before a run judges it against a disk it did not have."""
    before = measure_disk(path, size)
    result = work()
    after = measure_disk(path, size)
    return result, {
        "read": (before["read"] + after["read"]) / 2,
        "write": (before["write"] + after["write"]) / 2,
        "runs": [before, after],
    }


def measure_compute(config: Any, batch: int, fused: bool) -> dict[str, float]:
    """In a fresh process (its memory is not this one's): :func:`compute_per_parameter`."""
    names = ("n_layer", "d_model", "n_head", "vocab_size", "seq_len")
    spec = json.dumps({"config": {k: getattr(config, k) for k in names}, "batch": batch, "fused": fused})
    out = subprocess.run([sys.executable, __file__, "--compute-only", spec], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compute_per_parameter(config: Any, batch: int, fused: bool) -> dict[str, float]:
    """Plain PyTorch forward+backward+AdamW step of a model of ``config``'s width that fits
    (2 layers): seconds per parameter (median of steps 2-4)."""
    import dataclasses

    import torch

    from tiermem.app.models.gpt import GPT

    small = dataclasses.replace(config, n_layer=2)
    torch.manual_seed(0)
    model = GPT(small)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    generator = torch.Generator().manual_seed(1)
    seconds = []
    for _ in range(4):
        tokens = torch.randint(0, small.vocab_size, (batch, small.seq_len + 1), generator=generator)
        started = time.perf_counter()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    n = model.num_parameters()
    return {
        "parameters": n,
        "step_s": statistics.median(seconds[1:]),
        "s_per_param": statistics.median(seconds[1:]) / n,
    }


def nvme_moved(moved: dict[str, int]) -> tuple[int, int]:
    """Bytes read from and written to NVMe in one step's link counters."""
    read = sum(v for k, v in moved.items() if k.startswith("nvme->"))
    written = sum(v for k, v in moved.items() if k.endswith("->nvme"))
    return read, written


# long: one straight run (facts, needs, floor, build, manage, steps, report), kept in order
def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--compute-only":  # measure_compute's child
        from tiermem.app.models.gpt import GPTConfig

        spec = json.loads(sys.argv[2])
        print(json.dumps(compute_per_parameter(GPTConfig(**spec["config"]), spec["batch"], spec["fused"])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratio", type=float, default=2.5, help="training state / RAM (default 2.5)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3; the first is warm-up)")
    parser.add_argument("--loop", choices=("declared", "plain"), default="declared")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--host", default="1536MiB", help="host tier capacity (default 1.5 GiB)")
    parser.add_argument(
        "--nvme-capacity",
        default=None,
        help="NVMe tier capacity (default: room for a copy of every home too, up to 28 B/param, where the disk has it)",
    )
    parser.add_argument(
        "--path", type=arguments.directory, default=None, help="NVMe directory (default: a private one under $TMPDIR)"
    )
    parser.add_argument("--chunk-size", type=int, default=64 << 20, help="bytes (default 64 MiB)")
    parser.add_argument("--no-fused", action="store_true", help="AdamW's CPU default instead of fused=True")
    parser.add_argument("--io-size", default="4GiB", help="bytes per tiermem bench io pass (default 4GiB)")
    parser.add_argument("--trace", default=None, help="keep the run's timeline trace in FILE (Chrome trace JSON)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import psutil
    import torch

    from tiermem.app.models.gpt import GPT
    from tiermem.units import format_size, parse_size

    ram = psutil.virtual_memory().total
    config = size_model(int(args.ratio * ram / STATE_BYTES), args.vocab, args.seq)
    with torch.device("meta"):  # counted without memory
        n = GPT(config).num_parameters()
    state = n * STATE_BYTES
    try:  # before the folder is made: a bad size leaves nothing behind
        host_capacity = parse_size(args.host)
        nvme_given = parse_size(args.nvme_capacity) if args.nvme_capacity else None
    except ValueError as exc:
        print(f"states_headline: {exc}", file=sys.stderr)
        return 2
    own_dir = args.path is None
    path = args.path or tempfile.mkdtemp(prefix="tiermem-headline-")
    free = shutil.disk_usage(path).free
    nvme_need = n * 16 + (256 << 20)  # homes 12 B + (the build while managed, or stored gradients) 4 B
    # the plain loop steps ahead into a copy of each home, freed at optimizer.step(): 12 B more
    nvme_room = n * 28 + (256 << 20)
    fused = not args.no_fused
    facts = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": ram,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": {"layers": config.n_layer, "d_model": config.d_model, "vocab": config.vocab_size},
        "parameters": n,
        "training_state_bytes": state,
        "state_over_ram": state / ram,
        "nvme_path": path,
        "nvme_free_bytes": free,
        "nvme_needed_bytes": nvme_need,
        "nvme_capacity": nvme_given if nvme_given is not None else min(nvme_room, max(nvme_need, free - (1 << 30))),
        "host_capacity": host_capacity,
        "loop": args.loop,
        "adamw_fused": fused,
    }
    say = (lambda *a: None) if args.json else print
    say(
        f"machine: {facts['cpu_count']} CPUs, {format_size(ram)} RAM, torch {torch.__version__}; model "
        f"{config.n_layer} layers x d {config.d_model}: {n / 1e9:.2f}B parameters, training state "
        f"{format_size(state)} = {state / ram:.2f}x RAM; {args.loop} loop, AdamW fused={fused}"
    )
    say(
        f"needs: NVMe {format_size(nvme_need)} at {path} (homes 12 B/param + the file-backed build or the stored "
        f"gradients 4 B/param; {format_size(free)} free); host {format_size(host_capacity)}, device 2GiB; the NVMe "
        f"tier gets {format_size(facts['nvme_capacity'])} (up to 28 B/param: the plain loop's steps ahead write a "
        "copy of each home, NOTE [ Speculative steps ])"
    )
    refused = None
    if free < nvme_need:
        refused = f"not enough disk: need {format_size(nvme_need)} at {path}, {format_size(free)} free"
    elif not nvme_need <= facts["nvme_capacity"] <= free:
        refused = (
            f"--nvme-capacity {args.nvme_capacity}: the NVMe tier needs at least {format_size(nvme_need)} (the homes "
            f"and the build or the stored gradients) and at most the {format_size(free)} free at {path}"
        )
    if refused is not None:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)
        print(refused, file=sys.stderr)
        return 1
    result: dict[str, Any] = {"machine": facts}
    try:
        result["compute"] = compute = measure_compute(config, args.batch, fused)
        say(
            f"floor input: plain step {compute['s_per_param'] * 1e9:.2f} ns/param "
            f"({compute['parameters'] / 1e6:.0f}M-param model)"
        )
        trained, disk = disk_around(
            path, args.io_size, lambda: train(args, config, path, host_capacity, facts["nvme_capacity"], fused, say)
        )
        result.update(trained, disk=disk)
        say(
            f"floor input: tiermem bench io read {format_size(disk['read'])}/s, write {format_size(disk['write'])}/s "
            f"(the mean of a run just before training and one just after: read "
            + " / ".join(f"{format_size(r['read'])}/s" for r in disk["runs"])
            + ")"
        )
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)
    result["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report(result, ram, state, n, say)
    if args.json:
        print(json.dumps(result))
    return 0


def train(args: Any, config: Any, path: str, host: int, nvme: int, fused: bool, say: Any) -> dict[str, Any]:
    import torch

    import tiermem
    from tiermem import tracing
    from tiermem.app import trace_report
    from tiermem.app.models.gpt import GPT
    from tiermem.units import format_size

    tier_config = {
        "device": {"device": "cpu", "capacity": "2GiB"},
        "host": {"capacity": host},
        "nvme": {"paths": [path], "capacity": nvme},
        "activations": {"policy": "keep"},
    }
    # Every chunk streams from its NVMe home; chunks hold the largest parameter and 1 MiB more: a
    # chunk of exactly its size left each bias between two such weights a chunk of its own, which
    # took a buffer and cost forward its prefetch (38 x 2944: 5 chunks a block instead of 3).
    largest = 4 * config.d_model * max(4 * config.d_model, config.vocab_size)
    plan = {"state_home": "nvme", "persistent_chunks": 0, "chunk_size": max(largest + (1 << 20), args.chunk_size)}
    declared = {"grad_accumulation_steps": 1, "keep_gradients": False} if args.loop == "declared" else {}
    sampler = PeakSampler()
    result: dict[str, Any] = {}
    with tiermem.Runtime(tier_config) as rt:
        started = time.perf_counter()
        torch.manual_seed(0)
        with rt.init():
            model = GPT(config)
        result["build_s"] = time.perf_counter() - started
        say(
            f"built in {result['build_s']:.1f}s (RSS {format_size(_status_kib('VmRSS'))}, peak "
            f"{format_size(_status_kib('VmHWM'))})"
        )
        started = time.perf_counter()
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-4, fused=fused, plan=plan, **declared)
        result["manage_s"] = time.perf_counter() - started
        result["plan"] = {k: v for k, v in rt.plan.as_dict().items() if k not in ("state_home", "predicted")}
        rss = f"{format_size(_status_kib('VmRSS'))}, peak {format_size(_status_kib('VmHWM'))}"
        say(f"managed in {result['manage_s']:.1f}s (RSS {rss}): {json.dumps(result['plan'])}")
        generator = torch.Generator().manual_seed(1)
        seconds, losses, moved = [], [], []
        trace_path = args.trace or os.path.join(path, "headline.trace.json")
        with rt.trace(trace_path):  # where the time goes: tiermem trace summary's (NOTE [ Timeline trace ])
            for step in range(args.steps):
                tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
                before = rt.stats().as_dict()["links"]
                started = time.perf_counter()
                with tracing.traced("step", "step"):
                    with tracing.traced("forward pass", "phase"):
                        _, loss = model(tokens[:, :-1], tokens[:, 1:])
                    assert loss is not None
                    with tracing.traced("backward pass", "phase"):  # a declared loop steps chunks in here
                        loss.backward()
                    with tracing.traced("optimizer.step", "phase"):
                        optimizer.step()
                        optimizer.zero_grad()
                seconds.append(time.perf_counter() - started)
                losses.append(loss.item())
                after = rt.stats().as_dict()["links"]
                moved.append({k: v["bytes"] - before.get(k, {}).get("bytes", 0) for k, v in after.items()})
                say(
                    f"step {step}: {seconds[-1]:.1f}s, loss {losses[-1]:.4f}, moved "
                    f"{format_size(sum(moved[-1].values()))} (RSS {format_size(_status_kib('VmRSS'))}, peak so far "
                    f"{format_size(_status_kib('VmHWM'))})"
                )
        stats = rt.stats().as_dict()
        summary = [step.as_dict() for step in trace_report.summarize(trace_report.load(trace_path))]
        for step in summary:
            say(f"step {step['step'] - 1}: " + where_the_time_goes(step))
        if args.trace:
            say(f"timeline trace: {trace_path} (Perfetto; tiermem trace summary|plot FILE)")
        else:
            os.remove(trace_path)
    result["memory"] = sampler.stop()
    result.update(
        {
            "steps": args.steps,
            "batch": args.batch,
            "step_seconds": seconds,
            "where_the_time_goes": summary,  # tiermem trace summary --json's steps
            "median_step_s": statistics.median(seconds[1:] or seconds),
            "losses": losses,
            "bytes_moved_per_step": moved,
            "tiers": {k: {f: v[f] for f in ("capacity", "peak_bytes")} for k, v in stats["tiers"].items()},
        }
    )
    return result


def where_the_time_goes(step: dict[str, Any]) -> str:
    """One step of ``tiermem trace summary --json`` in a line: phases, compute and waits (the three
    largest causes), each busy link, the overlap."""
    phases = ", ".join(f"{name.split()[0]} {s:.1f}s" for name, s in step["phases"].items())
    causes = sorted(step["waits"].items(), key=lambda kv: -kv[1])[:3]
    waits = ", ".join(f"{cause} {s:.1f}s" for cause, s in causes)
    links = ", ".join(
        f"{name} {link['busy_fraction']:.0%}" for name, link in sorted(step["links"].items()) if link["busy_s"]
    )
    overlap = "-" if step["overlap"] is None else f"{step['overlap']:.0%}"
    return (
        f"{step['seconds']:.1f}s = compute {step['compute_s']:.1f} + waits {step['wait_s']:.1f} ({waits}); "
        f"{phases}; busy {links}; {overlap} of the moves hidden"
    )


def report(result: dict[str, Any], ram: int, state: int, n: int, say: Any) -> None:
    """The floor and the ratios against the targets."""
    from tiermem.units import format_size

    last = result["bytes_moved_per_step"][-1]
    read, written = nvme_moved(last)
    disk_s = read / result["disk"]["read"] + written / result["disk"]["write"]
    compute_s = result["compute"]["s_per_param"] * n
    floor = max(disk_s, compute_s)
    stored = 4 if result["machine"]["loop"] == "plain" else 0
    # the plan's minimum: parameters read for forward and backward, the homes read (masters
    # known from the device copy in a declared loop) and written, stored gradients each way
    minimum_read = n * (4 + 4 + (8 if result["machine"]["loop"] == "declared" else 12) + stored)
    minimum_written = n * (12 + stored)
    result["floor"] = {
        "disk_s": disk_s,
        "compute_s": compute_s,
        "floor_s": floor,
        "step_over_floor": result["median_step_s"] / floor,
        "nvme_read": read,
        "nvme_written": written,
        "minimum_read": minimum_read,
        "minimum_written": minimum_written,
    }
    say(
        f"median step {result['median_step_s']:.1f}s; floor {floor:.1f}s (disk {disk_s:.1f}s for "
        f"{format_size(read)} read + {format_size(written)} written; compute {compute_s:.1f}s): "
        f"{result['median_step_s'] / floor:.2f}x the floor (target <= {STEP_GOALS[result['machine']['loop']]}x)"
    )
    say(
        f"NVMe per step: read {format_size(read)} ({read / minimum_read:.2f}x the plan's minimum), written "
        f"{format_size(written)} ({written / minimum_written:.2f}x); all links: "
        + ", ".join(f"{k} {format_size(v)}" for k, v in last.items() if v)
    )
    mem = result["memory"]
    say(
        f"whole-process peak RSS (ru_maxrss) {format_size(result['ru_maxrss'])} = {result['ru_maxrss'] / ram:.3f}x RAM "
        f"(target <= 0.25x; sampled peak {format_size(mem['peak_rss'])}, anonymous "
        f"{format_size(mem['peak_rss_anon'])}); "
        f"training state {format_size(state)} = {state / ram:.2f}x RAM"
    )


if __name__ == "__main__":
    sys.exit(main())
