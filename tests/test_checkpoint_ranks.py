"""rt.save / rt.load of FSDP2-sharded models on 2 gloo ranks (NOTE [ Checkpoints on ranks ] in
tiermem.checkpoint.ranks): resume in a new pair of processes is bitwise the uninterrupted run,
and checkpoints cross world sizes through DCP's resharding (2 ranks -> one process under
rt.manage or plain PyTorch, one process -> 2 ranks); a damaged checkpoint gives every rank the
same CheckpointError; nothing is left beside the checkpoint."""

from __future__ import annotations

import os
import pickle
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.forked_children import start_ranks
from tiermem.errors import CheckpointError
from tiermem.states import StatesUsageError

WIDTH = 64
BATCH = 16
LR = 1e-2
SAVED_AT = 2  # steps before the save
MORE = 2  # steps after it
PLAN = {"state_home": "nvme", "chunk_size": "16KiB"}

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)) for _ in range(3))
    )


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)
    return nn.functional.mse_loss(model(x), y)


def train(model: nn.Module, optimizer: Any, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model, 2 * step + rank)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def config(path: str) -> dict[str, Any]:
    os.makedirs(path, exist_ok=True)
    return {
        "device": {"capacity": "64MiB", "device": "cpu"},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [path], "capacity": "64MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
    }


