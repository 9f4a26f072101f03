"""The zarr checkpoint format (NOTE [ Zarr checkpoint rules ]): DCP saves and loads a state dict of
every dtype through ZarrWriter/ZarrReader bitwise, and each array reads back without torch, both
with tensorstore and with a plain NumPy reader of the zarr v3 files written from the spec; the
format is found from what is on disk; bad input is refused and a failed save leaves nothing."""

from __future__ import annotations

import io
import itertools
import json
import math
import pathlib
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import tiermem
import tiermem.checkpoint
from tests.test_checkpoint import config, manage, train
from tiermem.checkpoint import zarr_storage
from tiermem.checkpoint.zarr_storage import ZarrReader, ZarrWriter
from tiermem.errors import CheckpointError

_SINGLE = "torch.distributed is disabled"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(37, 10, generator=g).bfloat16(),  # 13 chunk rows of 3 at 64 bytes
        "wide": torch.randn(3, 50, generator=g),  # a row bigger than a chunk: 4 chunks per row
        "transposed": torch.randn(8, 6, generator=g).t(),  # not contiguous
        "fp16": torch.randn(5, generator=g).half(),
        "int64": torch.randint(-(2**40), 2**40, (4, 3), generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.25),
        "scalar_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "step": 7,  # a non-tensor: a DCP bytes item
        "note": {"lr": 0.5, "betas": [0.9, 0.99]},
    }


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """The expected values as NumPy (ml_dtypes for bf16 and fp8)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return tensor.contiguous().numpy()


def read_zarr_array(directory: pathlib.Path) -> np.ndarray:
    """A zarr v3 array with the ``bytes`` codec and the default chunk keys, read from its files
    as the spec lays them out: no tensorstore, no torch."""
    meta = json.loads((directory / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["node_type"] == "array"
    assert meta["chunk_key_encoding"]["name"] == "default"
    (codec,) = meta["codecs"]
    assert codec["name"] == "bytes" and codec.get("configuration", {}).get("endian", "little") == "little"
    name = meta["data_type"]
    dtype = np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name).newbyteorder("<")
    shape, chunk = meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]
    out = np.zeros(shape, dtype)
    for index in itertools.product(*(range(math.ceil(s / c)) for s, c in zip(shape, chunk, strict=True))):
        block = np.frombuffer((directory / "/".join(["c", *map(str, index)])).read_bytes(), dtype).reshape(chunk)
        region = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunk, shape, strict=True))
        out[region] = block[tuple(slice(0, r.stop - r.start) for r in region)]
    return out


def test_every_dtype_round_trips_and_reads_without_torch(tmp_path):
    state = _state()
    path = tmp_path / "z"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE)
        dcp.save(state, storage_writer=ZarrWriter(path, chunk_bytes=64, in_flight_bytes=128), no_dist=True)
    group = json.loads((path / "zarr.json").read_text())
    entries = group["attributes"]["dcp"]["entries"]
    assert group["node_type"] == "group" and entries["bf16"] == {
        "array": "bf16",
        "kind": "tensor",
        "shape": [37, 10],
        "dtype": "torch.bfloat16",
    }
    assert json.loads((path / "wide" / "zarr.json").read_text())["chunk_grid"]["configuration"]["chunk_shape"] == [
        1,
        16,
    ]
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        expected = _numpy(value)
        by_spec = read_zarr_array(path / entries[key]["array"])
        by_tensorstore = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / key)}}).result()
        for got in (by_spec, by_tensorstore.read().result()):
            assert got.dtype == expected.dtype and got.shape == expected.shape, key
            assert got.tobytes() == expected.tobytes(), key  # bitwise
    betas = json.loads((path / "note.betas" / "zarr.json").read_text())  # DCP flattens the dict
    assert entries["note.betas"]["kind"] == "bytes" and betas["attributes"]["value"] == [0.9, 0.99]
    assert torch.load(io.BytesIO(read_zarr_array(path / "step").tobytes()), weights_only=True) == 7

    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    loaded["note"] = {"lr": None, "betas": None}
    loaded["transposed"] = torch.zeros(8, 6).t()  # a strided target: DCP writes into it in place
    reader = tiermem.checkpoint.storage_reader(path)
    assert isinstance(reader, ZarrReader)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE)
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(
                loaded[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
            )
        else:
            assert loaded[key] == value, key


def test_the_format_is_found_on_disk_and_recorded(tmp_path):
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(1))
        for fmt, kind in (("dcp", FileSystemReader), ("zarr", ZarrReader)):
            rt.save(tmp_path / fmt, format=fmt)
            reader = tiermem.checkpoint.storage_reader(tmp_path / fmt)
            assert isinstance(reader, kind), fmt
            assert reader.read_metadata().state_dict_metadata.keys() >= {"model.head.weight"}
            manifest = json.loads((tmp_path / fmt / "tiermem-manifest.json").read_text())
            assert manifest["storage"] == fmt
        assert any("/c/" in name for name in manifest["files"])  # the zarr arrays' chunks are digested
        rt.save(tmp_path / "dcp", format="zarr")  # a checkpoint replaces one of the other format
        assert isinstance(tiermem.checkpoint.storage_reader(tmp_path / "dcp"), ZarrReader)
        rt.load(tmp_path / "dcp")


def test_unknown_formats_and_dtypes_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        with pytest.raises(CheckpointError, match=r"format='hdf5'.*\('dcp', 'zarr'\).*Nothing was written"):
            rt.save(path, format="hdf5")
        assert not path.exists()
    with pytest.raises(CheckpointError, match=r"dtype torch\.complex32.*format='dcp'"):
        zarr_storage.zarr_dtype(torch.complex32)


def test_a_zarr_save_failing_with_writes_in_flight_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        rt.save(path, extra="first", format="zarr")
        train(model, optimizer, schedule, range(1))
        waited = []
        abandon = zarr_storage._InFlight.abandon

        def counted(self: Any) -> None:
            waited.append(len(self.pending))
            abandon(self)

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ZarrWriter, "_write_bytes", broken)  # param groups: after tensors were written
        monkeypatch.setattr(zarr_storage._InFlight, "abandon", counted)
        with pytest.raises(CheckpointError, match="No space left"):
            rt.save(path, extra="second", format="zarr")
        monkeypatch.undo()
        assert waited and waited[0] > 0  # writes were still in flight, and were waited for
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")) == []
        assert rt.load(path) == "first"
