"""``tiermem train --checkpoint/--save-every/--resume`` and ``tiermem checkpoint inspect`` through the
real command: a run SIGKILLed after a save resumes on the uninterrupted run's exact loss curve and
final parameters; bad resumes are one-line errors; inspect reports a complete checkpoint, and a
damaged or partial one as not complete (exit 1). (NOTE [ Resuming a train run ], NOTE
[ Inspecting a checkpoint ])"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.forked_children import ForkServer
from tiermem.app.models import GPT, GPTConfig
from tiermem.checkpoint import files, storage_reader
from tiermem.cli import main

TINY = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=64, seq_len=32)
TINY_ARGS = [
    "--layers",
    "2",
    "--d-model",
    "64",
    "--heads",
    "4",
    "--vocab",
    "64",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.upper().startswith("TIERMEM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _config_file(tmp_path: Path) -> str:
    (tmp_path / "nvme").mkdir(exist_ok=True)
    path = tmp_path / "tiers.toml"
    path.write_text(
        f'[device]\ndevice = "cpu"\n[nvme]\npaths = ["{tmp_path / "nvme"}"]\n'
        f'[scheduler]\nloop = "asyncio"\n[activations]\nmin_bytes = 0\n'
    )
    return str(path)


def _train(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> dict[str, Any]:
    assert main(["train", *TINY_ARGS, "--config", _config_file(tmp_path), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _inspect(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, dict[str, Any]]:
    status = main(["checkpoint", "inspect", str(path), "--json"])
    return status, json.loads(capsys.readouterr().out)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights, read by plain PyTorch."""
    model = GPT(TINY)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), storage_reader=storage_reader(path), no_dist=True)
    return state["model"]


def _train_child(threads: str, environment: str, *argv: str) -> None:
    """The child: ``tiermem train ARGV`` on ``threads`` threads, with ``environment`` (JSON) as its
    variables, its summary dropped (stdout to /dev/null)."""
    torch.set_num_threads(int(threads))
    os.environ.clear()
    os.environ.update(json.loads(environment))
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.exit(main(["train", *argv]))


#: the children by name, for tests/forked_children.py
CHILDREN = {"train": _train_child}


def _run_until_saved_then_kill(tmp_path: Path, path: Path, fork_server: ForkServer) -> None:
    """``tiermem train --save-every 2`` in a process of its own (forked from the suite's server,
    without an interpreter start), SIGKILLed once a save is there."""
    argv = [*TINY_ARGS, "--config", _config_file(tmp_path)]
    argv += ["--steps", "100000", "--save-every", "2", "--checkpoint", str(path), "--json"]
    # The child computes the saved steps with this process's thread count, as the in-process runs
    # compared with it do (an embedding's backward sums in a thread-dependent order); and this
    # process's environment (its profile cache, no TIERMEM_* variables).
    threads, environment = str(torch.get_num_threads()), json.dumps(dict(os.environ))
    pid = fork_server.start(__name__, "train", threads, environment, *argv)
    try:
        deadline = time.monotonic() + 120
        while not (path / files.MANIFEST).exists() and fork_server.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        lines, status = fork_server.kill(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, lines  # not ended by itself
    assert (path / files.MANIFEST).exists(), lines


def test_a_killed_train_resumes_on_the_exact_loss_curve(tmp_path, capsys, fork_server):
    saved = tmp_path / "ckpt"
    _run_until_saved_then_kill(tmp_path, saved, fork_server)
    status, report = _inspect(capsys, saved)
    assert status == 0 and report["complete"], report
    step = report["step"]
    assert step >= 2 and step % 2 == 0
    resumed = _train(capsys, tmp_path, "--steps", str(step + 3), "--resume", str(saved), "--checkpoint", str(saved))
    full = _train(capsys, tmp_path, "--steps", str(step + 3), "--checkpoint", str(tmp_path / "full"))
    assert resumed["start_step"] == step and resumed["steps"] == 3
    assert resumed["losses"] == full["losses"][step:]  # bitwise: floats compared exactly
    assert resumed["checkpoint"]["resumed_from"] == str(saved)
    ours, theirs = _weights(saved), _weights(tmp_path / "full")
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_bad_resumes_and_flags_are_one_line_errors(tmp_path, capsys):
    config = ["--config", _config_file(tmp_path)]
    assert main(["train", *TINY_ARGS, *config, "--save-every", "2", "--json"]) == 2
    assert "--save-every 2 needs --checkpoint DIR" in capsys.readouterr().err
    assert main(["train", *TINY_ARGS, *config, "--no-states", "--resume", str(tmp_path), "--json"]) == 2
    assert "drop --no-states" in capsys.readouterr().err
    assert main(["train", *TINY_ARGS, *config, "--resume", str(tmp_path / "missing"), "--json"]) == 1
    assert "no checkpoint there" in capsys.readouterr().err

    saved = tmp_path / "ckpt"
    _train(capsys, tmp_path, "--steps", "2", "--checkpoint", str(saved))
    # NOTE [ Resuming a train run ] rule 6: the error first and alone (no intro, no budget paragraph)
    for flags, expected in (
        (["--layers", "3", "--steps", "4"], "holds another model"),
        (["--lr", "0.01", "--steps", "4"], "lr 0.001 (this run: 0.01)"),
        (["--steps", "2"], "is at step 2 and --steps 2 asks for no more"),
    ):
        assert main(["train", *TINY_ARGS, *config, *flags, "--resume", str(saved)]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"tiermem train: --resume {saved}"), captured
        assert expected in captured.err and len(captured.err.strip().splitlines()) == 1

    data = saved / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["train", *TINY_ARGS, *config, "--steps", "4", "--resume", str(saved), "--json"]) == 1
    err = capsys.readouterr().err
    assert "__0_0.distcp does not match its digest" in err and "Traceback" not in err