def full_states(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Parameters and optimizer states as full tensors by name (DTensors gathered), as DCP names them."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def full(v: torch.Tensor) -> torch.Tensor:
        return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()

    out = {f"model.{name}": full(p) for name, p in model.named_parameters()}
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        state = get_optimizer_state_dict(model, optimizer)["state"]
    else:  # one process: DCP's getter would run its initialising step on a managed optimizer
        names = [name for name, _ in model.named_parameters()]
        state = {names[i]: entry for i, entry in optimizer.state_dict()["state"].items()}
    out.update({f"optimizer.{fqn}.{key}": full(v) for fqn, entry in state.items() for key, v in entry.items()})
    return out


def stray(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tiermem-" in p.name)


# -- the ranks ---------------------------------------------------------------------------------


def _sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _first(rank: int, root: Path) -> dict[str, Any]:
    """Train, save (states on NVMe), train more; a damaged copy and the refusals."""
    import shutil

    import torch.distributed as dist

    model = _sharded()
    with tiermem.Runtime(config(str(root / f"nvme{rank}"))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan=PLAN, lr=LR)
        losses = train(model, optimizer, range(SAVED_AT), rank)
        loss_of(model, 99).backward()  # gradients not stepped: refused on every rank
        with pytest.raises(StatesUsageError, match="gradients accumulated"):
            rt.save(root / "ckpt")
        optimizer.zero_grad(set_to_none=True)
        with pytest.raises(CheckpointError, match="zarr format on several ranks"):
            rt.save(root / "ckpt", format="zarr")
        refusals = _failing_saves(rt, rank, root)
        torch.manual_seed(100 + rank)  # each rank's own RNG
        rt.save(root / "ckpt", extra={"rank": rank, "step": SAVED_AT})
        saved = full_states(model, optimizer)
        draws = torch.rand(3)
        losses += train(model, optimizer, range(SAVED_AT, SAVED_AT + MORE), rank)
        final = full_states(model, optimizer)
        rt.save(root / "ckpt2", extra={"rank": rank})  # a second checkpoint, damaged below
        if rank == 0:
            data = root / "ckpt2" / "__1_0.distcp"  # rank 1's data file
            blob = bytearray(data.read_bytes())
            blob[len(blob) // 2] ^= 0xFF
            data.write_bytes(bytes(blob))
        dist.barrier()
        with pytest.raises(CheckpointError) as damaged:
            rt.load(root / "ckpt2")
        after_damage = full_states(model, optimizer)
        nvme_used = rt.stats().tiers["nvme"].bytes_written
    if rank == 0:
        shutil.rmtree(root / "ckpt2")
    return {
        "losses": losses,
        "saved": saved,
        "draws": draws,
        "final": final,
        "damaged": str(damaged.value),
        "unchanged_by_damage": all(torch.equal(final[k], after_damage[k]) for k in final),
        "nvme_used": nvme_used,
        "refusals": refusals,
    }


def _failing_saves(rt: Any, rank: int, root: Path) -> list[str]:
    """A rank that cannot see rank 0's directory (rank 1 looks for another probe file: the view
    of another filesystem), and a rank whose write fails: every rank raises, nothing is left."""
    from tiermem.checkpoint import ranks
    from tiermem.states.sharded.stateio import ShardedStateIO

    messages = []
    probe, read = ranks.PROBE, ShardedStateIO.read_tensor
    try:
        if rank == 1:
            ranks.PROBE = "elsewhere"
        with pytest.raises(CheckpointError, match="needs a path on a filesystem every rank sees") as blind:
            rt.save(root / "failed")
        messages.append(str(blind.value))
        ranks.PROBE = probe
        if rank == 1:

            def broken(self: Any, tensor: Any) -> torch.Tensor:
                raise OSError(5, "Input/output error (injected)")

            ShardedStateIO.read_tensor = broken  # type: ignore[method-assign]
        with pytest.raises(CheckpointError, match="injected") as failed:
            rt.save(root / "failed")
        messages.append(str(failed.value))
    finally:
        ranks.PROBE, ShardedStateIO.read_tensor = probe, read  # type: ignore[method-assign]
    return messages


def _from_one_process(rank: int, root: Path) -> dict[str, Any]:
    """A checkpoint one process saved (plain model under rt.manage) loads on 2 ranks."""
    model = _sharded()
    with tiermem.Runtime(config(str(root / f"nvme{rank}"))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan=PLAN, lr=LR)
        extra = rt.load(root / "one")
        return {"extra": extra, "loaded": full_states(model, optimizer)}


def _plain_fsdp2(rank: int, root: Path) -> dict[str, Any]:
    """Plain FSDP2 (no tiermem) loads the checkpoint rt.save wrote on the ranks with dcp.load and
    set_state_dict; and one plain FSDP2 saved with dcp.save(get_state_dict) loads with rt.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    plain = _sharded()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(plain, plain_optimizer)
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=root / "ckpt")
    set_state_dict(plain, plain_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    read_plainly = full_states(plain, plain_optimizer)
    train(plain, plain_optimizer, range(SAVED_AT, SAVED_AT + 1), rank)
    model_sd, optim_sd = get_state_dict(plain, plain_optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=root / "plain")
    model = _sharded()
    with tiermem.Runtime(config(str(root / f"nvme{rank}"))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan=PLAN, lr=LR)
        extra = rt.load(root / "plain")
        loaded = full_states(model, optimizer)
    return {
        "read_plainly": read_plainly,
        "plain_saved": full_states(plain, plain_optimizer),
        "loaded": loaded,
        "extra": extra,
    }


def _resumed(rank: int, root: Path) -> dict[str, Any]:
    """New processes: build, manage, load, train the rest."""
    model = _sharded()
    with tiermem.Runtime(config(str(root / f"nvme{rank}"))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan=PLAN, lr=LR)
        extra = rt.load(root / "ckpt")
        draws = torch.rand(3)
        losses = train(model, optimizer, range(SAVED_AT, SAVED_AT + MORE), rank)
        return {"extra": extra, "draws": draws, "losses": losses, "final": full_states(model, optimizer)}


SPAWNS: dict[str, list[Callable[[int, Path], dict[str, Any]]]] = {
    "first": [_first, _from_one_process, _plain_fsdp2],
    "resumed": [_resumed],
}


def _rank(rank: int, world: int, port: int, root: str, spawn: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore", FutureWarning)  # FSDP2/gloo deprecations (issue 18's trap)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {scenario.__name__: scenario(rank, Path(root)) for scenario in SPAWNS[spawn]}
        with open(os.path.join(root, f"{spawn}{rank}.pt"), "wb") as f:
            pickle.dump(results, f)
        dist.barrier()  # both ranks leave together (gloo aborts a rank whose peer tore down first)
    finally:
        dist.destroy_process_group()


def _spawn(root: Path, spawn: str) -> list[dict[str, Any]]:
    """New processes for the ranks (forked from a server that imported torch once: suite time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(_rank, args=(2, port, str(root), spawn), nprocs=2)
    out = []
    for rank in range(2):
        with open(root / f"{spawn}{rank}.pt", "rb") as f:
            out.append(pickle.load(f))
    return out


def _one_process_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """One process, plain model under rt.manage, states on NVMe: trained, saved at root/one."""
    with tiermem.Runtime(config(str(root / "nvme_one"))) as rt:
        model, optimizer = rt.manage(mlp(), torch.optim.AdamW, plan=PLAN, lr=LR)
        for step in range(SAVED_AT):
            ((loss_of(model, 2 * step) + loss_of(model, 2 * step + 1)) / 2).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        rt.save(root / "one", extra={"from": "one process"})
        return full_states(model, optimizer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("torch.distributed.fsdp")
    root = tmp_path_factory.mktemp("checkpoint_ranks")
    one = _one_process_checkpoint(root)
    first = _spawn(root, "first")
    resumed = _spawn(root, "resumed")
    return {"root": root, "one": one, "first": first, "resumed": resumed}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_on_two_ranks_is_bitwise_the_uninterrupted_run(runs):
    """2 ranks train N, save (states on NVMe), train M == new processes load and train M: the
    losses, parameters and AdamW states bitwise; each rank gets its own extra and RNG back."""
    for rank, (first, resumed) in enumerate(zip(runs["first"], runs["resumed"], strict=True)):
        run, again = first["_first"], resumed["_resumed"]
        assert again["losses"] == run["losses"][SAVED_AT:]
        _equal(again["final"], run["final"])
        assert again["extra"] == {"rank": rank, "step": SAVED_AT}
        assert torch.equal(again["draws"], run["draws"])
        assert run["nvme_used"] > 0
    assert not torch.equal(runs["first"][0]["_first"]["draws"], runs["first"][1]["_first"]["draws"])
    assert stray(runs["root"]) == [] and not (runs["root"] / "failed").exists()
    assert sorted(p.name for p in (runs["root"] / "ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "tiermem-manifest.json", "tiermem-state.pkl",
    ]  # fmt: skip


def test_two_ranks_to_one_process_under_rt_manage_and_plain_pytorch(runs):
    """DCP's resharding: the 2-rank checkpoint loads bitwise (parameters and AdamW states) into
    a plain model managed in one process (extra and RNG: rank 0's), and into plain PyTorch."""
    import torch.distributed.checkpoint as dcp

    saved = runs["first"][0]["_first"]["saved"]
    path = runs["root"] / "ckpt"
    with tiermem.Runtime(config(str(runs["root"] / "nvme_load"))) as rt:
        model, optimizer = rt.manage(mlp(), torch.optim.AdamW, plan=PLAN, lr=LR)
        assert rt.load(path) == {"rank": 0, "step": SAVED_AT}
        _equal(full_states(model, optimizer), saved)
        assert torch.equal(torch.rand(3), runs["first"][0]["_first"]["draws"])
    plain = mlp()
    state = {"model": plain.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, storage_reader=tiermem.checkpoint.storage_reader(path))
    plain.load_state_dict(state["model"])
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[f"model.{name}"]), name


def test_one_process_to_two_ranks(runs):
    """A one-process checkpoint loads on 2 ranks (FSDP2 + rt.manage) bitwise, both ranks
    getting its extra."""
    for rank in runs["first"]:
        result = rank["_from_one_process"]
        assert result["extra"] == {"from": "one process"}
        _equal(result["loaded"], runs["one"])


def test_a_failing_rank_fails_the_save_on_every_rank(runs):
    """NOTE [ Checkpoints on ranks ] rules 3 and 4: rank 1 not seeing rank 0's directory, and a
    write failing on rank 1, raise on both ranks (none hangs) and leave nothing (checked above)."""
    on_rank0, on_rank1 = (rank["_first"]["refusals"] for rank in runs["first"])
    assert on_rank0 == on_rank1  # the same errors on both ranks
    assert "rank 1 cannot see" in on_rank0[0] and "injected" in on_rank0[1]


def test_a_damaged_checkpoint_is_the_same_clear_error_on_every_rank(runs):
    """Rank 0 verifies the digests and every rank raises its CheckpointError naming the file,
    before anything was loaded."""
    messages = [rank["_first"]["damaged"] for rank in runs["first"]]
    assert messages[0] == messages[1]
    assert "__1_0.distcp does not match its digest" in messages[0]
    assert all(rank["_first"]["unchanged_by_damage"] for rank in runs["first"])


def test_rank_0_not_seeing_a_rank_s_data_file_is_refused(tmp_path: Path):
    """NOTE [ Checkpoints on ranks ] rule 3, rank 0's half: a data file DCP's metadata names that
    rank 0 cannot see (another rank wrote it on a filesystem of its own) fails the save."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from tiermem.checkpoint import ranks

    (tmp_path / "__0_0.distcp").write_bytes(b"0")
    storage = {
        MetadataIndex("model.w", (0,)): _StorageInfo("__0_0.distcp", 0, 1),
        MetadataIndex("model.w", (1,)): _StorageInfo("__1_0.distcp", 0, 1),
    }
    with pytest.raises(CheckpointError, match=r"rank 0 cannot see \['__1_0.distcp'\]"):
        ranks.check_files_seen(tmp_path, Metadata({}, storage_data=storage))
    (tmp_path / "__1_0.distcp").write_bytes(b"1")
    ranks.check_files_seen(tmp_path, Metadata({}, storage_data=storage))


def test_each_rank_gets_its_own_values_or_rank_0_s():
    """Rule 5: rank r's extra, RNG and loops where saved; rank 0's (the top level) beyond."""
    from tiermem.checkpoint import ranks

    by_rank = [{"extra": r, "rng": None, "loops": []} for r in range(2)]
    state = {**by_rank[0], "world_size": 2, "ranks": by_rank}
    assert [ranks.own_state(state, r)["extra"] for r in range(3)] == [0, 1, 0]
    assert ranks.own_state({"extra": "one process", "rng": None, "loops": []}, 1)["extra"] == "one process"


def test_plain_fsdp2_reads_it_and_writes_what_rt_load_reads(runs):
    """The layout is get_state_dict's for plain FSDP2: dcp.load + set_state_dict of plain FSDP2
    reads rt.save's checkpoint bitwise, and rt.load reads plain FSDP2's dcp.save bitwise."""
    saved = runs["first"][0]["_first"]["saved"]
    for rank in runs["first"]:
        result = rank["_plain_fsdp2"]
        _equal(result["read_plainly"], saved)
        _equal(result["loaded"], result["plain_saved"])
        assert result["extra"] is None
