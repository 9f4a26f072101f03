"""Property test: random sequences of store / fetch / free / cancel against a plain dict.

Whatever the interleaving of moves, a read returns exactly the bytes registered, every
handle reports a real tier, and after everything is freed every tier accounts zero.
"""

from __future__ import annotations

import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from tiermem.registry import Handle, ObjectState, Registry
from tiermem.schedulers import AsyncioScheduler, Priority
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.nvme import NvmeTier

TIERS = ["device", "host", "nvme"]


class StoreMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.tiers = {
            "device": DeviceTier(64 << 20, "cpu"),
            "host": HostTier(64 << 20),
            "nvme": NvmeTier([self.directory.name], 256 << 20, block_size=16 << 10, queue_depth=3, backend="posix"),
        }
        self.scheduler = AsyncioScheduler(block_size=16 << 10, max_inflight=48 << 10, loop="asyncio")
        self.registry = Registry(self.tiers, self.scheduler)
        self.model: dict[int, torch.Tensor] = {}
        self.seed = 0

    @rule(target=handles, nbytes=st.integers(1, 100_000), dtype=st.sampled_from([torch.uint8, torch.float32]))
    def register(self, nbytes: int, dtype: torch.dtype) -> Handle:
        self.seed += 1
        count = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        generator = torch.Generator().manual_seed(self.seed)
        tensor = torch.randint(0, 255, (count,), generator=generator).to(dtype)
        handle = self.registry.register(tensor.clone(), dedup=False)
        self.model[id(handle)] = tensor
        return handle

    @rule(handle=handles, tier=st.sampled_from(TIERS), priority=st.sampled_from(list(Priority)), wait=st.booleans())
    def move(self, handle: Handle, tier: str, priority: Priority, wait: bool) -> None:
        if handle._freed:
            return
        handle.move_to(tier, priority)
        if wait:
            handle.wait()
            assert handle.tier == tier

    @rule(handle=handles)
    def read(self, handle: Handle) -> None:
        if handle._freed:
            return
        assert torch.equal(handle.tensor(), self.model[id(handle)])

    @rule(handle=handles)
    def cancel_by_asking_back(self, handle: Handle) -> None:
        if handle._freed or handle.state is not ObjectState.MOVING:
            return
        home = handle.tier
        handle.move_to(home)
        handle.wait()
        assert handle.tier in TIERS

    @rule(handle=consumes(handles))
    def free(self, handle: Handle) -> None:
        handle.free()
        self.model.pop(id(handle), None)

    @invariant()
    def accounting_never_negative(self) -> None:
        for tier in self.tiers.values():
            assert tier.statistics().current_bytes >= 0

    def teardown(self) -> None:
        try:
            self.registry.free_all()
            for tier in self.tiers.values():
                assert tier.statistics().current_bytes == 0, tier.statistics()
        finally:
            self.scheduler.close()
            for tier in self.tiers.values():
                tier.close()
            self.directory.cleanup()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