def test_inspect_a_complete_checkpoint(tmp_path, capsys):
    saved = tmp_path / "ckpt"
    _train(capsys, tmp_path, "--steps", "2", "--checkpoint", str(saved))
    status, report = _inspect(capsys, saved)
    assert status == 0
    assert report["complete"] and report["verified"] and report["problem"] is None
    assert report["format"] == files.FORMAT and report["step"] == 2
    parameters = list(GPT(TINY).state_dict().values())
    # the model's tensors, and AdamW's exp_avg, exp_avg_sq and step per parameter
    assert report["sections"]["model"] == {"tensors": len(parameters), "bytes": sum(p.nbytes for p in parameters)}
    assert report["sections"]["optimizer"]["tensors"] == 3 * len(list(GPT(TINY).parameters()))
    assert report["tensors"] == sum(section["tensors"] for section in report["sections"].values())
    largest = report["largest"][0]
    assert largest["bytes"] == max(p.nbytes for p in parameters) and largest["dtype"] == "float32"
    assert report["interrupted"] == [] and report["bytes_on_disk"] >= report["tensor_bytes"]
    # the settings --resume checks (NOTE [ Inspecting a checkpoint ] rule 3)
    assert report["run"] == {
        "model": {**dataclasses.asdict(TINY)}, "batch_size": 4, "lr": 1e-3, "seed": 0, "world_size": 1,
    }  # fmt: skip
    assert main(["checkpoint", "inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "every file matches its digest" in out and "largest 5 tensors" in out and largest["name"] in out
    assert "run settings" in out and "--layers 2 --d-model 64 --heads 4" in out
    assert "--batch-size 4 --lr 0.001 --seed 0 world size 1" in " ".join(out.split())


def test_inspect_a_damaged_and_a_partial_checkpoint(tmp_path, capsys):
    saved = tmp_path / "ckpt"
    _train(capsys, tmp_path, "--steps", "2", "--checkpoint", str(saved))
    (tmp_path / ".ckpt.tiermem-tmp-0123").mkdir()  # what a killed save leaves (its lock is free)
    data = saved / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    status, report = _inspect(capsys, saved)
    assert status == 1 and not report["complete"] and report["step"] is None
    assert "__0_0.distcp is" in report["problem"] and "truncated" in report["problem"]
    assert report["interrupted"] == [".ckpt.tiermem-tmp-0123"] and report["in_progress"] == []
    assert main(["checkpoint", "inspect", str(saved)]) == 1
    out = capsys.readouterr().out
    assert "NOT complete" in out and "interrupted save" in out

    (saved / files.MANIFEST).unlink()  # partial: killed before the manifest, the last file written
    status, report = _inspect(capsys, saved)
    assert status == 1 and "tiermem-manifest.json is missing" in report["problem"]
    status, report = _inspect(capsys, tmp_path / "never")
    assert status == 1 and not report["exists"] and "no checkpoint directory" in report["problem"]


def test_a_checkpoint_destination_is_checked_before_the_first_step(tmp_path, capsys):
    """NOTE [ Resuming a train run ] rule 5: a directory that cannot take a save, or a checkpoint a
    new run (no --resume) would replace, is refused before any step runs."""
    config = ["--config", _config_file(tmp_path)]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    assert main(["train", *TINY_ARGS, *config, "--steps", "4", "--checkpoint", str(other), "--json"]) == 1
    captured = capsys.readouterr()
    assert "is a directory that is not a tiermem checkpoint" in captured.err and captured.out == ""
    assert [p.name for p in other.iterdir()] == ["todo.txt"]
    saved = tmp_path / "ckpt"
    _train(capsys, tmp_path, "--steps", "2", "--checkpoint", str(saved))
    before = files.digest_file(saved / files.MANIFEST)
    assert main(["train", *TINY_ARGS, *config, "--steps", "3", "--checkpoint", str(saved), "--json"]) == 1
    assert f"continue it with --resume {saved}" in capsys.readouterr().err
    assert files.digest_file(saved / files.MANIFEST) == before  # untouched


def test_inspect_says_a_directory_is_not_a_checkpoint(tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    status, report = _inspect(capsys, other)
    assert status == 1 and not report["complete"]
    assert report["problem"].startswith(f"{other} is not a checkpoint: no {files.MANIFEST}")
