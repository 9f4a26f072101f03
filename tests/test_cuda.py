"""CUDA-only paths: the device tier's copy stream and the pinned host pool.

Skipped (not faked) where CUDA is absent; run them on a machine with a GPU.
"""

from __future__ import annotations

import pytest
import torch

import tiermem
from tests import test_states
from tiermem.registry import Registry
from tiermem.schedulers import AsyncioScheduler, Priority
from tiermem.states.hostgrad import HostGradient
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.nvme import NvmeTier

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_device_tier_allocates_on_the_gpu_and_copies_on_its_stream():
    tier = DeviceTier(64 << 20, "cuda")
    try:
        allocation = tier.allocate(10_000)
        assert allocation.tensor.is_cuda and allocation.tensor.data_ptr() % 4096 == 0
        src = torch.randint(0, 256, (10_000,), dtype=torch.uint8, device="cuda")
        tier.write(allocation, 0, src).result(timeout=30)
        back = torch.empty(10_000, dtype=torch.uint8, device="cuda")
        tier.read(allocation, 0, back).result(timeout=30)
        assert torch.equal(back, src)
        tier.free(allocation)
    finally:
        tier.close()


def test_pinned_pool_is_sized_once_and_exactly():
    capacity = 10 << 20  # not a power of two: the pool must not round up
    host = HostTier(capacity, pinned=True)
    try:
        a = host.allocate(3 << 20)
        assert a.tensor.is_pinned()
        assert host._pool is not None and host._pool.numel() == capacity
        host.free(a)
    finally:
        host.close()


def test_gpu_to_nvme_and_back_through_the_scheduler(tmp_path):
    device = DeviceTier(64 << 20, "cuda")
    host = HostTier(64 << 20, pinned=True)
    nvme = NvmeTier([tmp_path], 256 << 20, backend="posix", block_size=1 << 20)
    scheduler = AsyncioScheduler(loop="asyncio")
    registry = Registry({"device": device, "host": host, "nvme": nvme}, scheduler)
    try:
        t = torch.randn(3, 1 << 18, device="cuda")
        handle = registry.register(t.clone(), "device")
        for tier in ("host", "nvme", "device"):
            handle.move_to(tier, Priority.WRITEBACK)
            handle.wait()
        assert handle.tier == "device"
        assert torch.equal(handle.tensor(), t)
        handle.free()
    finally:
        registry.free_all()
        scheduler.close()
        for tier_ in (device, host, nvme):
            tier_.close()


def test_a_copy_is_ordered_after_the_submitting_threads_stream():
    """TRAPS 28: the scheduler fences on the submitting thread, so a device->host move issued
    under a side stream reads what that stream's kernels wrote, not what was there before."""
    device = DeviceTier(64 << 20, "cuda")
    host = HostTier(64 << 20, pinned=True)
    scheduler = AsyncioScheduler(loop="asyncio")
    registry = Registry({"device": device, "host": host}, scheduler)
    try:
        buffer = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        handle = registry.register(buffer, "device")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # the zeros above are written first
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the write lands long after the move is submitted
            buffer.fill_(7)
            handle.move_to("host", Priority.WRITEBACK)
        handle.wait()
        assert handle.tier == "host"
        assert bool((handle.tensor("host") == 7).all())
        handle.free()
    finally:
        registry.free_all()
        scheduler.close()
        device.close()
        host.close()


def test_pageable_bytes_registered_on_a_pinned_host_tier_land_in_its_pool():
    host = HostTier(16 << 20, pinned=True)
    registry = Registry({"host": host}, AsyncioScheduler(loop="asyncio"))
    try:
        pageable = torch.arange(4096, dtype=torch.int32)
        handle = registry.register(pageable, "host", dedup=False)
        kept = handle.tensor("host")
        assert kept.is_pinned() and torch.equal(kept, pageable)
        handle.free()
    finally:
        registry.free_all()
        registry.scheduler.close()
        host.close()


