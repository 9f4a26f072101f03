"""Model-state management (issue 5, first step): training under ``rt.manage`` is bitwise plain
PyTorch on the CPU for AdamW, Adam and SGD, whatever the device budget and wherever the states
live; state dicts round-trip; the device tier never goes past its capacity; errors are clear.
(NOTE [ Model-state rules ], NOTE [ Exact optimizer step ], NOTE [ Default placement rule ])"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tiermem.objects import ObjectState
from tiermem.registry import Priority
from tiermem.states import (
    ManagedOptimizer,
    PlanError,
    StatesClosedError,
    StatesMemoryError,
    StatesUsageError,
    UnsupportedOptimizerError,
)
from tiermem.states.forward_order import ForwardOrder

D, VOCAB, SEQ = 32, 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Tied embeddings; ``head_first`` registers the head before the blocks, so registration
    order differs from execution order."""

    def __init__(self, layers: int = 8, head_first: bool = False) -> None:
        super().__init__()
        if head_first:
            self.head = nn.Linear(D, VOCAB)
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln = nn.LayerNorm(D)
        if not head_first:
            self.head = nn.Linear(D, VOCAB, bias=False)
            self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def make_model(seed: int = 0, **kwargs: Any) -> GPT:
    torch.manual_seed(seed)
    model = GPT(**kwargs)
    model.blocks[0].ln1.weight.requires_grad_(False)  # a frozen parameter
    return model


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """No weight decay on norms and biases."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95)),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
}
STATE_BYTES = 16  # model-state bytes per fp32 parameter, as for Adam (the measure)


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    return tokens, torch.randint(0, VOCAB, (2, SEQ), generator=generator)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    *,
    micro_batches: int = 1,
    clip: float | None = None,
    set_to_none: bool = True,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> list[torch.Tensor]:
    """Losses (and clip norms) of ``steps``, with an LR scheduler stepping every step."""
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    out = []
    for step in steps:
        for micro in range(micro_batches):
            tokens, targets = batch(step, micro)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            out.append(loss.detach())
        if clip is not None:
            out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        scheduler.step()
    return out


def train_autocast(
    model: nn.Module, optimizer: torch.optim.Optimizer, after_forward: Callable[[], None] | None = None
) -> list[torch.Tensor]:
    """Losses of three steps with the forward under bf16 autocast on the CPU (fp32 parameters,
    the loss in fp32 outside it); ``after_forward`` runs inside autocast after each forward."""
    losses = []
    for step in range(3):
        tokens, targets = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
            if after_forward is not None:
                after_forward()
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def state_bytes(name: str, model: nn.Module) -> int:
    return STATE_BYTES * sum(p.numel() for p in model.parameters())


def config(tmp_path, device: int, host: int | str = "64MiB") -> dict[str, Any]:
    return {
        "device": {"capacity": device, "device": "cpu"},
        "host": {"capacity": host},
        "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
    }


@functools.cache
def reference(name: str, steps: int = 3, **kwargs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain PyTorch: losses and final parameters."""
    model = make_model()
    optimizer = OPTIMIZERS[name](param_groups(model))
    losses = train(model, optimizer, range(steps), **kwargs)
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("home", ["host", "nvme"])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.1])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_is_bitwise_plain_pytorch(tmp_path, name, fraction, home):
    model = make_model()
    capacity = int(state_bytes(name, model) * fraction)
    parameters = list(model.parameters())
    frozen = model.blocks[0].ln1.weight.detach().clone()
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        managed, optimizer = rt.manage(model, OPTIMIZERS[name](param_groups(model)), plan={"state_home": home})
        assert managed is model and list(model.parameters()) == parameters  # same Parameter objects
        assert isinstance(optimizer, torch.optim.Optimizer)
        losses = train(model, optimizer, range(3))
        plan = rt.plan
        stats = rt.stats().as_dict()
        assert model.blocks[0].ln1.weight.grad is None
    want_losses, want_params = reference(name)
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_params)
    assert torch.equal(model.blocks[0].ln1.weight, frozen)
    device = stats["tiers"]["device"]
    assert device["peak_bytes"] <= device["capacity"] == capacity
    if fraction < 1.0:
        assert plan.persistent_chunks < plan.chunks  # some chunks streamed through the pool
        assert set(plan.state_home[plan.persistent_chunks :]) == {home}
        source = "host" if home == "host" else "nvme"
        assert stats["links"][f"{source}->device"]["bytes"] > 0
    if fraction == 0.1:
        assert plan.persistent_chunks == 0
    assert list(tmp_path.iterdir()) == []


