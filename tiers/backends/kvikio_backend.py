"""kvikio backend: cuFile (GPUDirect Storage, or kvikio's own POSIX compatibility mode).

kvikio is imported lazily, inside this module's functions: it is an optional dependency
(``tiermem[gds]``), and it loads the CUDA driver (``libcuda.so.1``) at its first I/O even
for host buffers and in compatibility mode (TRAPS 13). So whether it can run is decided by
:func:`probe`, which does one small real write and read, never by a successful import.

# NOTE [ Registered device buffers ]
1. Device memory is registered with cuFile only when a caller declares it long-lived
   (:func:`~tiermem.tiers.backends.base.register_buffer`: many I/Os until it is deregistered) and
   GPUDirect Storage is active. kvikio documents registration as a gain for streaming buffers
   reused across many cuFile I/Os, a possible loss for one-time transfers, and a no-op in
   compatibility mode. Everything else (host memory, one-off device tensors, compatibility mode)
   goes to ``pread``/``pwrite`` unregistered, as it did before.
2. ``kvikio.memory_register`` registers the whole CUDA allocation holding the buffer, and
   PyTorch's caching allocator cuts many tensors out of one allocation (a segment). So
   registrations are counted per segment: the first declared buffer of a segment registers it,
   the last one deregistered deregisters it. cuFile refuses a second registration of a segment,
   and one deregistration ends it for every buffer inside.
3. A buffer in an expandable segment (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), or in
   memory the caching allocator does not know, is not registered: kvikio would register only the
   driver mapping holding it, which the allocator's snapshot does not show, so another buffer of
   the segment could be counted as covered when it is not.
4. Deregistration comes before the memory can go back to the driver: a caller deregisters before
   it drops the buffer (a live tensor keeps its segment allocated), and what is still registered
   when the backend is closed or collected is deregistered then (:meth:`DeviceRegistrations.release_all`).
5. A registration that fails is logged and counted as not made: the buffer's I/O still works,
   unregistered. A deregistration of a buffer never registered does nothing.
6. Training's streamed chunk buffers are long-lived only as *memory*, not as tensors (a chunk's
   storage is emptied and refilled on every fetch), so they are not declared one by one: the
   device tier allocates them from a private pool whose segments it declares once each and
   undeclares before the pool can give them back (NOTE [ Registered device pool ] in
   :mod:`tiermem.tiers.device_pool`). :attr:`KvikioBackend.registers_device_memory` tells it
   whether declaring does anything here.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "DevicePointer",
    "DeviceRegistrations",
    "KvikioBackend",
    "Segment",
    "cuda_segment_of",
    "gds_active",
    "probe",
]

logger = logging.getLogger("tiermem.nvme")

_PROBE_TIMEOUT_S = 120.0

# The probe runs in a child interpreter: a missing or broken CUDA driver can abort the
# process inside native code instead of raising, and "auto" must survive that.
_PROBE_CODE = r"""
import os, sys, tempfile
import numpy as np
import kvikio
fd, path = tempfile.mkstemp(prefix=".tiermem-kvikio-probe-", dir=sys.argv[1])
os.close(fd)
try:
    f = kvikio.CuFile(path, "r+")
    try:
        data = np.arange(4096, dtype=np.uint8)
        n = f.pwrite(data, 4096, 0).get()
        back = np.zeros(4096, dtype=np.uint8)
        m = f.pread(back, 4096, 0).get()
    finally:
        f.close()
    if n != 4096 or m != 4096 or not np.array_equal(data, back):
        sys.exit(f"probe I/O returned wrong bytes (wrote {n}, read {m})")
    mode = "unknown"
    try:
        import kvikio.defaults  # a submodule that `import kvikio` does not load (TRAPS 39)

        settings = kvikio.defaults
        mode = str(settings.get("compat_mode") if hasattr(settings, "get") else settings.compat_mode())
    except Exception:
        pass
    print(f"kvikio {getattr(kvikio, '__version__', '?')}, compat_mode={mode}")
finally:
    os.unlink(path)
