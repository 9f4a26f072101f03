"""The profile cache: ``$XDG_CACHE_HOME/tiermem/profiles`` (else ``~/.cache/tiermem/profiles``).

# NOTE [ Profile cache ]
1. Key: a hash of the model's signature (parameter names, shapes, dtypes, whether they train;
   module types in order), the sample's shapes and dtypes (a callable sample is not cached:
   its batch cannot be seen) and the autocast regions it was profiled in, the device, the
   resolved tier configuration without the capacities (capacities change the plan, which is
   searched afresh every run in well under a second, not what the profile measured), the
   optimizer and its hyper-parameters, torch's version and thread count, and
   :data:`PROFILE_VERSION`.
2. Revalidation is cheap (:func:`revalidate`, tens of milliseconds): a cached profile is used
   when its links still hold, each probe within a factor ``REVALIDATE_FACTOR`` of what the
   cached bandwidth predicts for it:
   a. device->host moves through the tiers, as the profiler's probe, of the size the profile
      probed with, or of less where the device or host has less room now (a quarter of the
      free bytes, down to ``MIN_PROBE_BYTES``; below that a fresh profile could not measure
      the link either, so it is not checked);
   b. where the profile has NVMe bandwidths and the NVMe tier exists, a write of at most
      ``NVME_REVALIDATE_BYTES`` straight through the NVMe tier and its read back, against
      ``host->nvme`` and ``nvme->host``;
   c. a probe smaller than the profile's pays the per-move latency on fewer bytes (64 KiB
      moved 30x slower than 32 MiB here): the prediction adds that latency, measured now
      with one-page moves, for the bytes the probe lacks. At the profile's size it is the
      cached bandwidth itself.
   Each probe runs up to three times (the best counts, as in the profiler) and stops at the
   first that agrees. The factor is wide because a shared machine swings copy bandwidth a
   lot between moments (0.9 to 6 GB/s for 16 MiB here); outside it the machine changed, and
   the model is profiled again. So is a profile without the per-path NVMe bandwidths that a
   profiling now would measure (one cached by an older tiermem; ``probe_links`` in
   :mod:`~tiermem.planner.probes`), and one without a device->host bandwidth. Every probe
   frees what it moved: nothing is left in a tier or in an NVMe path.
3. Writes are atomic (a temporary file renamed), so two processes never read half a profile.
   Profiles live in the user's cache, never in an NVMe run directory (a run directory is
   private to one run and removed with it: NOTE [ Run directory rules ]).
4. The cache's ``tiermem`` and ``tiermem/profiles`` are tiermem's own directories (NOTE
   [ Private directories ]): made with mode 0700, and read or written only while they are real
   directories of this user, not writable by group or others; otherwise :func:`load` and
   :func:`store` raise :class:`~tiermem.errors.UnsafeDirectoryError` (never a silent miss: a
   profile planted there would steer the plan).
5. Caching is best effort: a write that fails (a full disk, a quota) leaves no temporary
   file and warns (:class:`~tiermem.errors.TiermemWarning`) naming the error, the path and, for
   a full disk, ENOSPC and the bytes needed and free; the run goes on with the profile it
   measured, and the next one profiles again.
6. The last sample per model: beside each profile stored, a small index file ``<model key>.last``
   names it and its sample's shapes and dtypes, under a key of everything in rule 1 but the
   sample. ``rt.manage(plan="auto")`` without ``sample=`` plans from that profile at once when it
   loads and revalidates (:func:`last_profile`), so the chunks are built under the plan and the
   first step neither profiles nor re-packs; the first forward's arguments are then checked
   against the index's shapes (and autocast regions: a profile made under bf16 autocast counts
   half the activation bytes of an fp32 forward), and a batch of other shapes, or one under
   other autocast, plans at the first step as before
   (NOTE [ Model-state rules ] rule 9 in ``tiermem.states.manager``). The index is written
   with the profile, atomically and best effort, as rules 3-5 say; :func:`clear` removes it too.
7. A profile measured streamed (NOTE [ Profiling step ] rule 8: times estimated without the
   fetch waits) is cached like any other and marked so (``extra["streamed"]``): without it
   every run of a model whose plain copy does not fit the capacities profiled its first step
   again (measured: 37 s against a 6.2 s step, for a 210M GPT-2). A profiling step on plain
   parameters (``sample=``, or a first step with room for a plain copy) measures again rather
   than take it, and its plain profile replaces the streamed one; planning at ``rt.manage``
   (rule 6) takes either: the streamed times err slow, and were the closer ones measured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tiermem.errors import NO_SPACE_ERRNOS, TiermemWarning, UnsafeDirectoryError, describe_os_error
from tiermem.planner.probes import (
    MIN_PROBE_BYTES,
    move_seconds,
    nvme_io_seconds,
    nvme_path_links,
    nvme_paths,
    path_probe_plan,
    probe_size,
)
from tiermem.planner.profile import PROFILE_VERSION, Profile
from tiermem.planner.profiler import Batch
from tiermem.private_dirs import open_tree
from tiermem.registry import Registry
from tiermem.units import ALIGNMENT

REVALIDATE_FACTOR = 4.0
"""Rule 2."""
NVME_REVALIDATE_BYTES = 8 << 20
"""Rule 2b: the NVMe write and read-back's bytes at most."""