def _nvme_homes_hold_their_own_values(homes, values) -> None:
    """Byte for byte: each home's values in their slots, zeros everywhere else (padding,
    optimizer sections), not bytes an earlier home left in the memory it was made in."""
    for chunk, home in homes:
        want = torch.zeros(chunk.home_bytes, dtype=torch.uint8)
        for slot in chunk.layout.slots:
            slot.view(want, chunk.working_base).copy_(values[slot.index])
        assert torch.equal(home[: chunk.home_bytes], want)


def test_nvme_homes_are_written_while_the_next_is_filled_in_kept_host_blocks(tmp_path, monkeypatch):
    """A build makes each NVMe home in a block of the host tier and moves it to NVMe while it
    fills the next (``_HomeWriter``): never more than one write in flight while a home is
    filled, the blocks the writes leave serve the next homes (of any size: they take the
    largest home's room), the host stays within its capacity, and every home holds its own
    chunk's values once built."""
    from tiermem.states import store as store_module

    in_flight: list[int] = []  # writes in flight as each home's block is handed out
    blocks: set[int] = set()  # addresses of the host blocks homes were made in
    real_zeros = store_module._HomeWriter.zeros

    def zeros(self, nbytes):
        home = real_zeros(self, nbytes)
        assert self._made is not None  # a host block, not the scratch buffer
        in_flight.append(sum(h.state is ObjectState.MOVING for h in self._writing))
        blocks.add(home.data_ptr())  # a block an earlier home was made in holds its bytes still
        return home

    monkeypatch.setattr(store_module._HomeWriter, "zeros", zeros)
    model = make_model()
    values = [p.detach().clone() for p in model.parameters()]
    capacity = int(state_bytes("adamw", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"})
        store = rt._model_states[0].store
        chunks = [c for c in store.chunks if c.home is not None and c.home.tier == "nvme"]
        assert all(c.home.state is ObjectState.RESIDENT for c in chunks)  # landed when the build ended
        homes = [(chunk, chunk.home.copy_out()) for chunk in chunks]
    assert len(in_flight) == len(chunks) > 2
    assert max(in_flight) <= 1
    assert len({c.home_bytes for c in chunks}) > 1  # homes of several sizes ...
    assert len(blocks) <= 2  # ... take turns in two blocks of the largest one's room
    _nvme_homes_hold_their_own_values(homes, values)


@pytest.mark.parametrize("declared", [False, True])
def test_new_nvme_homes_leave_their_zero_states_unwritten_and_train_bitwise(tmp_path, declared):
    """A new model's NVMe homes are written without their optimizer-state sections, still zeros
    (NOTE [ Managed object rules ] rule 12): ``rt.manage`` writes only the parameters' bytes of
    its NVMe homes, a third of them under AdamW, where the file holds other bytes from an object
    freed before. Training stays bitwise plain PyTorch's in the plain loop and the declared one
    (whose chunks step in backward, staging their homes with the device copies as known bytes),
    and once stepped the homes are written whole. In the plain loop the first step reads no
    more from NVMe than a steady step and one read of the parameters (its re-pack's snapshot):
    the zeros are not read back (4.3 MB against 2.3 MB when they were)."""
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        stale = rt.registry.register(torch.full((32 << 20,), 255, dtype=torch.uint8), "nvme", dedup=False)
        stale.free()  # the homes are written where these bytes are
        written = rt.stats().tiers["nvme"].bytes_written
        declaration = {"grad_accumulation_steps": 1, "keep_gradients": False} if declared else {}
        _, optimizer = rt.manage(
            model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"}, **declaration
        )
        store = rt._model_states[0].store
        homes = [c for c in store.chunks if c.home is not None and c.home.tier == "nvme"]
        # a frozen chunk's home holds its values alone
        assert len(homes) > 2 and all(c.home.obj.zero_from == (c.nbytes if c.sections else None) for c in homes)
        params = sum(c.nbytes for c in homes)
        assert rt.stats().tiers["nvme"].bytes_written - written == params < sum(c.home_bytes for c in homes) // 2
        reads = [rt.stats().tiers["nvme"].bytes_read]
        losses: list[torch.Tensor] = []
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # as train() makes it
        for step in range(3):
            losses += train(model, optimizer, range(step, step + 1), scheduler=scheduler)
            reads.append(rt.stats().tiers["nvme"].bytes_read)
        stepped = [c.home.obj for c in store.chunks if c.home is not None and c.home.tier == "nvme"]
        assert stepped and all(home.zero_from is None for home in stepped)  # stepped, so written whole
    first, steady = reads[1] - reads[0], reads[3] - reads[2]
    if not declared:
        assert first <= steady + params
    want_losses, want_params = reference("adamw")
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_params)


def test_nvme_homes_without_host_room_are_built_in_one_buffer_each_hold_their_own_values(tmp_path, monkeypatch):
    """Where the host has no room for a home's block, a build makes its NVMe homes one after
    another in one buffer (``_HomeScratch``: each is written out before the next is made): homes
    of one size share it, and each home on NVMe holds its own chunk's values and zeros
    everywhere else, not bytes an earlier home left in the buffer (each home's buffer is
    overwritten once registered)."""
    from tiermem.states import store as store_module

    made: list[tuple[int, int]] = []  # (storage address, bytes) of each NVMe home made
    real_zeros = store_module._HomeScratch.zeros

    def zeros(self, nbytes):
        home = real_zeros(self, nbytes)
        made.append((home.untyped_storage().data_ptr(), nbytes))
        return home

    real_register = store_module.ChunkStore.register

    def register(self, tensor, tier, label):
        handle = real_register(self, tensor, tier, label)
        if tier == "nvme":
            tensor.fill_(0xA5)  # written out when register() returned: the next home must not see this
        return handle

    monkeypatch.setattr(store_module._HomeScratch, "zeros", zeros)
    monkeypatch.setattr(store_module.ChunkStore, "register", register)
    monkeypatch.setattr(store_module._HomeWriter, "_make", lambda self, nbytes: None)  # no host room
    model = make_model()
    values = [p.detach().clone() for p in model.parameters()]
    capacity = int(state_bytes("adamw", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"})
        chunks = [c for c in rt._model_states[0].store.chunks if c.home is not None and c.home.tier == "nvme"]
        homes = [(chunk, chunk.home.copy_out()) for chunk in chunks]
    assert len(made) == len(chunks) > 2
    sizes = [n for _, n in made]
    repeated = {n for n in sizes if sizes.count(n) > 1}
    assert repeated  # every size made again is made in the buffer its last home used
    assert all(len({ptr for ptr, size in made if size == n}) == 1 for n in repeated)
    _nvme_homes_hold_their_own_values(homes, values)


def test_home_scratch_keeps_a_buffer_for_each_of_the_last_two_sizes():
    """Homes of two sizes in turn (a block spanning a chunk and a half) each reuse their own
    buffer, zeroed again; a third size drops the least recent one, so at most two are held."""
    from tiermem.states.store import _HomeScratch

    scratch = _HomeScratch()
    a, b = scratch.zeros(4096), scratch.zeros(8192)
    a.fill_(1)
    b.fill_(2)
    again_a, again_b = scratch.zeros(4096), scratch.zeros(8192)
    assert again_a is a and again_b is b  # the same buffers (addresses could be a new block's)
    assert not a.any() and not b.any()
    scratch.zeros(12288)  # 4096 is the least recent size now
    assert scratch.zeros(8192) is b
    assert scratch.zeros(4096) is not a


@pytest.mark.parametrize(
    "make",
    [
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
        lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, dampening=0.1, foreach=True),
        lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, fused=True),
    ],
    ids=["adamw-foreach", "adamw-fused", "sgd-foreach", "sgd-fused"],
)
def test_the_users_foreach_and_fused_settings_stay_bitwise(tmp_path, make):
    """TRAPS 3: torch's own kernels, per parameter, with the user's implementation choice."""
    plain = make_model()
    plain_opt = make(param_groups(plain))
    want = train(plain, plain_opt, range(3))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, make(param_groups(model)), plan={"state_home": "nvme"})
        assert optimizer.param_groups[0]["foreach"] == plain_opt.param_groups[0]["foreach"]
        assert optimizer.param_groups[0]["fused"] == plain_opt.param_groups[0]["fused"]
        got = train(model, optimizer, range(3))
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_backward_refetches_chunks_released_after_forward(tmp_path):
    """TRAPS 2: backward of linear keeps ``weight.t()``, a view of the chunk's storage; the
    chunk is emptied after forward and must be refilled in place before backward reads it."""
    plain = make_model()
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, _optimizer = rt.manage(model, torch.optim.AdamW)
        states = rt.__dict__["_model_states"][0]
        tokens, targets = batch(0)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        released = [c for c in states.chunks if not c.persistent and not c.resident]
        assert released and all(c.data.untyped_storage().nbytes() == 0 for c in released)
        loss.backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    want = nn.functional.cross_entropy(plain(tokens).flatten(0, 1), targets.flatten())
    want.backward()
    assert_bitwise([loss], [want])
    for got, p in zip(grads, plain.parameters(), strict=True):
        assert (got is None) == (p.grad is None)
        if got is not None:
            assert_bitwise([got], [p.grad])


