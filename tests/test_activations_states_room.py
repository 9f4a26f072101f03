"""Kept activations give device room to the model states (NOTE [ Activation fallbacks ] rule 8,
NOTE [ Managed object rules ] rule 7): with gradient accumulation a chunk's gradient buffer comes
back to the device as its backward begins, while the kept blocks of the forward still hold the
bytes it had when they were kept. Before, the model states' retry ladder had nothing more to
release and raised "gradients needs ... on the device" (issue 22's nanoGPT example at a 3 MiB
device); now the offloader writes kept tensors out, the one backward needs last first, and training
stays bitwise plain PyTorch within the capacity."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import OPTIMIZERS, assert_bitwise, batch, make_model, param_groups, train
from tiermem.activations.managed import ManagedRequest
from tiermem.activations.offloader import ActivationOffloader
from tiermem.activations.saved import live_handles
from tiermem.config import Config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

LAYERS = 4


def config(tmp_path: Any, device: int) -> dict[str, Any]:
    return {
        "device": {"capacity": device, "device": "cpu"},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
        "activations": {"min_bytes": "1KiB", "policy": "auto"},  # the tiny model's tensors are 4-16 KiB
    }


def given_back(rt: tiermem.Runtime) -> int:
    reasons = rt.stats().activations.fallback_reasons
    return sum(n for reason, n in reasons.items() if reason.startswith("model_states->"))


def test_gradients_brought_back_to_accumulate_take_room_from_kept_activations(tmp_path):
    """A 4-layer GPT (~0.9 MiB of AdamW states) streamed through devices of 145-157.5 KB with two
    micro-batches a step: every one trains bitwise plain PyTorch within its capacity (before the
    give-back, 147.5-157.5 KB raised StatesMemoryError at the second micro-batch's backward)."""
    model = make_model(layers=LAYERS)
    want_losses = train(model, OPTIMIZERS["adamw"](param_groups(model)), range(2), micro_batches=2)
    want_params = [p.detach().clone() for p in model.parameters()]
    asked = 0
    for device in range(145_000, 160_000, 2_500):
        model = make_model(layers=LAYERS)
        with tiermem.Runtime(config(tmp_path, device)) as rt:
            model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"persistent_chunks": 0})
            losses = train(model, optimizer, range(2), micro_batches=2)
            assert rt.stats().tiers["device"].peak_bytes <= device
            asked += given_back(rt)
        assert_bitwise(losses, want_losses)
        assert_bitwise([p.detach().clone() for p in model.parameters()], want_params)
        assert list(tmp_path.iterdir()) == []
    assert asked > 0, "no capacity in the sweep needed the give-back: retune the sweep to the model"


def kept_offloader(rt: tiermem.Runtime, model: nn.Module, *, chosen: bool) -> ActivationOffloader:
    """Every block kept; ``chosen``: tiermem's own choice (a plan's), else the user's instruction."""
    return ActivationOffloader(
        rt.registry, model, rt._activation_counters, policy="keep", default_policy="auto", min_bytes=1024, chosen=chosen
    )


def block_tiers(offloader: ActivationOffloader) -> list[set[str]]:
    """Per block of the current forward, the tiers its live saved tensors are on."""
    forward = offloader.forwards.forward_id
    return [{h.tier for h in live_handles(offloader.forwards.groups[(forward, i)].saved)} for i in range(LAYERS)]


