"""Activation offload under frameworks that swap and free parameter storages (issue 18,
TRAPS 30): FSDP2's pattern in one process, storages freed under a write in flight (NOTE
[ Activation offload rules ] rules 3 and 9), and real FSDP2 on 2 gloo processes."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import socket
import threading
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

import tiermem
from tests.forked_children import start_ranks
from tiermem.activations import ActivationStorageError
from tiermem.activations.storages import StorageWatch
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend

WIDTH = 256  # a 256x256 weight is 256 KiB: above min_bytes, so only rule 3 keeps it on the device
BATCH = 128


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block(), Block())


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = batch(seed)
    return nn.functional.mse_loss(model(x), y)


class GatheredParameters:
    """FSDP2's pattern on one module, in one process: the optimizer holds ``sharded``; a
    forward pre-hook (prepended, as FSDP2's) swaps ``module._parameters[name]`` to a full
    parameter whose one storage is given bytes for the forward and freed with
    ``resize_(0)`` after it, given bytes again for backward by a hook on the output, and
    whose gradient goes to the sharded parameter (FSDP2's reduce-scatter)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.sharded = dict(module.named_parameters(recurse=False))
        self.full = {name: nn.Parameter(torch.empty_like(p)) for name, p in self.sharded.items()}
        for name, full in self.full.items():
            full.untyped_storage().resize_(0)
            full.register_post_accumulate_grad_hook(self._reduce(name))
        module.register_forward_pre_hook(self._pre_forward, prepend=True)
        module.register_forward_hook(self._post_forward)

    def _unshard(self) -> None:
        for name, full in self.full.items():
            storage = full.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(full.numel() * full.element_size())
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
                full.copy_(self.sharded[name])

    def _reshard(self) -> None:
        self.module._parameters.update(self.sharded)
        for full in self.full.values():
            full.untyped_storage().resize_(0)

    def _pre_forward(self, _module: nn.Module, _args: object) -> None:
        self._unshard()
        self.module._parameters.update(self.full)

    def _post_forward(self, _module: nn.Module, _args: object, output: torch.Tensor) -> None:
        self._reshard()
        if output.requires_grad:
            output.register_hook(lambda _grad: self._unshard())

    def _reduce(self, name: str):
        def hook(full: torch.Tensor) -> None:
            self.sharded[name].grad, full.grad = full.grad, None
            full.untyped_storage().resize_(0)

        return hook


def _config(path, **activations) -> dict:
    return {
        "device": {"capacity": "256MiB", "device": "cpu"},
        "host": {"capacity": "256MiB"},
        "nvme": {"paths": [str(path)], "capacity": "256MiB", "block_size": "256KiB"},
        "activations": {"min_bytes": 64 << 10, **activations},
        "scheduler": {"loop": "asyncio"},
    }


def _train(model: nn.Module, steps: int, context=contextlib.nullcontext) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        with context():
            loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_parameters_swapped_in_at_forward_are_never_offloaded(tmp_path):
    """Regression (issue 18): the full parameters a pre-hook swaps in after the context
    opened are parameters (rule 3), never written out while their owner frees them."""
    want = _train(mlp(), 2)
    model = mlp()
    gathered = [GatheredParameters(m) for m in model.modules() if isinstance(m, nn.Linear)]
    full_storages = [full.untyped_storage() for g in gathered for full in g.full.values()]
    registered: list[weakref.ref] = []
    with tiermem.Runtime(_config(tmp_path)) as rt:

        def context():
            offloader = rt.offload_activations(model, policy="nvme")
            register = offloader.hooks.fallbacks.register

            def spy(tensor, group):
                registered.append(weakref.ref(tensor.untyped_storage()))
                return register(tensor, group)

            offloader.hooks.fallbacks.register = spy
            return offloader

        got = _train(model, 2, context)
        assert rt.stats().as_dict()["activations"]["captured_bytes"] > 0
    assert registered and not any(ref() is s for ref in registered for s in full_storages)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert list(tmp_path.iterdir()) == []


class GatheredFresh(nn.Module):
    """Adds a bias gathered anew for each forward (a framework that allocates the full parameter
    per forward, instead of FSDP2's one storage resized) and dropped right after it: nothing
    saves it, so its storage, protected while the module ran (rule 3), is freed in the middle of
    the forward. Right then storage objects are made until Python gives one the freed one's id
    (it reuses the memory of freed objects at once); :class:`ReusesTheId` saves a tensor on it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.zeros(WIDTH))
        self.register_forward_pre_hook(self._gather, prepend=True)
        self.register_forward_hook(self._drop)
        self.reused: torch.UntypedStorage | None = None

    def _gather(self, _module: nn.Module, _args: object) -> None:
        self._buffers["bias"] = torch.full((WIDTH,), 0.5)

    def _drop(self, _module: nn.Module, _args: object, output: torch.Tensor) -> None:
        freed = id(self._buffers["bias"].untyped_storage())  # the object rule 3's set saw
        self._buffers["bias"] = torch.zeros(WIDTH)
        made = []
        for _ in range(10_000):
            storage = torch.UntypedStorage(output.numel() * output.element_size())
            if id(storage) == freed:
                self.reused = storage
                return
            made.append(storage)
        raise AssertionError("no storage object took the freed storage's id")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class ReusesTheId(nn.Module):
    """Multiplies by a tensor on ``source``'s reused storage, which autograd saves for backward."""

    def __init__(self, source: GatheredFresh) -> None:
        super().__init__()
        self.source = source
        self.storage: torch.UntypedStorage | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.storage, self.source.reused = self.source.reused, None
        assert self.storage is not None
        return x * torch.empty(0).set_(self.storage, 0, x.shape).fill_(2.0)


def test_an_activation_whose_storage_reuses_a_freed_parameters_id_is_offloaded(tmp_path):
    """Rule 3 matches storages by identity, never by ``id`` alone: a protected storage freed in
    the middle of a forward, and an activation's storage object that Python then gives the same
    id, is an activation (captured and written out), not taken for the parameter."""
    torch.manual_seed(0)
    gathered = GatheredFresh()
    reuses = ReusesTheId(gathered)
    model = nn.Sequential(gathered, reuses, nn.Linear(WIDTH, WIDTH))
    captured: list[bool] = []
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    (want,) = torch.autograd.grad(model(x).sum(), x)
    with tiermem.Runtime(_config(tmp_path)) as rt:
        offloader = rt.offload_activations(model, policy="nvme", blocks=["0", "1", "2"])
        register = offloader.hooks.fallbacks.register

        def spy(tensor, group):
            captured.append(tensor.untyped_storage() is reuses.storage)
            return register(tensor, group)

        offloader.hooks.fallbacks.register = spy
        with offloader:
            (got,) = torch.autograd.grad(model(x).sum(), x)
    assert any(captured), "the activation on the reused id was taken for the freed parameter"
    assert torch.equal(got, want)
    assert list(tmp_path.iterdir()) == []


class HeldWrites(FaultyBackend):
    """Posix writes held *before* they read their bytes, until the test says; the write then
    reads the storage as it is by then. A storage the test freed and gave other bytes, at an
    address the allocator chose anew, is read where it is now: the old address would be a
    use-after-free in this process (unmapped memory: SIGSEGV), so the bytes that such a read
    gets (what the memory holds now) are written instead; a storage still freed reads as zeros."""

    def __init__(self) -> None:
        super().__init__(PosixBackend())
        self.hold = False
        self.fail = False  # the held write then fails (EIO): it never lands
        #: The saved tensor's storage, once the test freed it under the held write.
        self.freed: torch.UntypedStorage | None = None
        self.entered = threading.Event()
        self.go = threading.Event()

    def pwrite(self, handle, buffer, offset) -> int:
        if self.hold:
            self.entered.set()
            self.go.wait(30)
            if self.fail:
                raise OSError(errno.EIO, "Input/output error (injected)")
            storage = self.freed
            if storage is not None:
                size = len(memoryview(buffer).cast("B"))
                aligned = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
                if storage.nbytes() >= size:
                    aligned.write(ctypes.string_at(storage.data_ptr(), size))
                buffer = memoryview(aligned)
        return super().pwrite(handle, buffer, offset)


class Saves(nn.Module):
    """``sin`` saves ``hidden`` (128 KiB, offloaded); kept here so a test can free its storage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 512)
        self.hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = self.lin(x)
        return torch.sin(self.hidden)


class OneBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Saves()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


@pytest.mark.parametrize("rule_9", [True, False], ids=["rule-9", "without-rule-9"])
@pytest.mark.parametrize("seen", ["at-block-end", "when-the-write-lands", "never-freed"])
def test_a_storage_freed_under_its_write_is_never_returned(tmp_path, monkeypatch, seen, rule_9):
    """Rule 9: the saved tensor's storage is freed (resize_(0)) while its write to NVMe is
    held before it reads its bytes, and given other bytes (zeros) before the write reads them
    (at-block-end: seen by the block end's check) or only after it landed from freed memory
    (when-the-write-lands: seen then). The copy on NVMe is then wrong: without rule 9
    (monkeypatched off) backward's gradient differs from plain PyTorch's; with it backward
    raises ActivationStorageError instead of using the copy."""
    backend = HeldWrites()
    monkeypatch.setattr("tiermem.tiers.nvme.select_backend", lambda name, probe_dir: (backend, "injected by test"))
    if not rule_9:
        monkeypatch.setattr(StorageWatch, "broken", lambda self, obj: None)
    torch.manual_seed(0)
    model = OneBlock()
    block = model.blocks[0]
    x = torch.randn(64, 64)
    want = torch.autograd.grad(block(x).sum(), block.lin.weight)[0]
    nbytes = 64 * 512 * 4

    def free_under_the_write(_module, _args, _output) -> None:  # runs before the offloader's block end
        assert backend.entered.wait(10)
        if seen == "at-block-end":
            block.hidden.untyped_storage().resize_(0)

    def given_zeros(storage: torch.UntypedStorage) -> None:
        storage.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(storage).zero_()  # other bytes than were saved

    block.register_forward_hook(free_under_the_write)
    with tiermem.Runtime(_config(tmp_path)) as rt:
        offloader = rt.offload_activations(model, policy={0: "nvme"})
        backend.hold = True
        with offloader:
            out = model(x).sum()
            storage = block.hidden.untyped_storage()
            if seen == "at-block-end":
                given_zeros(storage)  # before the write reads them
            elif seen == "when-the-write-lands":
                storage.resize_(0)
            if seen != "never-freed":
                backend.freed = storage
            backend.go.set()
            offloader.history.ledger.wait_idle()
            deadline = time.monotonic() + 10
            while offloader.hooks.watch._watched and time.monotonic() < deadline:
                time.sleep(0.001)  # the watch's own callback runs after the ledger's
            if seen == "when-the-write-lands":
                given_zeros(storage)
            if seen == "never-freed":
                assert torch.equal(torch.autograd.grad(out, block.lin.weight)[0], want)
            elif rule_9:
                with pytest.raises(ActivationStorageError, match="freed or resized its storage"):
                    torch.autograd.grad(out, block.lin.weight)
            else:  # the copy holds the freed memory's bytes: a silently wrong gradient
                assert not torch.equal(torch.autograd.grad(out, block.lin.weight)[0], want)
            del out
        assert rt.stats().as_dict()["activations"]["bytes_written"]["nvme"] >= nbytes
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("write", ["landed", "failed", "cancelled"])
def test_only_a_write_that_landed_is_judged(tmp_path, monkeypatch, caplog, write):
    """Rule 9 judged at unpack, before the watch's own callback on the scheduler's thread (here
    it never judges): the storage is freed under the write (seen at block end) and given other
    bytes (zeros) before backward. A write that landed raises; one that failed, or was cancelled
    by a backward forwarding the tensor while it was in flight, left the object at home, in its
    own storage, so backward reads it as plain PyTorch does, again after the write ended
    (retain_graph; found in review)."""
    backend = HeldWrites()
    backend.fail = write == "failed"
    monkeypatch.setattr("tiermem.tiers.nvme.select_backend", lambda name, probe_dir: (backend, "injected by test"))
    judge = StorageWatch._judge
    monkeypatch.setattr(StorageWatch, "_judge", lambda self, key, obj=None: obj and judge(self, key, obj))
    torch.manual_seed(0)
    model = OneBlock()
    block = model.blocks[0]
    x = torch.randn(64, 64)
    nbytes = 64 * 512 * 4

    def free(_module, _args, _output) -> None:  # runs before the offloader's block end
        assert not backend.hold or backend.entered.wait(10)
        block.hidden.untyped_storage().resize_(0)

    def given_zeros() -> None:
        storage = block.hidden.untyped_storage()
        storage.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(storage).zero_()  # other bytes than were saved

    hook = block.register_forward_hook(free)
    out = model(x).sum()
    given_zeros()
    want = torch.autograd.grad(out, block.lin.weight)[0]  # plain PyTorch reads the zeros
    hook.remove()
    block.register_forward_hook(free)
    with tiermem.Runtime(_config(tmp_path)) as rt:
        offloader = rt.offload_activations(model, policy={0: "nvme"})
        backend.hold = True
        with offloader:
            out = model(x).sum()
            backend.freed = block.hidden.untyped_storage()  # the held write reads it as it is then
            if write == "cancelled":
                given_zeros()
                assert torch.equal(torch.autograd.grad(out, block.lin.weight, retain_graph=True)[0], want)
            backend.go.set()
            offloader.history.ledger.wait_idle()
            if write != "cancelled":
                given_zeros()
            assert offloader.hooks.watch._watched  # judged at unpack, not by the callback
            if write == "landed":
                with pytest.raises(ActivationStorageError, match="freed or resized its storage"):
                    torch.autograd.grad(out, block.lin.weight)
            else:
                assert torch.equal(torch.autograd.grad(out, block.lin.weight)[0], want)
            del out
        assert not offloader.hooks.watch._watched
    assert (write == "failed") == ("io_error->keep" in caplog.text)
    assert list(tmp_path.iterdir()) == []


# -- real FSDP2 on 2 gloo processes (issue 18) ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, world: int, port: int, root: str) -> None:
    """One rank: the MLP sharded per block and at the root, 2 AdamW steps under offload."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore", FutureWarning)  # FSDP2/gloo deprecations (issue 18's trap)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = mlp()
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        path = os.path.join(root, f"rank{rank}")
        os.makedirs(path)
        config = {"nvme": {"paths": [path]}, "activations": {"min_bytes": 100000}}
        with tiermem.Runtime(config) as rt:
            for step in range(2):
                with rt.offload_activations(model, policy="nvme"):
                    loss_of(model, 2 * step + rank).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            activations = rt.stats().as_dict()["activations"]
        assert activations["bytes_written"]["nvme"] > 0 or activations["cancelled"] > 0, activations
        assert activations["fallbacks"] == 0, activations  # no gathered weight was written, then freed
        assert os.listdir(path) == [], os.listdir(path)
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        if rank == 0:
            torch.save(full, os.path.join(root, "params.pt"))
        # Both ranks leave together: gloo aborts a process ("terminate called without an active
        # exception") whose peer tears its connections down while it still holds them.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_with_activations_on_nvme_matches_one_process(tmp_path):
    """Issue 18: FSDP2 (reshard after forward) + offload to NVMe on 2 gloo ranks ends with
    parameters bitwise those of plain PyTorch trained on the mean loss of both ranks' batches."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("torch.distributed.fsdp")
    # New processes, forked from a server that imported torch, FSDP2 and tiermem once (suite time)
    start_ranks(_fsdp_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ((loss_of(model, 2 * step) + loss_of(model, 2 * step + 1)) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    got = torch.load(tmp_path / "params.pt")
    for a, b in zip(got, model.parameters(), strict=True):
        assert torch.equal(a, b.detach())
