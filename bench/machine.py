"""The machine facts a benchmark prints at the top of its run (bench/README.md: each section names
the machine its numbers come from). Imported by the benchmark scripts beside it."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def facts() -> dict[str, Any]:
    """CPU model, usable cores, RAM, torch, kernel and the load average now."""
    import psutil
    import torch

    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if "model name" in line), platform.processor())
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel": platform.release(),
        "load": os.getloadavg(),
    }
