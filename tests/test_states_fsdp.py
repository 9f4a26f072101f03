"""rt.manage on FSDP2-sharded models (issue 18, NOTE [ Sharded model states ]): each rank's
optimizer states in chunks on the host or NVMe, FSDP2's parameters left to FSDP2. Real FSDP2 on
2 gloo processes against a single-process plain PyTorch reference; the packing and the plan rule
in one process."""

from __future__ import annotations

import os
import pickle
import socket
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.forked_children import start_ranks
from tiermem.layout.placement import Budgets, PlanRequest
from tiermem.states import PlanError, StatesClosedError, StatesMemoryError, StatesUsageError
from tiermem.states.sharded.layout import (
    DEFAULT_CHUNK_SIZE,
    ShardSpec,
    decide_homes,
    pack_shards,
    padded_shard_shape,
    signature,
)

WIDTH = 64
BATCH = 32
STEPS = 2
LR = 1e-2


def mlp(seed: int = 0, blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)) for _ in range(blocks))
    )


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)
    return nn.functional.mse_loss(model(x), y)


def reference(steps: int = STEPS, accumulation: int = 1, blocks: int = 3) -> list[torch.Tensor]:
    """Plain PyTorch in one process on the mean loss of both ranks' batches (exact with 2 ranks);
    rank r's batch of micro-batch m in step s has seed ``2 * (s * accumulation + m) + r``."""
    model = mlp(blocks=blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        for micro in range(accumulation):
            seed = 2 * (step * accumulation + micro)
            ((loss_of(model, seed) + loss_of(model, seed + 1)) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


# -- packing and the plan rule, one process ------------------------------------------------------


def test_every_rank_packs_the_same_chunks_whatever_its_shard():
    """Rule 2: slots have the padded shard shape, so a 5-row weight over 2 ranks (3 rows and 2)
    packs alike on both; a different chunk size gives another digest."""
    assert padded_shard_shape((5, 4), [(0, 2)]) == (3, 4)
    assert padded_shard_shape((5, 4), []) == (5, 4)  # replicated (HSDP's replicate dim)
    assert padded_shard_shape((7, 6), [(0, 2), (1, 4)]) == (4, 2)
    specs = [
        ShardSpec(padded_shard_shape((5, 4), [(0, 2)]), torch.float32, True),
        ShardSpec((3,), torch.float32, False),
    ]
    size, layouts = pack_shards(specs, None)
    assert [[s.index for s in c.slots] for c in layouts] == [[0]]  # the frozen one has no state slot
    assert layouts[0].slots[0].nbytes == 3 * 4 * 4 and size == 4096
    assert signature(size, layouts, 2) == signature(*pack_shards(specs, None), 2)
    assert signature(size, layouts, 2) != signature(*pack_shards(specs, 8192), 2)
    with pytest.raises(PlanError, match="below the largest parameter shard"):
        pack_shards([ShardSpec((4096,), torch.float32, True)], 4096)


def test_an_outlier_shard_gets_a_chunk_of_its_own():
    """Rule 4: an embedding-sized shard (over twice every other) no longer sets every chunk's size."""
    specs = [ShardSpec((300_000, 64), torch.float32, True)] + [ShardSpec((64, 64), torch.float32, True)] * 4
    size, layouts = pack_shards(specs, None)  # 73 MiB of embedding: the default 64 MiB size stays
    assert size == DEFAULT_CHUNK_SIZE
    assert [[s.index for s in c.slots] for c in layouts] == [[0], [1, 2, 3, 4]]
    assert layouts[0].nbytes == 300_000 * 64 * 4
    size, layouts = pack_shards(specs, 64 * 64 * 4)
    assert [len(c.slots) for c in layouts] == [1, 1, 1, 1, 1]
    with pytest.raises(PlanError, match="does not get a chunk of its own"):
        pack_shards(specs, 1024)


def test_default_rule_places_device_then_host_then_nvme():
    """Rule 4: a device prefix in half its free bytes, then the host while it keeps room to stage
    two NVMe homes, then NVMe; a hand plan is honoured and checked."""
    homes = [8 << 10] * 6
    auto = PlanRequest()
    plan = decide_homes(homes, Budgets(device=40 << 10, host=24 << 10, nvme=1 << 30), auto, 4096, "host")
    # greedily three on the host, then two given back to stage the NVMe homes (2 x 8 KiB)
    assert plan.state_home == ("device", "device", "host", "nvme", "nvme", "nvme")
    assert plan.persistent_chunks == 2 and plan.buffers == 0 and plan.block_policy is None
    plan = decide_homes(homes, Budgets(0, 1 << 30, 0), PlanRequest(state_home="host"), 4096, "host")
    assert plan.state_home == ("host",) * 6
    plan = decide_homes(homes, Budgets(1 << 30, 16 << 10, 1 << 30), PlanRequest(state_home="nvme"), 4096, "host")
    assert plan.state_home == ("nvme",) * 6
    with pytest.raises(StatesMemoryError, match="the host needs 16KiB but has 8KiB free"):  # two staged homes
        decide_homes(homes, Budgets(1 << 30, 8 << 10, 1 << 30), PlanRequest(state_home="nvme"), 4096, "host")
    with pytest.raises(PlanError, match="buffers=2 has no meaning"):
        decide_homes(homes, Budgets(0, 0, 0), PlanRequest(buffers=2), 4096, "host")
    with pytest.raises(PlanError, match="come first"):
        decide_homes(
            homes, Budgets(1 << 30, 1 << 30, 1 << 30), PlanRequest(state_home=("host",) * 5 + ("device",)), 4096, "host"
        )


# -- real FSDP2 on 2 gloo processes ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(path: str, **device: Any) -> dict[str, Any]:
    os.makedirs(path, exist_ok=True)
    return {
        "device": {"capacity": "64MiB", "device": "cpu", **device},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [path], "capacity": "64MiB", "block_size": "64KiB"},
        "activations": {"min_bytes": 1024},
        "scheduler": {"loop": "asyncio"},
    }


def _sharded(offload: bool = False, blocks: int = 3) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    model = mlp(blocks=blocks)
    for block in model:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _gathered(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _train(rt: Any, model: nn.Module, optimizer: Any, rank: int, *, offload: str | None = None, check=None) -> None:
    for step in range(STEPS):
        if offload is None:
            loss_of(model, 2 * step + rank).backward()
        else:
            with rt.offload_activations(model, policy=offload):
                loss_of(model, 2 * step + rank).backward()
        if check is not None:
            check(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# long: every scenario of one rank, one spawn for all (each spawn costs seconds of imports)
def _rank(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore", FutureWarning)  # FSDP2/gloo deprecations (issue 18's trap)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for name, scenario in SCENARIOS.items():
            path = os.path.join(root, f"rank{rank}", name)
            results[name] = scenario(rank, path)
            assert os.listdir(path) == [], (name, os.listdir(path))  # no file left after `with rt`
        with open(os.path.join(root, f"results{rank}.pt"), "wb") as f:
            pickle.dump(results, f)
        dist.barrier()  # both ranks leave together (gloo aborts a rank whose peer tore down first)
    finally:
        dist.destroy_process_group()


def _homes(state_home: str) -> Callable[[int, str], dict[str, Any]]:
    def run(rank: int, path: str) -> dict[str, Any]:
        model = _sharded()
        with tiermem.Runtime(_config(path)) as rt:
            model, optimizer = rt.manage(
                model, torch.optim.AdamW, plan={"state_home": state_home, "chunk_size": "16KiB"}, lr=LR
            )
            _train(rt, model, optimizer, rank)
            stats = rt.stats()
            describe = rt._model_states[0].describe()
        return {
            "params": _gathered(model),
            "nvme_written": stats.tiers["nvme"].bytes_written,
            "chunks": stats.model_states.chunks,
            "homes": {c["home"] for c in describe["chunks"]},
            "adopted": describe["adopted_shard_bytes"],
        }

    return run


def _with_activations(rank: int, path: str) -> dict[str, Any]:
    model = _sharded()
    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, plan={"state_home": "nvme", "chunk_size": "16KiB"}, lr=LR
        )
        _train(rt, model, optimizer, rank, offload="nvme")
        stats = rt.stats()
    activations = stats.activations
    assert activations.fallbacks == 0, activations
    return {
        "params": _gathered(model),
        "activations_out": activations.bytes_written.get("nvme", 0) + activations.cancelled,
        "nvme_written": stats.tiers["nvme"].bytes_written,
    }


def _declared(rank: int, path: str) -> dict[str, Any]:
    model = _sharded()
    grads_after_backward: list[bool] = []

    def check(m: nn.Module) -> None:
        grads_after_backward.append(any(p.grad is not None for p in m.parameters()))

    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model,
            torch.optim.AdamW,
            plan={"state_home": "nvme", "chunk_size": "16KiB"},
            grad_accumulation_steps=1,
            keep_gradients=False,
            lr=LR,
        )
        _train(rt, model, optimizer, rank, check=check)
        stats = rt.stats().model_states
        params = _gathered(model)
        # Another backward than declared after chunks stepped: refused at step, never a different step.
        loss_of(model, 9).backward()
        loss_of(model, 9).backward()
        with pytest.raises(StatesUsageError, match="another backward than declared"):
            optimizer.step()
    return {
        "params": params,
        "early": stats.early_chunk_steps,
        "chunks": stats.chunks,
        "grads_after_backward": grads_after_backward,
    }


def _accumulated(rank: int, path: str) -> dict[str, Any]:
    """Rule 6 over two backwards a step, gradients kept: chunks step in the second backward."""
    model = _sharded()
    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model,
            torch.optim.AdamW,
            plan={"state_home": "nvme", "chunk_size": "16KiB"},
            grad_accumulation_steps=2,
            lr=LR,
        )
        for step in range(STEPS):
            for micro in range(2):
                loss_of(model, 2 * (step * 2 + micro) + rank).backward()
            assert all(p.grad is not None for p in model.parameters())  # kept
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        stats = rt.stats().model_states
        params = _gathered(model)
        for micro in range(2):  # a declared window, then a hand edit of a gradient before the step
            loss_of(model, 20 + micro).backward()
        with torch.no_grad():
            next(model.parameters()).grad.mul_(2)
        with pytest.raises(StatesUsageError, match=r"gradients of 1 parameter\(s\) changed"):
            optimizer.step()
    with pytest.raises(StatesClosedError, match="closed and freed its optimizer states"):
        optimizer.step()
    return {"params": params, "early": stats.early_chunk_steps, "chunks": stats.chunks}


def _clipped(rank: int, path: str) -> dict[str, Any]:
    """Declared clipping against plain FSDP2 + clip_grad_norm_ on the DTensor parameters, and
    ONE all-reduce for the norm."""
    import torch.distributed._functional_collectives as funcol

    max_norm = 0.02  # below the first step's norm (0.049): clipping acts
    plain = _sharded()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        loss_of(plain, 2 * step + rank).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(list(plain.parameters()), max_norm).full_tensor())
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)
    model = _sharded()
    all_reduces = []
    real = funcol.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        all_reduces.append(1)
        return real(*args, **kwargs)

    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, plan={"state_home": "host", "chunk_size": "16KiB"}, clip_grad_norm=max_norm, lr=LR
        )
        got_norms = []
        for step in range(STEPS):
            loss_of(model, 2 * step + rank).backward()
            funcol.all_reduce = counting
            try:
                optimizer.step()
            finally:
                funcol.all_reduce = real
            got_norms.append(optimizer.grad_norm.full_tensor())
            optimizer.zero_grad(set_to_none=True)
        plain_state = _local_states(plain, plain_optimizer)
        managed_state = _local_states(model, optimizer)
    same_params = all(torch.equal(a, b) for a, b in zip(_gathered(model), _gathered(plain), strict=True))
    return {
        "same_params": same_params,
        "norms": (norms, got_norms),
        "all_reduces": len(all_reduces),
        "clipped": bool(norms[0] > max_norm),
        "same_state": plain_state == managed_state,
    }


