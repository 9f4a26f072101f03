"""The timeline trace (NOTE [ Timeline trace ] in tiermem.tracing): a traced ``tiermem train``
writes a valid Chrome trace whose bytes per link are the runtime's, torch.profiler sees
tiermem's ranges, and ``tiermem trace summary|plot`` read it."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tiermem
from tiermem import tracing
from tiermem.app import trace_report
from tiermem.cli import main
from tiermem.config import Config

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_ARGS = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "64", "--seq-len", "32"]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.upper().startswith("TIERMEM_"):
            monkeypatch.delenv(name)


def _config(tmp_path: Path) -> str:
    """NVMe under tmp_path; every saved tensor offloaded (the tiny model's are all below 1MiB)."""
    (tmp_path / "nvme").mkdir(exist_ok=True)
    path = tmp_path / "tiers.toml"
    path.write_text(
        f'[device]\ndevice = "cpu"\n[nvme]\npaths = ["{tmp_path / "nvme"}"]\n'
        f'[scheduler]\nloop = "asyncio"\n[activations]\nmin_bytes = 0\n'
    )
    return str(path)


Blocked = tuple[float, float, str]  # (start, end) on the trace's clock, and where the thread blocked


@contextlib.contextmanager
def main_thread_blocks() -> Iterator[list[Blocked]]:
    """Every stretch the main thread spends blocked in ``threading.Condition.wait``, measured
    apart from the trace: what ``Event.wait``, ``Condition.wait_for``, ``Future.result`` and so
    every wait of tiermem's (on a transfer, a chunk step, a move's end, write-backs) blocks in.
    Not counted: other threads (the scheduler's and the trace writer's idle waits), polls with no
    time to wait, and ``Thread.start`` waiting for a new thread to run (the OS's start-up, not a
    wait on tiermem's work)."""
    original = threading.Condition.wait
    main_thread = threading.main_thread()
    blocks: list[Blocked] = []

    def wait(cond: threading.Condition, timeout: float | None = None) -> bool:
        if threading.current_thread() is not main_thread or timeout == 0:
            return original(cond, timeout)
        if sys._getframe(2).f_code is threading.Thread.start.__code__:
            return original(cond, timeout)
        start = time.perf_counter()
        try:
            return original(cond, timeout)
        finally:
            end = time.perf_counter()
            frame, where = sys._getframe(1), []
            while frame is not None and len(where) < 6:
                where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
                frame = frame.f_back
            blocks.append((start, end, " <- ".join(where)))

    threading.Condition.wait = wait  # type: ignore[method-assign]
    try:
        yield blocks
    finally:
        threading.Condition.wait = original  # type: ignore[method-assign]


@dataclass
class TracedRun:
    path: Path
    summary: dict[str, Any]
    blocks: list[Blocked]  # the main thread's, over the whole run (main_thread_blocks)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> TracedRun:
    """``tiermem train --steps 3 --trace FILE`` with activations on NVMe: the file, the run's
    summary and where the training thread blocked."""
    tmp = tmp_path_factory.mktemp("traced")
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.upper().startswith("TIERMEM_")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp / "summary.json"
        trace = tmp / "run.trace.json"
        args = ["train", *TINY_ARGS, "--steps", "3", "--config", _config(tmp), "--policy", "nvme"]
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), main_thread_blocks() as blocks:
            assert main([*args, "--json", "--trace", str(trace)]) == 0
        out.write_text(buffer.getvalue())
        return TracedRun(trace, json.loads(buffer.getvalue()), blocks)
    finally:
        torch.set_num_threads(threads)
        os.environ.update(saved)


def _check_nested(events: list[dict[str, Any]]) -> None:
    """Complete events of one track nest: each is inside the one open before it, or after it."""
    stack: list[float] = []
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        end = event["ts"] + event["dur"]
        while stack and stack[-1] <= event["ts"]:
            stack.pop()
        assert not stack or end <= stack[-1] + 1e-3, f"{event['name']} overlaps its parent on its track"
        stack.append(end)


