"""NOTE [ Registered device buffers ]: the bookkeeping only, with a fake kvikio module.

What these tests can and cannot show: which segment is registered and deregistered with kvikio,
when, and for which declared buffers (the counting of rules 1-5). They never touch CUDA or cuFile:
the fake module records calls and the "device buffers" are objects carrying a
``__cuda_array_interface__`` address. Real registration on a GPU is tests/test_cuda.py's job.
"""

from __future__ import annotations

import gc
import logging
import sys
import types
from typing import Any

import pytest

from tiermem.tiers.backends import PosixBackend, kvikio_backend
from tiermem.tiers.backends.base import deregister_buffer, register_buffer, registers_device_memory
from tiermem.tiers.backends.kvikio_backend import DeviceRegistrations, Segment, gds_active

MiB = 1 << 20


class FakeDeviceBuffer:
    """Stands for a CUDA tensor: only its address matters to the bookkeeping."""

    def __init__(self, address: int, nbytes: int = 4096) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


class FakeKvikio(types.ModuleType):
    """Records memory_register / memory_deregister by the address kvikio would be given."""

    def __init__(self, *, compat: bool = False, fail_register: bool = False) -> None:
        super().__init__("kvikio")
        self.calls: list[tuple[str, int]] = []
        self.fail_register = fail_register
        self.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat)

    def memory_register(self, buf: Any) -> None:
        if self.fail_register:
            raise RuntimeError("cuFile error 5030: nvidia-fs not loaded")
        self.calls.append(("register", buf.__cuda_array_interface__["data"][0]))

    def memory_deregister(self, buf: Any) -> None:
        self.calls.append(("deregister", buf.__cuda_array_interface__["data"][0]))


# Two caching-allocator segments of 20 MiB, and one expandable segment.
SEGMENTS = [
    Segment(0x10000000, 20 * MiB, False),
    Segment(0x20000000, 20 * MiB, False),
    Segment(0x40000000, 1 << 30, True),
]


def segment_of(address: int) -> Segment | None:
    return next((s for s in SEGMENTS if s.base <= address < s.base + s.size), None)


def test_the_first_buffer_of_a_segment_registers_it_and_the_last_one_deregisters_it() -> None:
    kvikio = FakeKvikio()
    regs = DeviceRegistrations(kvikio, segment_of)
    a, b = FakeDeviceBuffer(0x10000000 + 2 * MiB), FakeDeviceBuffer(0x10000000 + 9 * MiB)
    other = FakeDeviceBuffer(0x20000000 + MiB)
    assert regs.register(a) and regs.register(b) and regs.register(other)
    # One registration per segment, by its base (cuFile refuses a second one of the same segment).
    assert kvikio.calls == [("register", 0x10000000), ("register", 0x20000000)]
    assert regs.registered_segments == {0x10000000: 2, 0x20000000: 1}
    regs.deregister(a)
    assert kvikio.calls[2:] == []  # b still lives in the segment: it stays registered
    regs.deregister(b)
    assert kvikio.calls[2:] == [("deregister", 0x10000000)]
    assert regs.registered_segments == {0x20000000: 1}
    regs.deregister(other)
    assert kvikio.calls[3:] == [("deregister", 0x20000000)] and regs.registered_segments == {}


def test_a_buffer_declared_twice_is_deregistered_by_its_second_deregistration() -> None:
    kvikio = FakeKvikio()
    regs = DeviceRegistrations(kvikio, segment_of)
    a = FakeDeviceBuffer(0x10000000)
    assert regs.register(a) and regs.register(a)
    regs.deregister(a)
    assert kvikio.calls == [("register", 0x10000000)]
    regs.deregister(a)
    assert kvikio.calls == [("register", 0x10000000), ("deregister", 0x10000000)]
    regs.deregister(a)  # rule 5: no longer declared, nothing to do
    assert len(kvikio.calls) == 2


def test_compatibility_mode_registers_nothing_and_never_looks_up_segments() -> None:
    kvikio = FakeKvikio(compat=True)

    def no_lookup(address: int) -> Segment | None:
        raise AssertionError("no segment lookup in compatibility mode")

    regs = DeviceRegistrations(kvikio, no_lookup)
    buffer = FakeDeviceBuffer(0x10000000)
    assert not regs.register(buffer)
    regs.deregister(buffer)
    regs.release_all()
    assert kvikio.calls == [] and regs.registered_segments == {}


def test_host_memory_expandable_segments_and_foreign_memory_are_not_registered() -> None:
    kvikio = FakeKvikio()
    regs = DeviceRegistrations(kvikio, segment_of)
    assert not regs.register(bytearray(4096))  # host memory: no __cuda_array_interface__
    assert not regs.register(FakeDeviceBuffer(0x40000000 + 5 * MiB))  # rule 3: expandable
    assert not regs.register(FakeDeviceBuffer(0x70000000))  # rule 3: not the caching allocator's
    assert kvikio.calls == [] and regs.registered_segments == {}


