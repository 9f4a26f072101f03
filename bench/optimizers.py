"""AdamW vs Adafactor vs SGD under ``rt.manage`` at the same capacities (issue 32): the planner
counts each optimizer's real state bytes (NOTE [ Exact optimizer step ] rule 3), so a smaller
state buys a plan that moves fewer bytes and steps faster.

The model: the 200M GPT of ``bench/states.py`` (16 layers, d=1024, vocab 8192, seq 256, batch
2x256), trained in a declared loop (``grad_accumulation_steps=1, keep_gradients=False``) with
activations offloaded to NVMe, device and host capacities each ``--fraction`` (default 10%) of
AdamW's model-state bytes (16 bytes a parameter) for every optimizer, the rest on NVMe; the
planner plans at the first step. Optimizers:

- ``adamw``: ``torch.optim.AdamW(lr=1e-4)``: two state sections (8 bytes a parameter);
- ``sgd``: ``torch.optim.SGD(lr=1e-3, momentum=0.9)``: one section (4 bytes);
- ``adafactor``: ``transformers.optimization.Adafactor(lr=1e-3, relative_step=False,
  scale_parameter=False)``: no section; its factored row/column statistics (rows + columns
  numbers a matrix) stay in memory.

Each worker is a fresh process; the optimizers alternate A B C A B C over ``--rounds``. Reported
per optimizer (medians over rounds): the plan (chunks, persistent, homes, sections a chunk, the
predicted step), the state bytes per step on each link (activations' bytes taken out), the NVMe
bytes read and written per step, and the measured step time.

    .venv/bin/python bench/optimizers.py                       # 200M, 1 round
    .venv/bin/python bench/optimizers.py --size tiny --steps 2 --fraction 0.5 --json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "d_model": 128, "n_head": 4, "vocab_size": 512, "seq_len": 64, "batch": 2},
    "200M": {"n_layer": 16, "d_model": 1024, "n_head": 16, "vocab_size": 8192, "seq_len": 256, "batch": 2},
}
OPTIMIZERS = ("adamw", "adafactor", "sgd")
ADAMW_STATE_BYTES = 16  # fp32 parameter, gradient and two AdamW states: the capacities' yardstick


def _make(name: str, params: Any) -> Any:
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False)


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import tiermem
    from tiermem.app.models.gpt import GPT, GPTConfig
    from tiermem.errors import PlanError, StatesMemoryError

    size = SIZES[args.size]
    config = GPTConfig(**{k: v for k, v in size.items() if k != "batch"})
    torch.manual_seed(0)
    model = GPT(config)
    params = model.num_parameters()
    yardstick = ADAMW_STATE_BYTES * params
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, config.vocab_size, (size["batch"], config.seq_len + 1), generator=generator)
        for _ in range(args.warmup + args.steps)
    ]
    capacity = int(yardstick * args.fraction)
    tiers = {
        "device": {"device": "cpu", "capacity": capacity},
        "host": {"capacity": capacity},
        "nvme": {"paths": [args.nvme_path], "capacity": 2 * yardstick + (1 << 30)},
        "activations": {"min_bytes": "1MiB"},
    }
    result: dict[str, Any] = {"optimizer": args.optimizer, "size": args.size, "params": params, "capacity": capacity}
    with tiermem.Runtime(tiers) as rt:
        try:
            model, optimizer = rt.manage(
                model,
                _make(args.optimizer, model.parameters()),
                plan={"block_policy": "nvme"},
                grad_accumulation_steps=1,
                keep_gradients=False,
            )
        except (StatesMemoryError, PlanError) as exc:
            return {**result, "error": str(exc)}
        states = rt._model_states[0]
        times: list[float] = []
        before: dict[str, Any] = {}
        for i, tokens in enumerate(batches):
            if i == args.warmup:  # the first step planned (and re-packed): measure after it
                before = rt.stats().as_dict()
            start = time.perf_counter()
            with rt.offload_activations(model, policy="nvme"):
                _, loss = model(tokens[:, :-1], tokens[:, 1:])
                assert loss is not None
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        after = rt.stats().as_dict()
        described = states.describe()
        sections = sorted({c.sections for c in states.store.chunks if c.offloaded})
    steps = args.steps

    def per_step(now: dict[str, Any], then: dict[str, Any], *keys: str) -> int:
        for key in keys:
            now, then = now.get(key, {}), then.get(key, {})
        return (int(now or 0) - int(then or 0)) // steps

    act = {
        t: per_step(after, before, "activations", "bytes_written", t)
        + per_step(after, before, "activations", "bytes_read", t)
        for t in ("host", "nvme")
    }
    links = {name: per_step(after, before, "links", name, "bytes") for name in after["links"]}
    nvme_links = sum(v for k, v in links.items() if "nvme" in k)
    plan = described["plan"]
    result.update(
        plan={
            "chunks": len(described["chunks"]),
            "persistent_chunks": plan["persistent_chunks"],
            "buffers": plan["buffers"],
            "homes": {h: plan["state_home"].count(h) for h in ("device", "host", "nvme")},
            "sections_per_offloaded_chunk": sections,
            "predicted_step_s": (plan.get("predicted") or {}).get("step_s"),
        },
        links_per_step=links,
        state_nvme_bytes_per_step=nvme_links - act["nvme"],
        state_bytes_per_step=sum(links.values()) - act["host"] - act["nvme"],
        nvme_read_per_step=per_step(after, before, "tiers", "nvme", "bytes_read"),
        nvme_written_per_step=per_step(after, before, "tiers", "nvme", "bytes_written"),
        step_s=times[args.warmup :],
        first_step_s=times[0],
    )
    return result


def _run_worker(args: argparse.Namespace, name: str, path: str) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--worker",
        "--optimizer",
        name,
        "--size",
        args.size,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--fraction",
        str(args.fraction),
        "--nvme-path",
        path,
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench/optimizers.py: the {name} worker failed:\n{out.stderr[-4000:]}")
    for entry in os.listdir(path):
        shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="200M")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps before measuring (the first one plans)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--fraction", type=float, default=0.10, help="device and host capacity / AdamW state bytes")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--nvme-path", type=arguments.directory, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    names = args.optimizers.split(",")
    path = tempfile.mkdtemp(prefix="tiermem-bench-optimizers-", dir=args.nvme_path)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for round_ in range(args.rounds):
            for name in names:
                r = _run_worker(args, name, path)
                results[name].append(r)
                if "error" in r:
                    print(f"round {round_ + 1} {name}: REFUSED {r['error']}", file=sys.stderr)
                    continue
                print(
                    f"round {round_ + 1} {name}: steps {', '.join(f'{t:.2f}' for t in r['step_s'])} s, "
                    f"plan {r['plan']}",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(path, ignore_errors=True)
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            summary[name] = {"error": runs[-1]["error"]}
            continue
        summary[name] = {
            "plan": ok[-1]["plan"],
            "step_s": statistics.median(t for r in ok for t in r["step_s"]),
            "state_bytes_per_step": statistics.median(r["state_bytes_per_step"] for r in ok),
            "state_nvme_bytes_per_step": statistics.median(r["state_nvme_bytes_per_step"] for r in ok),
            "nvme_read_per_step": statistics.median(r["nvme_read_per_step"] for r in ok),
            "nvme_written_per_step": statistics.median(r["nvme_written_per_step"] for r in ok),
        }
    if args.json:
        print(json.dumps({"settings": vars(args), "optimizers": summary}, indent=2))
        return 0
    print(
        "| optimizer | sections | persistent / chunks | homes h/n | predicted s | step s | state bytes / step "
        "(of it NVMe) |"
    )
    for name, s in summary.items():
        if "error" in s:
            print(f"| {name} | refused: {s['error'][:120]} |")
            continue
        p = s["plan"]
        predicted = f"{p['predicted_step_s']:.2f}" if p["predicted_step_s"] else "-"
        print(
            f"| {name} | {p['sections_per_offloaded_chunk']} | {p['persistent_chunks']} / {p['chunks']} | "
            f"{p['homes']['host']}/{p['homes']['nvme']} | {predicted} | {s['step_s']:.2f} | "
            f"{_mib(s['state_bytes_per_step'])} ({_mib(s['state_nvme_bytes_per_step'])}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
