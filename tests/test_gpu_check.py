"""bench/gpu_check.sh (issue 21 item 3): its plumbing, without a GPU. A dry run lists every step as
skipped with the command it would run, and writes the one JSON report; it takes well under a second."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    "install_gds",
    "cuda_tests",
    "bench_io_posix_host",
    "bench_io_kvikio_host",
    "bench_io_posix_device",
    "bench_io_kvikio_device",
    "train_keep",
    "train_auto",
    "train_nvme",
    "activations",
]
#: Issue 21 item 3: the whole check in under 8 minutes on one GPU.
EIGHT_MINUTES_S = 480


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
    assert "10 skipped" in done.stdout
    notes = {s["step"]: s["note"] for s in report["steps"]}
    for backend in ("posix", "kvikio"):
        assert f"--backend {backend} --buffer device" in notes[f"bench_io_{backend}_device"]
        assert (
            "--buffer" not in notes[f"bench_io_{backend}_host"]
            and f"--backend {backend}" in notes[f"bench_io_{backend}_host"]
        )


def test_the_step_budgets_and_the_deadline_bound_the_run_under_eight_minutes(tmp_path: Path) -> None:
    """Every step has a budget (it is killed past it); the budgets, plus the 20 s probe of the machine,
    fit in the deadline, and the deadline (which cuts any step still running) is under 8 minutes."""
    subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    budgets = [s["budget_s"] for s in report["steps"]]
    assert all(b > 0 for b in budgets) and report["budget_s"] == sum(budgets)
    assert report["budget_s"] + 20 <= report["deadline_s"] < EIGHT_MINUTES_S


def test_unknown_arguments_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--fast"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr


def test_a_wheels_folder_without_wheels_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path), "--wheels", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "holds no .whl file" in done.stderr


def test_a_python_that_is_not_there_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(out), "--python", "/no/such/python"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "is not a program here" in done.stderr
    assert not out.exists()