def cache_dir() -> Path:
    """Rule 3: where profiles are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiermem" / "profiles"


_CACHE_ADVICE = (
    "It is tiermem's profile cache: if you made it, 'chmod 700' it; if you did not, remove it (tiermem makes it again)"
)


def private_cache_dir(*, create: bool) -> Path | None:
    """Rule 4: :func:`cache_dir`, checked private to the user (made with mode 0700 when ``create``);
    None when it does not exist or cannot be made (caching is best effort). Raises
    :class:`~tiermem.errors.UnsafeDirectoryError`."""
    directory = Path(os.path.abspath(cache_dir()))
    own = {str(directory.parent): _CACHE_ADVICE, str(directory): _CACHE_ADVICE}
    try:
        fd, _ = open_tree(str(directory), own, create=create)
    except UnsafeDirectoryError:
        raise
    except OSError:
        return None
    os.close(fd)
    return directory


def model_signature(model: nn.Module) -> list[Any]:
    params = [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()]
    modules = [type(m).__qualname__ for m in model.modules()]
    return [params, modules]


def sample_signature(sample: Any) -> list[Any] | None:
    """Shapes and dtypes of the sample's tensors, and the autocast regions in force on this
    thread; None for a callable (rule 1)."""
    if callable(sample):
        return None
    if isinstance(sample, Batch):  # keyword names count too: another call is another profile
        sample = (sample.args, sorted(sample.kwargs.items()))
    signature: list[Any] = [
        [list(t.shape), str(t.dtype), str(t.device)] if isinstance(t, torch.Tensor) else repr(t)
        for t in tree_leaves(sample)
    ]
    if autocast := autocast_regions():
        signature.append({"autocast": autocast})
    return signature


def autocast_regions() -> list[list[str]]:
    """The autocast regions in force on this thread, as [device type, dtype]: a step profiled
    inside one measures its working dtype's activations (NOTE [ Profiling step ]), half an fp32
    step's under bf16, so a forward outside it must not plan from that profile, nor the other way."""
    return [
        [device, str(torch.get_autocast_dtype(device))]
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
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
    return _digest(_facts(model, shape, device, tier_config, optimizer))


def model_key(model: nn.Module, device: str, tier_config: Mapping[str, Any], optimizer: Mapping[str, Any]) -> str:
    """Rule 6: rule 1's key without the sample: what names the model's last profiled sample."""
    return _digest(_facts(model, "the last one profiled", device, tier_config, optimizer))


def _facts(
    model: nn.Module, sample: Any, device: str, tier_config: Mapping[str, Any], optimizer: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "version": PROFILE_VERSION,
        "model": model_signature(model),
        "sample": sample,
        "device": device,
        "tiers": tier_config,
        "optimizer": optimizer,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _digest(facts: Mapping[str, Any]) -> str:
    text = json.dumps(facts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load(key: str) -> Profile | None:
    """The cached profile for ``key``, or None (missing, unreadable or from another version)."""
    if private_cache_dir(create=False) is None:  # rule 4: not a private directory of ours, not read
        return None
    path = cache_dir() / f"{key}.json"
    try:
        profile = Profile.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return profile if profile.key == key else None


def store(profile: Profile, model: str | None = None, sample: list[Any] | None = None) -> Path | None:
    """Rule 3; None when the cache directory cannot be written (caching is best effort). With
    ``model`` (a :func:`model_key`) and the ``sample``'s signature, also rule 6's index."""
    directory = cache_dir()
    if private_cache_dir(create=True) is None:  # rule 4: never write where another user can
        return None
    path = _write(directory / f"{profile.key}.json", profile.to_json())
    if path is not None and model is not None and sample is not None:
        _write(directory / f"{model}.last", json.dumps({"profile": profile.key, "sample": sample}))
    return path


def last_profile(model: str) -> tuple[Profile, list[Any]] | None:
    """Rule 6: the profile last stored for the model ``model`` names, and its sample's
    signature (:func:`sample_signature`, as JSON reads it back); None when there is none."""
    if private_cache_dir(create=False) is None:  # rule 4: not a private directory of ours, not read
        return None
    try:
        index = json.loads((cache_dir() / f"{model}.last").read_text(encoding="utf-8"))
        key, sample = index["profile"], index["sample"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(key, str) or not isinstance(sample, list):
        return None
    profile = load(key)
    return (profile, sample) if profile is not None else None


def same_batch(recorded: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Rule 6: whether a first forward's arguments have the shapes and dtypes ``recorded`` in the
    index (as the first step would profile them: NOTE [ Profiling step ] rule 1)."""
    signature = sample_signature(Batch(args, kwargs) if kwargs else args)
    return signature is not None and json.loads(json.dumps(signature, default=repr)) == recorded


def _write(path: Path, text: str) -> Path | None:
    """Rules 3 and 5: ``text`` into ``path`` atomically; None (warned) when it cannot be written."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".profile-", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:  # rule 5: best effort, the run goes on with what it measured
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _warn_not_stored(exc, path, len(text.encode()))
        return None
    return path


def _warn_not_stored(exc: OSError, path: Path, nbytes: int) -> None:
    """Rule 5: what failed, where, and for a full disk the bytes needed and free."""
    free = None
    if exc.errno in NO_SPACE_ERRNOS:
        existing = next((p for p in (path.parent, *path.parents) if p.is_dir()), path.anchor)
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(existing).free
    what = describe_os_error(exc, exc.filename or path, nbytes=nbytes, free=free)
    warnings.warn(
        TiermemWarning(
            f"tiermem planner: the profile was not cached: {what}. This run goes on with the profile it measured; "
            "the next one profiles again. Free space there, or set XDG_CACHE_HOME to a writable directory."
        ),
        stacklevel=4,  # the caller of store(), through _write()
    )


def clear() -> int:
    """Remove every cached profile; returns how many were removed."""
    removed = 0
    directory = cache_dir()
    if private_cache_dir(create=False) is None:  # rule 4: not a private directory of ours, not read
        return 0
    for path in directory.glob("*.json"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    for path in directory.glob("*.last"):  # rule 6's index names profiles that are gone now
        with contextlib.suppress(OSError):
            path.unlink()
    return removed


@dataclass(frozen=True)
class Check:
    """One revalidation probe (rule 2): ``nbytes`` moved over ``link`` at ``measured`` bytes/s;
    the profile's ``cached`` bytes/s, and ``expected``: what it predicts for ``nbytes``."""

    link: str
    nbytes: int
    measured: float
    cached: float
    expected: float

    @property
    def agrees(self) -> bool:
        return self.expected / REVALIDATE_FACTOR <= self.measured <= self.expected * REVALIDATE_FACTOR


@dataclass(frozen=True)
class Revalidation:
    """What :func:`revalidate` found: the probes it ran, the links a profiling now would
    measure that the profile lacks, and the seconds it took."""

    checks: tuple[Check, ...]
    missing: tuple[str, ...]
    seconds: float

    @property
    def valid(self) -> bool:
        return not self.missing and all(check.agrees for check in self.checks)


def still_valid(profile: Profile, registry: Registry) -> bool:
    """Rule 2: the cached profile's links still hold on this machine now."""
    return revalidate(profile, registry).valid


def revalidate(profile: Profile, registry: Registry) -> Revalidation:
    """Rule 2, with what each probe measured."""
    start = time.perf_counter()
    checks: list[Check] = []
    missing: list[str] = []
    links = profile.links
    probed = int(profile.extra.get("probe_bytes", 0))
    if not links.get("device->host") or probed <= 0:
        missing.append("device->host")
    else:
        checks += _device_to_host(registry, probed, links["device->host"])
    if links.get("host->nvme") and links.get("nvme->host") and registry.has_tier("nvme"):
        checks += _nvme_round_trip(registry, probed, links["host->nvme"], links["nvme->host"])
        missing += _missing_paths(profile, registry)
    return Revalidation(tuple(checks), tuple(missing), time.perf_counter() - start)


def _expected(cached: float, nbytes: int, probed: int, latency: float) -> float:
    """Rule 2c: bytes/s the cached bandwidth (measured with ``probed`` bytes, one per-move
    ``latency`` included) predicts for a move of ``nbytes``."""
    seconds = nbytes / cached + latency * max(1.0 - nbytes / probed, 0.0)
    return nbytes / max(seconds, 1e-12)


def _device_to_host(registry: Registry, probed: int, cached: float) -> list[Check]:
    """Rule 2a: up to three device->host moves (the best counts; stopping at the first that
    agrees), of the profile's size or of what the tiers have room for."""
    nbytes = probe_size(registry, probed, ("device", "host"))
    while nbytes >= MIN_PROBE_BYTES:
        try:
            latency = _best(3, lambda: move_seconds(registry, "device", "host", ALIGNMENT)) if nbytes < probed else 0.0
            expected = _expected(cached, nbytes, probed, latency)
            best = float("inf")
            for _ in range(3):
                best = min(best, move_seconds(registry, "device", "host", nbytes))
                check = Check("device->host", nbytes, nbytes / max(best, 1e-12), cached, expected)
                if check.agrees:
                    break
            return [check]
        except MemoryError:  # fragmented since the room was counted: a smaller probe
            nbytes //= 2
            nbytes -= nbytes % ALIGNMENT
    return []


def _nvme_round_trip(registry: Registry, probed: int, write_bw: float, read_bw: float) -> list[Check]:
    """Rule 2b: a write of at most ``NVME_REVALIDATE_BYTES`` to the NVMe tier and its read
    back (again, up to three times, while they disagree)."""
    nbytes = probe_size(registry, min(probed, NVME_REVALIDATE_BYTES), ("nvme",))
    if nbytes < MIN_PROBE_BYTES:
        return []
    latency = (0.0, 0.0)
    if nbytes < probed:
        tiny = [nvme_io_seconds(registry, ALIGNMENT) for _ in range(3)]
        if any(t is None for t in tiny):
            return []
        latency = (min(t[0] for t in tiny if t is not None), min(t[1] for t in tiny if t is not None))
    expected = (_expected(write_bw, nbytes, probed, latency[0]), _expected(read_bw, nbytes, probed, latency[1]))
    best = [float("inf"), float("inf")]
    checks: list[Check] = []
    for _ in range(3):
        seconds = nvme_io_seconds(registry, nbytes)
        if seconds is None:
            return []
        best = [min(b, s) for b, s in zip(best, seconds, strict=True)]
        checks = [
            Check("host->nvme", nbytes, nbytes / max(best[0], 1e-12), write_bw, expected[0]),
            Check("nvme->host", nbytes, nbytes / max(best[1], 1e-12), read_bw, expected[1]),
        ]
        if all(check.agrees for check in checks):
            break
    return checks


def _missing_paths(profile: Profile, registry: Registry) -> list[str]:
    """Per-path NVMe links a profiling now would measure that ``profile`` lacks (rule 2)."""
    paths = nvme_paths(registry)
    absent = [key for path in paths for key in nvme_path_links(path) if not profile.links.get(key)]
    if absent and (len(paths) == 1 or path_probe_plan(registry, probe_size(registry))[1] >= MIN_PROBE_BYTES):
        return absent
    return []


def _best(rounds: int, timed: Callable[[], float]) -> float:
    return min(timed() for _ in range(rounds))
