"""``tiermem train``: the main job. Trains the built-in GPT on generated data under a tier
configuration and prints what each tier held and moved, and what the NVMe writes mean for
the drive's endurance.

Unless the configuration sets ``[device] capacity`` (file or ``TIERMEM_DEVICE_CAPACITY``),
the device budget is deliberately half of the activation bytes one step saves — measured
for this model and batch — so activations must leave the device and offloading really
happens, plus a quarter of the model-state bytes (16 per parameter). Within that one
budget the planner (``rt.manage(plan="auto", sample=<the first batch>)``) chooses chunk size,
persistent chunks, buffers, homes and each block's activation policy, and the summary puts
its predicted step time and peak bytes next to the measured ones. ``--state-home host|nvme``
or ``--plan FILE`` give a hand plan instead; ``--no-states`` leaves the states as ordinary
tensors outside the tiers. ``--checkpoint DIR`` saves the run there (``--save-every N``
steps and at the end, each save atomic) and ``--resume DIR`` continues a saved run on its
exact loss curve (NOTE [ Resuming a train run ] in :mod:`tiermem.app.train_resume`). The loop
itself lives in :mod:`tiermem.app.train`; this module only parses, chooses the budget and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from tiermem.cli.arguments import add_gpt_shape, positive_float, positive_int
from tiermem.cli.output import stdout_closed
from tiermem.config import AUTO, Config
from tiermem.units import format_size

if TYPE_CHECKING:  # the real import waits for run(): torch is slow to import for --help
    from tiermem.app.models.gpt import ActivationBytes

POLICIES = ("auto", "keep", "recompute", "host", "nvme")
DEFAULT_BUDGET_FRACTION = 0.5
"""Default device budget as a fraction of the measured activation bytes of one step."""

_IN_FLIGHT_BLOCKS = 0.25
"""Room for write-backs in flight, in blocks, on top of the one block the offloader holds."""
_RULE = (
    f"the larger of {DEFAULT_BUDGET_FRACTION:.0%} of the activation bytes one step saves and the least the "
    f"offloader needs: what lies outside the blocks plus {1 + _IN_FLIGHT_BLOCKS:g} x the largest block"
)

_STATE_BYTES_PER_PARAMETER = 16  # fp32 parameter + gradient + AdamW exp_avg and exp_avg_sq
STATES_BUDGET_FRACTION = 0.25
"""Device room for model-state chunks by default, as a fraction of the model-state bytes."""
_POOL_SLOTS = 4
"""Buffers the hand plan of ``--state-home`` expects the pool to need: a block's chunk, the tied
embedding's, prefetch."""
STATES_PLAN = {"persistent_chunks": 0}
"""The hand plan of ``--state-home host|nvme``: every chunk streams through the buffer pool
(the planner, by default, decides this instead)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tiermem train``; defaults run 30 steps in about a minute on two cores."""
    parser.add_argument("--config", metavar="FILE", help="tier configuration (TOML); default: defaults + TIERMEM_*")
    parser.add_argument("--steps", type=positive_int, default=30, help="optimizer steps (default: 30)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default: 8)")
    add_gpt_shape(parser, vocab=512)
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="what happens to saved activations (default: [activations] policy of the configuration)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model init and the data (default: 0)")
    parser.add_argument(
        "--state-home",
        choices=("auto", "host", "nvme"),
        default="auto",
        help="where offloaded chunks of parameters and AdamW states live: host or nvme give a hand plan (every "
        "chunk streamed, chunks sized to the budget); default: auto, the planner decides",
    )
    parser.add_argument(
        "--plan",
        metavar="FILE",
        default="auto",
        help="a hand plan for the model states (JSON, as rt.plan.save writes it); default: auto, the planner",
    )
    parser.add_argument(
        "--no-states",
        dest="states",
        action="store_false",
        help="leave parameters, gradients and AdamW states as ordinary tensors outside the tiers",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save the run to DIR (a tiermem checkpoint) at the end, and every --save-every steps",
    )
    parser.add_argument(
        "--save-every", type=positive_int, metavar="N", help="save to --checkpoint DIR every N steps (and at the end)"
    )
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run saved in DIR up to --steps in total (give the same model, batch, lr and seed flags)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="record a timeline of the run to FILE (Chrome trace JSON: Perfetto; tiermem trace summary|plot FILE)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object, nothing else")