def test_released_chunk_bytes_are_refilled_without_new_memory_and_stay_accounted(tmp_path, monkeypatch):
    """NOTE [ Spare chunk storage ]: after the first step every streamed chunk's fetch takes
    the bytes a released chunk left (no storage grows, so no fresh page is zeroed under the
    NVMe read); spares are accounted on the device tier, never more than the pool's buffers,
    and training stays bitwise plain PyTorch."""
    model = make_model()
    grows: list[int] = []
    storages: set[int] = set()
    resize = torch.UntypedStorage.resize_

    def counting_resize(storage: torch.UntypedStorage, size: int) -> Any:
        if size and storage._cdata in storages:
            grows.append(size)
        return resize(storage, size)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", counting_resize)
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.3))) as rt:
        model, optimizer, states, _ = _manage_streamed(rt, model)
        losses = train(model, optimizer, range(2))  # the first step re-packs: new chunks
        pool = states.pool
        streamed = [c for c in states.chunks if not c.persistent]
        storages.update(c.data.untyped_storage()._cdata for c in streamed)
        assert len(streamed) > pool.buffers and len({c.nbytes for c in streamed}) > 1  # sizes differ
        device = rt.registry.tiers["device"]
        spares = len(pool._spares)
        assert 0 < spares <= pool.buffers
        held = sum(c.dev.obj.home.reserved for c in states.chunks if c.dev is not None)
        assert device.statistics().current_bytes == held + spares * pool.slot_bytes
        losses += train(model, optimizer, range(2, 3))
        assert grows == []  # every refill took a spare's bytes
        assert all(c.data.untyped_storage().nbytes() in (0, pool.slot_bytes) for c in streamed)
        states.close()
        assert device.statistics().current_bytes == 0  # the spares went with the chunks
    want_losses, want_params = reference("adamw")
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], want_params)


