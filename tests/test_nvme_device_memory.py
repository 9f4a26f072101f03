"""NOTE [ NVMe tier layout and I/O ] rule 7, the dispatch half: which segments of a CUDA request the
NVMe tier hands to a backend as device memory, and which it stages through page-locked buffers.

Without CUDA a backend that declares ``takes_device_memory`` is a recording POSIX backend, and the
request is marked as a CUDA one over host memory: what is checked is the tier's choice and that the
backend gets the caller's tensor itself, never a bounce buffer. The CUDA half (kvikio on real device
memory, pinned bounces, fences) is in tests/test_cuda.py.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.nvme import NvmeTier
from tiermem.tiers.nvme_engine import _Request as Request
from tiermem.tiers.staging import memview


class DeviceMemoryBackend(PosixBackend):
    """POSIX I/O that, like kvikio, takes tensors as buffers and handles alignment itself."""

    name = "device-memory"
    handles_alignment = True
    takes_device_memory = True

    def __init__(self) -> None:
        self.buffers: list[Any] = []

    def _host(self, buffer: Any) -> Any:
        self.buffers.append(buffer)
        return memview(buffer.data_ptr(), buffer.numel()) if isinstance(buffer, torch.Tensor) else buffer

    def pread(self, handle: int, buffer: Any, offset: int) -> int:
        return super().pread(handle, self._host(buffer), offset)

    def pwrite(self, handle: int, buffer: Any, offset: int) -> int:
        return super().pwrite(handle, self._host(buffer), offset)


def run_as_cuda_request(tier: NvmeTier, op: str, allocation: Any, tensor: torch.Tensor) -> None:
    """Carry out ``op`` on ``allocation`` as the tier carries out a CUDA tensor's request."""
    requests = tier._requests
    segments = requests._segments(allocation.location, tensor.numel())
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()
    request = Request(
        op, allocation.id, allocation.location + allocation.nbytes, tensor, 0, True, future, len(segments)
    )
    for segment in segments:
        requests._run_segment(request, segment)
    future.result(timeout=10)


def test_a_backend_that_takes_device_memory_gets_the_callers_tensor(tmp_path: Path) -> None:
    backend = DeviceMemoryBackend()
    tier = NvmeTier([str(tmp_path)], 1 << 20, backend=backend, block_size=64 << 10, direct=False)
    try:
        nbytes = 200_000  # four stripe units, the last one partial and unaligned
        allocation = tier.allocate(nbytes)
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        run_as_cuda_request(tier, "write", allocation, source)
        written = [b for b in backend.buffers if isinstance(b, torch.Tensor)]
        assert len(written) == len(backend.buffers) == 4  # every segment as the tensor, no bounce buffer
        assert [b.data_ptr() - source.data_ptr() for b in written] == [0, 65536, 131072, 196608]
        back = torch.empty(nbytes, dtype=torch.uint8)
        backend.buffers.clear()
        run_as_cuda_request(tier, "read", allocation, back)
        assert all(isinstance(b, torch.Tensor) for b in backend.buffers) and torch.equal(back, source)
        assert tier.segment_counts() == {"zero_copy": 8, "staged": 0, "read_modify_write": 0}
        plain = torch.empty(nbytes, dtype=torch.uint8)
        tier.read(allocation, 0, plain).result(timeout=10)  # host requests read what was written
        assert torch.equal(plain, source)
        tier.free(allocation)
    finally:
        tier.close()


def test_cuda_requests_stage_through_pinned_buffers_where_the_backend_cannot_take_them(tmp_path: Path) -> None:
    """A backend for host memory only, or checksums (hashed on the host), keep the bounce path,
    with the page-locked pool; host requests keep the pageable one."""
    for backend, checksum in ((PosixBackend(), False), (DeviceMemoryBackend(), True)):
        tier = NvmeTier([str(tmp_path)], 1 << 20, backend=backend, checksum=checksum, direct=False)
        try:
            requests = tier._requests
            segment = requests._segments(0, 4096)[0]
            cuda = Request("write", 0, 4096, None, 0, True, None, 1)
            host = Request("write", 0, 4096, None, 0, False, None, 1)
            assert not requests._takes_device(cuda, segment)
            assert requests._bounce_pool(cuda) is tier._pinned_bounces
            assert requests._bounce_pool(host) is tier._bounces
        finally:
            tier.close()
