"""The planner's link probes and the profile cache's revalidation: each NVMe path's own write and
read bandwidth next to the aggregate links, and a revalidation that re-probes the NVMe link and
probes with less where the tiers have less room, never trusting the key blindly.
(NOTE [ Profile cache ] rule 2; ``probe_links`` in ``tiermem.planner.probes``)"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest
import torch

import tiermem
from tests.test_planner import one_thread  # noqa: F401  (autouse: one thread, a private cache)
from tiermem.app.models.data import MarkovChainData
from tiermem.app.models.gpt import GPT, GPTConfig
from tiermem.planner import BlockStats, Profile, cache
from tiermem.planner import probes as probes_module
from tiermem.planner.auto import profile_model
from tiermem.planner.probes import (
    MIN_PROBE_BYTES,
    PATH_PROBE_ROUNDS,
    nvme_path_links,
    path_probe_plan,
    probe_links,
    probe_nvme_paths,
    probe_size,
)
from tiermem.registry import Registry
from tiermem.schedulers import AsyncioScheduler
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.host import HostTier
from tiermem.tiers.nvme import NvmeTier

MiB = 1 << 20
AGGREGATE = ("device->host", "host->device", "device->nvme", "nvme->device", "host->nvme", "nvme->host")


def nvme_dirs(tmp_path, count: int = 2) -> list[str]:
    paths = [str(tmp_path / f"nvme-{i}") for i in range(count)]
    for path in paths:
        os.mkdir(path)
    return paths


def settings(paths: list[str], device: str = "64MiB") -> dict[str, Any]:
    return {
        "device": {"capacity": device, "device": "cpu"},
        "host": {"capacity": "128MiB"},
        "nvme": {"paths": paths, "capacity": "128MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
        "activations": {"min_bytes": "16KiB"},
    }


def assert_nothing_left(rt: tiermem.Runtime) -> None:
    """Every tier back at zero bytes, and the run directories hold only the tier's own files."""
    for name, tier in rt.registry.tiers.items():
        assert tier.statistics().current_bytes == 0, name
    for run_dir in rt.registry.tiers["nvme"].run_directories:  # type: ignore[attr-defined]
        assert sorted(os.listdir(run_dir)) == ["data", "lock"]


def profile_with(links: dict[str, float], probe_bytes: int) -> Profile:
    """A profile carrying only what revalidation reads: links and the probe's size."""
    return Profile(
        blocks=(),
        outside=BlockStats("outside", 0.0, 0.0, 0),
        params=(),
        order=(),
        modules=(),
        shared=(),
        links=links,
        optimizer_s_per_byte=0.0,
        extra={"probe_bytes": probe_bytes},
    )


# -- per-path bandwidths ------------------------------------------------------------------------


def test_each_nvme_path_gets_its_own_write_and_read_bandwidth(tmp_path):
    paths = nvme_dirs(tmp_path)
    with tiermem.Runtime(settings(paths)) as rt:
        size = probe_size(rt.registry)
        assert size >= MIN_PROBE_BYTES
        links = probe_links(rt.registry, size)
        assert_nothing_left(rt)
    assert all(links[key] > 0 for key in AGGREGATE)
    for path in paths:
        write, read = nvme_path_links(path)
        assert links[write] > 0 and links[read] > 0
    assert len(links) == len(AGGREGATE) + 2 * len(paths)
    assert all(os.listdir(path) == [] for path in paths)  # the runtime's close removed its files


def test_a_full_host_leaves_the_links_between_device_and_nvme_measured(tmp_path):
    """Each link is probed at the room of the tiers it passes through: a host with less free than
    the smallest probe (streamed profiling at a small host, full of the chunks' homes) leaves its
    own links unmeasured but not the device's to and from NVMe (all were dropped, and the cost
    model took every NVMe read as free: a LoRA plan at 10-20% of its base predicted 2.3x fast)."""
    (path,) = nvme_dirs(tmp_path, 1)
    config = settings([path], device="4MiB")
    config["host"] = {"capacity": 4 * MIN_PROBE_BYTES - 4096}
    with tiermem.Runtime(config) as rt:
        assert probe_size(rt.registry) < MIN_PROBE_BYTES  # the least free tier: one probe for all was none
        links = probe_links(rt.registry, 32 * MiB)
        assert_nothing_left(rt)
    assert links["device->nvme"] > 0 and links["nvme->device"] > 0
    assert not any(key in links for key in ("device->host", "host->device", "host->nvme", "nvme->host"))
    assert os.listdir(path) == []