def test_a_device_allocation_that_does_not_fit_takes_the_spares_room_first(tmp_path):
    """NOTE [ Spare chunk storage ] rule 4: the retry ladder drops the spares before it waits
    or evicts; a prefetch (no demand) gets their room too, and so does any user of the device
    tier through ``Registry.reclaim`` (the activation offloader)."""
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.3))) as rt:
        model, optimizer, states, _ = _manage_streamed(rt, model)
        train(model, optimizer, range(2))  # the first step re-packs
        pool, device = states.pool, rt.registry.tiers["device"]
        assert pool._spares
        need = device.capacity - device.statistics().current_bytes + pool.slot_bytes // 2
        allocation = pool.device_room(lambda: device.allocate(need), (), demand=False, what="a test")
        assert allocation is not None and pool._spares == []
        device.free(allocation)
        with torch.no_grad():
            model(batch(2)[0])  # a forward leaves the last chunks resident, no spares
        pool.release(next(iter(pool.resident.values())))  # one becomes a spare
        resident = dict(pool.resident)
        assert len(pool._spares) == 1 and resident
        need = device.capacity - device.statistics().current_bytes + pool.slot_bytes // 2
        allocation = pool.device_room(lambda: device.allocate(need), (), demand=True, what="a test")
        assert pool._spares == [] and pool.resident == resident  # no chunk was evicted for it
        device.free(allocation)
        pool.release(next(iter(pool.resident.values())))
        before = device.statistics().current_bytes
        assert pool._spares and rt.registry.reclaim("device")  # other device users reclaim them too
        assert pool._spares == [] and device.statistics().current_bytes == before - pool.slot_bytes


def _pins_at(model: nn.Module, where: nn.Module, chunk_of: Callable[[], Any]) -> list[int]:
    """The pins of ``chunk_of()`` each time backward reaches ``where``'s output."""
    seen: list[int] = []

    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: seen.append(chunk_of().pins))

    where.register_forward_hook(hook)
    return seen


def _manage_streamed(rt: tiermem.Runtime, model: GPT) -> tuple[GPT, Any, Any, Callable[[], Any]]:
    """Every chunk streamed through 3 buffers; also the manager and the chunk holding the tied
    embedding, looked up when asked (a re-pack would replace the chunks)."""
    plan = {"chunk_size": "64KiB", "persistent_chunks": 0, "buffers": 3}
    model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan=plan)
    states = rt._model_states[-1]
    return model, optimizer, states, lambda: states.chunk_of(model.wte.weight)