def run(args: argparse.Namespace) -> int:
    """Check, choose the budget, train, print the summary. Errors tiermem raises on purpose are
    printed once per job, first and alone (NOTE [ Training on ranks ] rule 7, NOTE [ Resuming a
    train run ] rule 6); exit status 1, 2 for flags that do not go together."""
    from tiermem import distributed
    from tiermem.app import train_ranks
    from tiermem.app.models.gpt import GPTConfig
    from tiermem.app.train_resume import TrainCheckpoints
    from tiermem.errors import TiermemError

    ranks = distributed.RankContext()
    try:
        ranks = distributed.detect()
        usage = _checkpoint_usage(args) or _model_usage(args)
        if usage is None:
            try:  # the flags are checked above and by argparse; this catches what GPTConfig adds later
                sizes = {"d_model": args.d_model, "n_head": args.heads, "vocab_size": args.vocab}
                model_config = GPTConfig(n_layer=args.layers, seq_len=args.seq_len, **sizes)
            except ValueError as exc:
                usage = str(exc)
        if usage is not None:
            if ranks.rank == 0:  # the same flags on every rank
                print(f"tiermem train: {usage}", file=sys.stderr)
            return 2
        checkpoints = TrainCheckpoints(path=args.checkpoint, save_every=args.save_every, resume=args.resume)
        config = Config.coerce(args.config)
        if args.trace:  # [trace] path for this run (NOTE [ Timeline trace ] in tiermem.tracing)
            config = dataclasses.replace(config, trace=dataclasses.replace(config.trace, path=args.trace))
        owned = distributed.setup_process_group(config.resolve().distributed)
        ranks = distributed.detect()
    except TiermemError as exc:  # a configuration or environment that does not work
        train_ranks.report_error(exc, ranks, None, grouped=False)
        return 1
    failure: TiermemError | None = None
    status = 1
    try:
        with distributed.peer_failures():
            status = _run(args, config, model_config, checkpoints, ranks.rank)
    except TiermemError as exc:
        failure = exc
    except BaseException as exc:
        train_ranks.close_group(owned, exc)
        raise
    messages = train_ranks.close_group(owned, failure)
    if failure is not None:
        train_ranks.report_error(failure, ranks, messages)
    return status


