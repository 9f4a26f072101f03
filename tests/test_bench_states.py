"""Smoke test of bench/states.py: one round at a tiny size, ``--json``; no timing asserts (speed
goals live in bench/, never in timed tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "states.py"


def test_tiny_run_gives_well_formed_json_and_leaves_no_files(tmp_path: Path) -> None:
    command = [
        sys.executable, str(BENCH), "--size=tiny", "--rounds=1", "--steps=2", "--warmup=1", "--threads=1",
        # the default fractions, raised by --fit to exactly what the plan needs: backward's
        # staging must stay within that (it once overflowed the host there)
        f"--nvme-path={tmp_path}", "--json",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["machine"]["cpus"] >= 1 and report["left_behind"] == []
    tiny = report["sizes"]["tiny"]
    plain, managed = tiny["plain"], tiny["tiermem"]
    for s in (plain, managed):
        assert s["params"] > 0 and s["median_step_s"] > 0 and len(s["step_s_samples"]) == 2
        assert s["rss_peak_steps"] > 0 and s["ru_maxrss"] > 0
    # the run trains: the same losses with and without tiermem (bitwise on the CPU)
    assert tiny["same_losses"] is True
    assert tiny["ratios"]["step_time"] > 0 and tiny["ratios"]["rss_peak_steps"] > 0
    assert managed["state_bytes_per_step"] > 0 and managed["minimum_bytes_per_step"] > 0
    assert all(v >= 0 for v in managed["state_links_per_step"].values())
    assert managed["plan"]["chunks"] >= 1 and managed["early_chunk_steps"] > 0
    for tier in ("device", "host"):
        assert 0 < managed["tiers"][tier]["peak_bytes"] <= managed["tiers"][tier]["capacity"]
    assert list(tmp_path.iterdir()) == []
