"""A DCP ``StorageWriter`` / ``StorageReader`` pair that keeps each tensor in a zarr v3 array,
written and read with tensorstore (NOTE [ Zarr checkpoint rules ]).

# NOTE [ Zarr checkpoint rules ]
1. Layout: the checkpoint directory is a zarr v3 group (``zarr.json``); every DCP entry (a
   flattened state-dict key such as ``model.layers.0.weight``) is one array directly under it,
   named by the key (keys with other characters than ``[A-Za-z0-9._-]``, or that zarr reserves,
   get a safe name plus a hash of the key). Chunks are C-order blocks of at most
   :data:`CHUNK_BYTES`, raw little-endian (the ``bytes`` codec, no compression: a weight does not
   compress and a codec would cost the save its throughput), every chunk stored (also one equal
   to the fill value, so that a missing file is damage, never silent zeros).
2. Readable without torch: any zarr v3 reader opens an array and gets the tensor's values
   (``bfloat16`` and ``float8_*`` are the zarr extension data types tensorstore and ml_dtypes
   read). The group's attributes list every entry (array, kind, shape, dtype). DCP's non-tensor
   items (param groups' hyper-parameters, scalars) are 1-d ``uint8`` arrays holding the bytes
   DCP's planner serialised (``torch.save``), with the value itself in the array's attributes
   where it is plain JSON (an ``lr``, ``betas``).
3. DCP's own :class:`Metadata` (what ``read_metadata`` returns: sizes, dtypes, planner data) is
   pickled in ``dcp.metadata``, as DCP's ``.metadata``: a tiermem or DCP reader plans from it.
4. Bounded memory: a tensor is written in slabs of whole chunks (rows of the chunk grid), each an
   asynchronous tensorstore write; at most :data:`IN_FLIGHT_BYTES` of writes are uncommitted at
   once (the oldest is waited for first), and every write has copied its source before DCP's
   planner is asked for the next tensor (TRAPS 31: the planner frees the previous one then).
   A read goes from the chunk files straight into DCP's target tensor (no whole-tensor temporary).
5. Durable: tensorstore's file store fsyncs every file it writes (``file_io_sync``); the group's
   ``zarr.json`` and ``dcp.metadata`` are fsynced here; the directories are fsynced by the
   manifest (NOTE [ Checkpoint commit rules ] rule 2).
6. A failure waits for every write still in flight before it propagates, so nothing writes into
   a directory (or reads a source) that the caller is about to remove.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

#: the zarr v3 group metadata at the checkpoint's root: its presence marks the zarr format
ROOT = "zarr.json"
#: DCP's Metadata, pickled (rule 3)
METADATA = "dcp.metadata"
#: largest chunk of an array (rule 1): few files per tensor, one chunk's I/O per slab
CHUNK_BYTES = 8 << 20
#: uncommitted writes at most (rule 4)
IN_FLIGHT_BYTES = 4 * CHUNK_BYTES
DCP_VERSION = "1.0.0"

#: torch dtype -> (zarr data type, the same-size integer dtype to view it through for NumPy,
#: where NumPy has no such dtype of its own and ml_dtypes provides it)
_DTYPES: dict[torch.dtype, tuple[str, torch.dtype | None]] = {
    torch.bool: ("bool", None),
    torch.uint8: ("uint8", None),
    torch.int8: ("int8", None),
    torch.int16: ("int16", None),
    torch.int32: ("int32", None),
    torch.int64: ("int64", None),
    torch.uint16: ("uint16", None),
    torch.uint32: ("uint32", None),
    torch.uint64: ("uint64", None),
    torch.float16: ("float16", None),
    torch.float32: ("float32", None),
    torch.float64: ("float64", None),
    torch.complex64: ("complex64", None),
    torch.complex128: ("complex128", None),
    torch.bfloat16: ("bfloat16", torch.int16),
    torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8),
    torch.float8_e5m2: ("float8_e5m2", torch.uint8),
    torch.float8_e4m3fnuz: ("float8_e4m3fnuz", torch.uint8),
    torch.float8_e5m2fnuz: ("float8_e5m2fnuz", torch.uint8),
}
_SAFE = re.compile(r"[A-Za-z0-9._-]+")
_RESERVED = {ROOT, METADATA, ".", ".."}


@dataclasses.dataclass(frozen=True)
class ZarrLocation:
    """Where a DCP item lives: its array, and where the item's chunk starts in it."""

    array: str
    offsets: tuple[int, ...] = ()