def _local_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's optimizer state dict, local shards as bytes (comparable with ==)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)
    return {
        (fqn, key): (type(v).__name__, v.to_local().numpy().tobytes() if hasattr(v, "to_local") else float(v))
        for fqn, entry in osd["state"].items()
        for key, v in entry.items()
    }


def _cpu_offload(rank: int, path: str) -> dict[str, Any]:
    model = _sharded(offload=True)
    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, plan={"state_home": "nvme", "chunk_size": "16KiB"}, lr=LR
        )
        _train(rt, model, optimizer, rank)
        host_shards = rt.registry.resident_bytes("fsdp_shard", "host")
        device_shards = rt.registry.resident_bytes("fsdp_shard", "device")
    return {"params": _gathered(model), "host_shards": host_shards, "device_shards": device_shards}


def _state_dict_round_trip(rank: int, path: str) -> dict[str, Any]:
    """DCP's get/set_optimizer_state_dict over the managed optimizer: states like plain FSDP2's,
    and loading them back (after a step changed them) restores them."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _sharded()
    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, plan={"state_home": "nvme", "chunk_size": "16KiB"}, lr=LR
        )
        _train(rt, model, optimizer, rank)
        saved = get_optimizer_state_dict(model, optimizer)
        before = _local_states(model, optimizer)
        loss_of(model, 7).backward()
        optimizer.step()
        optimizer.zero_grad()
        changed = _local_states(model, optimizer) != before
        set_optimizer_state_dict(model, optimizer, saved)
        restored = _local_states(model, optimizer) == before
    return {"changed": changed, "restored": restored, "types": {v[0] for v in before.values()}}


def _agreement(rank: int, path: str) -> dict[str, Any]:
    """Rule 3: one plan for both ranks though their free bytes differ (rank 1 has less device);
    different packings (chunk sizes) raise the same clear error on both; and the refusals."""
    model = _sharded()
    capacity = "64MiB" if rank == 0 else "128KiB"  # ~50 KiB of it hold the shards
    with tiermem.Runtime(_config(path, capacity=capacity)) as rt:
        with pytest.raises(StatesUsageError, match="MixedPrecisionPolicy"):
            rt.manage(model, torch.optim.AdamW, param_dtype=torch.bfloat16, lr=LR)
        with pytest.raises(PlanError, match=r"packing of rank\(s\) \[1\] differs"):
            rt.manage(model, torch.optim.AdamW, plan={"chunk_size": "16KiB" if rank == 0 else "32KiB"}, lr=LR)
        model, optimizer = rt.manage(model, torch.optim.AdamW, plan={"chunk_size": "16KiB"}, lr=LR)
        plan = rt.plan.as_dict()
        with pytest.raises(StatesUsageError, match="already managed"):
            rt.manage(model, torch.optim.AdamW, lr=LR)
        _train(rt, model, optimizer, rank)
    return {"plan": plan, "params": _gathered(model)}


def _mixed_precision(rank: int, path: str) -> dict[str, Any]:
    """FSDP2's MixedPrecisionPolicy (bf16 gathers and compute, fp32 shards as the masters) with
    each rank's AdamW states on NVMe, against plain FSDP2 with the same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def sharded() -> nn.Module:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = mlp()
        for block in model:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    plain = sharded()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
    _train(None, plain, plain_optimizer, rank)
    model = sharded()
    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, plan={"state_home": "nvme", "chunk_size": "16KiB"}, lr=LR
        )
        _train(rt, model, optimizer, rank)
        written = rt.stats().tiers["nvme"].bytes_written
    same = all(torch.equal(a, b) for a, b in zip(_gathered(model), _gathered(plain), strict=True))
    dtypes = {str(p.dtype) for p in model.parameters()}
    return {"same_params": same, "nvme_written": written, "dtypes": dtypes}