def _run(args: argparse.Namespace, config: Config, model_config: Any, checkpoints: Any, rank: int) -> int:
    """``run`` once the flags, the configuration and the process group are there."""
    from tiermem import distributed
    from tiermem.app.models.gpt import GPT, measure_activations
    from tiermem.app.train_resume import run_settings

    settings = run_settings(model_config, args.batch_size, args.lr, args.seed)
    checkpoints.check_before_start(model_config, settings, args.steps)  # before any output
    # Resolving names the device the activations are measured on.
    device = config.resolve().device.device
    measured = measure_activations(model_config, args.batch_size, device=device)
    sizes = [p.numel() * p.element_size() for p in GPT(model_config).parameters()] if args.states else []
    parameters = sum(sizes) // 4  # fp32
    state_bytes = parameters * _STATE_BYTES_PER_PARAMETER
    budget = _budget(config, measured, args.policy or config.activations.policy, state_bytes)
    plan: Any = args.plan
    if args.states and args.state_home != "auto":
        plan = {"state_home": args.state_home}
        if budget["source"] == "default":
            # A parameter and a gradient buffer per pool slot, a few slots: chunks small enough
            # that the pool fits the share (never below the largest parameter).
            chunk_size = max(max(sizes), budget["model_state_share"] // (2 * _POOL_SLOTS))
            plan.update(STATES_PLAN, chunk_size=chunk_size)
    if budget["source"] == "default":
        config = dataclasses.replace(config, device=dataclasses.replace(config.device, capacity=budget["bytes"]))

    if not args.json and rank == 0:
        try:
            _print_intro(model_config, args, device, budget)
            sys.stdout.flush()
        except BrokenPipeError:  # nobody reads the summary (`| head -1`): no run for it
            return stdout_closed()
    summary = _train_here(args, config, model_config, plan, checkpoints, rank)
    if summary is None:
        return 0  # rank 0 prints the summary (NOTE [ Training on ranks ] rule 6)
    budget["bytes"] = summary.tiers["device"]["capacity"]  # what "auto" resolved to, if it was left
    budget["fraction_of_activations"] = budget["bytes"] / measured.total if measured.total else None
    result = {
        **summary.as_dict(),
        "world_size": distributed.detect().world_size,
        "device_budget": budget,
        "checkpoint": _checkpoint_block(args, summary.start_step),
    }
    try:
        if args.json:
            # Strict JSON: a diverged (NaN) loss becomes null rather than the invalid token NaN.
            from tiermem.app.train_summary import finite

            print(json.dumps(finite(result), allow_nan=False))
        else:
            _print_summary(result)
            if config.trace.path:  # each rank's own file under torchrun: <path>.rank<R>
                path = config.trace.path + (".rank0" if result["world_size"] > 1 else "")
                print(f"\ntimeline trace: {path} (Perfetto; tiermem trace summary|plot FILE)")
        sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()
    return 0


def _train_here(
    args: argparse.Namespace, config: Config, model_config: Any, plan: Any, checkpoints: Any, rank: int
) -> Any:
    """Train in this process: the whole job, or, under torchrun, one rank of it with FSDP2 over
    the ranks (NOTE [ Training on ranks ] in tiermem.app.train_ranks); the summary on rank 0, None
    on the others."""
    from tiermem.app.train import train
    from tiermem.runtime import Runtime

    with Runtime(config) as rt:
        summary = train(
            rt,
            model_config,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            policy=args.policy,
            seed=args.seed,
            progress=not args.json and rank == 0,
            manage_states=args.states,
            states_plan=plan,
            checkpoints=checkpoints,
        )
    return summary if rank == 0 else None


def _model_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with the model flags together, or None."""
    if args.d_model % args.heads:
        return (
            f"--d-model {args.d_model} is not divisible by --heads {args.heads}; every attention head needs the same "
            "width"
        )
    return None


def _checkpoint_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with the checkpoint flags together, or None."""
    if args.save_every is not None and args.checkpoint is None:
        return f"--save-every {args.save_every} needs --checkpoint DIR, the directory to save to"
    if not args.states and (args.checkpoint is not None or args.resume is not None):
        return "--checkpoint and --resume save and load the managed model states; drop --no-states"
    return None


def _checkpoint_block(args: argparse.Namespace, start_step: int) -> dict[str, Any] | None:
    """Where this run saved and what it resumed (the summary's ``checkpoint``; None: neither)."""
    if args.checkpoint is None and args.resume is None:
        return None
    path = None if args.checkpoint is None else os.path.abspath(args.checkpoint)
    resumed = None if args.resume is None else os.path.abspath(args.resume)
    return {"path": path, "save_every": args.save_every, "resumed_from": resumed, "start_step": start_step}


def _budget(config: Config, measured: ActivationBytes, policy: str, state_bytes: int = 0) -> dict[str, Any]:
    """The device budget and why: the configuration's, or a default deliberately below the
    measured activation bytes plus a share of the model-state bytes (``bytes`` None: leave
    ``[device] capacity`` at auto)."""
    facts = {
        "activation_bytes_per_step": measured.total,
        "activation_bytes_outside_blocks": measured.outside,
        "largest_block_bytes": max(measured.blocks, default=0),
        "model_state_bytes": state_bytes,
        "model_state_share": int(state_bytes * STATES_BUDGET_FRACTION),
    }
    if config.device.capacity != AUTO:
        return {"bytes": int(config.device.capacity), "source": "config", **facts}
    # The offloader holds a block's activations on the device until that block's forward
    # ends, keeps the last block for the backward that follows, and cannot move what lies
    # outside the blocks (embeddings, head, loss): it needs at least that plus one block, and
    # some room for write-backs in flight. Below that even offloading everything fails.
    floor = measured.outside + int(max(measured.blocks, default=0) * (1 + _IN_FLIGHT_BLOCKS))
    budget = max(int(measured.total * DEFAULT_BUDGET_FRACTION), floor)
    if policy == "keep" or budget >= measured.total:
        # keep must hold every activation (a lower budget can only fail), and a model with
        # too few blocks leaves no budget between the floor and the need.
        why = "keep holds every activation" if policy == "keep" else "too few blocks to offload any"
        return {"bytes": None, "source": "auto", "why": why, **facts}
    return {"bytes": budget + facts["model_state_share"], "source": "default", "rule": _RULE, **facts}


def _print_intro(model_config: Any, args: argparse.Namespace, device: str, budget: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    c = model_config
    console.print(
        f"[bold]tiermem train[/]: GPT {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
        f"vocab {c.vocab_size}, seq {c.seq_len}; batch {args.batch_size}, {args.steps} steps, "
        f"lr {args.lr:g}, seed {args.seed}, on {device}"
    )
    need = format_size(budget["activation_bytes_per_step"])
    if budget["source"] == "default":
        states = budget["model_state_share"]
        activations = budget["bytes"] - states
        share = activations / budget["activation_bytes_per_step"]
        text = (
            f"device budget: {format_size(budget['bytes'])}: for activations {format_size(activations)} ({share:.0%} "
            f"of the {need} one step saves, measured): {_RULE}. So activations must leave the device."
        )
        if states:
            text += (
                f" For model states {format_size(states)} ({STATES_BUDGET_FRACTION:.0%} of the "
                f"{format_size(budget['model_state_bytes'])} of fp32 parameters, gradients and AdamW states), room "
                "for their chunks to stream through the device from their homes. The planner shares the whole "
                "budget as the step runs fastest: the plan line below says how (on a GPU it may keep every chunk "
                "and recompute activations instead)."
            )
        else:
            text += " Parameters, gradients and AdamW states stay outside the tiers (--no-states)."
        text += " Set [device] capacity to choose another budget."
    elif budget["source"] == "config":
        text = f"device budget: {format_size(budget['bytes'])} from the configuration (one step saves {need}, measured)"
    else:
        text = f"device budget: auto, not lowered ({budget['why']}; one step saves {need}, measured)"
    console.print(text, markup=False)  # "[device]" is text here, not rich markup


def _show_stat(key: str, value: Any) -> str:
    """Activation statistics by their key's unit: ``*bytes*`` as sizes, ``*_s`` as seconds;
    a mapping (bytes per tier) as ``name value`` pairs."""
    if isinstance(value, dict):
        return ", ".join(f"{name} {_show_stat(key, item)}" for name, item in value.items()) or "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "bytes" in key:
            return format_size(value)
        if key.endswith("_s"):
            return f"{value:.3f}s"
    return str(value)


def _states_line(params: int, states: dict[str, Any] | None) -> str:
    """Where the model's parameters, gradients and AdamW states lived."""
    total = format_size(params * _STATE_BYTES_PER_PARAMETER)
    if states is None:
        return f"{params / 1e6:.2f}M parameters ({total} of fp32 parameters, gradients and AdamW states, not managed)"
    homes = ", ".join(f"{count} on {tier}" for tier, count in states["homes"].items()) or "none offloaded"
    return (
        f"{params / 1e6:.2f}M parameters ({total} of fp32 parameters, gradients and AdamW states) in "
        f"{states['chunks']} chunks of {format_size(states['chunk_size'])}: {states['persistent_chunks']} resident on "
        f"the device, homes {homes}; {states['buffers']} device buffers; chunks' device peak "
        f"{format_size(states['peak_device_chunk_bytes'])}"
    )


def _plan_lines(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The plan's decisions, and predicted next to measured (NOTE [ Predicted and measured ])."""
    homes = plan["state_home"]
    policies = plan["block_policy"]
    decided = (
        f"{plan['source']}: chunks of {format_size(plan['chunk_size'])}, {plan['persistent_chunks']} of {len(homes)} "
        f"persistent, {plan['buffers']} buffers, homes host {homes.count('host')} / nvme {homes.count('nvme')}; "
        f"blocks {' '.join(policies) if policies else 'as the activation policy says'}"
    )
    lines = [("plan", decided)]
    predicted, measured, ratios = plan["predicted"], plan["measured"], plan["ratios"]
    if predicted.get("step_s") is None:
        lines.append(("predicted", "nothing (a hand plan)"))
        return lines

    def ratio(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    lines.append(
        (
            "step: predicted",
            f"{predicted['step_s']:.3f}s, measured {measured['step_s']:.3f}s (median): {ratio(ratios['step_s'])}",
        )
    )
    for tier in ("device", "host", "nvme"):
        want, got = predicted["peak_bytes"].get(tier), measured["peak_bytes"][tier]
        shown = format_size(want) if want is not None else "-"
        lines.append(
            (
                f"{tier} peak: predicted",
                f"{shown}, measured over the steps {format_size(got)} of {format_size(plan['capacities'][tier])}: "
                f"{ratio(ratios['peak_bytes'][tier])}",
            )
        )
    if not plan["activations_as_planned"]:
        lines.append(("note", "the run's activation policy is not the plan's: predictions are for the plan's"))
    return lines


def _print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    # The tiers' own peaks cover the Runtime's life, the planner's link probes included; the
    # plan lines below give the steps' (tiermem.app.train, NOTE [ Predicted and measured ] rule 2).
    tiers = Table(title="tiers (bytes tiermem managed; peaks include the planner's probes)", title_justify="left")
    for column in ("tier", "capacity", "peak", "written", "read"):
        tiers.add_column(column, justify="left" if column == "tier" else "right")
    for name, tier in result["tiers"].items():
        tiers.add_row(
            name,
            format_size(tier["capacity"]),
            format_size(tier["peak_bytes"]),
            format_size(tier["bytes_written"]),
            format_size(tier["bytes_read"]),
        )
    console.print(tiers)

    nvme = result["nvme"]
    params = result["model"]["parameters"]
    policy = result["policy"]
    lines = [
        ("policy", json.dumps(policy) if isinstance(policy, dict) else str(policy)),
        ("model", _states_line(params, result["model_states"])),
        (
            "loss",
            f"{result['loss_first']:.4f} -> {result['loss_last']:.4f} "
            f"(the best possible on this data is {result['loss_optimal']:.4f})",
        ),
        ("median step", f"{result['median_step_s']:.3f}s"),
        ("tokens/s", f"{result['tokens_per_s']:,.0f} (at the median step time)"),
    ]
    lines += [(f"activations {key}", _show_stat(key, value)) for key, value in result["activations"].items()]
    moved = {name: value for name, value in result["links"].items() if value}
    lines.append(("moved", ", ".join(f"{name} {format_size(value)}" for name, value in moved.items()) or "-"))
    if result.get("plan") is not None:
        lines += _plan_lines(result["plan"])
    lines += _checkpoint_lines(result)
    if result["activations"].get("captured_bytes") == 0 and policy != "keep":
        lines.append(
            ("note", "no saved tensor reached [activations] min_bytes; lower it to offload this model's activations")
        )
    if result.get("world_size", 1) > 1:
        lines.append(("ranks", f"rank 0 of {result['world_size']}: every number above is this rank's (its shards)"))
    per_step, per_s = format_size(nvme["bytes_written_per_step"]), format_size(nvme["bytes_written_per_s"])
    lines.append(("NVMe written", f"{per_step} per step ({per_s}/s)"))
    dwpd = nvme["drive_writes_per_day"]
    lines.append(
        (
            "SSD endurance",
            "unknown (no drive size)"
            if dwpd is None
            else f"{dwpd:.3g} drive writes per day at this pace, on {', '.join(nvme['paths'])} "
            f"({format_size(nvme['drive_bytes'])}); drives are typically rated for about 0.3 (consumer) "
            "to 1-3 (data centre) drive writes per day",
        )
    )
    lines.append(("assumption", nvme["assumption"]))
    rows = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    rows.add_column(style="bold")
    rows.add_column()
    for name, text in lines:
        rows.add_row(Text(name), Text(text))  # Text: "[device]" and paths are not rich markup
    console.print(rows)


def _checkpoint_lines(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's checkpoint lines: what was resumed, where it was saved."""
    block = result.get("checkpoint")
    if block is None:
        return []
    lines = []
    if block["resumed_from"] is not None:
        lines.append(
            (
                "resumed",
                f"{block['resumed_from']} at step {block['start_step']}; losses above are steps "
                f"{block['start_step'] + 1}-{block['start_step'] + result['steps']}",
            )
        )
    if block["path"] is not None:
        every = f"every {block['save_every']} steps and " if block["save_every"] else ""
        lines.append(("checkpoint", f"saved to {block['path']} {every}at step {block['start_step'] + result['steps']}"))
    return lines