def zarr_dtype(dtype: torch.dtype) -> str:
    """The zarr v3 data type of ``dtype``; a clear error for one zarr cannot hold."""
    if dtype not in _DTYPES:
        from tiermem.errors import CheckpointError

        raise CheckpointError(
            f"tiermem checkpoint: the zarr format cannot hold a tensor of dtype {dtype} (it holds "
            f"{sorted(str(d) for d in _DTYPES)}); save with format='dcp'."
        )
    return _DTYPES[dtype][0]


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (ml_dtypes' types for bf16 and fp8), by address:
    ``Tensor.numpy()`` would make the storage unresizable for good (TRAPS 32), and tiermem frees storages
    by resizing them (the save planner's copies, a model's streamed parameters). The view does
    not keep ``tensor`` alive: the caller holds it until tensorstore is done with the view."""
    name = _DTYPES[tensor.dtype][0]
    dtype = np.dtype(getattr(ml_dtypes, name) if _DTYPES[tensor.dtype][1] is not None else name)
    if tensor.numel() == 0:
        return np.empty(tuple(tensor.shape), dtype)
    itemsize = tensor.element_size()
    span = 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    memory = (ctypes.c_byte * (span * itemsize)).from_address(tensor.data_ptr())
    flat = np.frombuffer(memory, dtype=dtype)
    return np.lib.stride_tricks.as_strided(
        flat, shape=tuple(tensor.shape), strides=tuple(stride * itemsize for stride in tensor.stride())
    )


def chunk_shape(shape: list[int], itemsize: int, limit: int = CHUNK_BYTES) -> list[int]:
    """Rule 1: the largest C-order block of ``shape`` of at most ``limit`` bytes (whole trailing
    dimensions, part of one, ones before it)."""
    chunk = list(shape)
    inner = itemsize
    for d in reversed(range(len(shape))):
        if inner * shape[d] <= limit:
            inner *= shape[d]
            continue
        chunk[d] = max(1, limit // inner)
        chunk[:d] = [1] * d
        break
    return [max(1, c) for c in chunk]


def array_name(fqn: str) -> str:
    """Rule 1: the array's name for a DCP key: the key itself where zarr and file systems take it."""
    if _SAFE.fullmatch(fqn) and not fqn.startswith("__") and fqn not in _RESERVED:
        return fqn
    digest = hashlib.sha1(fqn.encode()).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', fqn).lstrip('_.')[:80]}-{digest}"


def _context(sync: bool = True) -> ts.Context:
    # no chunk cache: a written or read chunk is not kept (bounded memory, rule 4)
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": sync})


def _spec(path: Path) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}


def _json_value(raw: bytes) -> Any:
    """Rule 2: a bytes item's value where it is plain JSON (an lr, betas), else None."""
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        text = json.dumps(value, allow_nan=False)
    except Exception:  # noqa: BLE001  (any value that is not plain data simply has no JSON form)
        return None
    return json.loads(text)