def _hsdp(rank: int, path: str) -> dict[str, Any]:
    """HSDP: a 2-D mesh (replicate x shard) with the ranks replicating; states on NVMe."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = mlp()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with tiermem.Runtime(_config(path)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, plan={"state_home": "nvme", "chunk_size": "16KiB"}, lr=LR
        )
        _train(rt, model, optimizer, rank)
        written = rt.stats().tiers["nvme"].bytes_written
    placements = {str(tuple(p.placements)) for p in model.parameters()}  # type: ignore[attr-defined]
    return {"params": _gathered(model), "nvme_written": written, "placements": placements}


def _sized_to_capacities(plan: dict[str, Any]) -> Callable[[int, str], dict[str, Any]]:
    """Issue 34: a 4-block MLP at per-rank device 30% and host 50% of the rank's state bytes (the
    device holds the rank's shards, 25%), the chunk size left to the rule (``plan``: the other
    fields of a hand plan): the default size (one chunk, every state) needs two staged homes,
    2x the host; smaller chunks fit."""

    def run(rank: int, path: str) -> dict[str, Any]:
        from tiermem.states.sharded.step import local_of

        model = _sharded(blocks=4)
        state = 16 * sum(local_of(p).numel() for p in model.parameters())  # parameter, gradient, 2 states
        config = _config(path)
        config["device"]["capacity"], config["host"]["capacity"] = int(state * 0.3), int(state * 0.5)
        with tiermem.Runtime(config) as rt:
            model, optimizer = rt.manage(model, torch.optim.AdamW, plan=plan, lr=LR)
            in_force = rt.plan.as_dict()
            _train(rt, model, optimizer, rank)
            tiers = rt.stats().as_dict()["tiers"]
        peaks = {tier: (tiers[tier]["peak_bytes"], tiers[tier]["capacity"]) for tier in ("device", "host")}
        return {"params": _gathered(model), "plan": in_force, "peaks": peaks}

    return run


def _configured_size(rank: int, path: str) -> dict[str, Any]:
    """``[model_states] chunk_size`` sizes a sharded model's chunks as it sizes one process's (the
    rule alone packs every state into one chunk here); a size below the largest shard (8 KiB a
    rank) is refused with a note naming the setting. Where only rank 1's configuration refuses its
    size, it still joins the ranks' gather: rank 0 raises too, naming it, instead of waiting."""
    model = _sharded()
    mixed = {**_config(path), "model_states": {"chunk_size": "16KiB" if rank == 0 else "4KiB"}}
    with tiermem.Runtime(mixed) as rt, pytest.raises(PlanError) as one_refused:
        rt.manage(model, torch.optim.AdamW, lr=LR)
    small = {**_config(path), "model_states": {"chunk_size": "4KiB"}}
    with tiermem.Runtime(small) as rt, pytest.raises(PlanError, match="below the largest parameter shard") as info:
        rt.manage(model, torch.optim.AdamW, lr=LR)
    notes = getattr(info.value, "__notes__", [])
    with tiermem.Runtime({**_config(path), "model_states": {"chunk_size": "16KiB"}}) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=LR)
        plan = rt.plan.as_dict()
        _train(rt, model, optimizer, rank)
    return {"plan": plan, "params": _gathered(model), "notes": notes, "one_refused": str(one_refused.value)}


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "host": _homes("host"),
    "nvme": _homes("nvme"),
    "hsdp": _hsdp,
    "mixed_precision": _mixed_precision,
    "activations": _with_activations,
    "declared": _declared,
    "accumulated": _accumulated,
    "clipped": _clipped,
    "cpu_offload": _cpu_offload,
    "state_dict": _state_dict_round_trip,
    "agreement": _agreement,
    "sized": _sized_to_capacities({}),
    "sized_one_staged": _sized_to_capacities({"staged_homes": 1}),
    "configured_size": _configured_size,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("torch.distributed.fsdp")
    root = tmp_path_factory.mktemp("fsdp_states")
    start_ranks(_rank, args=(2, _free_port(), str(root)), nprocs=2)  # forked from a server that imported torch once
    out = []
    for rank in range(2):
        with open(root / f"results{rank}.pt", "rb") as f:
            out.append(pickle.load(f))
    return out


