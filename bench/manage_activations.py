"""rt.manage alone against the plan's predictions (issue 22 item 1): Hugging Face GPT-2 (8 layers,
d=512, batch 4x256, AdamW, built from a config: no download), ``rt.manage(model, AdamW,
sample=...)`` at a few device capacities, and the plain README loop with no
``rt.offload_activations`` context: forward (the loss computed inside, from ``labels``),
backward, step. Prints predicted and measured device peak and step time per capacity.

Each capacity is a fresh process (``--worker``) so one's profile cache, allocator and threads do
not touch the next; the first measured step is a warm-up and left out of the step-time median.

The prediction rests on the profile's compute times, measured when ``rt.manage`` ran; these VMs
change speed within a process (they throttle sustained load after about 20 s: the same plain
step took 2.4 s in one process and 3.3 s in the next). So each worker also steps a plain copy of
the model, three steps before the managed steps and three after (B A B: the managed steps run
back to back, as a loop runs them, and the plain ones do not share the cores with the managed
model's foreground work; a write-back the last managed step left may still run), and reports
the error twice: raw, and compute-corrected, with the profile's compute replaced by the plain
copy's forward and backward measured around the managed steps (median of the warm ones;
``drift``: that over the profiled compute). The correction is additive: the optimizer, copy and
overhead parts were timed at profiling too and drift alike, and stalls depend on compute, so
it removes most of the machine's drift from the error, not all of it.

Usage::

    .venv/bin/python bench/manage_activations.py                    # 450, 600, 900 MiB, 5 steps
    .venv/bin/python bench/manage_activations.py --capacities 300 --steps 3
"""

from __future__ import annotations

import argparse
import copy
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
    plain = copy.deepcopy(model)  # the drift reference, stepped beside the managed model
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def sample(m: torch.nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[float, float]:
        """The README loop: no context. (forward + backward seconds, whole step seconds)."""
        start = time.perf_counter()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        computed = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return computed - start, time.perf_counter() - start

    with tempfile.TemporaryDirectory() as nvme:
        tiers = {
            "device": {"capacity": args.capacity * MiB, "device": "cpu"},
            "nvme": {"paths": [nvme]},
        }
        with tiermem.Runtime(tiers) as rt:
            model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-4, sample=sample)
            predicted = rt.plan.predicted.as_dict()
            profiled_compute = rt.decision.estimate.parts_s["compute"]
            rt.tiers["device"].reset_peak()
            before = [step(plain, plain_optimizer)[0] for _ in range(3)]
            managed = [step(model, optimizer)[1] for _ in range(args.steps)]  # back to back, as a loop runs
            stats = rt.stats().as_dict()
            after = [step(plain, plain_optimizer)[0] for _ in range(3)]
            measured_compute = statistics.median(before[1:] + after[1:])
            return {
                "capacity_mib": args.capacity,
                "block_policy": list(rt.plan.block_policy or ()),
                "predicted_peak": predicted["peak_bytes"]["device"],
                "measured_peak": stats["tiers"]["device"]["peak_bytes"],
                "predicted_step_s": predicted["step_s"],
                "measured_step_s": statistics.median(managed[1:] or managed),
                "profiled_compute_s": profiled_compute,
                "plain_compute_s": measured_compute,
                "corrected_step_s": predicted["step_s"] - profiled_compute + measured_compute,
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
    print(
        f"{'MiB':>5} {'pred peak':>10} {'meas peak':>10} {'err':>7} {'pred s':>7} {'meas s':>7} {'err':>7} "
        f"{'drift':>6} {'corr s':>7} {'err':>7}  policy"
    )
    for capacity in args.capacities:
        command = [sys.executable, __file__, "--worker", "--capacity", str(capacity), "--steps", str(args.steps)]
        command += ["--batch", str(args.batch), "--seq", str(args.seq)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        peak_err = (r["measured_peak"] - r["predicted_peak"]) / r["predicted_peak"]
        time_err = (r["measured_step_s"] - r["predicted_step_s"]) / r["predicted_step_s"]
        corr_err = (r["measured_step_s"] - r["corrected_step_s"]) / r["corrected_step_s"]
        drift = r["plain_compute_s"] / r["profiled_compute_s"]
        print(
            f"{capacity:>5} {r['predicted_peak'] / MiB:>10.1f} {r['measured_peak'] / MiB:>10.1f} {peak_err:>+7.1%} "
            f"{r['predicted_step_s']:>7.2f} {r['measured_step_s']:>7.2f} {time_err:>+7.1%} {drift:>6.2f} "
            f"{r['corrected_step_s']:>7.2f} {corr_err:>+7.1%}  " + ",".join(r["block_policy"]),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