def test_traced_train_writes_a_valid_chrome_trace(traced_run: TracedRun) -> None:
    path = traced_run.path
    data = json.loads(path.read_text())  # the whole file is one JSON object
    events = data["traceEvents"]
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    named: set[tuple[int, int]] = set()
    phases: dict[str, int] = defaultdict(int)
    for event in events:
        assert {"name", "ph", "pid", "tid"} <= set(event), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        phases[event["ph"]] += 1
        if event["ph"] == "M":
            if event["name"] == "thread_name":
                named.add((event["pid"], event["tid"]))
            continue
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        if event["ph"] == "X":
            assert event["dur"] >= 0 and isinstance(event.get("cat"), str)
            tracks[(event["pid"], event["tid"])].append(event)
        elif event["ph"] == "C":
            assert event["args"] and all(isinstance(v, (int, float)) for v in event["args"].values())
    assert phases["X"] and phases["C"] and phases["M"]
    for key, track in tracks.items():
        assert key in named, f"track {key} has no name"
        _check_nested(track)
    cats = {e.get("cat") for e in events}
    assert {"step", "forward", "backward", "optimizer", "chunk_step", "wait", "transfer"} <= cats
    assert sum(1 for e in events if e.get("cat") == "step") == 3
    assert any(e["name"].startswith("backward chunk") for e in events if e["ph"] == "X")  # per module call
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert any(name.endswith("bytes in use") for name in counters)
    assert any(name.startswith("in flight ") for name in counters)
    transfer = next(e for e in events if e.get("cat") == "transfer" and e["args"]["link"] == "device->nvme")
    assert {"bytes", "priority", "object", "outcome", "queued_ms", "link"} <= set(transfer["args"])
    to_nvme = {
        e["args"]["object"] for e in events if e.get("cat") == "transfer" and e["args"]["link"] == "device->nvme"
    }
    assert to_nvme == {"probe", "saved activation"}  # the planner's link probes, then the policy's offload
    assert data["tiermem"]["dropped_events"] == 0


def test_every_wait_is_inside_a_phase_of_its_thread(traced_run: TracedRun) -> None:
    trace = trace_report.load(traced_run.path)
    waits = 0
    for events in trace.spans.values():
        work = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] not in ("wait", "fetch", "chunk_step")]
        for event in events:
            if event["cat"] == "wait" and trace.thread_names.get(event["tid"]) == "MainThread":
                waits += 1
                inside = any(s <= event["ts"] and event["ts"] + event["dur"] <= e + 1e-6 for s, e in work)
                assert inside, f"{event['name']} at {event['ts']} is in no phase"
    assert waits > 0


def _uncovered(blocks: list[Blocked], trace: trace_report.Trace, thread: str = "MainThread") -> list[Blocked]:
    """The blocks inside the recording that no ``wait`` span of ``thread`` covers."""
    t0, t1 = trace.info["t0_s"], trace.info["t1_s"]
    tids = [tid for tid, name in trace.thread_names.items() if name == thread]
    waits = [(t0 + e["ts"], t0 + e["ts"] + e["dur"]) for tid in tids for e in trace.spans[tid] if e["cat"] == "wait"]
    slack = 1e-8  # the file's microseconds have three decimals
    recorded = [b for b in blocks if t0 <= b[0] and b[1] <= t1]
    return [b for b in recorded if not any(s - slack <= b[0] and b[1] <= e + slack for s, e in waits)]