"""

_cache: dict[int, tuple[bool, str]] = {}
_cache_lock = threading.Lock()


def probe(directory: str | os.PathLike[str]) -> tuple[bool, str]:
    """Whether kvikio can do I/O on files in ``directory``, and why (or why not).

    Runs one 4 KiB write and read in a child interpreter (TRAPS 13). Cached per filesystem
    for the life of the process.
    """
    directory = os.fspath(directory)
    if importlib.util.find_spec("kvikio") is None:
        return False, "kvikio is not installed"
    try:
        key = os.stat(directory).st_dev
    except OSError as exc:
        return False, f"cannot stat {directory}: {exc.strerror}"
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        result = _run_probe(directory)
        _cache[key] = result
        return result


def _run_probe(directory: str) -> tuple[bool, str]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE, directory],
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"probe could not run: {exc}"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()
        why = tail[-1] if tail else f"exit status {done.returncode}"
        return False, f"probe I/O failed: {why}"
    return True, f"probe I/O succeeded ({done.stdout.strip()})"


# -- registered device buffers (NOTE [ Registered device buffers ]) ------------------------------------
class Segment(NamedTuple):
    """The CUDA allocation (caching-allocator segment) holding a buffer."""

    base: int
    size: int
    expandable: bool


def cuda_segment_of(address: int) -> Segment | None:
    """The caching allocator's segment holding device ``address``, from ``torch.cuda.memory_snapshot()``
    (rare: once per buffer registered), or None when the allocator does not own that memory."""
    import torch

    for seg in torch.cuda.memory_snapshot():
        base, size = int(seg["address"]), int(seg["total_size"])
        if base <= address < base + size:
            return Segment(base, size, bool(seg.get("is_expandable", False)))
    return None


def kvikio_defaults(kvikio: Any) -> Any:
    """kvikio's settings module: a submodule the package's ``__init__`` does not import, so the
    attribute is missing until something imports it by name (TRAPS 39)."""
    defaults = getattr(kvikio, "defaults", None)
    if defaults is None:
        defaults = importlib.import_module(f"{kvikio.__name__}.defaults")
    return defaults


def gds_active(kvikio: Any) -> bool:
    """Whether kvikio does cuFile (GDS) I/O rather than its POSIX compatibility mode. Older kvikio
    has only ``compat_mode()`` (a bool, or a CompatMode where AUTO is decided at first use: taken as
    active, since kvikio's own registration skips itself when compatibility mode wins)."""
    defaults = kvikio_defaults(kvikio)
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:
        return not bool(preferred())
    mode = defaults.compat_mode()
    if isinstance(mode, bool):
        return not mode
    return str(getattr(mode, "name", mode)).upper() != "ON"


class DevicePointer:
    """An address as kvikio's array-likes read it (``__cuda_array_interface__``), to deregister a
    segment by its base after the buffer that registered it is gone."""

    def __init__(self, address: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (1,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


def _address(buffer: Any) -> int:
    return int(buffer.__cuda_array_interface__["data"][0])


class DeviceRegistrations:
    """Which segments are registered with cuFile, for which declared buffers (rules 2-5).

    ``kvikio`` is the kvikio module (``memory_register``, ``memory_deregister``, ``defaults``);
    ``segment_of`` maps a device address to its :class:`Segment` (default :func:`cuda_segment_of`).
    Thread-safe."""

    def __init__(self, kvikio: Any, segment_of: Callable[[int], Segment | None] | None = None) -> None:
        self._kvikio = kvikio
        self._segment_of = segment_of
        self._active: bool | None = None  # decided at the first registration: it may load libcufile
        self._lock = threading.Lock()
        #: declared buffer address -> (its segment base, how many times declared)
        self._buffers: dict[int, tuple[int, int]] = {}
        #: registered segment base -> declared buffers inside it
        self._segments: dict[int, int] = {}

    @property
    def active(self) -> bool:
        """Whether a registration would be made (GDS active: rule 1); decided once, at first need."""
        with self._lock:
            return self._active_locked()

    def _active_locked(self) -> bool:
        """:attr:`active`, with ``self._lock`` held."""
        if self._active is None:
            self._active = gds_active(self._kvikio)
        return self._active

    @property
    def registered_segments(self) -> dict[int, int]:
        """Registered segment base -> declared buffers inside it (a copy)."""
        with self._lock:
            return dict(self._segments)

    def register(self, buffer: Any) -> bool:
        """Rule 1: register ``buffer``'s segment if it is device memory and GDS is active; True if
        ``buffer`` is now covered by a registration this object made."""
        if not hasattr(buffer, "__cuda_array_interface__"):
            return False  # host memory: cuFile registration is for device buffers here
        address = _address(buffer)
        with self._lock:
            if address in self._buffers:
                base, count = self._buffers[address]
                self._buffers[address] = (base, count + 1)
                return True
            if not self._active_locked():
                return False  # rule 1: a no-op in compatibility mode, so no bookkeeping either
            segment = (self._segment_of or cuda_segment_of)(address)
            if segment is None or segment.expandable:
                return False  # rule 3: memory the allocator cannot vouch for is not registered
            if segment.base not in self._segments:
                try:
                    self._kvikio.memory_register(DevicePointer(segment.base))
                except Exception as exc:  # noqa: BLE001 - rule 5: the I/O works unregistered
                    logger.warning("tiermem nvme: kvikio could not register device memory (used unregistered): %s", exc)
                    return False
                self._segments[segment.base] = 0
            self._segments[segment.base] += 1
            self._buffers[address] = (segment.base, 1)
            return True

    def deregister(self, buffer: Any) -> None:
        """Rule 2: the last declared buffer of a segment to go deregisters the segment."""
        if not hasattr(buffer, "__cuda_array_interface__"):
            return
        address = _address(buffer)
        with self._lock:
            entry = self._buffers.get(address)
            if entry is None:
                return  # rule 5: never registered, nothing to undo
            base, count = entry
            if count > 1:
                self._buffers[address] = (base, count - 1)
                return
            del self._buffers[address]
            self._segments[base] -= 1
            if self._segments[base] == 0:
                del self._segments[base]
                self._deregister_segment(base)

    def release_all(self) -> None:
        """Rule 4: deregister every segment still registered (backend closed or collected)."""
        with self._lock:
            bases = list(self._segments)
            self._segments.clear()
            self._buffers.clear()
        for base in bases:
            self._deregister_segment(base)

    def _deregister_segment(self, base: int) -> None:
        try:
            self._kvikio.memory_deregister(DevicePointer(base))
        except Exception as exc:  # noqa: BLE001 - nothing to undo; the memory stays valid
            logger.warning("tiermem nvme: kvikio could not deregister device memory at 0x%x: %s", base, exc)


def _nbytes(array: Any) -> int:
    """Bytes of a NumPy array or a (1-D uint8) torch tensor."""
    return int(array.nbytes)


class KvikioBackend:
    """File I/O through ``kvikio.CuFile``. Handles are ``CuFile`` objects.

    kvikio opens each file twice, once with ``O_DIRECT``, and stages unaligned requests
    itself, so the tier passes buffers as they are (``handles_alignment``).

    ``takes_device_memory``: ``CuFile.pread``/``pwrite`` take device memory as well as host
    memory (any object with ``__cuda_array_interface__``, as a CUDA tensor has), at any offset and
    size: GPUDirect Storage moves it between the file and the GPU where the driver and
    filesystem allow, kvikio's compatibility mode through its own pinned bounce buffers
    otherwise. So the NVMe tier hands CUDA tensors over as they are (NOTE [ NVMe tier layout and
    I/O ] rule 7) instead of staging them on the host first.

    ``register_buffer`` / ``deregister_buffer``: long-lived device buffers registered with cuFile
    (NOTE [ Registered device buffers ]).
    """

    name = "kvikio"
    handles_alignment = True
    takes_device_memory = True

    def __init__(self) -> None:
        import kvikio  # lazily: optional dependency, see the module docstring

        self._kvikio = kvikio
        self.registrations = DeviceRegistrations(kvikio)
        # Rule 4: what callers left registered is deregistered when the backend goes.
        self._release = weakref.finalize(self, self.registrations.release_all)

    @property
    def registers_device_memory(self) -> bool:
        """Whether :meth:`register_buffer` registers anything here: GPUDirect Storage is active
        (rule 1; in compatibility mode registration is a no-op)."""
        return self.registrations.active

    def register_buffer(self, buffer: Any) -> bool:
        return self.registrations.register(buffer)

    def deregister_buffer(self, buffer: Any) -> None:
        self.registrations.deregister(buffer)

    def open(self, path: str, *, direct: bool) -> Any:
        # CuFile "r+" needs an existing file and "w" would truncate: create it first.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        return self._kvikio.CuFile(path, "r+")

    @staticmethod
    def _array(buffer: Any) -> Any:
        """Device memory as it is (kvikio reads ``__cuda_array_interface__``); host memory as bytes."""
        if hasattr(buffer, "__cuda_array_interface__"):
            return buffer
        import numpy as np

        return np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)

    def pread(self, handle: Any, buffer: Any, offset: int) -> int:
        array = self._array(buffer)
        return int(handle.pread(array, _nbytes(array), offset).get())

    def pwrite(self, handle: Any, buffer: Any, offset: int) -> int:
        array = self._array(buffer)
        return int(handle.pwrite(array, _nbytes(array), offset).get())

    def fallocate(self, handle: Any, offset: int, length: int) -> None:
        if length > 0:
            os.posix_fallocate(handle.fileno(), offset, length)

    def fdatasync(self, handle: Any) -> None:
        os.fdatasync(handle.fileno())

    def close(self, handle: Any) -> None:
        handle.close()

    def __repr__(self) -> str:
        return "KvikioBackend()"
