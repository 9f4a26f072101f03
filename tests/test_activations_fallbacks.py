"""Activation offload fallbacks (NOTE [ Activation fallbacks ]): a failing disk and a device
budget too small to keep, with gradients still bitwise those of plain PyTorch, a warning,
a count in the stats, and no files left behind; a clear error only when nothing fits."""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch
from torch import nn

import tiermem
from tests.test_activations import Decoder, _assert_identical, _batch, _settled_activations, _step, offloaded
from tests.test_registry import DeviceCache
from tiermem.activations import ActivationMemoryError, BlockPolicy
from tiermem.activations.fallback import decide
from tiermem.activations.history import MAX_OUTAGE_FORWARDS, OffloadHistory
from tiermem.activations.hooks import SavedTensorHooks
from tiermem.activations.ledger import WriteLedger
from tiermem.activations.prefetch import Prefetcher
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend

#: One Decoder block saves ~0.8 MiB here (batch 4, 48 tokens, d=64): this budget holds
#: about three blocks, so under a failing disk the later ones must be recomputed.
TIGHT_DEVICE = "2816KiB"


def _config(path, device: str, host: str = "64MiB") -> dict:
    return {
        "device": {"capacity": device, "device": "cpu"},
        "host": {"capacity": host},
        "nvme": {"paths": [str(path)], "capacity": "256MiB", "block_size": "256KiB"},
        "activations": {"min_bytes": "4KiB"},
        "scheduler": {"loop": "asyncio"},
    }


def _faulty_disk(monkeypatch: pytest.MonkeyPatch) -> FaultyBackend:
    """The NVMe tier's backend, healthy until :func:`_arm` (the tier probes it at start)."""
    backend = FaultyBackend(PosixBackend())
    monkeypatch.setattr("tiermem.tiers.nvme.select_backend", lambda name, probe_dir: (backend, "injected by test"))
    return backend


def _arm(backend: FaultyBackend, fault: str) -> None:
    if fault == "enospc-on-write":  # every later write fails, on the I/O worker
        backend.enospc_after = backend.bytes_written
    elif fault == "enospc-on-fallocate":  # the disk is full when room is reserved: at once
        backend.fallocate_limit = 0
    elif fault == "eio-once":  # the next write fails; the disk works again afterwards
        backend.eio_on_write = backend.writes + 1
    else:
        raise AssertionError(fault)


def _reasons(offloader: tiermem.activations.ActivationOffloader) -> dict[str, int]:
    with offloader.counters.lock:
        return dict(offloader.counters.fallback_reasons)


