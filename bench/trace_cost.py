"""What the timeline trace costs a training step (issue 30, NOTE [ Timeline trace ] in tiermem.tracing).

Modes, each a fresh process, alternating A B, B A over ``--rounds``:

- ``off``: the model-state benchmark's tiermem run (``bench/states.py``: issue 5's GPT, AdamW through
  ``rt.manage`` in a declared loop, device and host at ``--fraction`` of the state bytes, the rest and
  the activations on NVMe), tracing off (the shipped default);
- ``on``: the same inside ``rt.trace(path)``, from before the first step to after the last.

After ``--warmup`` steps, ``--steps`` steps are timed; reported: median step time per mode, the
ratio on / off per round and overall (and of CPU seconds a step, all threads), the plan each run
made, the trace's size and events a timed step, and what tracing costs when off, estimated as
(events a step) x (one instrumentation point with nothing recording, timed here) / (step time):
the instrumentation points are those that emit the events, so the count is theirs. Then
``tiermem trace summary`` of the last "on" run's last step: where the time goes.

``--micro`` measures the two costs apart from any training (so a loaded machine blurs them less
than it blurs a step): what an instrumentation point costs off (ns), and what one recorded event
costs on, by kind (a thread's span begun and ended, a move on a link, a counter sample), in CPU
seconds of every thread (recording on the calling thread, serialising and writing on the
writer's), recorder started and stopped around them. With ``--events-per-step`` (an on run's
``events_by_kind``, JSON) it turns them into the on cost as a fraction of ``--step-s``.

    .venv/bin/python bench/trace_cost.py --size 200M --rounds 2 --steps 3
    .venv/bin/python bench/trace_cost.py --size 200M --alternate --steps 8   # one process, off on off on
    .venv/bin/python bench/trace_cost.py --micro                              # ns a point off, ns an event on
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path
import machine  # bench/machine.py: run as `python bench/NAME.py`, the folder is on sys.path

MODES = ("off", "on")
#: ``--alternate``: one process, the timed steps alternating off, on, off, on (same plan, same load drift)
ALTERNATE = "alternate"
SIZES: dict[str, dict[str, int]] = {  # bench/states.py's
    "tiny": {"n_layer": 2, "d_model": 128, "n_head": 4, "vocab_size": 512, "seq_len": 64, "batch": 2},
    "50M": {"n_layer": 3, "d_model": 1024, "n_head": 16, "vocab_size": 8192, "seq_len": 256, "batch": 2},
    "200M": {"n_layer": 16, "d_model": 1024, "n_head": 16, "vocab_size": 8192, "seq_len": 256, "batch": 2},
}


def _child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import tiermem
    from tiermem.app import trace_report
    from tiermem.app.models.gpt import GPT, GPTConfig
    from tiermem.states import StatesMemoryError

    size = SIZES[args.size]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: v for k, v in size.items() if k != "batch"}))
    state_bytes = 16 * model.num_parameters()
    generator = torch.Generator().manual_seed(1)
    shape = (size["batch"], size["seq_len"] + 1)
    batches = [
        torch.randint(0, size["vocab_size"], shape, generator=generator) for _ in range(args.warmup + args.steps)
    ]
    fraction = args.fraction
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
        for _ in range(6):  # raise the capacities until the planner fits (bench/states.py --fit does it by the need)
            tiers = {
                "device": {"device": "cpu", "capacity": int(state_bytes * fraction)},
                "host": {"capacity": int(state_bytes * fraction)},
                "nvme": {"paths": [nvme], "capacity": 2 * state_bytes + (1 << 30)},
                "activations": {"min_bytes": "1MiB"},
            }
            rt = tiermem.Runtime(tiers).start()
            try:
                managed, optimizer = rt.manage(
                    model,
                    torch.optim.AdamW,
                    plan={"block_policy": "nvme"},
                    lr=1e-4,
                    grad_accumulation_steps=1,
                    keep_gradients=False,
                )
                break
            except StatesMemoryError:
                rt.close()
                fraction *= 1.25
        else:
            sys.exit("bench trace_cost: no capacities fit")
        trace_path = Path(nvme) / "trace.json"
        times, cpu, loss = [], [], None
        try:
            recording = rt.trace(trace_path) if mode == "on" else None
            if recording is not None:
                recording.__enter__()
            alternate_on: list[float] = []
            for i, tokens in enumerate(batches):
                traced_step = mode == ALTERNATE and i >= args.warmup and (i - args.warmup) % 2 == 1
                if traced_step:
                    rt.start_trace(Path(nvme) / f"step{i}.json")
                start, cpu_start = time.perf_counter(), time.process_time()
                with rt.offload_activations(managed, policy="nvme"):
                    _, loss = managed(tokens[:, :-1], tokens[:, 1:])
                    assert loss is not None
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loss_value = loss.item()
                if traced_step:
                    alternate_on.append(time.perf_counter() - start)
                    rt.stop_trace()
                elif i >= args.warmup:
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - cpu_start)  # every thread's: what load inflates least
            if recording is not None:
                recording.__exit__(None, None, None)
        finally:
            rt.close()
        result = {"mode": mode, "step_s": statistics.median(times), "times": times, "loss": loss_value}
        result["cpu_s"] = statistics.median(cpu)
        if mode == ALTERNATE:
            result.update(on_times=alternate_on, on_step_s=statistics.median(alternate_on))
            result["ratio"] = round(result["on_step_s"] / result["step_s"], 3)
            return result
        plan = rt.plan.as_dict() if rt.plan is not None else {}
        result["plan"] = {k: plan.get(k) for k in ("chunk_size", "persistent_chunks", "buffers")}
        result["fraction"] = round(fraction, 3)
        if mode == "on":
            trace = trace_report.load(trace_path)
            steps = trace_report.summarize(trace)
            timed = steps[args.warmup :]
            lo, hi = timed[0].start, timed[-1].end
            times_of = [e["ts"] for v in trace.spans.values() for e in v] + [e["ts"] for e in trace.transfers]
            times_of += [t for v in trace.counters.values() for t, _ in v]
            result["events_per_step"] = sum(lo <= t <= hi for t in times_of) // len(timed)
            kinds: dict[str, int] = {}
            for events in trace.spans.values():
                for e in events:
                    if lo <= e["ts"] <= hi:
                        kinds["span"] = kinds.get("span", 0) + 1
            kinds["transfer"] = sum(lo <= e["ts"] <= hi for e in trace.transfers)
            kinds["counter"] = sum(lo <= t <= hi for v in trace.counters.values() for t, _ in v)
            result["events_by_kind"] = {k: v // len(timed) for k, v in kinds.items()}
            result["trace_bytes"] = trace_path.stat().st_size  # the planning step's profiling included
            result["last_step"] = steps[-1].as_dict() if steps else None
            result["dropped"] = trace.info.get("dropped_events")
    return result


def _off_point_s() -> float:
    """Seconds one instrumentation point costs with nothing recording (``tracing.span`` returning None)."""
    from tiermem import tracing

    assert tracing.RECORDER is None
    n = 200_000
    return min(timeit.repeat("span('forward', 'forward', 3)", globals={"span": tracing.span}, number=n, repeat=5)) / n


def _micro(n: int = 100_000, repeat: int = 3) -> dict[str, float]:
    """ns a recorded event costs by kind (every thread's CPU: recording it, serialising and writing
    it), the recorder started and stopped (its file drained) inside the timing; and ns a point
    costs off. The smallest of ``repeat`` tries (the least disturbed by other work)."""
    from tiermem import tracing

    def spans(count: int) -> None:
        span = tracing.span
        for i in range(count):
            traced = span("forward", "forward", i % 64)  # as the forward hooks: 64 module names
            if traced is not None:
                traced.end()

    def transfers(count: int) -> None:
        recorder = tracing.RECORDER
        assert recorder is not None
        for i in range(count):
            at = tracing.now()
            args = {"bytes": 20480, "nbytes": 20480, "priority": "WRITEBACK", "object": "gradient", "outcome": "done"}
            recorder.transfer("device->host", f"gradient {i % 64}", at, at, at, args)

    def counters(count: int) -> None:
        recorder = tracing.RECORDER
        assert recorder is not None
        for i in range(count):
            recorder.counter("host bytes in use", {"bytes": i})

    def cpu_ns(body: Any, on: bool) -> float:
        best = float("inf")
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as folder:
                start = time.process_time()
                recorder = tracing.Recorder(Path(folder) / "t.json").start() if on else None
                body(n)
                if recorder is not None:
                    recorder.stop()
                best = min(best, time.process_time() - start)
        return best / n * 1e9

    loop_off = cpu_ns(spans, False)  # the points themselves with nothing recording
    return {
        "off_point_ns": round(_off_point_s() * 1e9, 1),
        "span_ns": round(cpu_ns(spans, True) - loop_off, 1),
        "transfer_ns": round(cpu_ns(transfers, True), 1),
        "counter_ns": round(cpu_ns(counters, True), 1),
    }


def _on_cost(micro: dict[str, float], events_by_kind: dict[str, int], step_s: float) -> dict[str, Any]:
    """The recorded events of one step times what each kind costs, over the step."""
    seconds = sum(micro[f"{kind}_ns"] * count for kind, count in events_by_kind.items()) * 1e-9
    return {"on_s_per_step": round(seconds, 5), "on_fraction": f"{seconds / step_s:.2e}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="200M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.10, help="device and host capacity / state bytes")
    parser.add_argument(
        "--nvme-path",
        type=arguments.directory,
        default=None,
        help="where the NVMe tier's files go (default: the temp dir)",
    )
    parser.add_argument("--alternate", action="store_true", help="one process, timed steps alternating off and on")
    parser.add_argument("--micro", action="store_true", help="the per-point (off) and per-event (on) costs alone")
    parser.add_argument("--events-per-step", help="--micro: an on run's events_by_kind, e.g. '{\"span\": 2000, ...}'")
    parser.add_argument("--step-s", type=float, help="--micro: the step time to express the on cost against")
    parser.add_argument("--child", choices=(*MODES, ALTERNATE))
    args = parser.parse_args()
    if args.micro:
        micro = _micro()
        out: dict[str, Any] = {"machine": machine.facts(), "micro": micro}
        if args.events_per_step and args.step_s:
            out["on_cost"] = _on_cost(micro, json.loads(args.events_per_step), args.step_s)
        print(json.dumps(out))
        return
    if args.child:
        print(json.dumps(_child(args.child, args)))
        return
    if args.alternate:
        print(json.dumps(_child(ALTERNATE, args)))
        return
    print(json.dumps({"machine": machine.facts(), "args": {k: str(v) for k, v in vars(args).items()}}), flush=True)
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("size", "warmup", "steps", "fraction")]
    if args.nvme_path:
        passthrough.append(f"--nvme-path={args.nvme_path}")
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        row = {}
        for mode in MODES if index % 2 == 0 else MODES[::-1]:  # A B, B A: neither always goes first
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, *passthrough], capture_output=True, text=True, check=False
            )
            if out.returncode:
                sys.exit(f"bench trace_cost: {mode} failed:\n{out.stderr[-3000:]}")
            row[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({k: v for k, v in row[mode].items() if k != "last_step"}), flush=True)
        if row["on"]["loss"] != row["off"]["loss"]:
            sys.exit(f"bench trace_cost: the losses differ: {row}")
        rounds.append(row)
    ratios = [r["on"]["step_s"] / r["off"]["step_s"] for r in rounds]
    cpu_ratios = [r["on"]["cpu_s"] / r["off"]["cpu_s"] for r in rounds]
    off_s = statistics.median(r["off"]["step_s"] for r in rounds)
    events = statistics.median(r["on"]["events_per_step"] for r in rounds)
    micro = _micro()
    point = micro["off_point_ns"] * 1e-9
    summary = {
        "off_step_s": off_s,
        "on_step_s": statistics.median(r["on"]["step_s"] for r in rounds),
        "ratio_per_round": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "cpu_ratio_per_round": [round(x, 3) for x in cpu_ratios],
        "cpu_ratio_median": round(statistics.median(cpu_ratios), 3),
        "events_per_step": events,
        "trace_bytes": statistics.median(r["on"]["trace_bytes"] for r in rounds),
        "off_point_ns": round(point * 1e9, 1),
        "off_cost_estimate": f"{events * point / off_s:.2e} of a step",
        "micro": micro,
        **_on_cost(micro, rounds[-1]["on"]["events_by_kind"], off_s),
    }
    print(json.dumps({"summary": summary}))
    print(json.dumps({"where_the_time_goes": rounds[-1]["on"]["last_step"]}))


if __name__ == "__main__":
    main()
