"""One read or write of the NVMe tier in flight: what its segments share (NOTE [ NVMe tier layout
and I/O ] rules 2, 5 and 7), counted down by :mod:`tiermem.tiers.nvme_requests`."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["Request"]


class Request:
    """One read or write in flight. Holds the caller's tensor only until it completes (TRAPS 14).

    A plain class with slots, not a dataclass: one is made per request, and small requests
    are counted in tens of thousands a second (TRAPS 15)."""

    __slots__ = (
        "address", "allocation_id", "cuda", "data_end", "error", "fence", "future", "lock", "op", "queued",
        "remaining", "tensor",
    )  # fmt: skip

    def __init__(
        self,
        op: str,
        allocation_id: int,
        data_end: int,
        tensor: torch.Tensor | None,
        address: int,
        cuda: bool,
        future: Future[None] | None,
        remaining: int,
    ) -> None:
        self.op = op
        self.allocation_id = allocation_id
        self.data_end = data_end  # logical end of the allocation's meaningful bytes (location + nbytes)
        self.tensor = tensor
        self.address = address  # host address of the buffer, 0 for CUDA tensors
        self.cuda = cuda
        self.future = future
        self.remaining = remaining
        self.error: BaseException | None = None
        self.queued = 0  # segments the submission queue completed (counted as zero-copy at the end)
        self.lock = threading.Lock()
        self.fence: Any = None  # rule 7: the CUDA event a worker waits for before touching the tensor

    def wait_fence(self) -> None:
        """Rule 7: block until the device work queued before this request's fence has run."""
        if self.fence is not None:
            self.fence.synchronize()
