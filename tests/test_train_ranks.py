"""``torchrun --nproc-per-node 2 -m tiermem train``: the main job on 2 gloo processes, FSDP2
sharding the GPT and tiermem tiering each rank's states and activations (NOTE [ Training on
ranks ] in tiermem.app.train_ranks), against plain PyTorch in one process trained on the mean loss
of both ranks' batches."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.forked_children import start_ranks
from tiermem.app.models.data import MarkovChainData
from tiermem.app.models.gpt import GPT, GPTConfig
from tiermem.cli import main

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

MODEL = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=32)
FLAGS = ["--layers", "2", "--d-model", "64", "--heads", "2", "--vocab", "128", "--seq-len", "32"]


def _environment(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TIERMEM_")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    return env


def _torchrun(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # its log folder in the test's own, where torchrun would leave a /tmp/torchelastic_* behind
    command += ["--log-dir", str(tmp_path / "torchrun-logs"), "-m", "tiermem", "train", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=_environment(tmp_path), cwd=tmp_path
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rank(rank: int, port: int, root: str, argv: list[str]) -> None:
    """One rank of ``torchrun --nproc-per-node 2 -m tiermem train ARGV`` in ``root``, forked from
    the suite's forkserver: the environment torchrun and :func:`_environment` give a rank, set
    here (the forkserver's is the suite's), and its stdout in ``root/stdout<rank>``."""
    for name in [name for name in os.environ if name.upper().startswith("TIERMEM_")]:
        del os.environ[name]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), XDG_CACHE_HOME=os.path.join(root, "cache"),
    )  # fmt: skip
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1, read by torch at import: the forkserver imported it
    warnings.simplefilter("ignore", FutureWarning)  # PYTHONWARNINGS
    os.chdir(root)
    with open(f"stdout{rank}", "w") as out, contextlib.redirect_stdout(out):
        status = main(["train", *argv])
    assert status == 0, f"rank {rank}: tiermem train ended with {status}"


def _reference_losses(steps: int, batch_size: int, lr: float, seed: int = 0) -> list[float]:
    """Plain PyTorch, one process: the mean loss of rank 0's and rank 1's batches each step."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(MODEL)
    streams = [MarkovChainData(MODEL.vocab_size, MODEL.seq_len, seed=seed, stream=rank) for rank in (0, 1)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        batches = [stream.batch(batch_size) for stream in streams]
        loss = sum(model(x, y)[1] for x, y in batches) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


STEPS, BATCH = 4, 2


def _nvme_config(tmp_path: Path) -> tuple[Path, Path]:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = tmp_path / "tiers.toml"
    config.write_text(f'[nvme]\npaths = ["{nvme}"]\n[activations]\nmin_bytes = 1024\n')
    return nvme, config


def _run(tmp_path: Path, config: Path, steps: int, *args: str, torchrun: bool = True) -> dict:
    """The GPT trained on 2 ranks, states and activations on NVMe: rank 0's JSON summary. Under
    torchrun, or (``torchrun=False``) ranks forked with torchrun's environment, which spares the
    3 new interpreters (torchrun's and 2 ranks') of a run whose launcher the test is not about."""
    argv = [
        "--config", str(config), *FLAGS, "--batch-size", str(BATCH), "--steps", str(steps),
        "--state-home", "nvme", "--policy", "nvme", "--json", *args,
    ]  # fmt: skip
    if not torchrun:
        start_ranks(_train_rank, args=(_free_port(), str(tmp_path), argv), nprocs=2)
        assert (tmp_path / "stdout1").read_text() == ""  # rank 1 prints nothing
        return json.loads((tmp_path / "stdout0").read_text().strip().splitlines()[-1])
    done = _torchrun(tmp_path, *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # rank 0's; rank 1 prints nothing


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    nvme, config = _nvme_config(tmp_path)
    return _run(tmp_path, config, STEPS), nvme


def test_torchrun_trains_the_gpt_on_two_processes_with_nvme_states_exactly(uninterrupted) -> None:
    """The README's command: each rank's AdamW states on NVMe (its own rank<R> directory) and its
    activations offloaded to NVMe; the losses are bitwise plain PyTorch's on both ranks' batches."""
    summary, nvme = uninterrupted
    assert summary["world_size"] == 2
    assert summary["losses"] == _reference_losses(STEPS, BATCH, lr=1e-3)
    assert summary["nvme"]["paths"] == [str(nvme / "rank0")]
    assert summary["model_states"]["homes"] == {"nvme": summary["model_states"]["chunks"]}
    assert summary["tiers"]["nvme"]["bytes_written"] > 0
    assert summary["activations"]["bytes_written"]["nvme"] > 0
    assert list(nvme.iterdir()) == []  # every rank's directory removed


def test_torchrun_checkpoint_then_resume_continues_the_uninterrupted_losses(
    uninterrupted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--checkpoint --save-every 1 on 2 processes, then --resume on 2 new ones: each rank's
    data stream goes on where it stood, so the losses are bitwise the uninterrupted run's; a
    resume on another world size is refused, and a refused resume on 2 ranks says so once (under
    torchrun, whose output that is). The saving and resuming ranks are forked with torchrun's
    environment (suite time): the uninterrupted run above is torchrun's."""
    nvme, config = _nvme_config(tmp_path)
    ckpt = tmp_path / "ckpt"
    saved = _run(tmp_path, config, 2, "--checkpoint", str(ckpt), "--save-every", "1", torchrun=False)
    assert saved["losses"] == uninterrupted[0]["losses"][:2]
    resumed = _run(tmp_path, config, STEPS, "--resume", str(ckpt), torchrun=False)
    assert resumed["start_step"] == 2
    assert resumed["losses"] == uninterrupted[0]["losses"][2:]
    assert sorted(p.name for p in tmp_path.iterdir() if ".tiermem-" in p.name) == []  # no temporary siblings
    assert list(nvme.iterdir()) == []
    # one process, as `python -m tiermem train` without torchrun, run in this one (suite time)
    for name in [name for name in os.environ if name.upper().startswith("TIERMEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    assert main(["train", *FLAGS, "--steps", str(STEPS), "--resume", str(ckpt)]) != 0
    assert "world_size 2 (this run: 1)" in capsys.readouterr().err
    # NOTE [ Training on ranks ] rule 7: a refused resume on 2 ranks is printed once, not per rank
    refused = _torchrun(tmp_path, "--config", str(config), *FLAGS, "--steps", str(STEPS), "--lr", "0.01",
                        "--resume", str(ckpt))  # fmt: skip
    assert refused.returncode != 0 and "]: Traceback" not in refused.stderr  # no rank's (torchrun prints its own)
    assert refused.stderr.count("lr 0.001 (this run: 0.01)") == 1, refused.stderr[-3000:]
    assert "[rank 1]" not in refused.stderr and refused.stdout == ""
