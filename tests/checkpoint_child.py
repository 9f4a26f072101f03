"""Child processes of tests/test_checkpoint_crash.py: a training process that saves again and
again until it is killed (forked by tests/forked_children.py), and one that measures the RSS a
save and a load add.

    python -m tests.checkpoint_child kill DIR CHECKPOINT [FORMAT]
    python -m tests.checkpoint_child rss DIR CHECKPOINT [FORMAT]

FORMAT is rt.save's ``format=`` (``dcp`` or ``zarr``; the default format when left out).
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import torch
from torch import nn

import tiermem


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def config(directory: str, device: str, host: str) -> dict[str, Any]:
    return {
        "device": {"capacity": device, "device": "cpu"},
        "host": {"capacity": host},
        "nvme": {"paths": [directory], "capacity": "1GiB", "block_size": "1MiB"},
        "scheduler": {"loop": "asyncio"},
    }


#: the kill test's model: 8 x 512 x 512 (2.1M parameters, 25 MiB of fp32 AdamW states)
KILL = {"width": 512, "layers": 8}
KILL_CONFIG = {"device": "8MiB", "host": "16MiB"}
KILL_PLAN = {"state_home": "nvme", "chunk_size": "1MiB"}
#: the RSS test's: 16 x 1024 x 1024 (16.8M parameters, the issue's measure), states on NVMe,
#: 3 x 64 MiB of params and AdamW states against a 32 MiB host
RSS = {"width": 1024, "layers": 16}
RSS_CONFIG = {"device": "24MiB", "host": "32MiB"}
RSS_PLAN = {"state_home": "nvme", "chunk_size": "4MiB"}


def step(model: nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def kill(directory: str, path: str, fmt: str | None = None) -> None:
    """Save, say so, then save again forever: the parent kills it at a random moment."""
    with tiermem.Runtime(config(directory, **KILL_CONFIG)) as rt:
        model, optimizer = rt.manage(make_model(**KILL), torch.optim.AdamW, lr=1e-3, plan=KILL_PLAN)
        step(model, optimizer, KILL["width"])
        n = 0
        rt.save(path, extra={"n": n}, format=fmt)
        print("ready", flush=True)
        while True:
            n += 1
            step(model, optimizer, KILL["width"])
            rt.save(path, extra={"n": n}, format=fmt)
            print(f"saved {n}", flush=True)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _added_peak(run: Any) -> int:
    """Peak RSS during ``run()`` above the RSS before it: the kernel's high-water mark, reset
    first (``clear_refs`` 5), so no sample can miss the peak."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


def rss(directory: str, path: str, fmt: str | None = None) -> None:
    with tiermem.Runtime(config(directory, **RSS_CONFIG)) as rt:
        # a declared loop that frees gradients as chunks step: the host holds only staged homes
        model, optimizer = rt.manage(
            make_model(**RSS),
            torch.optim.AdamW,
            lr=1e-3,
            plan=RSS_PLAN,
            grad_accumulation_steps=1,
            keep_gradients=False,
        )
        step(model, optimizer, RSS["width"])
        if fmt == "zarr":
            # the library's code (17 MiB of RSS, once per process) is not the save's data
            import tensorstore  # noqa: F401
        chunks = [c for states in rt._model_states for c in states.chunks]
        homes = {c.home_tier for c in chunks if not c.persistent}
        result = {
            "homes": sorted(homes),
            "home_bytes": max(c.home_bytes for c in chunks),
            "state_bytes": sum(c.home_bytes for c in chunks),
            "host_capacity": rt.stats().as_dict()["tiers"]["host"]["capacity"],
            "save_added": _added_peak(lambda: rt.save(path, format=fmt)),
        }
        result["load_added"] = _added_peak(lambda: rt.load(path))
        print(json.dumps(result), flush=True)


#: the children by name, for ``python -m tests.checkpoint_child`` and tests/forked_children.py
CHILDREN = {"kill": kill, "rss": rss}

if __name__ == "__main__":
    torch.set_num_threads(1)
    CHILDREN[sys.argv[1]](sys.argv[2], sys.argv[3], *sys.argv[4:])