@pytest.mark.parametrize(
    ("fault", "cause"),
    [("enospc-on-write", "disk_full"), ("enospc-on-fallocate", "disk_full"), ("eio-once", "io_error")],
)
def test_failing_disk_keeps_then_recomputes_with_exact_gradients(tmp_path, monkeypatch, caplog, fault, cause):
    backend = _faulty_disk(monkeypatch)
    torch.manual_seed(0)
    model = Decoder(layers=6)
    want = _step(model, contextlib.nullcontext())
    with (
        caplog.at_level(logging.WARNING, logger="tiermem.activations"),
        tiermem.Runtime(_config(tmp_path, TIGHT_DEVICE)) as rt,
    ):
        _arm(backend, fault)
        for _ in range(3):  # the failing step, a step with the disk out, the retry
            offloader = rt.offload_activations(model, policy="nvme")
            _assert_identical(_step(model, offloader), want)
        stats = _settled_activations(rt)
        reasons = _reasons(offloader)
        assert backend.faults_injected > 0
        assert f"{cause}->keep" in reasons  # the blocks whose writes failed stayed on the device
        assert any(r.endswith("->recompute") for r in reasons)  # the budget could not keep the rest
        assert stats["fallbacks"] == sum(reasons.values())
        assert stats["resident_bytes"] == 0
        assert rt.stats().as_dict()["tiers"]["device"]["current_bytes"] == 0
    assert "falls back to keep" in caplog.text and "falls back to recompute" in caplog.text
    assert cause in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_auto_fits_a_device_budget_of_about_one_block(tmp_path):
    """A 1 MiB budget holds about one block's activations (~0.8 MiB) besides what is saved
    outside the blocks. Before fallbacks, auto failed here in backward (prefetches took the
    room demand fetches needed). Which fallback a step takes (recompute the kept last
    block, evict it or spill) depends on how many write-backs are still in flight when it
    starts, so only the kinds are checked."""
    torch.manual_seed(0)
    model = Decoder(layers=6)
    want = _step(model, contextlib.nullcontext())
    with tiermem.Runtime(_config(tmp_path, "1MiB")) as rt:
        for _ in range(3):
            offloader = rt.offload_activations(model, policy="auto")
            _assert_identical(_step(model, offloader), want)
        reasons = _reasons(offloader)
        assert set(reasons) <= {"device_full->recompute", "device_full->evict:nvme", "device_full->spill:nvme"}
        stats = _settled_activations(rt)
        assert stats["fallbacks"] == sum(reasons.values())
        assert stats["peak_resident_bytes"] <= 1 << 20
        assert offloaded(stats, "nvme")  # the other blocks still went to disk
    assert list(tmp_path.iterdir()) == []


def _synchronous_write_backs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write-back lands before the next tensor is saved, so what the device holds
    when backward starts (and at each unpack) does not depend on the machine's load."""
    original = SavedTensorHooks.write_back

    def write_back(self, handle, group):
        original(self, handle, group)
        with contextlib.suppress(Exception):  # a failure is the ledger's to report
            handle.wait()

    monkeypatch.setattr(SavedTensorHooks, "write_back", write_back)