def test_the_tied_chunk_is_unpinned_once_the_heads_backward_ran(tmp_path):
    """Rule 3: the tied weight accumulates only after the embedding's backward, at the end; the
    LM head's call must not pin its chunk until then (it took a streaming buffer from every
    block's backward), and training stays bitwise."""
    plain = make_model()
    want = train(plain, OPTIMIZERS["adamw"](param_groups(plain)), range(2))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.5))) as rt:
        model, optimizer, states, tied = _manage_streamed(rt, model)
        pins = _pins_at(model, model.blocks[4], tied)
        got = train(model, optimizer, range(2))
        assert not tied().persistent and tied() is not states.chunk_of(model.blocks[4].fc.weight)
    assert pins == [0, 0]  # pinned through every block's backward before: [1, 1]
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_the_embeddings_backward_does_not_fetch_its_chunk(tmp_path):
    """Rule 3: ``embedding_backward`` reads the indices, not the weight, so the tied chunk,
    evicted while the blocks' backward streamed, is not read back for the embeddings."""
    plain = make_model()
    want = train(plain, OPTIMIZERS["adamw"](param_groups(plain)), range(2))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.5))) as rt:
        model, optimizer, states, tied = _manage_streamed(rt, model)
        fetch, fetched, in_embedding_backward = states.pool.fetch, [], [False]

        def record(chunk: Any, *args: Any, **kwargs: Any) -> bool:
            if in_embedding_backward[0]:
                fetched.append(chunk)
            return fetch(chunk, *args, **kwargs)

        def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
            in_embedding_backward[0] = False
            output.register_hook(lambda grad: in_embedding_backward.__setitem__(0, True))

        states.pool.fetch = record
        model.wte.register_forward_hook(hook)
        got = []
        for step in range(2):
            got += train(model, optimizer, range(step, step + 1))
            assert in_embedding_backward[0]  # the hook saw the embedding's backward
        assert tied().index not in {chunk.index for chunk in fetched}
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_the_head_finds_the_tied_chunk_prefetched_in_the_order_the_last_forward_entered(tmp_path):
    """NOTE [ Forward order ] rules 2-3: nothing follows the last block's chunk by index, so the LM
    head fetched the tied embedding's chunk on demand; from the second forward on, the last block's
    run prefetches it, and training stays bitwise."""
    plain = make_model()
    want = train(plain, OPTIMIZERS["adamw"](param_groups(plain)), range(4))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.5))) as rt:
        model, optimizer, states, tied = _manage_streamed(rt, model)
        got = train(model, optimizer, range(1))  # the first step re-packs: a new chunk list, a new pool
        fetch, at_head = states.pool.fetch, []  # per forward: how the head found the tied chunk

        def record(chunk: Any, priority: Any, *args: Any, **kwargs: Any) -> bool:
            if chunk is tied() and priority == Priority.PREFETCH and not chunk.resident:
                prefetched.append(torch._C._current_graph_task_id() == -1)  # in forward, not backward
            return fetch(chunk, priority, *args, **kwargs)

        def head_started(_module: nn.Module, _args: Any) -> None:
            at_head.append(tied().resident and any(prefetched))

        states.pool.fetch = record
        model.head.register_forward_pre_hook(head_started, prepend=True)
        last_block = states.chunk_of(model.blocks[-1].out.weight)
        for step in range(1, 4):
            prefetched: list[bool] = []
            got += train(model, optimizer, range(step, step + 1))
        assert not tied().persistent and last_block is not tied()
        assert states.forward_order.last[-1] == (tied().index,)  # the head's run comes last
    assert at_head == [False, True, True]  # the first forward on these chunks learns the order
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_the_forward_order_answers_while_a_forward_follows_the_last_one_on_the_same_chunks():
    """NOTE [ Forward order ] rules 1-2: the next streamed chunk of the last forward's runs while
    this forward entered the same runs; the next by index (None) once it differs, outside a root
    forward, and after a re-pack (a new chunk list)."""
    chunks = [SimpleNamespace(index=i, persistent=i == 2) for i in range(5)]
    store = SimpleNamespace(chunks=chunks)
    order = ForwardOrder(store)  # type: ignore[arg-type]

    def forward(*runs: tuple[int, ...]) -> list[int | None]:
        order.began()
        answers = [order.entered(tuple(store.chunks[i] for i in run)) for run in runs]
        order.ended()
        return answers

    assert forward((0,), (0, 1), (1,), (2,), (3,), (4,), (0,)) == [None] * 7  # nothing learned yet
    # one module after another in a run asks again; the run's own chunks and the persistent chunk 2
    # are skipped; the last run has no next
    assert forward((0,), (0,), (0, 1), (1,), (2,), (3,), (4,), (0,)) == [1, 1, 3, 3, 3, 4, 0, None]
    assert forward((0,), (0, 1), (4,), (3,)) == [1, 3, None, None]  # another branch: by index from there
    assert order.last == ((0,), (0, 1), (4,), (3,))
    assert order.entered((chunks[0],)) is None  # a submodule called outside the root's forward
    assert forward((0,), (0, 1)) == [1, 4]  # ... is not recorded
    store.chunks = list(chunks)  # a re-pack
    assert order.last == () and forward((0,), (0, 1)) == [None, None]


