"""The profile cache: ``$XDG_CACHE_HOME/tiermem/profiles`` (else ``~/.cache/tiermem/profiles``).

# NOTE [ Profile cache ]
1. Key: a hash of the model's signature (parameter names, shapes, dtypes, whether they train;
   module types in order), the sample's shapes and dtypes (a callable sample is not cached:
   its batch cannot be seen), the device, the resolved tier configuration without the
   capacities (capacities change the plan, which is searched afresh every run in well under
   a second, not what the profile measured), the optimizer and its hyper-parameters, torch's
   version and thread count, and :data:`PROFILE_VERSION`.
2. Revalidation is cheap: a cached profile is used when one device->host move through the
   tiers, of the size the profile probed with, runs within a factor ``REVALIDATE_FACTOR`` of
   the cached bandwidth (best of three, as the probe). The factor is wide because a shared
   machine swings copy bandwidth a lot between moments (0.9 to 6 GB/s for 16 MiB here);
   outside it the machine changed, and the model is profiled again.
3. Writes are atomic (a temporary file renamed), so two processes never read half a profile.
   Profiles live in the user's cache, never in an NVMe run directory (DESIGN).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tiermem.planner.profile import PROFILE_VERSION, Profile
from tiermem.planner.profiler import Batch
from tiermem.registry import Registry
from tiermem.schedulers.base import Priority

REVALIDATE_FACTOR = 4.0
"""Rule 2."""


def cache_dir() -> Path:
    """Rule 3: where profiles are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiermem" / "profiles"


def model_signature(model: nn.Module) -> list[Any]:
    params = [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()]
    modules = [type(m).__qualname__ for m in model.modules()]
    return [params, modules]


def sample_signature(sample: Any) -> list[Any] | None:
    """Shapes and dtypes of the sample's tensors; None for a callable (rule 1)."""
    if callable(sample):
        return None
    if isinstance(sample, Batch):  # keyword names count too: another call is another profile
        sample = (sample.args, sorted(sample.kwargs.items()))
    return [
        [list(t.shape), str(t.dtype), str(t.device)] if isinstance(t, torch.Tensor) else repr(t)
        for t in tree_leaves(sample)
    ]


def profile_key(
    model: nn.Module,
    sample: Any,
    device: str,
    tier_config: Mapping[str, Any],
    optimizer: Mapping[str, Any],
) -> str | None:
    """Rule 1; None when the sample cannot be keyed."""
    shape = sample_signature(sample)
    if shape is None:
        return None
    facts = {
        "version": PROFILE_VERSION,
        "model": model_signature(model),
        "sample": shape,
        "device": device,
        "tiers": tier_config,
        "optimizer": optimizer,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    text = json.dumps(facts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load(key: str) -> Profile | None:
    """The cached profile for ``key``, or None (missing, unreadable or from another version)."""
    path = cache_dir() / f"{key}.json"
    try:
        profile = Profile.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return profile if profile.key == key else None


def store(profile: Profile) -> Path | None:
    """Rule 3; None when the cache directory cannot be written (caching is best effort)."""
    directory = cache_dir()
    path = directory / f"{profile.key}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".profile-", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(profile.to_json())
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def clear() -> int:
    """Remove every cached profile; returns how many were removed."""
    removed = 0
    directory = cache_dir()
    if not directory.is_dir():
        return 0
    for path in directory.glob("*.json"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    return removed


def still_valid(profile: Profile, registry: Registry) -> bool:
    """Rule 2: a device->host move agrees with the cached bandwidth."""
    cached = profile.links.get("device->host")
    nbytes = int(profile.extra.get("probe_bytes", 0))
    if not cached or nbytes <= 0:
        return False
    device = registry.tiers["device"].device  # type: ignore[attr-defined]
    best = 0.0
    for _ in range(3):
        tensor = torch.ones(nbytes, dtype=torch.uint8, device=device)
        try:
            handle = registry.register(tensor, "device", dedup=False, kind="probe")
        except MemoryError:
            return True  # no room to check now: trust the key
        try:
            start = time.perf_counter()
            handle.move_to("host", Priority.DEMAND)
            handle.wait()
            best = max(best, nbytes / max(time.perf_counter() - start, 1e-9))
        except MemoryError:
            return True
        finally:
            handle.free()
    return cached / REVALIDATE_FACTOR <= best <= cached * REVALIDATE_FACTOR
