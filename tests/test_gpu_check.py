"""bench/gpu_check.sh (issue 21 item 3): its plumbing, without a GPU. A dry run lists every step as
skipped with the command it would run, and writes the one JSON report; it takes well under a second."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["install_gds", "cuda_tests", "bench_io_posix", "bench_io_kvikio", "device_buffers", "activations", "states"]


def test_a_dry_run_lists_every_step_and_writes_the_report(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["summary"].endswith("(dry run: nothing ran)")
    assert [s["step"] for s in report["steps"]] == STEPS
    for step in report["steps"]:
        assert step["status"] == "skipped" and step["note"].startswith("dry run: would run: "), step
    assert "tests/test_cuda.py" in report["steps"][1]["note"]
    assert "7 skipped" in done.stdout


def test_unknown_arguments_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--fast"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr
