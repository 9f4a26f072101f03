"""``tiermem plan | head -1`` and the like: a reader that goes away is not an error. The
command exits quietly (status 0, nothing on stderr about the pipe) instead of ending in a
BrokenPipeError traceback, or CPython's "Exception ignored" at its final flush.

The read end is closed before the command writes anything, so its first write fails for
certain: reading a line first would race with a command that prints all its lines at once
(the pipe's buffer would take them all before the reader closed it, and nothing would fail).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


def _env(tmp_path: Path) -> dict[str, str]:
    """No TIERMEM_* from the developer's shell; the profile cache and temp files under tmp_path."""
    env = {name: value for name, value in os.environ.items() if not name.upper().startswith("TIERMEM_")}
    return {**env, "XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}


def _config(tmp_path: Path) -> str:
    (tmp_path / "nvme").mkdir(exist_ok=True)
    path = tmp_path / "tiers.toml"
    path.write_text(
        f'[device]\ndevice = "cpu"\n[nvme]\npaths = ["{tmp_path / "nvme"}"]\n[activations]\nmin_bytes = 0\n'
    )
    return str(path)


PLAN = shlex.split("plan --model tiny --batch 2 --seq 64")
# --json: no intro line, so the run trains and the summary's write is the one that fails.
TRAIN = shlex.split("train --layers 2 --d-model 64 --heads 4 --vocab 64 --seq-len 32 --batch-size 2 --steps 1 --json")


@pytest.mark.parametrize("command", [PLAN, TRAIN], ids=["plan", "train-json"])
def test_closed_stdout_pipe_is_no_traceback(tmp_path: Path, command: list[str]) -> None:
    child = subprocess.Popen(
        [sys.executable, "-m", "tiermem", *command, "--config", _config(tmp_path)],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        child.stdout.close()  # the reader is gone before the command prints (it takes seconds to start)
        _out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert "Traceback" not in err, err
    assert "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert child.returncode == 0, err


def test_plan_takes_the_batch_and_sequence_spellings_of_train() -> None:
    """A command line moves between `tiermem train` and `tiermem plan`: --batch-size and --seq-len
    are --batch and --seq."""
    from tiermem.cli import build_parser

    for argv in (["plan", "--batch-size", "4", "--seq-len", "32"], ["plan", "--batch", "4", "--seq", "32"]):
        args = build_parser(argv).parse_args(argv)
        assert (args.batch, args.seq) == (4, 32)


def test_an_unknown_flag_is_refused_with_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from tiermem.cli import main

    assert main(["plan", "--bogus", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tiermem plan ") and "tiermem plan: error: unrecognized arguments: --bogus 3" in err