def test_one_path_reuses_the_aggregate_instead_of_probing_again(tmp_path, monkeypatch):
    (path,) = nvme_dirs(tmp_path, 1)

    def refuse(*_args: object) -> dict[str, float]:
        raise AssertionError("one path: its bandwidth is the aggregate, not probed twice")

    monkeypatch.setattr(probes_module, "probe_nvme_paths", refuse)
    with tiermem.Runtime(settings([path])) as rt:
        links = probe_links(rt.registry, probe_size(rt.registry))
        assert_nothing_left(rt)
    write, read = nvme_path_links(path)
    assert links[write] == links["host->nvme"] > 0
    assert links[read] == links["nvme->host"] > 0
    assert os.listdir(path) == []


class RecordingBackend(PosixBackend):
    """The POSIX backend, recording which path's data file each read and write went to."""

    def __init__(self) -> None:
        self.files: dict[int, str] = {}
        self.log: list[tuple[str, str, int]] = []

    def open(self, path: str, *, direct: bool) -> int:
        handle = super().open(path, direct=direct)
        # parent / run dir / data; the tier opens it through the run directory's held descriptor
        # (/proc/self/fd/N/data, NOTE [ Run directory rules ]): resolve to the real path
        self.files[handle] = os.path.dirname(os.path.dirname(os.path.realpath(path)))
        return handle

    def pread(self, handle: int, buffer: Any, offset: int) -> int:
        self.log.append((self.files[handle], "read", len(memoryview(buffer))))
        return super().pread(handle, buffer, offset)

    def pwrite(self, handle: int, buffer: Any, offset: int) -> int:
        self.log.append((self.files[handle], "write", len(memoryview(buffer))))
        return super().pwrite(handle, buffer, offset)


def test_a_path_probe_moves_bytes_on_its_own_path_only(tmp_path):
    """Each path's probe writes and reads only that path's file, ``per_path`` bytes each time,
    through the tier's own I/O (stripe units, NOTE [ NVMe tier layout and I/O ] rule 1)."""
    paths = nvme_dirs(tmp_path, 3)
    backend = RecordingBackend()
    block = 64 << 10
    nvme = NvmeTier(paths, 64 * MiB, backend=backend, block_size=block)
    device, host = DeviceTier(64 * MiB, "cpu"), HostTier(64 * MiB)
    scheduler = AsyncioScheduler(block_size=block, loop="asyncio")
    registry = Registry({"device": device, "host": host, "nvme": nvme}, scheduler)
    try:
        size = 2 * MiB
        _, per_path = path_probe_plan(registry, size)
        assert per_path == size
        backend.log.clear()
        links = probe_nvme_paths(registry, size)
        assert set(links) == {key for path in paths for key in nvme_path_links(path)}
        # Collapse the log into runs of (path, op): one per path and direction, round after round.
        runs: list[list[Any]] = []
        for path, op, nbytes in backend.log:
            if runs and runs[-1][:2] == [path, op]:
                runs[-1][2] += nbytes
            else:
                runs.append([path, op, nbytes])
        expected = [[path, op, per_path] for path in paths for op in ("write", "read")] * PATH_PROBE_ROUNDS
        assert runs == expected
        assert nvme.statistics().current_bytes == 0
    finally:
        scheduler.close()
        for tier in (device, host, nvme):
            tier.close()
    assert all(os.listdir(path) == [] for path in paths)


def test_a_nvme_tier_too_full_for_the_path_probe_reports_no_per_path_numbers(tmp_path):
    paths = nvme_dirs(tmp_path)
    config = settings(paths)
    config["nvme"]["capacity"] = "256KiB"  # room for the aggregate probe (a quarter), not per path
    with tiermem.Runtime(config) as rt:
        size = probe_size(rt.registry)
        assert path_probe_plan(rt.registry, size)[1] < MIN_PROBE_BYTES
        links = probe_links(rt.registry, size)
        assert links["host->nvme"] > 0 and not any("[" in key for key in links)
        # Nor does revalidation ask for them: a profiling now could not measure them either.
        assert cache.revalidate(profile_with(links, size), rt.registry).missing == ()
        assert_nothing_left(rt)


# -- revalidation -------------------------------------------------------------------------------