def test_every_time_the_training_thread_blocked_is_a_traced_wait(traced_run: TracedRun) -> None:
    """Measured apart from the trace (main_thread_blocks): each stretch the training thread spent
    blocked while recording lies inside a ``wait`` span of its track, so a wait left unrecorded
    (a move's end booked late, write-backs waited for, a synchronous tier write) fails here."""
    trace = trace_report.load(traced_run.path)
    t0, t1 = trace.info["t0_s"], trace.info["t1_s"]
    assert sum(t0 <= b[0] and b[1] <= t1 for b in traced_run.blocks) > 10  # the run waited, often
    missing = _uncovered(traced_run.blocks, trace)
    assert not missing, "\n".join(f"{(e - s) * 1e3:.3f} ms untraced in {where}" for s, e, where in missing[:10])


def test_trace_bytes_per_link_are_the_runtimes(traced_run: TracedRun) -> None:
    path, summary = traced_run.path, traced_run.summary
    trace = trace_report.load(path)
    start, stop = trace.info["links_at_start"], trace.info["links_at_stop"]
    span = {link: stats["bytes"] - start.get(link, {}).get("bytes", 0) for link, stats in stop.items()}
    assert trace.link_bytes() == {link: n for link, n in span.items() if n}
    assert trace.link_bytes().get("device->nvme", 0) > 0
    # the run's own summary (rt.stats() at its end) counts the same bytes over the run
    assert summary["tiers"]["nvme"]["bytes_written"] == sum(
        n for link, n in trace.link_bytes().items() if link.endswith("->nvme")
    )


def test_rt_trace_bytes_equal_rt_stats_over_the_span(tmp_path: Path) -> None:
    config = {"device": {"device": "cpu"}, "nvme": {"paths": [str(tmp_path)]}, "scheduler": {"loop": "asyncio"}}
    with tiermem.Runtime(config) as rt:
        before = rt.stats().as_dict()["links"]
        with rt.trace(tmp_path / "t.json"):
            handles = [rt.store(torch.full((300_000,), i, dtype=torch.uint8), "nvme") for i in range(3)]
            for handle in handles:
                handle.wait()
            assert [int(h.tensor()[0]) for h in handles] == [0, 1, 2]
            for handle in handles:
                handle.free()
        after = rt.stats().as_dict()["links"]
        assert tracing.RECORDER is None
    moved = {link: after[link]["bytes"] - before.get(link, {}).get("bytes", 0) for link in after}
    assert trace_report.load(tmp_path / "t.json").link_bytes() == {k: v for k, v in moved.items() if v}


