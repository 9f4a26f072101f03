"""Headline: train a GPT whose full training state is larger than this machine's RAM.

Issue 5: "with ``rt.init()``, train a model whose full training state is at least 1.5x the
machine's RAM (check free disk first and say clearly what is needed), and record its step
time, bytes moved and peak RSS". The model is built inside ``rt.init()`` (its parameters on
file-backed pages, NOTE [ Materialising under rt.init() ]), managed with every chunk's home
(fp32 master + AdamW states) on NVMe, and trained with the loop declared
(``grad_accumulation_steps=1``: offloaded chunks step during backward, NOTE [ Declared steps ]).

What is needed, printed before anything is built: NVMe space for the homes (12 bytes a
parameter: master, exp_avg, exp_avg_sq) plus the file-backed parameters while the model is
being managed (4 bytes a parameter); host memory for the gradients of NVMe chunks, which
wait on the host until the step (4 bytes a parameter, a design decision: ``.grad`` stays
readable, TRAPS 4), and staging of two homes.

Usage::

    .venv/bin/python bench/states_headline.py                    # sized to 1.5x this machine's RAM
    .venv/bin/python bench/states_headline.py --ratio 0.05 --steps 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

STATE_BYTES = 16  # fp32 parameter, gradient, AdamW exp_avg and exp_avg_sq


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
    from tiermem.models.gpt import GPTConfig

    best = None
    for layers in range(24, 41, 2):
        d = int(math.sqrt(max(target_params - vocab * 1024, 1) / (12 * layers)) / 128 + 1) * 128
        params = 12 * layers * d * d + (vocab + seq) * d
        if params >= target_params and (best is None or params < best[0]):
            best = (params, layers, d)
    assert best is not None
    _, layers, d = best
    return GPTConfig(n_layer=layers, d_model=d, n_head=d // 128, vocab_size=vocab, seq_len=seq)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratio", type=float, default=1.5, help="training state / RAM (default 1.5)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3; the first is warm-up)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--path", default=None, help="NVMe directory (default: a private one under $TMPDIR)")
    parser.add_argument("--chunk-size", type=int, default=64 << 20, help="bytes (default 64 MiB)")
    parser.add_argument(
        "--free-gradients", action="store_true", help="rt.manage(keep_gradients=False)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import psutil
    import torch

    import tiermem
    from tiermem.models.gpt import GPT
    from tiermem.units import format_size

    ram = psutil.virtual_memory().total
    config = size_model(int(args.ratio * ram / STATE_BYTES), args.vocab, args.seq)
    with torch.device("meta"):  # counted without memory
        n = GPT(config).num_parameters()
    state = n * STATE_BYTES
    own_dir = args.path is None
    path = args.path or tempfile.mkdtemp(prefix="tiermem-headline-")
    free = shutil.disk_usage(path).free
    nvme_need = n * 12 + n * 4 + (256 << 20)
    host_need = n * 4 + 2 * (512 << 20)
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
        "host_needed_bytes": host_need,
    }
    say = (lambda *a: None) if args.json else print
    say(
        f"machine: {facts['cpu_count']} CPUs, {format_size(ram)} RAM, torch {torch.__version__}; model "
        f"{config.n_layer} layers x d {config.d_model}: {n / 1e9:.2f}B parameters, training state "
        f"{format_size(state)} = {state / ram:.2f}x RAM"
    )
    say(
        f"needs: NVMe {format_size(nvme_need)} at {path} (homes 12 B/param + the file-backed build 4 B/param; "
        f"{format_size(free)} free); host {format_size(host_need)} (gradients of NVMe chunks 4 B/param + staging)"
    )
    if free < nvme_need:
        print(f"not enough disk: need {format_size(nvme_need)} at {path}, {format_size(free)} free", file=sys.stderr)
        return 1
    if host_need > ram * 0.8:
        print(f"not enough RAM for the host tier: need {format_size(host_need)}", file=sys.stderr)
        return 1

    tier_config = {
        "device": {"device": "cpu", "capacity": "2GiB"},
        "host": {"capacity": host_need},
        "nvme": {"paths": [path], "capacity": nvme_need},
        "activations": {"policy": "keep"},
    }
    # Every chunk streams from its NVMe home; chunks no smaller than the largest parameter.
    largest = 4 * config.d_model * max(4 * config.d_model, config.vocab_size)
    plan = {"state_home": "nvme", "persistent_chunks": 0, "chunk_size": max(largest, args.chunk_size)}
    sampler = PeakSampler()
    result: dict[str, Any] = {"machine": facts, "keep_gradients": not args.free_gradients}
    try:
        with tiermem.Runtime(tier_config) as rt:
            started = time.perf_counter()
            torch.manual_seed(0)
            with rt.init():
                model = GPT(config)
            result["build_s"] = time.perf_counter() - started
            say(f"built in {result['build_s']:.1f}s (RssAnon {format_size(_status_kib('RssAnon'))})")
            started = time.perf_counter()
            model, optimizer = rt.manage(
                model,
                torch.optim.AdamW,
                lr=1e-4,
                plan=plan,
                grad_accumulation_steps=1,
                keep_gradients=not args.free_gradients,
            )
            result["manage_s"] = time.perf_counter() - started
            result["plan"] = {k: v for k, v in rt.plan.as_dict().items() if k not in ("state_home", "predicted")}
            say(f"managed in {result['manage_s']:.1f}s: {json.dumps(result['plan'])}")
            generator = torch.Generator().manual_seed(1)
            seconds, losses, moved = [], [], []
            for step in range(args.steps):
                tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
                before = rt.stats().as_dict()["links"]
                started = time.perf_counter()
                _, loss = model(tokens[:, :-1], tokens[:, 1:])
                assert loss is not None
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                seconds.append(time.perf_counter() - started)
                losses.append(loss.item())
                after = rt.stats().as_dict()["links"]
                moved.append({k: v["bytes"] - before.get(k, {}).get("bytes", 0) for k, v in after.items()})
                total = format_size(sum(moved[-1].values()))
                say(f"step {step}: {seconds[-1]:.1f}s, loss {losses[-1]:.4f}, moved {total}")
            stats = rt.stats().as_dict()
        result["memory"] = sampler.stop()
        measured = seconds[1:] or seconds
        result.update(
            {
                "steps": args.steps,
                "batch": args.batch,
                "step_seconds": seconds,
                "median_step_s": statistics.median(measured),
                "losses": losses,
                "bytes_moved_per_step": moved,
                "tiers": {k: {f: v[f] for f in ("capacity", "peak_bytes")} for k, v in stats["tiers"].items()},
            }
        )
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)
    mem = result["memory"]
    if args.json:
        print(json.dumps(result))
    else:
        last = moved[-1]
        print(
            f"median step {result['median_step_s']:.1f}s (steps after the first); moved per step: "
            + ", ".join(f"{k} {format_size(v)}" for k, v in last.items() if v)
        )
        print(
            f"peak RSS {format_size(mem['peak_rss'])} ({mem['peak_rss'] / ram:.2f}x RAM; anonymous "
            f"{format_size(mem['peak_rss_anon'])}, the rest file-backed pages the kernel may drop); training state "
            f"{format_size(state)} = {state / ram:.2f}x RAM"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