def test_a_cached_profile_whose_nvme_bandwidth_is_100x_off_fails_revalidation(tmp_path):
    """Both ways off: a 100x too fast or too slow NVMe link is re-measured, whatever the
    device->host check says (the NVMe checks themselves disagree)."""
    paths = nvme_dirs(tmp_path)
    with tiermem.Runtime(settings(paths)) as rt:
        # The profile's probe size is the NVMe check's: the cached bandwidth is the prediction.
        nbytes = cache.NVME_REVALIDATE_BYTES
        genuine = profile_with(probe_links(rt.registry, nbytes), nbytes)
        for factor in (100.0, 0.01):
            links = dict(genuine.links)
            links["host->nvme"] *= factor
            links["nvme->host"] *= factor
            stale = dataclasses.replace(genuine, links=links)
            result = cache.revalidate(stale, rt.registry)
            nvme_checks = {c.link: c for c in result.checks if "nvme" in c.link}
            assert set(nvme_checks) == {"host->nvme", "nvme->host"}
            assert all(c.nbytes == nbytes and c.expected == pytest.approx(c.cached) for c in nvme_checks.values())
            assert not any(c.agrees for c in nvme_checks.values()), (factor, result)
            assert not result.valid and not cache.still_valid(stale, rt.registry)
            assert_nothing_left(rt)
    assert all(os.listdir(path) == [] for path in paths)


def test_a_stale_nvme_bandwidth_in_the_cache_is_measured_again(tmp_path, monkeypatch):
    """End to end: ``profile_model`` stores per-path bandwidths in the cached JSON; a cached
    profile 100x off on NVMe, or lacking the per-path bandwidths (an older tiermem's), is not
    used but measured again."""
    paths = nvme_dirs(tmp_path)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=64)
    model = GPT(config)
    x, y = MarkovChainData(config.vocab_size, config.seq_len, seed=0).batch(4, torch.device("cpu"))
    with tiermem.Runtime(settings(paths)) as rt:
        args = (rt.registry, rt.resolved, model, torch.optim.AdamW, {"lr": 1e-3})
        first = profile_model(*args, (x, y))
        stored = json.loads((cache.cache_dir() / f"{first.key}.json").read_text())
        keys = [key for path in paths for key in nvme_path_links(path)]
        assert all(stored["links"][key] > 0 for key in keys)
        assert Profile.from_json(json.dumps(stored)) == first

        slow = {**first.links, "host->nvme": first.links["host->nvme"] / 100}
        cache.store(dataclasses.replace(first, links={**slow, "nvme->host": first.links["nvme->host"] / 100}))
        loaded = cache.load(first.key)
        assert loaded is not None and not cache.still_valid(loaded, rt.registry)

        # A profile cached before per-path probing: its links hold, but a profiling now measures more.
        monkeypatch.setattr(cache, "REVALIDATE_FACTOR", 1e6)  # only the missing keys may fail it
        older = dataclasses.replace(first, links={k: v for k, v in first.links.items() if k not in keys})
        result = cache.revalidate(older, rt.registry)
        assert set(result.missing) == set(keys) and not result.valid
        assert cache.revalidate(first, rt.registry).valid
        cache.store(dataclasses.replace(older, profiling_s=-1.0))
        again = profile_model(*args, (x, y))
        assert again.profiling_s > 0 and all(again.links[key] > 0 for key in keys)
        assert_nothing_left(rt)
    assert all(os.listdir(path) == [] for path in paths)


def test_no_room_for_the_old_probe_size_still_probes_with_less(tmp_path):
    """A device too small for the profile's probe size: the profile is probed with what fits
    (not trusted on its key), and a stale bandwidth is caught even at that size."""
    paths = nvme_dirs(tmp_path)
    with tiermem.Runtime(settings(paths, device="256MiB")) as rt:
        probed = probe_size(rt.registry)
        links = probe_links(rt.registry, probed)
    assert probed == 32 * MiB
    genuine = profile_with(links, probed)
    stale = profile_with({**links, "device->host": 1e3}, probed)  # 1 kB/s: no machine is that slow
    with tiermem.Runtime(settings(paths, device="1MiB")) as rt:
        assert probe_size(rt.registry, probed, ("device", "host")) < probed
        checks = {}
        for name, profile in (("genuine", genuine), ("stale", stale)):
            result = cache.revalidate(profile, rt.registry)
            (checks[name],) = [c for c in result.checks if c.link == "device->host"]
            assert MIN_PROBE_BYTES <= checks[name].nbytes < probed  # probed, with what fits
        assert not checks["stale"].agrees
        assert not cache.still_valid(stale, rt.registry)
        assert_nothing_left(rt)
    assert all(os.listdir(path) == [] for path in paths)
