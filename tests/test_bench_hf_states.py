"""bench/hf_states.py at its tiny size, its modes run in this process (a worker process each would
cost a torch import apiece): every mode trains the same losses, the summary's floor and ratios are
the arithmetic its docstring states, the breakdown comes from the trace, and nothing is left on
disk. No timing asserts (speed goals live in bench/, never in timed tests)."""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench_modules import bench_module


@pytest.fixture(scope="module")
def hf_states() -> Iterator[ModuleType]:
    with bench_module("hf_states") as module:
        yield module


def test_every_mode_trains_the_same_losses_and_the_summary_states_the_floor(
    hf_states: ModuleType, tmp_path: Path
) -> None:
    args = argparse.Namespace(size="tiny", steps=1, warmup=1, fraction=0.0, threads=0, path=str(tmp_path))
    runs = {mode: [hf_states.run_mode(mode, args)] for mode in hf_states.MODES}
    assert list(tmp_path.iterdir()) == []  # the trace files went with the runs
    disk = {"read": 1e9, "write": 5e8}
    for mode in ("declared", "undeclared"):
        runs[mode][0]["disk"] = disk  # as run_on_measured_disk leaves it
    summary = hf_states.summarize(runs)
    assert summary["losses_bitwise_equal"] is True
    plain = summary["modes"]["plain"]
    for mode in ("declared", "undeclared"):
        m, run = summary["modes"][mode], runs[mode][0]
        assert run["nvme_read"] > 0 and run["nvme_written"] > 0  # at 30% most homes are on NVMe
        assert m["disk_s"] == pytest.approx(run["nvme_read"] / 1e9 + run["nvme_written"] / 5e8)
        assert m["floor_s"] == max(plain["step_s"], m["disk_s"])
        assert m["step_over_floor"] == pytest.approx(m["step_s"] / m["floor_s"])
        assert m["rss_over_plain"] == pytest.approx(run["ru_maxrss"] / runs["plain"][0]["ru_maxrss"])
        assert len(run["where_the_time_goes"]) == args.steps  # one trace summary per timed step
        assert m["phases"].keys() >= {"forward pass", "backward pass", "optimizer.step"}
        assert 0.0 < m["disk_busy"]["backward pass"] <= 1.0  # its homes are read and written back there
        # the disk time of each phase's bytes at the disk the process had, over the phase
        shares = [
            (s["storage_read"]["backward pass"] / 1e9 + s["storage_written"]["backward pass"] / 5e8)
            / s["phases"]["backward pass"]
            for s in run["where_the_time_goes"]
        ]
        assert shares[0] > 0
        assert m["disk_time_share"]["backward pass"] == pytest.approx(statistics.median(shares))
        for tier in ("device", "host"):
            assert 0 < m["tier_peaks"][tier] <= m["capacity"]
        # the CPU a step took, by thread (clock ticks: a tiny step may read 0): the training
        # thread's, and each pool of tiermem's once, its threads' numbers dropped
        assert "training" in m["cpu_by_thread"] and min(m["cpu_by_thread"].values()) >= 0
        assert all(not name[-1].isdigit() for name in m["cpu_by_thread"])
    # where the steps' time went for the CPUs and the training thread: the idle share is a share, and
    # the training thread's seconds on a CPU, ready and asleep add up to the wall time of the window
    # read around its steps, a step's
    for mode in hf_states.MODES:
        sched, run = summary["modes"][mode]["schedule"], runs[mode][0]
        assert 0.0 <= sched["cpu_idle"] <= 1.0
        assert sched["on_cpu_s"] > 0 and sched["ready_s"] >= 0 and sched["asleep_s"] >= 0
        spent = sched["on_cpu_s"] + sched["ready_s"] + sched["asleep_s"]
        assert sched["wall_s"] - 1e-6 <= spent <= sched["wall_s"] + sched["reading_s"] + 1e-6  # within the reading
        assert sum(run["step_s"]) / args.steps <= sched["wall_s"]
        # and per phase of the timed steps, read at its start and end: the same sum holds in each, the
        # phases lie within the steps, and each names the training thread among its threads
        phases = summary["modes"][mode]["phase_schedule"]
        assert tuple(phases) == hf_states.PHASES
        for figures in phases.values():
            assert 0.0 <= figures["cpu_idle"] <= 1.0 and "training" in figures["cpu_by_thread"]
            spent = figures["on_cpu_s"] + figures["ready_s"] + figures["asleep_s"]
            assert figures["wall_s"] - 1e-6 <= spent <= figures["wall_s"] + figures["reading_s"] + 1e-6
        assert 0 < sum(f["wall_s"] for f in phases.values()) <= sum(run["step_s"]) / args.steps
    # each process against the disk it had: a second round on a disk so slow that it, not plain
    # PyTorch's step (as before), is the floor, and each mode's step 1.5x as long
    fast, slow = {"read": 1e15, "write": 1e15}, {"read": 1e4, "write": 5e3}
    again = {
        mode: [*rs, {**copy.deepcopy(rs[0]), "step_s": [t * 1.5 for t in rs[0]["step_s"]]}] for mode, rs in runs.items()
    }
    again["plain"][1]["step_s"] = runs["plain"][0]["step_s"]
    for mode in ("declared", "undeclared"):
        again[mode][0]["disk"], again[mode][1]["disk"] = fast, slow
    two = hf_states.summarize(again)
    for mode in ("declared", "undeclared"):
        m, run = two["modes"][mode], runs[mode][0]
        floors = [
            max(
                statistics.median(runs["plain"][0]["step_s"]),
                run["nvme_read"] / d["read"] + run["nvme_written"] / d["write"],
            )
            for d in (fast, slow)
        ]
        ratios = [statistics.median(run["step_s"]) * k / f for k, f in zip((1.0, 1.5), floors, strict=True)]
        assert floors[0] == statistics.median(runs["plain"][0]["step_s"]) < floors[1]  # plain's, then the disk's
        assert [r["floor_s"] for r in m["rounds"]] == pytest.approx(floors)
        assert [r["step_over_floor"] for r in m["rounds"]] == pytest.approx(ratios)
        assert m["step_over_floor"] == pytest.approx(statistics.median(ratios))
    assert two["disk_bytes_per_s"] == {"declared": [fast, slow], "undeclared": [fast, slow]}
    runs["undeclared"][0]["losses"] = [x + 1.0 for x in runs["undeclared"][0]["losses"]]
    with pytest.raises(SystemExit, match="undeclared losses"):
        hf_states.summarize(runs)


def test_a_tiermem_process_runs_between_two_disk_measurements_and_has_their_mean(
    hf_states: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    rates = iter([{"read": 1e9, "write": 4e9}, {"read": 3e9, "write": 2e9}])

    def measure(path: str, size: str) -> dict[str, float]:
        events.append(f"bench io {path} {size}")
        return next(rates)

    def run(mode: str, args: argparse.Namespace, cache_home: str) -> dict[str, object]:
        events.append(f"{mode} in {cache_home}")
        return {"mode": mode}

    monkeypatch.setattr(sys.modules["states_headline"], "measure_disk", measure)  # what disk_around calls
    monkeypatch.setattr(hf_states, "_run", run)
    args = argparse.Namespace(path="/p", io_size="1GiB")
    result = hf_states.run_on_measured_disk("declared", args, "/cache")
    assert events == ["bench io /p 1GiB", "declared in /cache", "bench io /p 1GiB"]
    assert result["mode"] == "declared"
    assert result["disk"] == {
        "read": 2e9,
        "write": 3e9,
        "runs": [{"read": 1e9, "write": 4e9}, {"read": 3e9, "write": 2e9}],
    }