def loss_of(model: nn.Module) -> torch.Tensor:
    tokens, targets = batch(0)
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def test_the_give_back_writes_out_what_backward_needs_last_and_never_an_unpacked_tensor(tmp_path):
    """Asked mid-backward (a gradient hook between block 3's backward and block 2's) for every device
    byte: blocks 0-2 go to NVMe, block 3's tensors, unpacked already and still held by the graph
    (``retain_graph``), stay; asked for a few bytes before backward, only block 0 goes. Gradients
    of two backwards stay bitwise plain PyTorch's."""
    plain = make_model(layers=LAYERS)
    loss = loss_of(plain)
    loss.backward(retain_graph=True)
    loss.backward()
    want = [p.grad.clone() for p in plain.parameters() if p.grad is not None]

    model = make_model(layers=LAYERS)
    with tiermem.Runtime(config(tmp_path, 64 << 20)) as rt:
        offloader = kept_offloader(rt, model, chosen=True)
        seen: list[list[set[str]]] = []

        def ask_for_everything(grad: torch.Tensor) -> None:
            rt.registry.reclaim("device", needed=64 << 20)
            seen.append(block_tiers(offloader))

        with offloader:
            loss = loss_of(model)
            assert block_tiers(offloader) == [{"device"}] * LAYERS
            block0 = offloader.forwards.groups[(offloader.forwards.forward_id, 0)]
            first = next(live_handles(block0.saved))
            assert rt.registry.reclaim("device", needed=rt.registry.free_bytes("device") + first.obj.nbytes)
            assert first.tier == "nvme" and block_tiers(offloader)[1:] == [{"device"}] * (LAYERS - 1)

            def watch_block_3s_input(_module: nn.Module, args: Any, _output: Any) -> None:
                args[0].register_hook(ask_for_everything)  # its gradient: after block 3's backward, before 2's

            model.blocks[3].register_forward_hook(watch_block_3s_input)
            loss = loss_of(model)  # a new forward: its blocks kept, the old graph released
            loss.backward(retain_graph=True)
            loss.backward()
        assert seen[0] == [{"nvme"}] * 3 + [{"device"}]
        assert rt.stats().activations.fallback_reasons.get("model_states->evict:nvme", 0) > 0
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert_bitwise(got, want)


def test_a_users_keep_is_never_given_back(tmp_path):
    """NOTE [ Activation fallbacks ] rule 2: a block the user keeps stays on the device."""
    model = make_model(layers=LAYERS)
    with tiermem.Runtime(config(tmp_path, 64 << 20)) as rt:
        with kept_offloader(rt, model, chosen=False) as offloader:
            loss = loss_of(model)
            assert not rt.registry.reclaim("device", needed=64 << 20)
            assert block_tiers(offloader) == [{"device"}] * LAYERS
            loss.backward()
        assert given_back(rt) == 0


def test_reclaimers_that_move_objects_run_after_the_caches_and_only_for_a_need(tmp_path):
    """NOTE [ Managed object rules ] rule 7: reclaim() frees caches only; reclaim(needed=...) asks
    the movers too, after the caches, and none once ``needed`` bytes are free."""
    calls: list[str] = []

    class Owner:
        """A cache of 4 KiB and an object of 8 KiB on the device."""

        def __init__(self, registry: Any) -> None:
            self.cache = registry.adopt_cache("device", torch.empty(4096, dtype=torch.uint8))
            self.handle = registry.register(torch.zeros(8192, dtype=torch.uint8), "device")

        def drop(self) -> bool:
            calls.append("cache")
            cache, self.cache = self.cache, None
            if cache is not None:
                cache.free()
            return cache is not None

        def move(self, needed: int) -> bool:
            calls.append(f"move {needed}")
            if self.handle.tier != "device":
                return False
            self.handle.move_to("host")
            self.handle.wait()
            return True

    with tiermem.Runtime(config(tmp_path, 64 << 10)) as rt:
        registry = rt.registry
        owner = Owner(registry)
        registry.add_reclaimer("device", owner.move, moves_objects=True)
        registry.add_reclaimer("device", owner.drop)
        assert registry.reclaim("device") and calls == ["cache"]  # no need given: the mover is not asked
        calls.clear()
        assert not registry.reclaim("device", needed=registry.free_bytes("device"))  # enough free already
        assert calls == ["cache"]
        calls.clear()
        needed = registry.free_bytes("device") + 1
        assert registry.reclaim("device", needed=needed) and calls == ["cache", f"move {needed}"]
        assert owner.handle.tier == "host"
        owner.handle.free()


def test_only_the_planners_block_policy_is_tiermems_choice():
    """Under ``activations="auto"`` the planner's per-block policy may fall back (rule 2); a policy
    the user fixed, by ``activations=``, ``plan={"block_policy": ...}`` or a hand plan, may not."""
    model = make_model(layers=LAYERS)
    settings = Config().activations
    assert ManagedRequest(model, "auto", settings, None).chosen
    assert not ManagedRequest(model, "auto", settings, None, planned=False).chosen  # a hand plan's
    assert not ManagedRequest(model, "auto", settings, ["keep"] * LAYERS).chosen
    assert not ManagedRequest(model, "keep", settings, None).chosen
