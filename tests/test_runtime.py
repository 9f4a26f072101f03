"""tiermem.Runtime end to end: config in, tensors through every tier, stats out, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import tiermem
from tiermem.errors import ConfigError, RuntimeClosedError, TierCapacityError


def _config(tmp_path, **nvme):
    return {
        "device": {"capacity": "64MiB", "device": "cpu"},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "256MiB", "block_size": "64KiB", **nvme},
        "scheduler": {"loop": "asyncio"},
    }


def test_store_and_fetch_through_every_tier_then_nothing_left(tmp_path):
    t = torch.randn(3, 1000, 77)
    with tiermem.Runtime(_config(tmp_path)) as rt:
        handle = rt.store(t.clone(), "nvme")
        handle.wait()
        assert handle.tier == "nvme"
        handle.move_to("host")
        handle.wait()
        assert torch.equal(handle.tensor("host"), t)
        handle.move_to("nvme")
        handle.wait()
        assert torch.equal(handle.tensor("device"), t)  # demand fetch
        assert handle.tier == "device"
        stats = rt.stats().as_dict()
        assert os.listdir(tmp_path)  # the run directory exists while running
        handle.free()
        after = rt.stats().as_dict()
    assert set(stats) >= {"tiers", "links", "activations", "dedup_hits", "forwarded", "cancelled"}
    assert set(stats["tiers"]) == {"device", "host", "nvme"}
    for tier in stats["tiers"].values():
        assert set(tier) >= {"capacity", "current_bytes", "peak_bytes", "bytes_written", "bytes_read"}
        assert all(isinstance(v, int) for v in tier.values())
    assert stats["tiers"]["device"]["capacity"] == 64 << 20
    nbytes = t.numel() * 4
    for link in ("device->nvme", "nvme->host", "host->nvme", "nvme->device"):
        assert stats["links"][link]["bytes"] == nbytes, link
        assert stats["links"][link]["busy_s"] > 0
    assert stats["tiers"]["nvme"]["peak_bytes"] >= t.numel() * 4
    assert all(tier["current_bytes"] == 0 for tier in after["tiers"].values())
    assert os.listdir(tmp_path) == []  # the runtime removed everything it created


def test_embedded_default_config_runs_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with tiermem.Runtime() as rt:
        assert rt.resolved is not None and rt.resolved.device.device == "cpu"
        handle = rt.store(torch.arange(10_000), "nvme")
        assert torch.equal(handle.tensor(), torch.arange(10_000))
    assert os.listdir(tmp_path) == []


def test_environment_supplies_settings_and_explicit_config_wins(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("TIERMEM_NVME_PATHS", str(other))
    monkeypatch.setenv("TIERMEM_DEVICE_CAPACITY", "32MiB")
    with tiermem.Runtime({"device": {"device": "cpu"}, "scheduler": {"loop": "asyncio"}}) as rt:
        assert rt.tiers["device"].capacity == 32 << 20
        rt.store(torch.ones(1000), "nvme").wait()
        assert os.listdir(other)
    with tiermem.Runtime(_config(tmp_path)) as rt:
        assert rt.tiers["device"].capacity == 64 << 20


def test_bad_config_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        tiermem.Runtime({"nvme": {"block_size": "3000", "queue_depth": 0}, "bogus": {}})
    text = str(info.value)
    assert "nvme.block_size" in text and "nvme.queue_depth" in text and "bogus" in text


def test_toml_file_config(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_text(
        textwrap.dedent(f"""
        [device]
        capacity = "16MiB"
        device = "cpu"
        [nvme]
        paths = ["{tmp_path / "disk"}"]
        capacity = "64MiB"
        """)
    )
    (tmp_path / "disk").mkdir()
    with tiermem.Runtime(str(path)) as rt:
        assert rt.tiers["device"].capacity == 16 << 20
        assert rt.tiers["nvme"].capacity == 64 << 20


def test_device_budget_is_enforced(tmp_path):
    with tiermem.Runtime(_config(tmp_path)) as rt:
        with pytest.raises(TierCapacityError, match=r"device tier.*\[device\] capacity"):
            rt.register(torch.empty(65 << 20, dtype=torch.uint8), "device")
        assert rt.stats().as_dict()["tiers"]["device"]["current_bytes"] == 0


def test_storing_what_is_not_a_tensor_says_so(tmp_path):
    with tiermem.Runtime(_config(tmp_path)) as rt:
        for call in (lambda: rt.store([1, 2, 3], "host"), lambda: rt.register([1, 2, 3])):
            with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
                call()
        assert rt.stats().as_dict()["tiers"]["device"]["current_bytes"] == 0


def test_requests_after_close_are_clear_errors(tmp_path):
    rt = tiermem.Runtime(_config(tmp_path))
    with pytest.raises(RuntimeClosedError, match=r"inside `with tiermem\.Runtime"):
        rt.register(torch.ones(3))
    with rt:
        handle = rt.store(torch.ones(3000), "nvme")
    with pytest.raises(RuntimeClosedError):
        rt.stats()
    with pytest.raises(tiermem.errors.ObjectFreedError):
        handle.tensor()
    rt.close()  # idempotent


def test_forked_child_never_cleans_up_the_parents_files(tmp_path):
    with tiermem.Runtime(_config(tmp_path)) as rt:
        t = torch.randn(50_000)
        handle = rt.store(t.clone(), "nvme")
        handle.wait()
        before = sorted(os.listdir(tmp_path))
        pid = os.fork()
        if pid == 0:  # child: a DataLoader worker would exit like this, running cleanup hooks
            try:
                rt.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sorted(os.listdir(tmp_path)) == before
        assert torch.equal(handle.tensor(), t)  # the parent's bytes are intact
    assert os.listdir(tmp_path) == []


def test_sigkilled_run_leaves_nothing_after_the_next_start(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch, tiermem
        rt = tiermem.Runtime({_config(tmp_path)!r}).start()
        rt.store(torch.ones(100_000), "nvme").wait()
        print("stored", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "stored" in proc.stdout
    assert os.listdir(tmp_path)  # the dead run's directory is still there
    with tiermem.Runtime(_config(tmp_path)) as rt:
        live = os.listdir(tmp_path)
        assert len(live) == 1  # only this runtime's own directory
        rt.store(torch.ones(10), "nvme").wait()
    assert os.listdir(tmp_path) == []


def test_the_readmes_submodules_are_reached_from_a_plain_import_tiermem() -> None:
    """``tiermem.checkpoint.storage_reader`` and ``tiermem.distributed.PeerFailureError`` as the
    README writes them, after ``import tiermem`` alone, in a fresh interpreter."""
    code = (
        "import tiermem, sys; assert 'tiermem.checkpoint' not in sys.modules; "
        "tiermem.checkpoint.storage_reader; tiermem.distributed.PeerFailureError"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_dir_lists_the_lazy_exports_without_importing_them() -> None:
    """``dir(tiermem)`` (and so tab completion) offers every name of ``__all__`` and the
    subpackages before any was used, as well as the module's own globals, in a fresh interpreter,
    and listing them imports none of the core."""
    code = (
        "import tiermem, sys; names = dir(tiermem); "
        "missing = [n for n in [*tiermem.__all__, 'integrations', '__version__', 'os'] if n not in names]; "
        "assert not missing, missing; assert names == sorted(names), names; "
        "assert 'tiermem.runtime' not in sys.modules and 'torch' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
