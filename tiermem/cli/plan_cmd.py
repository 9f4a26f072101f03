"""``tiermem plan``: the plan the planner picks for a built-in GPT under a tier configuration,
with its predicted step time and peak bytes per tier, and why it chose it.

The model is profiled on one generated batch (or its profile is taken from the cache, NOTE
[ Profile cache ]); nothing is trained. A configuration no plan fits exits with status 1 and
says by how much each tier is short.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tiermem.cli.arguments import positive_int
from tiermem.cli.output import stdout_closed
from tiermem.config import Config
from tiermem.units import format_size

MODELS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "d_model": 128, "n_head": 4, "vocab_size": 512},
    "small": {"n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 512},
    "medium": {"n_layer": 8, "d_model": 512, "n_head": 8, "vocab_size": 1024},
}
"""Built-in GPT sizes (``small`` is ``tiermem train``'s default model)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="tier configuration (TOML); default: defaults + TIERMEM_*")
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="built-in GPT (default: small)")
    parser.add_argument("--layers", type=positive_int, help="override the model's number of blocks")
    # the spellings of `tiermem train` too, so a command line moves between the two
    parser.add_argument(
        "--batch", "--batch-size", dest="batch", type=positive_int, default=8, help="sequences per step (default: 8)"
    )
    parser.add_argument(
        "--seq", "--seq-len", dest="seq", type=positive_int, default=256, help="tokens per sequence (default: 256)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate the plan is for (default: 1e-3)")
    parser.add_argument("--no-cache", action="store_true", help="profile again instead of using a cached profile")
    parser.add_argument("--clear-cache", action="store_true", help="remove every cached profile first")
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")


def run(args: argparse.Namespace) -> int:
    import torch  # torch only when the command runs

    from tiermem.app.models.data import MarkovChainData
    from tiermem.app.models.gpt import GPT, GPTConfig
    from tiermem.planner import cache
    from tiermem.planner.auto import free_bytes, plan_model
    from tiermem.runtime import Runtime

    removed = cache.clear() if args.clear_cache else 0
    sizes = dict(MODELS[args.model])
    if args.layers:
        sizes["n_layer"] = args.layers
    model_config = GPTConfig(seq_len=args.seq, **sizes)
    config = Config.coerce(args.config)
    with Runtime(config) as rt:
        assert rt.resolved is not None
        device = torch.device(rt.resolved.device.device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            model = GPT(model_config).to(device)
            x, y = MarkovChainData(model_config.vocab_size, model_config.seq_len, seed=0).batch(args.batch, device)
        capacities = free_bytes(rt.registry)
        start = time.perf_counter()
        decision, profile = plan_model(
            rt.registry, rt.resolved, model, torch.optim.AdamW, {"lr": args.lr}, (x, y), use_cache=not args.no_cache
        )
        elapsed = time.perf_counter() - start
    result: dict[str, Any] = {
        "model": {"name": args.model, **sizes, "seq_len": args.seq, "parameters": model.num_parameters()},
        "batch_size": args.batch,
        "device": str(device),
        "capacities": capacities,
        "plan": decision.plan.as_dict(),
        "reasons": list(decision.reasons),
        "predicted_parts_s": dict(decision.estimate.parts_s),
        "predicted_device_parts": dict(decision.estimate.device_parts),
        "profile": {
            "key": profile.key,
            "profiling_s": profile.profiling_s,
            "cached": elapsed < profile.profiling_s,
            "links_bytes_per_s": dict(profile.links),
            "optimizer_s_per_byte": profile.optimizer_s_per_byte,
        },
        "planning_s": elapsed,
        "cache_cleared": removed,
    }
    try:
        if args.json:
            print(json.dumps(result))
        else:
            _print(result)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``tiermem plan | head -1``): not an error of the plan
        return stdout_closed()
    return 0


def _print(result: dict[str, Any]) -> None:
    plan = result["plan"]
    predicted = plan["predicted"]
    m = result["model"]
    print(
        f"tiermem plan: GPT {m['name']} ({m['n_layer']} blocks, d_model {m['d_model']}, {m['parameters'] / 1e6:.2f}M "
        f"parameters), batch {result['batch_size']} x {m['seq_len']} tokens, on {result['device']}"
    )
    profiling_s, total_s = result["profile"]["profiling_s"], result["planning_s"]
    if result["profile"]["cached"]:
        print(f"profile: cached (measured in {profiling_s:.2f}s when made); planned in {total_s:.2f}s")
    else:  # planning_s is the whole call: the profile, then the search
        print(f"profile: measured in {profiling_s:.2f}s; planned in {max(total_s - profiling_s, 0.0):.2f}s after it")
    print(
        f"plan: chunk size {format_size(plan['chunk_size'])}, {plan['persistent_chunks']} of "
        f"{len(plan['state_home'])} chunks persistent, {plan['buffers']} buffers"
    )
    homes = plan["state_home"]
    print(f"  state homes: device {homes.count('device')}, host {homes.count('host')}, nvme {homes.count('nvme')}")
    print(f"  block policy: {', '.join(f'{i}:{p}' for i, p in enumerate(plan['block_policy'] or []))}")
    print(f"predicted step: {predicted['step_s'] * 1000:.1f} ms")
    for tier, peak in predicted["peak_bytes"].items():
        print(f"  {tier:<6} peak {format_size(peak):>10} of {format_size(result['capacities'][tier])}")
    margin = predicted["fragmentation_margin"]
    print(f"  transient operator peak (unmanaged) {format_size(predicted['transient_bytes'])}; margin {margin:.0%}")
    print("why:")
    for reason in result["reasons"]:
        print(f"  - {reason}")
