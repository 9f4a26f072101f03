"""What a checkpoint directory holds and whether it is complete, for ``tiermem checkpoint inspect``.

::

    report = inspect_checkpoint("ckpt")
    report.complete, report.step, report.tensors, report.largest[0].shape

Read-only: nothing is changed, repaired or removed (a save or load of the path does that,
NOTE [ Checkpoint commit rules ] rules 1 and 3).

# NOTE [ Inspecting a checkpoint ]
1. Complete means: the manifest is there and every file matches its size and digest
   (``files.verify``, rule 4 of NOTE [ Checkpoint commit rules ]), and the DCP metadata reads.
   A directory with DCP's metadata and no tiermem files is a plain DCP checkpoint: complete
   when its metadata reads (it has no digests to check, and the report says so).
2. Tensors, their shapes, dtypes and bytes come from the DCP metadata through
   ``storage_reader(path)``, so every on-disk format reports the same way; no tensor is read.
3. The step is ``extra["step"]`` where ``extra`` is a dict that has one (``tiermem train``
   writes it), and the run settings ``extra["run"]`` where it is a dict (``tiermem train``'s:
   model, batch size, lr, seed, world size; the ones ``--resume`` must be given again); both are
   read from the state file only once the digests verified, since that file is unpickled
   (inspect only checkpoints you trust, as for a load).
4. Beside the path: a temporary sibling whose lock is free is a save that died (the next save
   removes it); one whose lock is held is a save running now; an ``-old-`` sibling is a
   fallback commit's leftover (the next load or save restores or removes it).
5. One checkpoint: the directory is locked for reading while it is inspected (NOTE
   [ Checkpoint commit rules ] rule 7), so a save committing meanwhile waits, never mixes in.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tiermem.checkpoint import files, storage_reader
from tiermem.errors import CheckpointError

__all__ = ["CheckpointReport", "TensorInfo", "inspect_checkpoint"]

#: The sibling names a save uses (NOTE [ Checkpoint commit rules ] rules 1 and 3).
_TMP_TAG = ".tiermem-tmp-"
_OLD_TAG = ".tiermem-old-"
#: what reading a missing, truncated or damaged metadata file raises (pickle's errors, I/O)
_UNREADABLE = (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, RuntimeError, KeyError)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint: its DCP name (``model.<param>``, ``optimizer.state...``)."""

    name: str
    shape: list[int]
    dtype: str
    bytes: int


@dataclass
class CheckpointReport:
    """What :func:`inspect_checkpoint` found; ``as_dict()`` is ``--json``'s shape."""

    path: str
    exists: bool = False
    format: str | None = None
    complete: bool = False
    #: why it is not complete (None when it is)
    problem: str | None = None
    #: whether file digests were checked (a plain DCP checkpoint has none)
    verified: bool = False
    step: int | None = None
    extra_keys: list[str] | None = None
    #: rule 3: the run settings ``tiermem train`` saved (what ``--resume`` checks), where there are
    run: dict[str, Any] | None = None
    files: int = 0
    bytes_on_disk: int = 0
    tensors: int = 0
    tensor_bytes: int = 0
    #: tensors and bytes per top-level section (``model``, ``optimizer``)
    sections: dict[str, dict[str, int]] = field(default_factory=dict)
    largest: list[TensorInfo] = field(default_factory=list)
    #: rule 4: temporary siblings of saves that died, of saves running now, and fallback leftovers
    interrupted: list[str] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)
    leftover_old: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _siblings(path: Path, tag: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f".{path.name}{tag}*"))


def _lock_is_free(directory: Path) -> bool:
    """Rule 4: a save holds an ``flock`` on its temporary directory for its whole life."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases the lock if we took it
    return True


def _format_of(path: Path) -> str | None:
    try:
        manifest = json.loads((path / files.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and isinstance(manifest.get("format"), str):
        return str(manifest["format"])
    return None


def _tensor_bytes(entry: TensorStorageMetadata) -> int:
    dtype = entry.properties.dtype
    return math.prod(entry.size) * torch.empty((), dtype=dtype).element_size()


def _read_tensors(report: CheckpointReport, path: Path, largest: int) -> None:
    """Rule 2: tensors from the DCP metadata; raises what the format's reader raises."""
    metadata = storage_reader(path).read_metadata()
    infos = []
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue  # a pickled object (param groups' values, scalars)
        info = TensorInfo(
            name, list(entry.size), str(entry.properties.dtype).removeprefix("torch."), _tensor_bytes(entry)
        )
        infos.append(info)
        section = report.sections.setdefault(name.split(".", 1)[0], {"tensors": 0, "bytes": 0})
        section["tensors"] += 1
        section["bytes"] += info.bytes
    report.tensors = len(infos)
    report.tensor_bytes = sum(info.bytes for info in infos)
    report.largest = sorted(infos, key=lambda info: (-info.bytes, info.name))[:largest]


def _read_step(report: CheckpointReport, path: Path) -> None:
    """Rule 3: ``extra["step"]`` from the verified state file, where there is one."""
    try:
        with open(path / files.STATE_FILE, "rb") as f:
            extra = pickle.load(f)["extra"]
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, AttributeError, ImportError) as exc:
        # verified, yet unreadable: another tiermem version wrote it
        report.complete, report.problem = False, f"{path / files.STATE_FILE} cannot be read ({exc!r})"
        return
    if isinstance(extra, dict):
        report.extra_keys = sorted(str(key) for key in extra)
        step = extra.get("step")
        report.step = step if isinstance(step, int) else None
        run = extra.get("run")
        report.run = dict(run) if isinstance(run, dict) else None


def inspect_checkpoint(path: str | os.PathLike[str], *, largest: int = 5) -> CheckpointReport:
    """NOTE [ Inspecting a checkpoint ]: the checkpoint at ``path``, its ``largest`` tensors by size."""
    where = Path(os.path.abspath(os.fspath(path)))
    report = CheckpointReport(str(where))
    for sibling in _siblings(where, _TMP_TAG):
        (report.interrupted if _lock_is_free(sibling) else report.in_progress).append(sibling.name)
    report.leftover_old = [sibling.name for sibling in _siblings(where, _OLD_TAG)]
    report.exists = where.is_dir()
    if not report.exists:
        report.problem = f"no checkpoint directory at {where}"
        return report
    on_disk = [p for p in where.rglob("*") if p.is_file()]
    report.files, report.bytes_on_disk = len(on_disk), sum(p.stat().st_size for p in on_disk)
    report.format = _format_of(where)
    with files.reading(where):  # a shared lock: no commit swaps it out while it is read
        _inspect_files(report, where, largest)
    return report


def _inspect_files(report: CheckpointReport, where: Path, largest: int) -> None:
    """Rules 1-3 on the existing directory ``where``."""
    if not any((where / name).exists() for name in (files.MANIFEST, ".metadata", "dcp.metadata")):
        report.problem = (
            f"{where} is not a checkpoint: no {files.MANIFEST} (tiermem's) and no DCP metadata; "
            "give the directory a --checkpoint or rt.save wrote"
        )
        return
    try:
        report.verified = files.verify(where)
        report.complete = True
        if not report.verified:
            report.format = "dcp (plain PyTorch)"
    except CheckpointError as exc:
        report.problem = str(exc)
    try:
        _read_tensors(report, where, largest)
    except _UNREADABLE as exc:  # a damaged or missing metadata file
        report.complete = False
        report.problem = report.problem or f"its DCP metadata cannot be read ({exc!r})"
    if report.complete and report.verified:
        _read_step(report, where)
