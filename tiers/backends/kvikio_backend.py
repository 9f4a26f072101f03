"""kvikio backend: cuFile (GPUDirect Storage, or kvikio's own POSIX compatibility mode).

kvikio is imported lazily, inside this module's functions: it is an optional dependency
(``tiermem[gds]``), and it loads the CUDA driver (``libcuda.so.1``) at its first I/O even
for host buffers and in compatibility mode (TRAPS 13). So whether it can run is decided by
:func:`probe`, which does one small real write and read, never by a successful import.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from typing import Any

__all__ = ["KvikioBackend", "probe"]

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
        mode = str(kvikio.defaults.compat_mode())
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
    """

    name = "kvikio"
    handles_alignment = True
    takes_device_memory = True

    def __init__(self) -> None:
        import kvikio  # lazily: optional dependency, see the module docstring

        self._kvikio = kvikio

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
