"""bench/compute_under_io.py: its training worker times every phase of plain PyTorch's steps, its
summary is the arithmetic its docstring states, fio's report is read after the line fio prints as
a signal stops it, and the loaded run leaves no file of fio's behind. No timing asserts (speed goals
live in bench/, never in timed tests)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench_modules import bench_module

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "seq": 8, "batch": 2}


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_module("compute_under_io") as module:
        yield module


@pytest.fixture
def tiny_args(bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> argparse.Namespace:
    monkeypatch.setitem(bench.SIZES, "tiny", TINY)
    return argparse.Namespace(
        size="tiny", steps=2, warmup=1, threads=0, path=str(tmp_path), read_share=55, iodepth=4,
        fio_size="8MiB", settle=0.5, fio=shutil.which("fio"),
    )  # fmt: skip


def test_the_worker_times_each_phase_of_every_timed_step(bench: ModuleType, tiny_args: argparse.Namespace) -> None:
    result = bench.train(tiny_args)
    assert len(result["losses"]) == 3  # the warmup step's loss too
    assert len(result["step_s"]) == len(result["cpu_s"]) == 2
    for phase in bench.PHASES:
        assert len(result["phases"][phase]) == 2
    for index, step in enumerate(result["step_s"]):  # the phases cover the step, nothing else
        assert sum(result["phases"][p][index] for p in bench.PHASES) == pytest.approx(step)
    assert set(result["machine_cpu_s"]) == set(bench.CPU_KINDS)


def _run(step: float, losses: list[float], fio: dict[str, float] | None = None) -> dict[str, object]:
    thirds = {"forward": step * 0.4, "backward": step * 0.5, "optimizer.step": step * 0.1}
    run: dict[str, object] = {
        "phases": {p: [t, t] for p, t in thirds.items()},
        "step_s": [step, step],
        "cpu_s": [2 * step, 2 * step],
        "losses": losses,
        "machine_cpu_s": {"user": 1.0},
    }
    if fio is not None:
        run["fio"] = fio
    return run


def test_the_summary_is_each_rounds_ratio_and_the_time_lost_per_gib_moved(bench: ModuleType) -> None:
    fio = {"read_mib_s": 1024.0, "write_mib_s": 1024.0, "cpu_share": 0.1}
    rounds = [
        {"alone": _run(3.0, [1.0]), "loaded": _run(3.3, [1.0], fio)},
        {"alone": _run(2.0, [1.0]), "loaded": _run(2.5, [1.0], fio)},
        {"alone": _run(3.0, [1.0]), "loaded": _run(3.6, [1.0], fio)},
    ]
    summary = bench.summarize(rounds)
    assert [r["ratios"]["step_s"] for r in summary["rounds"]] == pytest.approx([1.1, 1.25, 1.2])
    assert summary["ratios"]["step_s"] == pytest.approx(1.2)  # the median of the rounds'
    assert summary["ratios"]["forward"] == pytest.approx(1.2)
    # 2 GiB/s moved during a loaded step of 3.3 s: 6.6 GiB, for 0.3 s lost
    assert summary["rounds"][0]["lost_s_per_gib"] == pytest.approx(0.3 / 6.6)
    assert summary["lost_s_per_gib"] == pytest.approx(0.6 / 7.2)  # the median of 0.045, 0.1 and 0.083


def test_the_summary_refuses_runs_whose_losses_differ(bench: ModuleType) -> None:
    fio = {"read_mib_s": 1.0, "write_mib_s": 1.0, "cpu_share": 0.1}
    with pytest.raises(SystemExit, match="loaded losses"):
        bench.summarize([{"alone": _run(1.0, [1.0]), "loaded": _run(1.1, [1.5], fio)}])


def test_fios_report_is_read_after_the_line_it_prints_as_it_stops(bench: ModuleType) -> None:
    report = {
        "jobs": [
            {"read": {"bw_bytes": 3 << 20}, "write": {"bw_bytes": 1 << 20}, "usr_cpu": 4.0, "sys_cpu": 6.0},
            {"read": {"bw_bytes": 1 << 20}, "write": {"bw_bytes": 0}, "usr_cpu": 1.0, "sys_cpu": 1.0},
        ]
    }
    parsed = bench.fio_report("fio: terminating on signal 2\n" + json.dumps(report))
    assert parsed == {"read_mib_s": 4.0, "write_mib_s": 1.0, "cpu_share": pytest.approx(0.12)}
    with pytest.raises(SystemExit, match="fio printed no report"):
        bench.fio_report("fio: unknown option\n")


def test_without_fio_the_bench_says_how_to_get_it(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["compute_under_io.py", "--fio="])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert stopped.value.code == 2
    assert "apt-get install fio" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_a_loaded_run_reads_what_fio_moved_and_leaves_no_file(
    bench: ModuleType, tiny_args: argparse.Namespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "_worker", bench.train)  # no torch import per process
    result = bench.run_mode("loaded", tiny_args)
    assert result["fio"]["read_mib_s"] > 0 and result["fio"]["write_mib_s"] > 0
    assert list(tmp_path.iterdir()) == []
