"""rt.manage alone against the plan's predictions (issue 22 item 1): Hugging Face GPT-2 (8 layers,
d=512, batch 4x256, AdamW, built from a config: no download), ``rt.manage(model, AdamW,
sample=...)`` at a few device capacities, and the plain README loop with no
``rt.offload_activations`` context: forward (the loss computed inside, from ``labels``),
backward, step. Prints predicted and measured device peak and step time per capacity.

Each capacity is a fresh process (``--worker``) so one's profile cache, allocator and threads do
not touch the next; the first measured step is a warm-up and left out of the step-time median.

Usage::

    .venv/bin/python bench/manage_activations.py                    # 450, 600, 900 MiB, 5 steps
    .venv/bin/python bench/manage_activations.py --capacities 300 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import tiermem

    torch.manual_seed(0)
    config = GPT2Config(n_layer=8, n_embd=512, n_head=8, n_positions=args.seq, vocab_size=50257)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def sample(m: torch.nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    with tempfile.TemporaryDirectory() as nvme:
        tiers = {
            "device": {"capacity": args.capacity * MiB, "device": "cpu"},
            "nvme": {"paths": [nvme]},
        }
        with tiermem.Runtime(tiers) as rt:
            model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-4, sample=sample)
            predicted = rt.plan.predicted.as_dict()
            rt.tiers["device"].reset_peak()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss  # the README loop: no context
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.perf_counter() - start)
            stats = rt.stats().as_dict()
            return {
                "capacity_mib": args.capacity,
                "block_policy": list(rt.plan.block_policy or ()),
                "predicted_peak": predicted["peak_bytes"]["device"],
                "measured_peak": stats["tiers"]["device"]["peak_bytes"],
                "predicted_step_s": predicted["step_s"],
                "measured_step_s": statistics.median(times[1:] or times),
                "activations_written": stats["activations"]["bytes_written"],
            }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[450, 600, 900], help="device MiB")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    print(f"{'MiB':>5} {'pred peak':>10} {'meas peak':>10} {'err':>7} {'pred s':>7} {'meas s':>7} {'err':>7}  policy")
    for capacity in args.capacities:
        command = [sys.executable, __file__, "--worker", "--capacity", str(capacity), "--steps", str(args.steps)]
        command += ["--batch", str(args.batch), "--seq", str(args.seq)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        peak_err = (r["measured_peak"] - r["predicted_peak"]) / r["predicted_peak"]
        time_err = (r["measured_step_s"] - r["predicted_step_s"]) / r["predicted_step_s"]
        print(
            f"{capacity:>5} {r['predicted_peak'] / MiB:>10.1f} {r['measured_peak'] / MiB:>10.1f} {peak_err:>+7.1%} "
            f"{r['predicted_step_s']:>7.2f} {r['measured_step_s']:>7.2f} {time_err:>+7.1%}  "
            + ",".join(r["block_policy"])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