def test_tracing_off_reaches_only_the_entry_checks(tmp_path: Path) -> None:
    """Off (no recorder, no torch.profiler), steps of a managed model with activations on NVMe reach
    tiermem.tracing only through its entry points, on every thread, and each returns at its first
    check: no Span is made, no Recorder method runs, no clock is read for the trace. (What those
    checks cost a step is bench/trace_cost.py's --off-micro.)"""
    file = tracing.__file__
    calls: collections.Counter[str] = collections.Counter()
    results: list[object] = []
    lock = threading.Lock()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if frame.f_code.co_filename != file:
            return
        with lock:
            if event == "call":
                calls[frame.f_code.co_qualname] += 1
            elif event == "return" and frame.f_code.co_name == "span":
                results.append(arg)

    config = {
        "device": {"device": "cpu"},
        "nvme": {"paths": [str(tmp_path)]},
        "scheduler": {"loop": "asyncio"},
        "activations": {"min_bytes": 0},
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(8, 64)
    steps = 2
    threading.setprofile(profile)  # the runtime's threads start below: each is watched
    try:
        with tiermem.Runtime(config) as rt:
            plan = {"chunk_size": 64 * 65 * 4, "persistent_chunks": 0, "state_home": "nvme", "buffers": 2}
            model, optimizer = rt.manage(model, torch.optim.AdamW, plan=plan, lr=1e-3)
            calls.clear()
            sys.setprofile(profile)  # this thread from here
            for _ in range(steps):
                with rt.offload_activations(model, policy="nvme"):
                    model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            assert rt.stats().as_dict()["links"]["device->nvme"]["bytes"] > 0  # saved tensors went to NVMe
            counted = dict(calls)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert counted, "no instrumentation point was passed: this test watches nothing"
    assert set(counted) <= {"span", "wrap"}, counted  # nothing past the entry checks
    assert counted.get("span", 0) >= steps  # the forward hooks, fetches and waits passed theirs
    assert all(result is None for result in results)


def test_torch_profiler_shows_tiermem_ranges(tmp_path: Path) -> None:
    config = {"device": {"device": "cpu"}, "nvme": {"paths": [str(tmp_path)]}, "scheduler": {"loop": "asyncio"}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(8, 64)
    with tiermem.Runtime(config) as rt:
        plan = {"chunk_size": 64 * 65 * 4, "persistent_chunks": 0, "state_home": "host", "buffers": 2}
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan=plan, lr=1e-3)
        model(x).sum().backward()  # a first step outside the profiler
        optimizer.step()
        optimizer.zero_grad()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    names = {event.name for event in prof.events()}
    ours = {name for name in names if name.startswith("tiermem.")}
    assert any(name.startswith("tiermem.forward") for name in ours), sorted(names)[:30]
    assert any(name.startswith("tiermem.fetch chunk") for name in ours), ours
    assert any(name.startswith("tiermem.chunk step") for name in ours), ours
    assert "tiermem.optimizer step" in ours


def test_summary_and_plot(traced_run: TracedRun, capsys: pytest.CaptureFixture[str]) -> None:
    path = traced_run.path
    assert main(["trace", "summary", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == 3
    for step in report["steps"]:
        assert step["wait_s"] == pytest.approx(step["seconds"] - step["compute_s"], abs=1e-9)
        assert step["wait_s"] == pytest.approx(sum(step["waits"].values()), abs=1e-9)
        assert 0.0 <= step["compute_s"] <= step["seconds"]
        assert set(step["phases"]) == {"forward pass", "backward pass", "optimizer.step"}  # tiermem train's
        assert 0.0 < sum(step["phases"].values()) <= step["seconds"]
        assert step["overlap"] is None or 0.0 <= step["overlap"] <= 1.0 + 1e-9
        for link in step["links"].values():
            assert 0.0 <= link["busy_fraction"] <= 1.0 + 1e-9
    assert main(["trace", "summary", str(path)]) == 0
    text = capsys.readouterr().out
    assert "step 3:" in text and "compute" in text and "overlap" in text and "phases: forward pass" in text
    png = path.parent / "timeline.png"
    assert main(["trace", "plot", str(path), "-o", str(png), "--steps", "2:3"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_loop_offloading_activations_alone_is_summarized_step_by_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule 7 of NOTE [ Timeline trace ]: a loop with ``rt.offload_activations`` and a plain
    optimizer (no step spans, no managed optimizer) is cut into steps where each forward pass over
    the offloaded blocks begins; each step holds its own saved activations' moves."""
    config = {
        "device": {"device": "cpu"},
        "nvme": {"paths": [str(tmp_path / "nvme")]},
        "scheduler": {"loop": "asyncio"},
        "activations": {"min_bytes": 0},
    }
    (tmp_path / "nvme").mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    steps, path = 3, tmp_path / "t.json"
    with tiermem.Runtime(config) as rt, rt.trace(path):
        for _ in range(steps):
            offloader = rt.offload_activations(model, policy="nvme", blocks=[torch.nn.Sequential])
            with offloader:
                loss = model(x).sum()
                # The writes land before backward: one it overtook would be cancelled (its read
                # forwarded), and on a loaded machine all of them were, leaving nothing to split.
                offloader.history.ledger.wait_idle()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    trace = trace_report.load(path)
    assert len(trace.passes) == steps
    assert main(["trace", "summary", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == steps
    starts = [start for start, _ in trace_report.step_intervals(trace)]
    assert starts == [ts for ts, _ in trace.passes]  # each step begins with its forward pass
    for step in report["steps"]:
        assert step["wait_s"] == pytest.approx(sum(step["waits"].values()), abs=1e-9)
    # Every write falls in a step, split by time where one spans two.
    assert all(step["links"]["device->nvme"]["bytes"] > 0 for step in report["steps"])
    written = sum(step["links"]["device->nvme"]["bytes"] for step in report["steps"])
    assert written == pytest.approx(trace.link_bytes()["device->nvme"], rel=1e-9)


def test_plot_and_summary_say_what_is_wrong_in_words(
    traced_run: TracedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Steps past the trace's last, a folder that is not there, a reader that went away: a line
    saying so (or, for the reader, nothing), never a traceback; a range past the end ends at the
    last step."""
    path = traced_run.path
    assert main(["trace", "plot", str(path), "-o", str(tmp_path / "past.png"), "--steps", "5:9"]) == 1
    assert "begin past the trace's last step: it has 3 (give steps 1 to 3)" in capsys.readouterr().err
    assert not (tmp_path / "past.png").exists()
    assert main(["trace", "plot", str(path), "-o", str(tmp_path / "end.png"), "--steps", "3:9"]) == 0
    assert (tmp_path / "end.png").exists()
    missing = tmp_path / "missing" / "p.png"
    assert main(["trace", "plot", str(path), "-o", str(missing)]) == 1
    assert f"cannot write {missing}: no such directory {missing.parent}" in capsys.readouterr().err
    script = f"from tiermem.cli import main; import sys; sys.exit(main(['trace', 'summary', {str(path)!r}]))"
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout is not None
    reader.stdout.close()  # `| head -0`: gone before the summary is printed
    assert reader.stderr is not None
    with reader.stderr:
        errors = reader.stderr.read()
    assert reader.wait(timeout=120) == 0
    assert b"Traceback" not in errors
    with pytest.raises(FileNotFoundError, match=r"tiermem trace: cannot write the trace to .*missing.*existing folder"):
        tracing.Recorder(tmp_path / "missing" / "t.json").start()
    with pytest.raises(IsADirectoryError, match=r"cannot write the trace to"):
        tracing.Recorder(tmp_path).start()
    assert tracing.RECORDER is None


def test_a_phases_storage_busy_time_is_the_union_of_its_storage_moves(tmp_path: Path) -> None:
    """The summary's storage busy time of a phase: the part of it in which some move read or wrote
    storage, moves on several storage links counted once where they overlap, moves between memory
    tiers not at all, and a move across two phases split between them; its storage bytes, read and
    written, the same way (a move across two phases pro rata)."""

    def span(name: str, cat: str, start_ms: float, end_ms: float, pid: int = 1, **args: object) -> dict[str, object]:
        return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 7 if pid == 1 else 1 << 30,
                "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3, "args": args}  # fmt: skip

    def move(link: str, start_ms: float, end_ms: float) -> dict[str, object]:
        return span("chunk home", "transfer", start_ms, end_ms, pid=2, link=link, bytes=1 << 20)

    events = [
        span("step", "step", 0, 300),
        span("forward pass", "phase", 0, 100),
        span("backward pass", "phase", 100, 300),
        move("nvme->device", 20, 50),
        move("device->nvme", 40, 80),  # overlaps the read: 20-80 ms busy in forward
        move("host->device", 85, 95),  # memory to memory: not storage
        move("nvme->host", 90, 150),  # 90-100 in forward, 100-150 in backward
        move("host->nvme", 200, 260),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (step,) = trace_report.summarize(trace_report.load(path))
    assert step.storage_busy == pytest.approx({"forward pass": 0.070, "backward pass": 0.110})
    assert step.as_dict()["storage_busy"] == step.storage_busy
    assert step.phases == pytest.approx({"forward pass": 0.1, "backward pass": 0.2})
    mib = 1 << 20  # each move's bytes: the read across the phases is 1/6 in forward, 5/6 in backward
    assert step.storage_read == pytest.approx({"forward pass": mib + mib / 6, "backward pass": 5 * mib / 6})
    assert step.storage_written == pytest.approx({"forward pass": mib, "backward pass": mib})
    assert step.as_dict()["storage_written"] == {"forward pass": mib, "backward pass": mib}


def test_a_cut_off_trace_still_reads(tmp_path: Path) -> None:
    recorder = tracing.Recorder(tmp_path / "cut.json").start()
    try:
        with tracing.traced("step", "step"):
            tracing.span("wait", "wait").end()  # type: ignore[union-attr]
        time.sleep(3 * tracing.FLUSH_S)  # the writer thread wrote them
    finally:
        text = (tmp_path / "cut.json").read_text()  # what a killed run leaves: no closing entry
        recorder.stop()
    (tmp_path / "cut.json").write_text(text)
    trace = trace_report.load(tmp_path / "cut.json")
    assert [e["cat"] for events in trace.spans.values() for e in events] == ["step", "wait"]


def test_trace_config_section(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert Config().trace.path == "" and Config().to_dict()["trace"]["max_size"] == 1 << 30
    monkeypatch.setenv("TIERMEM_TRACE", str(tmp_path / "env.json"))
    assert Config.coerce(None).trace.path == str(tmp_path / "env.json")
    assert Config.coerce({"trace": {"path": "file.json"}}).trace.path == "file.json"  # the file wins
    with pytest.raises(tiermem.errors.ConfigError, match=r"trace\.path"):
        Config.from_dict({"trace": {"path": 3}})
    config = {"device": {"device": "cpu"}, "nvme": {"paths": [str(tmp_path)]}, "scheduler": {"loop": "asyncio"}}
    with tiermem.Runtime(config):
        assert tracing.RECORDER is not None and tracing.RECORDER.path == str(tmp_path / "env.json")
        with tiermem.Runtime(config):  # a second runtime while the first records: it records nothing
            assert tracing.RECORDER.path == str(tmp_path / "env.json")
        assert tracing.RECORDER is not None
    assert tracing.RECORDER is None
    assert json.loads((tmp_path / "env.json").read_text())["tiermem"]["dropped_events"] == 0


def test_forwarded_reads_and_cancelled_writes_are_marked(tmp_path: Path) -> None:
    """A read served from a moving object's source and a write cancelled because the object is wanted
    back (NOTE [ Managed object rules ] rules 1 and 3) are instants; the cancelled move ends as such."""
    from tests.gated_tier import GatedTier
    from tiermem.registry import ObjectState, Priority, Registry
    from tiermem.schedulers import AsyncioScheduler
    from tiermem.tiers.device import DeviceTier
    from tiermem.tiers.host import HostTier

    nvme = GatedTier(queue_depth=2)
    device, host = DeviceTier(64 << 20, "cpu"), HostTier(64 << 20)
    scheduler = AsyncioScheduler(block_size=1 << 16, loop="asyncio")
    registry = Registry({"device": device, "host": host, "nvme": nvme}, scheduler)
    try:
        with tracing.recording(tmp_path / "t.json"):
            handle = registry.register(torch.randn(40_000))
            transfer = handle.move_to("nvme", Priority.WRITEBACK)
            nvme.wait_pending(1)
            assert handle.state is ObjectState.MOVING
            handle.tensor()  # forwarded
            assert handle.move_to("device", Priority.DEMAND) is None  # the write is cancelled
            nvme.gated = False
            nvme.release_all()
            with pytest.raises(tiermem.errors.TransferCancelledError):
                transfer.wait(timeout=10)
            handle.wait()
            handle.free()
    finally:
        nvme.gated = False
        nvme.release_all()
        registry.free_all()
        scheduler.close()
        for tier in (device, host, nvme):
            tier.close()
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["forwarded tensor read", "cancel tensor write"]
    moves = [e for e in events if e.get("cat") == "transfer"]
    assert [m["args"]["outcome"] for m in moves] == ["cancelled"]


@contextlib.contextmanager
def gated_registry() -> Iterator[tuple[Any, Any]]:
    """A registry whose NVMe tier serves a request only when the test releases it: (registry, nvme)."""
    from tests.gated_tier import GatedTier
    from tiermem.registry import Registry
    from tiermem.schedulers import AsyncioScheduler
    from tiermem.tiers.device import DeviceTier
    from tiermem.tiers.host import HostTier

    nvme = GatedTier(queue_depth=2)
    device, host = DeviceTier(64 << 20, "cpu"), HostTier(64 << 20)
    scheduler = AsyncioScheduler(block_size=1 << 16, loop="asyncio")
    registry = Registry({"device": device, "host": host, "nvme": nvme}, scheduler)
    try:
        yield registry, nvme
    finally:
        nvme.gated = False
        nvme.release_all()
        registry.free_all()
        scheduler.close()
        for tier in (device, host, nvme):
            tier.close()


def _in_function(thread: threading.Thread, code: Any) -> bool:
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


HOLD_S = 0.05  # how long each scenario keeps the training thread waiting


def _helper(work: Any) -> threading.Thread:
    thread = threading.Thread(target=work, name="test helper", daemon=True)
    thread.start()
    return thread


def _assert_traced(path: Path, blocks: list[Blocked], name: str) -> None:
    """The main thread waited about HOLD_S, all of it inside traced waits, one of them ``name``."""
    trace = trace_report.load(path)
    assert sum(e - s for s, e, _ in blocks) >= 0.8 * HOLD_S, blocks
    missing = _uncovered(blocks, trace)
    assert not missing, "\n".join(f"{(e - s) * 1e3:.3f} ms untraced in {where}" for s, e, where in missing)
    waits = [e for tid, events in trace.spans.items() for e in events if e["cat"] == "wait"]
    assert any(e["name"] == name and e["dur"] >= 0.8 * HOLD_S for e in waits), [(e["name"], e["dur"]) for e in waits]


def test_a_moves_end_booked_late_is_a_traced_wait(tmp_path: Path) -> None:
    """Registry.wait after the transfer ended but before the scheduler's thread booked the move's end
    (NOTE [ Managed object rules ] rule 2): forced by holding the registry's lock from a helper."""
    from tiermem.registry import Priority
    from tiermem.schedulers.base import Transfer

    with gated_registry() as (registry, nvme), tracing.recording(tmp_path / "t.json"):
        handle = registry.register(torch.randn(40_000), label="gradient")
        handle.move_to("nvme", Priority.WRITEBACK)
        main_thread = threading.main_thread()

        def hold_the_booking() -> None:
            nvme.wait_pending(1)
            while not _in_function(main_thread, Transfer.wait.__code__):  # the main thread waits on the move
                time.sleep(0.001)
            with registry._lock:  # the move's end cannot be booked meanwhile
                nvme.gated = False
                nvme.release_all()
                time.sleep(HOLD_S)

        helper = _helper(hold_the_booking)
        with main_thread_blocks() as blocks:
            handle.wait()
        helper.join()
        assert handle.tier == "nvme"
        handle.free()
    _assert_traced(tmp_path / "t.json", blocks, "wait gradient move end")


def test_waiting_for_activation_write_backs_is_a_traced_wait(tmp_path: Path) -> None:
    """The offloader's wait for every write-back in flight (WriteLedger.wait_idle: no one transfer)."""
    from tiermem.activations.ledger import WriteLedger
    from tiermem.registry import Priority

    with gated_registry() as (registry, nvme), tracing.recording(tmp_path / "t.json"):
        handle = registry.register(torch.randn(40_000), kind="activation", label="saved activation")
        ledger = WriteLedger({}, threading.Lock())
        transfer = handle.move_to("nvme", Priority.WRITEBACK)
        ledger.started(transfer, handle.obj, handle.obj.nbytes, "nvme", 0, 0)

        def land_later() -> None:
            nvme.wait_pending(1)
            time.sleep(HOLD_S)
            nvme.gated = False
            nvme.release_all()

        helper = _helper(land_later)
        with main_thread_blocks() as blocks:
            ledger.wait_idle()
        helper.join()
        assert ledger.inflight_bytes() == 0
        handle.wait()
        handle.free()
    _assert_traced(tmp_path / "t.json", blocks, "wait saved activation write-backs")


def test_a_synchronous_write_into_a_tier_is_a_traced_wait(tmp_path: Path) -> None:
    """A tensor registered straight onto NVMe (the offloader's spill when the device is full) is
    copied there before register returns: the training thread waits for the tier's write."""
    with gated_registry() as (registry, nvme), tracing.recording(tmp_path / "t.json"):

        def serve_later() -> None:
            nvme.wait_pending(1)
            time.sleep(HOLD_S)
            nvme.gated = False
            nvme.release_all()

        helper = _helper(serve_later)
        with main_thread_blocks() as blocks:
            handle = registry.register(torch.randn(40_000), "nvme", kind="activation", label="saved activation")
        helper.join()
        handle.free()
    _assert_traced(tmp_path / "t.json", blocks, "wait saved activation write nvme")


def test_moves_are_labelled_with_what_they_carry(tmp_path: Path) -> None:
    """Each move names its object truthfully: a chunk's gradients (its parameter bytes) as
    "gradient", its home (parameters and AdamW states) as "chunk home", the device copy's refill as
    "chunk copy fill", a checkpoint's copies as "checkpoint fill"; no bare "chunk"."""
    config = {"device": {"device": "cpu"}, "nvme": {"paths": [str(tmp_path)]}, "scheduler": {"loop": "asyncio"}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(8, 64)
    with tiermem.Runtime(config) as rt:
        plan = {"chunk_size": 64 * 65 * 4, "persistent_chunks": 0, "state_home": "nvme", "buffers": 2}
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan=plan, lr=1e-3)
        chunk_bytes = {c["nbytes"] for c in rt._model_states[0].describe()["chunks"]}
        with rt.trace(tmp_path / "t.json"):
            for step in range(3):
                if step == 2:  # an asynchronous save copies the chunks as training goes on
                    pending = rt.save(tmp_path / "ckpt", blocking=False)
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            assert pending is not None
            pending.wait()
    moves = trace_report.load(tmp_path / "t.json").transfers
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for move in moves:
        by_label[move["args"]["object"]].append(move["args"])
    assert {"gradient", "chunk home", "chunk copy fill", "checkpoint fill"} <= set(by_label), sorted(by_label)
    chunk_labels = {label.split()[1] for label in by_label if label.startswith("chunk ")}
    assert "chunk" not in by_label and chunk_labels <= {"home", "copy"}, sorted(by_label)
    assert all(m["nbytes"] in chunk_bytes for m in by_label["gradient"])  # a chunk's parameter bytes
    assert {m["link"] for m in by_label["gradient"]} == {"device->host"}  # offloaded chunks' gradients
    assert all(m["nbytes"] in chunk_bytes for m in by_label["chunk copy fill"])
    assert all(m["link"].endswith("->device") for m in by_label["chunk copy fill"])  # from the home, wherever
    # a home carries AdamW's two states (a move told the parameters are known reads only those) or all three;
    # a new home's states are zeros, neither written nor read (NOTE [ Managed object rules ] rule 12): its
    # parameters alone are, or nothing but the known bytes is moved
    assert all(m["nbytes"] in {k * n for n in chunk_bytes for k in (1, 2, 3)} for m in by_label["chunk home"])
    assert {m["link"] for m in by_label["chunk home"]} <= {"nvme->host", "host->nvme"}
