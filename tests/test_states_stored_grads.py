"""Gradients that wait on NVMe (issue 20 item 1, NOTE [ Stored gradients ]): a plain loop
(``.grad`` read and edited by hand, clipping, accumulation, ``zero_grad`` either way) trains
bitwise like plain PyTorch when the host cannot hold the NVMe chunks' gradients, and the host
tier never holds more than its capacity."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import tiermem
from tests.test_states import (
    OPTIMIZERS,
    assert_bitwise,
    batch,
    config,
    make_model,
    param_groups,
    reference,
    state_bytes,
    train,
)
from tiermem.errors import PlanError
from tiermem.states.stored_grads import StoredGradient

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

STORED = {"state_home": "nvme", "grad_home": "nvme"}


def _states(rt: tiermem.Runtime):
    return rt.__dict__["_model_states"][0]


def _within_capacities(rt: tiermem.Runtime) -> None:
    stats = rt.stats().as_dict()
    for tier in ("device", "host", "nvme"):
        assert stats["tiers"][tier]["peak_bytes"] <= stats["tiers"][tier]["capacity"], tier


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_plain_loop_with_gradients_on_nvme_is_bitwise(tmp_path, set_to_none):
    kwargs = {"micro_batches": 2, "clip": 0.5, "set_to_none": set_to_none}
    want = reference("adamw", **kwargs)
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        assert rt.plan.grad_home == "nvme"
        got = train(model, optimizer, range(3), **kwargs)
        states = _states(rt)
        assert states.gradients.stash.stagings > 0  # gradients were read back from NVMe
        _within_capacities(rt)
    assert_bitwise(got, want[0])  # losses and the clip norms
    assert_bitwise([p.detach() for p in model.parameters()], want[1])
    assert list(tmp_path.iterdir()) == []


def test_a_plain_loop_that_edits_then_reads_each_gradient_is_bitwise(tmp_path):
    """Rule 2: a staged copy that was written goes back to NVMe before it is dropped, also when
    a read followed the write. The loop clips each gradient by value and logs its largest entry
    right after (a write, then a read, of the same staged chunk); later chunks push the copy out
    before the step reads it again from NVMe."""

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        seen = []
        for step in range(2):
            tokens, targets = batch(step)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            seen.append(loss.detach())
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.clamp_(-1e-3, 1e-3)
                    seen.append(p.grad.abs().max().as_subclass(torch.Tensor))
            optimizer.step()
            optimizer.zero_grad()
        return seen

    plain = make_model()
    want = run(plain, OPTIMIZERS["adamw"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        got = run(model, optimizer)
        stash = _states(rt).gradients.stash
        assert stash.write_backs > 0  # edited copies went back to NVMe
        _within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_grad_is_a_stored_gradient_that_reads_and_edits_like_plain_pytorch(tmp_path):
    """``.grad`` after backward: values, views, in-place edits, replacement, ``deepcopy`` and
    ``model.zero_grad()`` all behave as in plain PyTorch (NOTE [ Host gradients ] rules 2-6)."""

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        seen = []
        for step in range(3):
            tokens, targets = batch(step)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            seen.append(loss.detach())
            weight = model.blocks[1].fc.weight
            seen.append(weight.grad.detach().clone())
            seen.append(weight.grad.t().reshape(-1)[:7].clone())  # a view's values
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
            weight.grad.view(-1)[:3].fill_(0.25)  # a write through a view lands in the gradient
            model.ln.weight.grad = torch.full_like(model.ln.weight, 0.01)
            model.blocks[0].fc.bias.grad = None
            seen.append(copy.deepcopy(weight.grad).clone())
            optimizer.step()
            seen.append(weight.grad.clone())  # still readable after the step
            model.zero_grad()
        return seen

    plain = make_model()
    want = run(plain, OPTIMIZERS["adam"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adam"](param_groups(model)), plan=STORED)
        tokens, targets = batch(0)
        got = run(model, optimizer)
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        streamed = [p for p in model.parameters() if p.grad is not None and isinstance(p.grad, StoredGradient)]
        assert streamed, "no gradient waits on NVMe"
        model.zero_grad()
        _within_capacities(rt)
    assert_bitwise([t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t for t in got], want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_the_default_rule_stores_gradients_when_the_host_cannot_hold_them(tmp_path):
    """At a host of 10% of the state bytes the rule puts gradients on NVMe instead of refusing
    (issue 20: 'the host needs ... (gradients of the NVMe chunks ...)')."""
    model = make_model()
    nbytes = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, nbytes // 10, host=nbytes // 10)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        assert rt.plan.grad_home == "nvme"
        losses = train(model, optimizer, range(3), clip=1.0)
        _within_capacities(rt)
    want = reference("adamw", clip=1.0)
    assert_bitwise(losses, want[0])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])


def test_a_roomy_host_keeps_gradients_on_the_host(tmp_path):
    model = make_model()
    nbytes = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, nbytes // 4, host=nbytes // 2)) as rt:
        rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        assert "nvme" in rt.plan.state_home
        assert rt.plan.grad_home == "host"


def test_a_bad_grad_home_is_refused_with_the_choices(tmp_path):
    model = make_model()
    with (
        tiermem.Runtime(config(tmp_path, state_bytes("adamw", model))) as rt,
        pytest.raises(PlanError, match=r"grad_home.*'host' or 'nvme'.*'disk'"),
    ):
        rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"grad_home": "disk"})


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=8, n_embd=128, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=6, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _hf_loop(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The loop users write: GradScaler, clipping by hand after unscale_, two micro-batches."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    out = []
    for step in range(3):
        for micro in range(2):
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 * step + micro))
            loss = model(input_ids=ids, labels=ids).loss / 2
            scaler.scale(loss).backward()
            out.append(loss.detach())
        scaler.unscale_(optimizer)
        out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_plain_loops_fit_at_a_tenth_device_and_host(tmp_path, name):
    """The issue's case: rt.manage(model, AdamW) at device 10% and host 10% of the state bytes
    (was refused: 'the host needs ... gradients of the NVMe chunks'), a plain loop, bitwise."""
    plain = _hf(name)
    want = _hf_loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    model = _hf(name)
    nbytes = 16 * sum(p.numel() for p in model.parameters())
    cfg = config(tmp_path, nbytes // 10, host=nbytes // 10)
    with tiermem.Runtime(cfg) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3)
        assert rt.plan.grad_home == "nvme"
        got = _hf_loop(model, optimizer)
        _within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_a_repack_and_leaving_the_runtime_keep_stored_gradients(tmp_path):
    """The first step re-packs in execution order (rule 2 of NOTE [ Model-state rules ]) with
    gradients on NVMe, and leaving the runtime gives ordinary ``.grad`` of plain PyTorch's values."""

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            tokens, targets = batch(step)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            losses.append(loss.detach())
            optimizer.step()
            if step < 2:
                optimizer.zero_grad()
        return losses  # the last step's gradients are kept

    plain = make_model(head_first=True)
    want = run(plain, OPTIMIZERS["sgd"](param_groups(plain)))
    model = make_model(head_first=True)
    with tiermem.Runtime(config(tmp_path, int(state_bytes("sgd", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["sgd"](param_groups(model)), plan=STORED)
        states = _states(rt)
        got = run(model, optimizer)
        assert states.describe()["order"] == "execution"  # re-packed with gradients on NVMe
        assert states.gradients.stash.stagings > 0
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters(), strict=True)]
    assert all((a is None) == (b is None) for a, b in grads)
    assert_bitwise([a for a, _ in grads if a is not None], [b for _, b in grads if b is not None])
    assert not any(isinstance(a, StoredGradient) for a, _ in grads)


def test_gradient_buffers_are_blocks_their_tier_kept(tmp_path, monkeypatch):
    """NOTE [ Spare tier blocks ]: a chunk's gradient buffer in backward (device) and the host copy
    a stored gradient is read into are made by their tier, which hands out a block it kept where
    it has room, not a fresh buffer it adopts: the kernel zeroes a fresh one's pages again as they
    are first written, and a pinned host copied one into its pool first. After the first step no
    gradient buffer is adopted, and most of those made reuse a kept block."""
    from tiermem.registry import Registry
    from tiermem.tiers import memory

    adopted: list[str] = []  # labels of the buffers registered (adopted) in steady steps
    made: dict[str, int] = {"device": 0, "host": 0}  # gradient buffers made, by tier
    fresh: dict[str, int] = {"device": 0, "host": 0}  # of those, the ones no kept block served
    making = threading.local()  # a gradient buffer is being made on this thread (allocated on it)
    real_register, real_make, real_empty = Registry.register, Registry.make, memory.aligned_empty

    def register(self, tensor, tier, **kwargs):
        adopted.append(kwargs.get("label") or kwargs.get("kind", ""))
        return real_register(self, tensor, tier, **kwargs)

    def make(self, tier, nbytes, **kwargs):
        if kwargs.get("label") != "gradient":
            return real_make(self, tier, nbytes, **kwargs)
        made[tier] += 1
        making.tier = tier
        try:
            return real_make(self, tier, nbytes, **kwargs)
        finally:
            making.tier = None

    def aligned_empty(nbytes: int, device: torch.device) -> torch.Tensor:  # a tier's only fresh blocks
        tier = getattr(making, "tier", None)
        if tier is not None:
            fresh[tier] += 1
        return real_empty(nbytes, device)

    monkeypatch.setattr(Registry, "register", register)
    monkeypatch.setattr(Registry, "make", make)
    monkeypatch.setattr(memory, "aligned_empty", aligned_empty)
    want = reference("adamw")
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=STORED)
        got = train(model, optimizer, range(1))
        for counts in (made, fresh):
            counts.update(device=0, host=0)
        adopted.clear()
        got += train(model, optimizer, range(1, 3))
        _within_capacities(rt)
    assert made["device"] > 0 and made["host"] > 0, made  # backward's buffers; stored gradients read back
    assert "gradient" not in adopted
    for tier in ("device", "host"):
        assert fresh[tier] < made[tier] / 2, (tier, fresh, made)
    assert_bitwise(got, want[0])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])


