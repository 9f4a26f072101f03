"""``rt.init()``: build a model whose parameters do not fit in RAM.

# NOTE [ Materialising under rt.init() ]
1. Inside ``with rt.init():``, every CPU floating-point tensor of at least ``min_bytes`` that
   ``torch.empty``, ``zeros``, ``ones`` or ``full`` creates (``nn.Linear``, ``nn.Embedding``,
   the norms and most custom modules create their parameters this way) is backed by a file
   in a run directory on the first NVMe path, mapped shared and unlinked at once. Its pages
   are file-backed: under memory pressure the kernel writes them to the drive instead of
   failing, and the space is gone with the last mapping (no file is left behind, even when
   the process is killed).
2. The modules' own initialisation runs unchanged on those tensors, in construction order,
   with the global RNG: the values are bitwise those of a plain construction with the same
   seed. Random factories (``torch.randn``...) are not redirected (their values must stay
   torch's own), so a module that draws its parameters from them builds them in RAM.
3. ``rt.manage(model, ...)`` then copies the parameters into chunks in their home tiers, one
   chunk at a time (construction order; re-packed by a first-step plan or at the first step
   after the first forward, NOTE [ Model-state rules ] rules 2 and 9); the mappings go when
   nothing refers to them any more.
   A model built here and never managed keeps working on its file-backed tensors.
4. On tmpfs the "file" is RAM: the run says so once with a warning.
5. Resident memory: a written page of a shared file mapping counts in the process's RSS until
   it is unmapped, although the kernel may drop it. So when a torch op on one of these tensors
   returns (an initialiser's ``normal_``, ``fill_``...), its pages are unmapped from the
   process (``MADV_DONTNEED``: the bytes stay in the file and the page cache and fault back in
   when read, by the next op or by ``rt.manage``), and all of them once the ``with`` block
   ends: building a model larger than RAM holds about one tensor's pages at a time; and
   ``rt.manage`` drops each parameter's pages once it copied them into its chunk
   (``release_file_pages``). tests/test_states_init.py measures a fresh process's ru_maxrss.
6. Leaving the runtime hands parameters back as ordinary tensors; when they exceed the memory
   tiers' capacities (the user's promise), they come back on file-backed pages the same way
   (``file_backed_empty`` under the first NVMe path, pages unmapped once written), so closing
   a model larger than its capacities does not pull it into RAM (NOTE [ Model-state rules ]
   rule 1).
7. Every such file has its blocks reserved (``posix_fallocate``) before it is mapped: a write
   to a shared mapping of a sparse file that finds the disk full kills the process with SIGBUS,
   with nothing to catch (TRAPS 43). Measured: the 2.5x-RAM headline GPT's plain loop, its NVMe
   tier grown to 66 GiB of the disk's 76, died with SIGBUS handing 14.8 GiB of parameters back
   at close. Now a full disk is an error that names the bytes and the free space
   (:class:`StorageError`; ``Runtime.close`` then leaves the model unusable and says why, and the
   restore checks the free space before it writes a byte).

The run directory and the filesystem check come from the runtime (``run_directory``,
``is_tmpfs``): this module touches no tier.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from tiermem.errors import StorageError
from tiermem.units import format_size

log = logging.getLogger("tiermem.states")

#: Factories whose result is fully determined without the RNG: safe to redirect (rule 2).
_FILLS: dict[Callable[..., Any], Callable[[torch.Tensor], None]] = {
    torch.empty: lambda t: None,
    torch.zeros: lambda t: None,  # a new file reads as zeros
    torch.ones: lambda t: t.fill_(1),
    torch.full: lambda t: None,  # filled from the meta result's fill value below
}

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_DONTNEED = mmap.MADV_DONTNEED


def _dont_need(mapping: torch.Tensor) -> None:
    """Rule 5: unmap ``mapping``'s pages from the process (a shared file mapping: bytes kept)."""
    # torch.from_file maps the whole file at a page-aligned address
    if _LIBC.madvise(ctypes.c_void_p(mapping.data_ptr()), ctypes.c_size_t(mapping.numel()), _DONTNEED):
        raise OSError(ctypes.get_errno(), "tiermem init: madvise(MADV_DONTNEED) failed")


def release_file_pages(tensor: torch.Tensor) -> None:
    """Rule 5 for a reader (``rt.manage`` copying parameters into chunks): once ``tensor``'s
    bytes are copied out, a tensor over a shared mapping (a file-backed one from ``rt.init()``,
    or shared memory) has its storage's pages unmapped from the process; anything else is left
    alone (dropping private pages would lose them)."""
    if tensor.device.type != "cpu" or not tensor.is_shared():
        return
    storage = tensor.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    first = -(-start // page) * page  # whole pages inside the storage only
    end = (start + nbytes) // page * page
    if end > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _DONTNEED)


