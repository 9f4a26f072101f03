"""Smoke test of bench/queued_moves.py: a few small moves, ``--json``; no timing asserts (speed
goals live in bench/, never in timed tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "queued_moves.py"


def test_a_small_run_reports_each_rounds_cost_a_move_and_leaves_no_files(tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH), "--moves=8", "--size=64KiB", "--rounds=2", f"--path={tmp_path}", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["settings"] == {"moves": 8, "size": 64 << 10, "rounds": 2}
    assert len(report["us_a_move"]) == 2
    assert {"tiermem-scheduler", "calling thread", "wall"} <= set(report["median_us_a_move"])
    assert report["median_us_a_move"]["wall"] > 0
    assert list(tmp_path.iterdir()) == []


def test_bad_counts_and_sizes_are_refused_at_the_command_line(tmp_path: Path) -> None:
    for flag, message in [
        ("--moves=0", "--moves and --rounds must be at least 1"),
        ("--size=abc", "cannot read 'abc' as a size"),
        ("--size=5", "a positive multiple of 4KiB"),
    ]:
        command = [sys.executable, str(BENCH), flag, f"--path={tmp_path}"]
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (flag, out.stderr)