def test_streamed_gradient_buffers_of_several_sizes_share_one_kept_block_size(tmp_path, monkeypatch):
    """NOTE [ Spare tier blocks ] rule 6: a streamed chunk's gradient buffer on the CPU device holds
    the largest regular streamed untied trainable chunk's bytes (what the plan counts for the
    buffer being filled), so the block one chunk's write-back leaves serves the next chunk whatever
    its size; a tied chunk's buffer holds its own bytes. The host copies the step reads stored
    gradients into share the largest such gradient's size."""
    from tiermem.registry import Registry

    made: list[tuple[int, int]] = []  # device gradient buffers: (their bytes, their block's)
    copies: list[tuple[int, int]] = []  # host copies of gradients that wait on NVMe: (their bytes, their block's)
    real_make = Registry.make

    def make(self, tier, nbytes, **kwargs):
        handle = real_make(self, tier, nbytes, **kwargs)
        if kwargs.get("label") == "gradient":
            (made if tier == "device" else copies).append((nbytes, handle.obj.home.reserved))
        return handle

    monkeypatch.setattr(Registry, "make", make)
    want = reference("adamw")
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        plan = {**STORED, "chunk_size": 16 << 10}  # blocks split into chunks of 16, 8 and 4 KiB
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=plan)
        got = train(model, optimizer, range(3))
        states = _states(rt)
        streamed = [c for c in states.store.chunks if not c.persistent and c.trainable]
        untied = {c.nbytes for c in streamed if not states.facts.tied(c.layout)}
        tied = {c.nbytes for c in streamed if states.facts.tied(c.layout)}
        slot_block = rt.registry.reserved_size("device", max(untied))
        tied_blocks = {rt.registry.reserved_size("device", n) for n in tied}
        copy_block = rt.registry.reserved_size("host", states.store.stored_grad_room)
        _within_capacities(rt)
    assert len(untied) > 1 and tied and not tied & untied, (untied, tied)  # several sizes, and a tied chunk
    assert {n for n, _ in made} >= untied | tied, made  # every size made buffers
    assert all(block == slot_block for n, block in made if n in untied), made
    assert {block for n, block in made if n in tied} == tied_blocks, made  # its own bytes
    # the optimizer step reads the stored gradients through host copies, which share one size too
    assert len({n for n, _ in copies}) > 1 and {block for _, block in copies} == {copy_block}, copies
    assert_bitwise(got, want[0])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])