# -- model states with offloaded chunks (NOTE [ Model-state rules ] rule 8) -----------------


class CudaGPT(test_states.GPT):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def cuda_model() -> CudaGPT:
    torch.manual_seed(0)
    model = CudaGPT()
    model.blocks[0].ln1.weight.requires_grad_(False)
    return model.cuda()


def cuda_config(tmp_path, device: int) -> dict:
    return {
        "device": {"capacity": device, "device": "cuda"},
        "host": {"capacity": "64MiB", "pinned": True},
        "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
    }


def cuda_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, *, check=None) -> list:
    """Losses and the norms ``clip_grad_norm_`` gives by hand (TRAPS 4), two micro-batches a step."""
    out = []
    for step in range(steps):
        for micro in range(2):
            tokens, targets = (t.cuda() for t in test_states.batch(step, micro))
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            out.append(loss.detach())
        if check is not None:
            check(model)
        out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        optimizer.step()
        optimizer.zero_grad()
    return out


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_offloaded_states_on_cuda_train_like_plain_pytorch(tmp_path, home):
    """Streamed chunks, CPU steps of offloaded chunks, HostGradients for clipping by hand. The
    CPU's Adam and the GPU's round differently, so this compares within float tolerance."""
    plain = cuda_model()
    want = cuda_loop(plain, test_states.OPTIMIZERS["adamw"](test_states.param_groups(plain)), 3)
    model = cuda_model()
    capacity = int(test_states.state_bytes("adamw", model) * 0.1)
    seen: list[type] = []

    def check(m: torch.nn.Module) -> None:
        seen.extend(type(p.grad) for p in m.parameters() if p.grad is not None)
        assert all(p.grad.device == p.device for p in m.parameters() if p.grad is not None)

    with tiermem.Runtime(cuda_config(tmp_path, capacity)) as rt:
        model, optimizer = rt.manage(
            model, test_states.OPTIMIZERS["adamw"](test_states.param_groups(model)), plan={"state_home": home}
        )
        got = cuda_loop(model, optimizer, 3, check=check)
        plan = rt.plan
        stats = rt.stats().as_dict()
    assert plan.persistent_chunks < plan.chunks and home in plan.state_home
    assert HostGradient in seen  # offloaded gradients wait on the host (NOTE [ Host gradients ])
    assert stats["tiers"]["device"]["peak_bytes"] <= capacity
    assert stats["links"][f"{'host' if home == 'host' else 'nvme'}->device"]["bytes"] > 0
    torch.testing.assert_close(torch.stack(got).cpu(), torch.stack(want).cpu(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)
    assert list(tmp_path.iterdir()) == []


def test_offloaded_states_on_cuda_with_fp16_grad_scaler_and_declared_clipping(tmp_path):
    """GradScaler unscales HostGradients one at a time; declared clipping reads host gradients
    in place. Compared with plain PyTorch within float tolerance."""

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_by_hand: bool) -> list:
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**18)
        out = []
        for step in range(4):
            tokens, targets = (t.cuda() for t in test_states.batch(step))
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            if clip_by_hand:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            out.append(loss.detach())
        return out

    plain = cuda_model()
    want = run(plain, test_states.OPTIMIZERS["adam"](test_states.param_groups(plain)), True)
    model = cuda_model()
    with tiermem.Runtime(cuda_config(tmp_path, int(test_states.state_bytes("adam", model) * 0.1))) as rt:
        model, optimizer = rt.manage(
            model, test_states.OPTIMIZERS["adam"](test_states.param_groups(model)), clip_grad_norm=1.0
        )
        got = run(model, optimizer, False)
        assert rt.plan.persistent_chunks < rt.plan.chunks
    torch.testing.assert_close(torch.stack(got).cpu(), torch.stack(want).cpu(), rtol=1e-3, atol=1e-4)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-4)