class Twice(nn.Module):
    """One linear called twice in a forward (ALBERT-style sharing across calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.mid = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.mid(torch.tanh(self.shared(x)))))


def test_a_module_called_twice_is_unpinned_after_each_calls_backward(tmp_path):
    """Rule 3: the second call's backward runs first, but ``shared.weight`` accumulates only
    after the first call's; between them (``mid``'s backward) nothing pins its chunk."""

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for step in range(2):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses

    torch.manual_seed(0)
    plain = Twice()
    model = copy.deepcopy(plain)
    want = run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    with tiermem.Runtime(config(tmp_path, 4 * 4096)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, lr=1e-2, plan={"chunk_size": "4KiB", "persistent_chunks": 0, "buffers": 2}
        )
        states = rt._model_states[-1]
        chunk = lambda: states.chunk_of(model.shared.weight)  # noqa: E731
        pins = _pins_at(model, model.mid, chunk)
        got = run(model, optimizer)
    assert pins == [0, 0]
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_state_dicts_round_trip(tmp_path):
    """Save after 2 steps, load into a fresh model and optimizer in a new Runtime, train on:
    the same as 4 uninterrupted plain-PyTorch steps."""
    capacity = int(state_bytes("adamw", make_model()) * 0.1)
    plain = make_model()
    plain_opt = OPTIMIZERS["adamw"](param_groups(plain))
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=1, gamma=0.7)
    train(plain, plain_opt, range(2), scheduler=plain_scheduler)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model = make_model()
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"})
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        train(model, optimizer, range(2), scheduler=scheduler)
        model_state = model.state_dict()
        optimizer_state = optimizer.state_dict()
        scheduler_state = scheduler.state_dict()
    assert list(model_state) == list(plain.state_dict())
    assert_bitwise(list(model_state.values()), list(plain.state_dict().values()))
    storages = {t.untyped_storage().data_ptr() for t in model_state.values()}
    assert len(storages) == len(model_state)  # one tensor per parameter, nothing shared (TRAPS 2)
    want = plain_opt.state_dict()
    assert optimizer_state["param_groups"] == want["param_groups"]
    assert sorted(optimizer_state["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        assert list(optimizer_state["state"][index]) == list(entry)
        assert_bitwise(list(optimizer_state["state"][index].values()), list(entry.values()))

    want_losses = train(plain, plain_opt, range(2, 4), scheduler=plain_scheduler)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model = make_model(seed=7)
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1.0)
        with pytest.raises(ValueError, match="different number of parameter groups"):
            optimizer.load_state_dict(optimizer_state)  # PyTorch's own validation
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model = make_model(seed=7)
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"state_home": "nvme"})
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(scheduler_state)
        losses = train(model, optimizer, range(2, 4), scheduler=scheduler)
    assert_bitwise(losses, want_losses)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("set_to_none", [True, False])
def test_clipping_and_gradient_accumulation_match(tmp_path, set_to_none):
    """``clip_grad_norm_`` over managed ``.grad`` gives PyTorch's norm (TRAPS 4), also across
    micro-batches and with ``zero_grad(set_to_none=False)``."""
    kwargs = {"micro_batches": 2, "clip": 0.5, "set_to_none": set_to_none}
    want = reference("adamw", **kwargs)
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        got = train(model, optimizer, range(3), **kwargs)
    assert_bitwise(got, want[0])  # losses and the clip norms
    assert_bitwise([p.detach() for p in model.parameters()], want[1])


def test_user_code_edits_gradients(tmp_path):
    """``.grad`` is the real gradient (TRAPS 4): in-place edits, replaced tensors and
    ``model.zero_grad()`` all reach the optimizer as in plain PyTorch."""

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            tokens, targets = batch(step)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            losses.append(loss.detach())
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
            model.ln.weight.grad = torch.full_like(model.ln.weight, 0.01)
            model.blocks[1].fc.weight.grad = None
            optimizer.step()
            model.zero_grad()
        return losses

    plain = make_model()
    want = run(plain, OPTIMIZERS["adam"](param_groups(plain)))
    model = make_model()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adam"](param_groups(model)))
        got = run(model, optimizer)
        assert all(p.grad is None for p in model.parameters())
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_execution_order_is_recorded_and_chunks_repacked(tmp_path):
    torch.manual_seed(0)
    plain = make_model(head_first=True)
    plain_opt = OPTIMIZERS["sgd"](param_groups(plain))
    want = train(plain, plain_opt, range(3))
    model = make_model(head_first=True)
    capacity = int(state_bytes("sgd", model) * 0.5)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["sgd"](param_groups(model)))
        states = rt.__dict__["_model_states"][0]
        assert states.describe()["order"] == "registration"
        got = train(model, optimizer, range(3))
        assert states.describe()["order"] == "execution"
        first = states.chunks[0].layout.slots[0].index
        assert states.params[first] is model.wte.weight  # packed in execution order now
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


def test_default_rule_streams_states_to_nvme_when_the_host_is_small(tmp_path):
    model = make_model()
    nbytes = state_bytes("adamw", model)
    with tiermem.Runtime(config(tmp_path, nbytes // 4, host=nbytes // 2)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        homes = rt.plan.state_home
        assert "nvme" in homes and "host" in homes
        assert homes[: rt.plan.persistent_chunks] == ("device",) * rt.plan.persistent_chunks
        losses = train(model, optimizer, range(3))
        stats = rt.stats().as_dict()
    assert_bitwise(losses, reference("adamw")[0])
    for tier in ("device", "host", "nvme"):
        assert stats["tiers"][tier]["peak_bytes"] <= stats["tiers"][tier]["capacity"]


def test_plan_round_trips_and_hand_plans_are_checked(tmp_path):
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.5)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        plan = rt.plan
        assert set(plan.as_dict()) >= {"chunk_size", "persistent_chunks", "buffers", "state_home", "predicted"}
        unknown = {"step_s": None, "peak_bytes": {"device": None, "host": None, "nvme": None}}
        assert plan.as_dict()["predicted"] == unknown
        plan.save(tmp_path / "plan.json")
        saved = tmp_path / "plan.json"
        again = make_model()
        rt.manage(again, OPTIMIZERS["adamw"](param_groups(again)), plan=str(saved))
        assert rt.plan == plan
        saved.unlink()
        for bad, match in [
            ({"chunk_sizes": 4096}, "unknown key"),
            ({"state_home": ["host"]}, "state_home lists 1 chunks"),
            (
                {"chunk_size": plan.chunk_size, "persistent_chunks": 1, "state_home": ["host"] * plan.chunks},
                "contradicts persistent_chunks",
            ),
            ({"chunk_size": 64}, "below the largest parameter"),
            ({"buffers": 1, "persistent_chunks": 0}, "buffers=1 is too few"),
        ]:
            with pytest.raises(PlanError, match=match):
                rt.manage(make_model(), torch.optim.AdamW, plan=bad)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_optimizers_and_misuse_get_clear_errors(tmp_path):
    class MyAdam(torch.optim.Adam):
        pass

    with tiermem.Runtime(config(tmp_path, 1 << 20)) as rt:
        model = make_model()
        for optimizer in (MyAdam(model.parameters()), "adam"):
            with pytest.raises(UnsupportedOptimizerError, match=r"per-parameter torch\.optim optimizers"):
                rt.manage(model, optimizer)
        with pytest.raises(UnsupportedOptimizerError, match=r"LBFGS is not supported: its step\(\) needs a closure"):
            rt.manage(model, torch.optim.LBFGS, lr=0.1)
        with pytest.raises(ValueError, match="not in the model"):
            rt.manage(model, torch.optim.SGD(make_model().parameters(), lr=0.1))
        model, optimizer = rt.manage(model, torch.optim.SGD, lr=0.1)
        assert isinstance(optimizer, ManagedOptimizer)
        with pytest.raises(StatesUsageError, match="already managed"):
            rt.manage(model, torch.optim.SGD, lr=0.1)
        with pytest.raises(StatesUsageError, match="assign=True"):
            model.load_state_dict(model.state_dict(), assign=True)
        with pytest.raises(StatesUsageError, match=r"fixed at rt\.manage"):
            optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))]})


def test_too_small_device_budget_is_refused_with_the_numbers(tmp_path):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with tiermem.Runtime(config(tmp_path, 48 << 10)) as rt:
        with pytest.raises(StatesMemoryError, match=r"too little device: the device has 48KiB free"):
            rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        assert rt.stats().as_dict()["tiers"]["device"]["current_bytes"] == 0
    assert_bitwise([p.detach() for p in model.parameters()], before)  # left as it was


def test_closing_restores_ordinary_parameters(tmp_path):
    model = make_model()
    capacity = int(state_bytes("sgd", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["sgd"](param_groups(model)), plan={"state_home": "nvme"})
        train(model, optimizer, range(3))
        model(batch(0)[0]).sum().backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        values = [t.clone() for t in model.state_dict().values()]
    assert_bitwise([p.detach() for p in model.parameters()], reference("sgd")[1])
    assert_bitwise(list(model.state_dict().values()), values)
    for p, grad in zip(model.parameters(), grads, strict=True):
        assert (p.grad is None) == (grad is None)
        if grad is not None:
            assert_bitwise([p.grad], [grad])
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))
    model(batch(0)[0])  # an ordinary model again
    with pytest.raises(StatesClosedError, match="ordinary tensors again"):
        optimizer.step()
    assert list(tmp_path.iterdir()) == []


def test_closing_without_memory_leaves_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr("tiermem.states.facts.memory_available", lambda device: 0)
    model = make_model()
    capacity = int(state_bytes("adamw", model) * 0.5)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        rt.manage(model, torch.optim.AdamW, plan={"state_home": "nvme"})
    assert model.wte.weight.device.type == "meta"
    with pytest.raises(StatesClosedError, match="did not fit in memory"):
        model(batch(0)[0])
    assert list(tmp_path.iterdir()) == []


def test_eval_forward_without_grad_and_state_dict_between_steps(tmp_path):
    model = make_model()
    plain = copy.deepcopy(model)
    capacity = int(state_bytes("adam", model) * 0.1)
    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, _optimizer = rt.manage(model, OPTIMIZERS["adam"](param_groups(model)))
        tokens = batch(5)[0]
        with torch.no_grad():
            assert_bitwise([model(tokens)], [plain(tokens)])
        model.eval()
        assert_bitwise([model(tokens).detach()], [plain(tokens).detach()])
        assert_bitwise(list(model.state_dict().values()), list(plain.state_dict().values()))


@pytest.mark.parametrize("fraction", [0.1, 1.0])
def test_inference_mode_forwards_match_plain_pytorch_and_training_goes_on(tmp_path, fraction):
    """A forward under ``torch.inference_mode()`` (evaluation, generation) fetches and releases
    streamed chunks like any other: before the first step (which then plans) and between steps,
    with the plan's activation policy in force; outputs and the training around them bitwise
    plain PyTorch's."""
    plain = make_model()
    plain_optimizer = OPTIMIZERS["adamw"](param_groups(plain))
    model = make_model()
    capacity = int(state_bytes("adamw", model) * fraction)
    tokens = batch(7)[0]

    def evaluated(model: nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            out = model(tokens)
        assert out.is_inference()
        return out.clone()

    with tiermem.Runtime(config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        got, want = [evaluated(model)], [evaluated(plain)]
        got += train(model, optimizer, range(2))
        want += train(plain, plain_optimizer, range(2))
        assert rt.plan is not None  # the first training forward planned, after the inference one
        got.append(evaluated(model))
        want.append(evaluated(plain))
        got += train(model, optimizer, range(2, 3))
        want += train(plain, plain_optimizer, range(2, 3))
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])


