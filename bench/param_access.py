"""What guarding managed parameters costs a training step that touches none (NOTE [ Parameter access ]).

Modes, each a fresh process, alternating A B B A over ``--rounds`` so a slow stretch of a noisy
machine (and going first) falls on both:

- ``guarded``: ``rt.manage`` as shipped: a chunk no module pins has its parameters guarded (their
  class swapped to ``GuardedParameter``) and swapped back when a module pins it;
- ``unguarded``: the same, with ``Chunk.guard`` made a no-op in that process, so parameters stay
  ``nn.Parameter`` throughout (reading a released one would then crash: this mode only trains).

The model is tiermem's GPT (``--layers``, ``--width``), AdamW, homes on the host, activations kept, device capacity
half the parameter bytes plus 128 MiB for the activations, and no persistent chunk, so every chunk is streamed and
guarded and unguarded at every use.
After ``--warmup`` steps, ``--steps`` steps (forward, backward, ``optimizer.step()``,
``zero_grad``) are timed; reported: median step time per mode, the ratio guarded / unguarded per
round and overall, and the final loss (identical across modes: the run fails otherwise).

    .venv/bin/python bench/param_access.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import machine  # bench/machine.py: run as `python bench/NAME.py`, the folder is on sys.path

MODES = ("guarded", "unguarded")


def _child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import tiermem
    from tiermem.app.models.data import MarkovChainData
    from tiermem.app.models.gpt import GPT, GPTConfig
    from tiermem.states.chunks import Chunk

    if mode == "unguarded":
        Chunk.guard = lambda self, params: None  # type: ignore[method-assign]
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, d_model=args.width, n_head=4, vocab_size=512, seq_len=128)
    model = GPT(config)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    data = MarkovChainData(vocab_size=512, seq_len=128, seed=0)
    tiers = {
        "device": {"capacity": param_bytes // 2 + (128 << 20)},  # room for the kept activations
        "host": {"capacity": 24 * param_bytes},
        "nvme": {"capacity": 0},
    }
    times, loss = [], None
    with tiermem.Runtime(tiers) as rt:
        plan = {"state_home": "host", "persistent_chunks": 0, "buffers": 2}
        model, opt = rt.manage(model, torch.optim.AdamW, lr=1e-3, plan=plan, activations="keep")
        for step in range(args.warmup + args.steps):
            x, y = data.batch(args.batch)
            start = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
    assert loss is not None
    return {"mode": mode, "step_s": statistics.median(times), "loss": float(loss.detach()), "param_bytes": param_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args)))
        return
    print(json.dumps({"machine": machine.facts(), "args": {k: str(v) for k, v in vars(args).items()}}), flush=True)
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "batch", "warmup", "steps")]
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        row = {}
        for mode in MODES if index % 2 == 0 else MODES[::-1]:  # A B, B A: neither always goes first
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, *passthrough], capture_output=True, text=True, check=False
            )
            if out.returncode:
                sys.exit(f"bench param_access: {mode} failed:\n{out.stderr[-3000:]}")
            row[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row[mode]), flush=True)
        if row["guarded"]["loss"] != row["unguarded"]["loss"]:
            sys.exit(f"bench param_access: the losses differ: {row}")
        rounds.append(row)
    ratios = [r["guarded"]["step_s"] / r["unguarded"]["step_s"] for r in rounds]
    summary = {mode: statistics.median(r[mode]["step_s"] for r in rounds) for mode in MODES} | {
        "ratio_per_round": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
    }
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