def test_prefetch_never_takes_the_room_a_demand_fetch_needs(tmp_path, monkeypatch):
    """Regression (issue 4): at 840 KiB the kept last block does not fit and is partly
    evicted to NVMe in forward. Backward's first unpack in that block prefetched the
    blocks before it *before* fetching the block's own evicted tensors on demand, so the
    prefetches took the room and backward died with ActivationMemoryError. Unpack now
    fetches on demand first and prefetches the rest of its own block before earlier
    blocks (each in reverse pack order). Deterministic: write-backs land synchronously."""
    _synchronous_write_backs(monkeypatch)
    torch.manual_seed(0)
    model = Decoder(layers=6)
    want = _step(model, contextlib.nullcontext())
    with tiermem.Runtime(_config(tmp_path, "840KiB")) as rt:
        for _ in range(2):  # the first step evicts the kept block; the second decides from sizes
            offloader = rt.offload_activations(model, policy="nvme")
            _assert_identical(_step(model, offloader), want)
        assert "device_full->evict:nvme" in _reasons(offloader)
        stats = _settled_activations(rt)
        assert stats["resident_bytes"] == 0 and stats["bytes_read"]["nvme"] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_demand_fetch_takes_its_room_back_from_prefetches(tmp_path, monkeypatch):
    """Rule 5's backstop: when prefetches hold the room a demand fetch needs (here forced
    by prefetching the earlier blocks before every demand, as unpack did before issue 4),
    the prefetched objects backward needs last are written back to NVMe until it fits,
    instead of an ActivationMemoryError; gradients stay bitwise those of plain PyTorch."""
    _synchronous_write_backs(monkeypatch)
    demand, prefetch = SavedTensorHooks.demand, Prefetcher.before

    def earlier_blocks_only(self, group):  # never the rest of the block being unpacked
        earlier = self.forwards.group(group.forward_id, group.index - 1)
        if earlier is not None:
            prefetch(self, earlier)

    def prefetch_first(self, handle, group):
        if group is not None:
            self.prefetcher.before(group)  # takes the free room before the demand can
        demand(self, handle, group)

    monkeypatch.setattr(Prefetcher, "before", earlier_blocks_only)
    monkeypatch.setattr(SavedTensorHooks, "demand", prefetch_first)
    # Whole blocks ahead, as before the prefetch window (NOTE [ Prefetch window ]) bounded them.
    monkeypatch.setattr(Prefetcher, "window", lambda self: 1 << 62)
    torch.manual_seed(0)
    model = Decoder(layers=6)
    want = _step(model, contextlib.nullcontext())
    with tiermem.Runtime(_config(tmp_path, "840KiB")) as rt:
        for _ in range(2):
            offloader = rt.offload_activations(model, policy="nvme")
            _assert_identical(_step(model, offloader), want)
        assert offloader.counters.prefetch_released > 0
        stats = _settled_activations(rt)
        assert stats["prefetch_released"] == offloader.counters.prefetch_released
        assert stats["resident_bytes"] == 0
        assert rt.stats().as_dict()["tiers"]["device"]["current_bytes"] == 0
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_the_device_cannot_hold_is_spilled_synchronously(tmp_path, caplog):
    """A saved tensor that does not fit even after the write-backs in flight landed is
    written to NVMe at once (a stall, not an error) and read back in backward."""
    torch.manual_seed(0)
    model = Decoder(layers=2)
    want = _step(model, contextlib.nullcontext())
    model.zero_grad(set_to_none=True)
    tokens, targets = _batch()
    with (
        caplog.at_level(logging.WARNING, logger="tiermem.activations"),
        tiermem.Runtime(_config(tmp_path, "1MiB")) as rt,
    ):
        # Leave 96 KiB of the budget: less than one 144 KiB attention projection.
        blocker = rt.register(torch.zeros((1 << 20) - 96 * 1024, dtype=torch.uint8))
        offloader = rt.offload_activations(model, policy="nvme")
        with offloader:
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            blocker.free()  # backward has the whole budget to read back into
            loss.backward()
        _assert_identical((loss.detach(), [p.grad for p in model.parameters()]), want)
        assert _reasons(offloader).get("device_full->spill:nvme", 0) > 0
        stats = _settled_activations(rt)
        assert stats["resident_bytes"] == 0 and stats["bytes_read"]["nvme"] > 0
    assert "spill:nvme" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_device_cache_gives_its_room_to_saved_tensors_before_they_spill(tmp_path):
    """NOTE [ Managed object rules ] rule 7: the same budget as the spill test above, but the
    bytes that leave no room are a cache with a reclaimer: the offloader reclaims them instead
    of writing a saved tensor to NVMe synchronously."""
    torch.manual_seed(0)
    model = Decoder(layers=2)
    want = _step(model, contextlib.nullcontext())
    model.zero_grad(set_to_none=True)
    tokens, targets = _batch()
    with tiermem.Runtime(_config(tmp_path, "1MiB")) as rt:
        cache = DeviceCache(rt.register(torch.zeros((1 << 20) - 96 * 1024, dtype=torch.uint8)))
        rt.registry.add_reclaimer("device", cache.drop)
        offloader = rt.offload_activations(model, policy="nvme")
        with offloader:
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
        _assert_identical((loss.detach(), [p.grad for p in model.parameters()]), want)
        assert cache.handle is None  # reclaimed
        assert not any(reason.startswith("device_full") for reason in _reasons(offloader))
    assert list(tmp_path.iterdir()) == []


def test_nothing_fits_is_a_clear_error_naming_block_bytes_and_tiers(tmp_path, monkeypatch):
    backend = _faulty_disk(monkeypatch)
    model = Decoder(layers=3)
    tokens, _ = _batch()
    with tiermem.Runtime(_config(tmp_path, "64KiB", host="64KiB")) as rt:
        _arm(backend, "enospc-on-fallocate")
        with (
            pytest.raises(ActivationMemoryError) as info,
            rt.offload_activations(model, policy="nvme"),
        ):
            model(tokens)
        message = str(info.value)
        for part in ("block 0 (blocks.0)", "bytes", "device budget", "nvme is out", "host", "[device] capacity"):
            assert part in message
        del info
        assert rt.stats().as_dict()["tiers"]["device"]["current_bytes"] == 0
    assert list(tmp_path.iterdir()) == []