@pytest.mark.parametrize("policy", ["nvme", "recompute"])
def test_composes_with_activation_offload(tmp_path, policy):
    """Saved activations offloaded or recomputed (recompute re-runs forward hooks inside
    backward, TRAPS 6) while chunks stream: still bitwise."""
    want = reference("adamw")
    model = make_model()
    settings = config(tmp_path, int(state_bytes("adamw", model) * 0.5) + (4 << 20))
    settings["activations"] = {"min_bytes": "1KiB"}
    with tiermem.Runtime(settings) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)), plan={"persistent_chunks": 2})
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        losses = []
        for step in range(3):
            tokens, targets = batch(step)
            with rt.offload_activations(model, policy=policy):
                loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                loss.backward()
            losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        assert rt.stats().as_dict()["activations"]["captured_bytes"] > 0
    assert_bitwise(losses, want[0])
    assert_bitwise([p.detach() for p in model.parameters()], want[1])


def test_reentrant_checkpointing_is_bitwise(tmp_path):
    """Reentrant checkpoint re-runs blocks' forward inside a nested backward (TRAPS 6)."""

    class Checkpointed(GPT):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            return self.head(self.ln(x))

    def build() -> GPT:
        torch.manual_seed(0)
        return Checkpointed()

    plain = build()
    want = train(plain, OPTIMIZERS["adamw"](param_groups(plain)), range(3))
    model = build()
    with tiermem.Runtime(config(tmp_path, int(state_bytes("adamw", model) * 0.1))) as rt:
        model, optimizer = rt.manage(model, OPTIMIZERS["adamw"](param_groups(model)))
        got = train(model, optimizer, range(3))
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
