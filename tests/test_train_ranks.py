"""``torchrun --nproc-per-node 2 -m tiermem train``: the main job on 2 gloo processes, FSDP2
sharding the GPT and tiermem tiering each rank's states and activations (NOTE [ Training on
ranks ] in tiermem.train_ranks), against plain PyTorch in one process trained on the mean loss
of both ranks' batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiermem.models.data import MarkovChainData
from tiermem.models.gpt import GPT, GPTConfig

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
    command += ["-m", "tiermem", "train", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=_environment(tmp_path), cwd=tmp_path
    )


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


def test_torchrun_trains_the_gpt_on_two_processes_with_nvme_states_exactly(tmp_path: Path) -> None:
    """The README's command: each rank's AdamW states on NVMe (its own rank<R> directory) and its
    activations offloaded to NVMe; the losses are bitwise plain PyTorch's on both ranks' batches."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = tmp_path / "tiers.toml"
    config.write_text(f'[nvme]\npaths = ["{nvme}"]\n[activations]\nmin_bytes = 1024\n')
    steps, batch = 3, 2
    done = _torchrun(
        tmp_path, "--config", str(config), *FLAGS, "--batch-size", str(batch), "--steps", str(steps),
        "--state-home", "nvme", "--policy", "nvme", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])  # rank 0's; rank 1 prints nothing
    assert summary["world_size"] == 2
    assert summary["losses"] == _reference_losses(steps, batch, lr=1e-3)
    assert summary["nvme"]["paths"] == [str(nvme / "rank0")]
    assert summary["model_states"]["homes"] == {"nvme": summary["model_states"]["chunks"]}
    assert summary["tiers"]["nvme"]["bytes_written"] > 0
    assert summary["activations"]["bytes_written"]["nvme"] > 0
    assert list(nvme.iterdir()) == []  # every rank's directory removed


def test_torchrun_refuses_checkpoints_clearly(tmp_path: Path) -> None:
    done = _torchrun(tmp_path, *FLAGS, "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"), "--json", timeout=120)
    assert done.returncode != 0
    assert "checkpoints (--checkpoint, --resume) are one process's for now" in done.stderr
    assert not (tmp_path / "ckpt").exists()
