"""The device tier: the compute device, within a byte budget.

With CUDA: device memory on ``cuda:N`` and a dedicated copy stream. Without CUDA: the
CPU, with the capacity enforced as a budget of real RAM (every byte allocated here is
a real byte of the process), and copies still asynchronous on a worker.
"""

from __future__ import annotations

import os

import torch

from tiermem.tiers.memory import CudaStreamCopier, MemoryTier, WorkerCopier


def resolve_device(spec: str = "auto") -> torch.device:
    """``"auto"`` -> ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


class DeviceTier(MemoryTier):
    """Memory on the compute device (or the CPU standing in for it)."""

    def __init__(self, capacity: int, device: str | torch.device = "auto") -> None:
        resolved = resolve_device(device) if isinstance(device, str) else device
        if resolved.type == "cuda":
            copier: CudaStreamCopier | WorkerCopier = CudaStreamCopier(resolved)
        else:
            copier = WorkerCopier(name="tiermem-device-copy")
        super().__init__("device", capacity, resolved, copier)