def _write_synced(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _InFlight:
    """Rule 4: tensorstore writes not yet committed, at most ``limit`` bytes of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending: collections.deque[tuple[Any, int]] = collections.deque()
        self.bytes = 0

    def add(self, write: Any, nbytes: int) -> None:
        self.pending.append((write, nbytes))
        self.bytes += nbytes
        while self.bytes > self.limit and len(self.pending) > 1:
            self._oldest()

    def _oldest(self) -> None:
        write, nbytes = self.pending.popleft()
        self.bytes -= nbytes
        write.commit.result()

    def drain(self) -> None:
        while self.pending:
            self._oldest()

    def abandon(self) -> None:
        """Rule 6: wait for every write (its errors are the failure's consequences, not news)."""
        while self.pending:
            write, _ = self.pending.popleft()
            with contextlib.suppress(Exception):
                write.commit.result()
        self.bytes = 0


class ZarrWriter(StorageWriter):
    """DCP ``StorageWriter``: each entry a zarr v3 array under ``path`` (NOTE [ Zarr checkpoint rules ])."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        chunk_bytes: int = CHUNK_BYTES,
        in_flight_bytes: int = IN_FLIGHT_BYTES,
        sync_files: bool = True,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.in_flight_bytes = in_flight_bytes
        self.context = _context(sync_files)
        self.sync_files = sync_files
        self._arrays: dict[str, ts.TensorStore] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self._arrays = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def _array(self, name: str, shape: list[int], dtype: str, itemsize: int, attributes: dict[str, Any]) -> Any:
        store = self._arrays.get(name)
        if store is None:
            metadata = {
                "shape": shape,
                "data_type": dtype,
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": chunk_shape(shape, itemsize, self.chunk_bytes)},
                },
                "chunk_key_encoding": {"name": "default"},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                "fill_value": False if dtype == "bool" else 0,
                "attributes": attributes,
            }
            spec = {**_spec(self.path / name), "metadata": metadata, "store_data_equal_to_fill_value": True}
            store = self._arrays[name] = ts.open(spec, create=True, open=True, context=self.context).result()
        return store

    def _write_tensor(self, item: WriteItem, tensor: torch.Tensor, writes: _InFlight) -> WriteResult:
        data = item.tensor_data
        assert data is not None
        dtype = data.properties.dtype
        shape = list(data.size)
        name = array_name(item.index.fqn)
        attributes = {"dcp": {"key": item.index.fqn, "kind": "tensor", "torch_dtype": str(dtype)}}
        store = self._array(name, shape, zarr_dtype(dtype), tensor.element_size(), attributes)
        offsets = list(data.chunk.offsets)
        host = tensor.detach().cpu().reshape(list(data.chunk.sizes))  # held until every copy is done
        source = as_numpy(host)
        copies = []
        if source.ndim == 0:
            copies.append(store.write(source))
            writes.add(copies[-1], source.nbytes)
        else:
            rows = store.chunk_layout.write_chunk.shape[0]
            start, end = offsets[0], offsets[0] + source.shape[0]
            while start < end:
                stop = min(end, (start // rows + 1) * rows)  # whole chunk rows: no read-modify-write
                inner = (slice(o, o + n) for o, n in zip(offsets[1:], source.shape[1:], strict=True))
                region = (slice(start, stop), *inner)
                copies.append(store[region].write(source[start - offsets[0] : stop - offsets[0]]))
                writes.add(copies[-1], source[: stop - start].nbytes)
                start = stop
        for write in copies:
            write.copy.result()  # the source may be freed once the planner is asked for the next tensor
        location = ZarrLocation(name, tuple(offsets))
        return WriteResult(index=item.index, size_in_bytes=source.nbytes, storage_data=location)

    def _write_bytes(self, item: WriteItem, value: io.BytesIO, writes: _InFlight) -> WriteResult:
        raw = value.getvalue()
        name = array_name(item.index.fqn)
        attributes: dict[str, Any] = {"dcp": {"key": item.index.fqn, "kind": "bytes", "serialization": "torch.save"}}
        plain = _json_value(raw)
        if plain is not None:
            attributes["value"] = plain
        store = self._array(name, [len(raw)], "uint8", 1, attributes)
        writes.add(store.write(np.frombuffer(raw, dtype=np.uint8)), len(raw))
        return WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=ZarrLocation(name))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        writes = _InFlight(self.in_flight_bytes)
        results = []
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    results.append(self._write_bytes(item, data, writes))
                else:
                    assert isinstance(data, torch.Tensor)
                    results.append(self._write_tensor(item, data, writes))
            writes.drain()
        except BaseException:
            writes.abandon()
            raise
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rules 2 and 3: DCP's metadata, then the group with its index of entries."""
        metadata.version = DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        _write_synced(self.path / METADATA, pickle.dumps(metadata))
        entries: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            entry: dict[str, Any] = {"array": array_name(key)}
            if hasattr(md, "size"):
                entry.update(kind="tensor", shape=list(md.size), dtype=str(md.properties.dtype))
            else:
                entry["kind"] = "bytes"
            entries[key] = entry
        attributes = {"dcp": {"metadata": METADATA, "entries": entries}}
        group = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
        _write_synced(self.path / ROOT, json.dumps(group, indent=1).encode())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class ZarrReader(StorageReader):
    """DCP ``StorageReader`` for a checkpoint :class:`ZarrWriter` wrote."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self.context = _context()
        self.storage_data: dict[MetadataIndex, ZarrLocation] = {}
        self._arrays: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self._arrays = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(self.path / METADATA, "rb") as f:
            metadata = pickle.load(f)
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path / METADATA} holds a {type(metadata).__name__}, not DCP Metadata")
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _array(self, name: str) -> Any:
        store = self._arrays.get(name)
        if store is None:
            store = self._arrays[name] = ts.open(_spec(self.path / name), open=True, context=self.context).result()
        return store

    def _read_tensor(self, item: ReadItem, location: ZarrLocation, planner: LoadPlanner) -> None:
        store = self._array(location.array)
        region = tuple(
            slice(base + offset, base + offset + n)
            for base, offset, n in zip(location.offsets, item.storage_offsets, item.lengths, strict=True)
        )
        source = store[region].translate_to[0] if region else store
        target = planner.resolve_tensor(item).detach()
        if target.device.type == "cpu":
            # rule 4: straight from the chunk files into the target's memory
            ts.array(as_numpy(target), copy=False, write=True, context=self.context).write(source).result()
        else:
            values = torch.empty(list(item.lengths), dtype=target.dtype)  # a device target: read, then copy
            ts.array(as_numpy(values), copy=False, write=True, context=self.context).write(source).result()
            target.copy_(values)
        planner.commit_tensor(item, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            location = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                raw = self._array(location.array).read().result()
                planner.load_bytes(item, io.BytesIO(raw.tobytes()))
            else:
                self._read_tensor(item, location, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return (Path(checkpoint_id) / ROOT).exists()