def test_explicit_keep_and_recompute_are_never_changed(tmp_path):
    """NOTE [ Activation fallbacks ] rule 2: only blocks tiermem placed may fall back."""
    model = Decoder(layers=3)
    with tiermem.Runtime(_config(tmp_path, "512MiB")) as rt:
        offloader = rt.offload_activations(model, policy={0: "keep", 1: "recompute", 2: "nvme"})
        assert offloader.flexible == [False, False, True]
        assert rt.offload_activations(model, policy="nvme").flexible == [True, True, True]
        assert rt.offload_activations(model, policy="keep").flexible == [False, False, False]
        assert rt.offload_activations(model, policy="auto").flexible == [True, True, True]


def test_decide_rule():
    keep, nvme, recompute = BlockPolicy.KEEP, BlockPolicy.NVME, BlockPolicy.RECOMPUTE
    assert decide(nvme, None, 100, 1000) == (nvme, "")
    assert decide(nvme, None, None, 0) == (nvme, "")  # nothing measured yet: as planned
    assert decide(nvme, None, 2000, 1000) == (recompute, "device_full->recompute")  # could not come back
    assert decide(nvme, "disk_full", 100, 1000) == (keep, "disk_full->keep")
    assert decide(nvme, "io_error", 2000, 1000) == (recompute, "io_error->recompute")
    assert decide(keep, None, 100, 1000) == (keep, "")
    assert decide(keep, None, 2000, 1000) == (recompute, "device_full->recompute")
    assert decide(recompute, "disk_full", 2000, 0) == (recompute, "")


def _out_forwards(memory: OffloadHistory, forwards: range) -> list[int]:
    """The forwards in ``forwards`` for which nvme is out."""
    out = []
    for forward in forwards:
        memory.forwards = forward
        if memory.outage("nvme") is not None:
            out.append(forward)
    return out


def test_outages_back_off_and_clear_when_a_write_lands():
    memory = OffloadHistory(WriteLedger({}, threading.Lock()))
    memory.forwards = 1
    assert memory.tier_failed("nvme", "disk_full", "full")
    assert not memory.tier_failed("nvme", "disk_full", "full")  # the same outage
    assert _out_forwards(memory, range(1, 12)) == [1, 2]  # the rest of forward 1 and the next
    memory.forwards = 3
    memory.tier_failed("nvme", "disk_full", "full again")  # the retry failed: out twice as long
    assert _out_forwards(memory, range(3, 12)) == [3, 4, 5]
    memory.forwards = 6
    memory.tier_worked("nvme")  # a write landed after the outage: forgotten, streak reset
    assert memory.outages == {}
    for _ in range(20):  # failing for ever: the outage stops growing
        memory.tier_failed("nvme", "io_error", "eio")
        memory.forwards = memory.outages["nvme"].until
    memory.tier_failed("nvme", "io_error", "eio")
    assert memory.outages["nvme"].until - memory.forwards == MAX_OUTAGE_FORWARDS + 1


def test_sizes_are_estimated_from_the_input_and_from_similar_blocks():
    memory = OffloadHistory(WriteLedger({}, threading.Lock()))
    assert memory.estimate(0, 100) is None
    memory.measured(0, 1000, 100)
    assert memory.estimate(0, 200) == 2000  # twice the tokens, twice the bytes
    assert memory.estimate(3, 100) == 1000  # an unmeasured block is like the largest measured
    memory.measured(1, 500, 0)  # no tensor input: raw bytes
    assert memory.estimate(1, 100) == 500