def _reserve(fd: int, path: str, nbytes: int, what: str) -> None:
    """Rule 7: the file's ``nbytes`` reserved on disk before it is mapped, or a clear error."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        free = shutil.disk_usage(os.path.dirname(path)).free
        raise StorageError(
            f"tiermem {what}: cannot reserve {format_size(nbytes)} for file-backed pages at {path} "
            f"({exc.strerror or exc}; {format_size(free)} free on that filesystem). Free space there or point the "
            "first [nvme] path at a larger filesystem (NOTE [ Materialising under rt.init() ] rule 7)",
            exc.errno,
            path,
        ) from exc


def file_backed_empty(directory: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rule 6: an uninitialised tensor on a shared mapping of a new file in ``directory``,
    unlinked at once (the mapping keeps the space until the tensor goes); its blocks reserved
    first (rule 7)."""
    nbytes = math.prod(shape) * dtype.itemsize
    fd, path = tempfile.mkstemp(prefix="tiermem-restored-", suffix=".bin", dir=directory)
    try:
        # an empty tensor still maps one byte: mmap takes no empty file
        _reserve(fd, path, max(nbytes, 1), "restoring parameters")
        tensor = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    finally:
        os.unlink(path)
        os.close(fd)
    return tensor[:nbytes].view(dtype).view(shape)


DEFAULT_MIN_BYTES = 64 * 1024
"""Smaller tensors (biases, norms) stay in RAM: a mapping per tiny tensor costs more than it saves."""


class _FileBacked(TorchFunctionMode):
    """Rule 1: redirect large CPU float factories to unlinked, shared file mappings."""

    def __init__(self, directory: str, min_bytes: int) -> None:
        super().__init__()
        self.directory = directory
        self.min_bytes = min_bytes
        self._names = itertools.count()
        self.tensors = 0
        self.bytes = 0
        #: rule 5: the mappings made inside the ``with`` block
        self._mappings: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _FILLS:
            result = func(*args, **kwargs)
            if self._mappings:  # nn.init passes its tensor by keyword
                for value in itertools.chain(args, kwargs.values()):
                    if isinstance(value, torch.Tensor):
                        self._drop_written(value)
            return result
        if not self._redirectable(kwargs):
            return func(*args, **kwargs)
        meta = func(*args, **{**kwargs, "device": "meta"})
        nbytes = meta.numel() * meta.element_size()
        if not meta.dtype.is_floating_point or nbytes < self.min_bytes:
            return func(*args, **kwargs)
        tensor = self._mapped(nbytes).view(meta.dtype).view(meta.shape)
        if func is torch.full:
            fill = args[1] if len(args) > 1 else kwargs["fill_value"]
            tensor.fill_(fill)
        else:
            _FILLS[func](tensor)
        self.tensors += 1
        self.bytes += nbytes
        return tensor.requires_grad_(bool(kwargs.get("requires_grad", False)))

    def _mapped(self, nbytes: int) -> torch.Tensor:
        """Rule 1: ``nbytes`` of a shared mapping of a new file, unlinked at once (the mapping
        keeps the space; nothing to clean up later)."""
        path = os.path.join(self.directory, f"init-{next(self._names)}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _reserve(fd, path, nbytes, "init")  # a full disk is an error here, not a SIGBUS later (rule 7)
            tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            os.unlink(path)
            os.close(fd)
        # rule 5: held until the block ends, so the address range stays this mapping's
        self._mappings[tensor.data_ptr()] = tensor
        return tensor

    def _drop_written(self, tensor: torch.Tensor) -> None:
        """Rule 5: an op on ``tensor`` returned; if it is one of ours, its pages go."""
        try:
            mapping = self._mappings.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # meta and tensor subclasses without storage
            return
        if mapping is not None:
            _dont_need(mapping)

    def drop_pages(self) -> None:
        """Rule 5: unmap the pages of every tensor made so far from this process (bytes kept)."""
        for mapping in self._mappings.values():
            _dont_need(mapping)

    def close(self) -> None:
        """Rule 5 at the ``with`` block's end; the mappings then live only in their tensors."""
        self.drop_pages()
        self._mappings.clear()

    @staticmethod
    def _redirectable(kwargs: dict[str, Any]) -> bool:
        device = kwargs.get("device")
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "cpu":
            return False
        if kwargs.get("pin_memory") or kwargs.get("out") is not None:
            return False
        layout = kwargs.get("layout")
        return layout in (None, torch.strided) and kwargs.get("memory_format") in (None, torch.contiguous_format)


class Directory(Protocol):
    """A private directory for the files (a run directory, NOTE [ Run directory rules ])."""

    @property
    def path(self) -> str: ...


@contextlib.contextmanager
def file_backed_init(
    parent: str,
    min_bytes: int = DEFAULT_MIN_BYTES,
    *,
    run_directory: Callable[[str], AbstractContextManager[Directory]],
    is_tmpfs: Callable[[str], bool],
) -> Iterator[_FileBacked]:
    """Rule 1: the context ``rt.init()`` opens; ``parent`` is the first NVMe path, under which
    ``run_directory(parent)`` makes the private directory; ``is_tmpfs(parent)``: rule 4."""
    if min_bytes < 1:
        raise ValueError(f"tiermem init: min_bytes must be at least 1, got {min_bytes}")
    if is_tmpfs(parent):
        log.warning("tiermem init: %s is on tmpfs, so the parameters built here stay in RAM (rule 4)", parent)
    with run_directory(parent) as rundir:
        mode = _FileBacked(rundir.path, min_bytes)
        try:
            with mode:
                yield mode
        finally:
            mode.close()
        log.info("tiermem init: %d tensors (%d bytes) on file-backed pages under %s", mode.tensors, mode.bytes, parent)