@pytest.mark.parametrize("predicted", ["room", "none", "short"])
def test_a_fresh_gradient_buffer_waits_for_write_backs_only_past_the_plans_peak(tmp_path, monkeypatch, predicted):
    """Rule 6 of the manager: a chunk's fresh gradient buffer is made beside the earlier chunks'
    write-backs still in flight while the device's bytes stay within the peak the plan predicted
    (the plain loop of a 210M HF GPT-2 waited 0.5-2.7 s a step for them otherwise); with no peak
    predicted, or one the buffer would pass, the write-backs land first. Bitwise either way, and
    the device never goes past the prediction."""
    from tests.test_states_declared import _slow_nvme_writes

    _slow_nvme_writes(monkeypatch)  # the last chunk's write-back is in flight as the next one fills
    want = reference("adamw")
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.1)
    plan: dict = dict(STORED)
    if predicted != "none":
        device = capacity if predicted == "room" else 1 << 16
        plan["predicted"] = {"step_s": 1.0, "peak_bytes": {"device": device, "host": None, "nvme": None}}
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=plan)
        got = train(model, optimizer, range(3))
        gradients = _states(rt).gradients
        device_peak = rt.stats().as_dict()["tiers"]["device"]["peak_bytes"]
        _within_capacities(rt)
    if predicted == "room":
        assert gradients.buffers_beside_writebacks > 0
        assert device_peak <= capacity
    else:
        assert gradients.buffers_beside_writebacks == 0
    assert_bitwise(got, want[0])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])
    assert list(tmp_path.iterdir()) == []
