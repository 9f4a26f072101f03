"""CUDA-only paths: the device tier's copy stream and the pinned host pool.

Skipped (not faked) where CUDA is absent; run them on a machine with a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tiermem.registry import Registry
from tiermem.schedulers import AsyncioScheduler, Priority
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
