"""A storage tier for scheduler tests whose requests finish only when the test says.

It stores real bytes (in RAM) so moves through it can be checked, and it logs every
request at issue time, so tests can force and observe interleavings without sleeps.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from tiermem.tiers.base import Allocation, Tier
from tiermem.tiers.device import DeviceTier

#: The scheduler tests' block size.
BLOCK = 64 << 10


def filled(device: DeviceTier, nbytes: int, seed: int = 0) -> Allocation:
    """A device allocation of ``nbytes`` random bytes (seeded), to move and compare."""
    allocation = device.allocate(nbytes)
    generator = torch.Generator().manual_seed(seed)
    allocation.view().copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
    return allocation


class GatedTier(Tier):
    is_memory = False

    def __init__(self, capacity: int = 1 << 30, queue_depth: int = 1, *, gated: bool = True) -> None:
        super().__init__("nvme", capacity, queue_depth=queue_depth)
        self.gated = gated
        self.log: list[tuple[str, int, int, int]] = []  # (op, allocation id, offset, length)
        self.pending: list[tuple[Future[None], object]] = []
        self.fail_next: BaseException | None = None
        self.cond = threading.Condition()
        self._data: dict[int, bytearray] = {}

    def _allocate(self, nbytes: int, reserved: int) -> Allocation:
        allocation = Allocation(self, nbytes, reserved)
        self._data[allocation.id] = bytearray(reserved)
        return allocation

    def _free(self, allocation: Allocation) -> None:
        del self._data[allocation.id]

    def _submit(self, op: str, allocation: Allocation, offset: int, buffer: torch.Tensor) -> Future[None]:
        future: Future[None] = Future()

        def run() -> None:
            if self.fail_next is not None:
                exc, self.fail_next = self.fail_next, None
                future.set_exception(exc)
                return
            data = self._data[allocation.id]
            view = buffer.numpy()
            if op == "write":
                data[offset : offset + len(view)] = view.tobytes()
            else:
                view[:] = memoryview(data)[offset : offset + len(view)]
            future.set_result(None)

        with self.cond:
            self.log.append((op, allocation.id, offset, buffer.numel()))
            if self.gated:
                self.pending.append((future, run))
                self.cond.notify_all()
            else:
                run()
        return future

    def _write(self, allocation: Allocation, offset: int, src: torch.Tensor) -> Future[None]:
        return self._submit("write", allocation, offset, src)

    def _read(self, allocation: Allocation, offset: int, dst: torch.Tensor) -> Future[None]:
        return self._submit("read", allocation, offset, dst)

    def wait_pending(self, count: int = 1, timeout: float = 10.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.pending) >= count, timeout):
                raise AssertionError(f"expected {count} pending requests, have {len(self.pending)}")

    def release(self, count: int = 1) -> None:
        """Complete the ``count`` oldest pending requests."""
        for _ in range(count):
            self.wait_pending(1)
            with self.cond:
                _future, run = self.pending.pop(0)
            run()  # type: ignore[operator]

    def release_all(self) -> None:
        with self.cond:
            pending, self.pending = self.pending, []
        for _future, run in pending:
            run()  # type: ignore[operator]


class VectoredGatedTier(GatedTier):
    """A gated tier that splits a call into blocks itself, as the NVMe tier does (scheduler rule 7)."""

    vectored = True