def test_a_failed_registration_is_logged_and_leaves_nothing_recorded(caplog: pytest.LogCaptureFixture) -> None:
    kvikio = FakeKvikio(fail_register=True)
    regs = DeviceRegistrations(kvikio, segment_of)
    buffer = FakeDeviceBuffer(0x10000000)
    with caplog.at_level(logging.WARNING, logger="tiermem.nvme"):
        assert not regs.register(buffer)
    assert "could not register device memory" in caplog.text and "5030" in caplog.text
    regs.deregister(buffer)  # never registered: no deregistration reaches kvikio
    assert kvikio.calls == [] and regs.registered_segments == {}


def test_release_all_deregisters_every_segment_left_registered() -> None:
    kvikio = FakeKvikio()
    regs = DeviceRegistrations(kvikio, segment_of)
    for address in (0x10000000, 0x10000000 + MiB, 0x20000000):
        regs.register(FakeDeviceBuffer(address))
    regs.release_all()
    assert sorted(kvikio.calls[2:]) == [("deregister", 0x10000000), ("deregister", 0x20000000)]
    assert regs.registered_segments == {}
    regs.deregister(FakeDeviceBuffer(0x10000000))  # released already: nothing more
    assert len(kvikio.calls) == 4


def test_the_backend_declares_through_the_base_helpers_and_releases_when_collected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kvikio = FakeKvikio()
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setattr(kvikio_backend, "cuda_segment_of", segment_of)
    backend = kvikio_backend.KvikioBackend()
    assert register_buffer(backend, FakeDeviceBuffer(0x10000000))
    assert register_buffer(backend, FakeDeviceBuffer(0x20000000))
    deregister_buffer(backend, FakeDeviceBuffer(0x20000000))
    assert kvikio.calls == [("register", 0x10000000), ("register", 0x20000000), ("deregister", 0x20000000)]
    del backend
    gc.collect()
    assert kvikio.calls[3:] == [("deregister", 0x10000000)]  # rule 4


@pytest.mark.parametrize("compat", [False, True])
def test_the_backend_says_whether_registering_does_anything(monkeypatch: pytest.MonkeyPatch, compat: bool) -> None:
    """Rule 6: what the device tier asks before it makes a registered pool."""
    monkeypatch.setitem(sys.modules, "kvikio", FakeKvikio(compat=compat))
    backend = kvikio_backend.KvikioBackend()
    assert backend.registers_device_memory is (not compat)
    assert registers_device_memory(backend) is (not compat)
    assert registers_device_memory(PosixBackend()) is False


def test_backends_without_registration_ignore_the_helpers() -> None:
    backend = PosixBackend()
    assert register_buffer(backend, FakeDeviceBuffer(0x10000000)) is False
    deregister_buffer(backend, FakeDeviceBuffer(0x10000000))  # nothing to do, and no error


@pytest.mark.parametrize(
    ("defaults", "active"),
    [
        ({"is_compat_mode_preferred": lambda: False}, True),
        ({"is_compat_mode_preferred": lambda: True}, False),
        ({"compat_mode": lambda: True}, False),  # older kvikio: a bool
        ({"compat_mode": lambda: False}, True),
        ({"compat_mode": lambda: types.SimpleNamespace(name="ON")}, False),  # a CompatMode
        ({"compat_mode": lambda: types.SimpleNamespace(name="OFF")}, True),
        ({"compat_mode": lambda: types.SimpleNamespace(name="AUTO")}, True),
    ],
)
def test_gds_active_reads_each_kvikio_generation(defaults: dict[str, Any], active: bool) -> None:
    assert gds_active(types.SimpleNamespace(defaults=types.SimpleNamespace(**defaults))) is active


def test_kvikio_26_settings_are_found_though_the_package_does_not_import_them(monkeypatch) -> None:
    """From kvikio 26, ``import kvikio`` leaves ``kvikio.defaults`` unimported, and reading the
    attribute raised AttributeError at the first device registration (seen on an H200 with kvikio
    26.10): the settings module is imported by name."""
    for compat in (False, True):
        package = types.ModuleType("fake_kvikio26")
        settings = types.ModuleType("fake_kvikio26.defaults")
        settings.is_compat_mode_preferred = lambda compat=compat: compat
        monkeypatch.setitem(sys.modules, "fake_kvikio26", package)
        monkeypatch.setitem(sys.modules, "fake_kvikio26.defaults", settings)
        assert not hasattr(package, "defaults")
        assert gds_active(package) is not compat