def _assert_reference(params: list[torch.Tensor]) -> None:
    for a, b in zip(params, reference(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_states_on_host_or_nvme_match_one_process(ranks, home):
    """AdamW with each rank's states in several chunks on ``home`` ends bitwise where plain PyTorch
    ends; NVMe was written on each rank; FSDP2's shards are counted on the device."""
    _assert_reference(ranks[0][home]["params"])
    for rank in ranks:
        assert rank[home]["homes"] == {home} and rank[home]["chunks"] > 1
        assert rank[home]["adopted"] > 0
        assert (rank[home]["nvme_written"] > 0) == (home == "nvme")


def test_states_and_activations_on_nvme_match_one_process(ranks):
    _assert_reference(ranks[0]["activations"]["params"])
    for rank in ranks:
        assert rank["activations"]["activations_out"] > 0 and rank["activations"]["nvme_written"] > 0


def test_declared_loop_steps_chunks_during_backward(ranks):
    """Rule 6: with grad_accumulation_steps=1, keep_gradients=False every chunk steps in backward
    (from FSDP2's post-accumulate-grad hooks) and drops .grad, bitwise plain PyTorch's."""
    _assert_reference(ranks[0]["declared"]["params"])
    for rank in ranks:
        result = rank["declared"]
        assert result["early"] == STEPS * result["chunks"] and result["chunks"] > 1
        assert result["grads_after_backward"] == [False] * STEPS


def test_declared_accumulation_steps_chunks_in_the_last_backward(ranks):
    """Rule 6 with grad_accumulation_steps=2 and gradients kept; the optimizer refuses to step
    once the runtime closed."""
    assert ranks[0]["accumulated"]["params"] and len(ranks[0]["accumulated"]["params"]) == 12
    for a, b in zip(ranks[0]["accumulated"]["params"], reference(accumulation=2), strict=True):
        assert torch.equal(a, b)
    for rank in ranks:
        result = rank["accumulated"]
        assert result["early"] == STEPS * result["chunks"] and result["chunks"] > 1


def test_declared_clipping_matches_plain_fsdp2(ranks):
    """Rule 7: bitwise plain FSDP2 + clip_grad_norm_ (norms, parameters, optimizer states), with
    one all-reduce per step for the norm."""
    for rank in ranks:
        result = rank["clipped"]
        assert result["clipped"]
        plain, got = result["norms"]
        assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
        assert result["same_params"] and result["same_state"]
        assert result["all_reduces"] == STEPS


def test_cpu_offload_policy_composes(ranks):
    """FSDP2's CPUOffloadPolicy: bitwise, and the host shards counted on the host tier."""
    _assert_reference(ranks[0]["cpu_offload"]["params"])
    for rank in ranks:
        assert rank["cpu_offload"]["host_shards"] > 0 and rank["cpu_offload"]["device_shards"] == 0


def test_optimizer_state_dict_through_dcp(ranks):
    for rank in ranks:
        result = rank["state_dict"]
        assert result["changed"] and result["restored"]
        assert result["types"] == {"DTensor", "Tensor"}


def test_one_plan_for_every_rank(ranks):
    """Rule 3: rank 1's smaller device makes the plan for both (some states off the device)."""
    plans = [rank["agreement"]["plan"] for rank in ranks]
    assert plans[0] == plans[1]
    assert "device" in plans[0]["state_home"] and set(plans[0]["state_home"]) != {"device"}
    _assert_reference(ranks[0]["agreement"]["params"])


def test_hsdp_on_a_2d_mesh_matches_one_process(ranks):
    """FSDP2's HSDP (replicate x shard mesh): each rank's states on NVMe, bitwise one process."""
    _assert_reference(ranks[0]["hsdp"]["params"])
    for rank in ranks:
        assert rank["hsdp"]["nvme_written"] > 0
        assert rank["hsdp"]["placements"] == {"(Replicate(), Shard(dim=0))"}


def test_fsdp2_mixed_precision_policy_composes(ranks):
    """fp32 masters under mixed precision on FSDP2 are FSDP2's own sharded parameters
    (MixedPrecisionPolicy gathers bf16): with the states on NVMe, bitwise plain FSDP2 + the policy."""
    for rank in ranks:
        result = rank["mixed_precision"]
        assert result["same_params"] and result["nvme_written"] > 0
        assert result["dtypes"] == {"torch.float32"}


@pytest.mark.parametrize("scenario", ["sized", "sized_one_staged"])
def test_chunks_are_sized_to_per_rank_capacities(ranks, scenario):
    """Issue 34: where the default chunk size is refused (2x the host for two staged homes), rank 0
    picks a smaller size that fits every rank's capacities, and training is bitwise the
    single-process reference; no tier went past its capacity. Asked to stage one home at a time
    (``staged_homes=1``), the step stages each home once the one before is back."""
    plans = [rank[scenario]["plan"] for rank in ranks]
    assert plans[0] == plans[1] and len(plans[0]["state_home"]) > 1 and "nvme" in plans[0]["state_home"]
    assert plans[0]["staged_homes"] == (1 if scenario == "sized_one_staged" else 2)
    for a, b in zip(ranks[0][scenario]["params"], reference(blocks=4), strict=True):
        assert torch.equal(a, b)
    for rank in ranks:
        assert all(peak <= capacity for peak, capacity in rank[scenario]["peaks"].values())


def test_the_configured_chunk_size_sizes_every_ranks_chunks(ranks):
    """``[model_states] chunk_size = "16KiB"``: both ranks pack at 16 KiB (several chunks where the
    rule alone makes one), bitwise the single-process reference; 4 KiB is refused, and the
    refusal says the size came from the configuration. A size only rank 1 refuses makes both ranks
    raise: rank 1 its own refusal, rank 0 one that names rank 1 and why."""
    for rank in ranks:
        result = rank["configured_size"]
        assert result["plan"]["chunk_size"] == 16 << 10 and len(result["plan"]["state_home"]) > 1
        assert any("[model_states] chunk_size = 4096" in note for note in result["notes"])
        assert "below the largest parameter shard" in result["one_refused"]
    assert "rank(s) [1] refused the plan" in ranks[0]["configured_size"]["one_refused"]
    _assert_reference(ranks[0]["configured_size"]["params"])
