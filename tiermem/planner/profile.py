"""What one instrumented step measured: the planner's only input besides the budgets.

A :class:`Profile` is plain data (ints, floats, tuples) so it serialises to JSON for the
profile cache and can be written by hand in tests (synthetic 100-layer models). Times are
seconds, sizes bytes, bandwidths bytes per second.

# NOTE [ Profile fields ]
1. Blocks are the model's activation blocks (``find_blocks``) in forward order; everything
   else the model runs (embeddings, head, loss) is ``outside``.
2. ``saved_bytes``: bytes of distinct storages autograd saved while the block ran (first
   saver counts, parameters and their views left out), at or above ``[activations] min_bytes``:
   the bytes the offloader manages on the device tier. ``small_bytes``: the rest, which stay
   as plain tensors (real RAM, outside the accounting).
3. ``transient_bytes``: the peak of live tensor bytes above the block's start while its
   forward or backward ran, minus its saved bytes: memory inside and between operators that
   no per-block total shows. ``input_bytes``: the block input's storage, which a recomputed
   block's checkpoint holds instead of its saved tensors.
4. Parameters are indexed as in ``list(model.parameters())``; ``order`` is the execution
   order the manager records (NOTE [ Model-state rules ] rule 2), ``modules`` the parameter
   indices each module owns, ``shared`` those owned by several modules (tied weights).
   ``param_block``: the block whose forward first used each parameter, ``-1`` before the
   first block, ``len(blocks)`` after the last (the head); backward delivers a parameter's
   gradient when it reaches that point (empty: unknown, all at backward's start).
5. ``links`` maps ``"src->dst"`` to measured bytes/s through the real tiers; ``memcpy_bw``
   is device<->host, the copy every CPU-mode move pays on the shared cores (TRAPS 7).
6. ``saved_count``: how many distinct storages make up ``saved_bytes`` (the tensors the
   offloader registers, one registry object each). ``overheads``: what a managed step costs
   beyond the plain-PyTorch step the blocks' times measure, per unit of managed work: per
   parameter (the manager's hooks, per-parameter optimizer calls), per saved tensor the
   offloader registers, per saved tensor it moves to the host and back (beyond its bytes),
   per saved tensor of a recomputed block (checkpoint's hooks, beyond the forward run again),
   and per streamed chunk (fetches, evictions, pins, gradient write-back, the chunk's
   optimizer staging: moves through the scheduler thread, beyond their bytes). Measured by
   a calibration on the real machinery (NOTE [ Profiling step ] rule 7).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: Bumped when the profile's shape or meaning changes: older cached profiles are re-measured.
PROFILE_VERSION = 3


@dataclass(frozen=True)
class BlockStats:
    """One activation block (rules 1-3)."""

    name: str
    forward_s: float
    backward_s: float
    saved_bytes: int
    small_bytes: int = 0
    input_bytes: int = 0
    transient_bytes: int = 0
    saved_count: int = 0


@dataclass(frozen=True)
class Overheads:
    """Rule 6: seconds a managed step costs beyond plain PyTorch, per unit of managed work.
    ``measured`` is False for the fallback (no room to calibrate): every cost 0, nothing charged."""

    param_s: float = 0.0
    saved_s: float = 0.0
    offload_s: float = 0.0
    recompute_s: float = 0.0
    chunk_s: float = 0.0
    measured: bool = False
    #: the calibration's raw step times (seconds, median per configuration), for reports
    steps_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ParamStats:
    """One parameter: bytes, whether it trains, and its optimizer-state tensors (0: none)."""

    nbytes: int
    trainable: bool = True
    sections: int = 2


@dataclass(frozen=True)
class Profile:
    """Everything the planner knows about one model, batch, device and tier configuration."""

    blocks: tuple[BlockStats, ...]
    outside: BlockStats
    params: tuple[ParamStats, ...]
    order: tuple[int, ...]
    modules: tuple[tuple[int, ...], ...]
    shared: tuple[int, ...]
    links: Mapping[str, float]
    #: CPU seconds the optimizer step takes per byte of trainable parameters (rule 5)
    optimizer_s_per_byte: float
    #: device and host are one RAM on the same cores (the CPU device, TRAPS 7)
    cpu: bool = True
    device: str = "cpu"
    threads: int = 1
    min_bytes: int = 1 << 20
    key: str = ""
    version: int = PROFILE_VERSION
    #: seconds the profiling itself took (what the cache saves the next run)
    profiling_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    param_block: tuple[int, ...] = ()
    overheads: Overheads = field(default_factory=Overheads)
    #: the optimizer's state is element-wise, so a chunk larger than the chunk size may step in
    #: slices (NOTE [ Default placement rule ] rule 6)
    element_wise: bool = True

    @property
    def memcpy_bw(self) -> float:
        """Device<->host copy bandwidth: the slower direction, so a round trip is not flattered."""
        values = [self.links[k] for k in ("device->host", "host->device") if self.links.get(k)]
        return min(values) if values else 0.0

    @property
    def compute_s(self) -> float:
        """Forward and backward of the whole model, as measured in plain PyTorch."""
        blocks = sum(b.forward_s + b.backward_s for b in self.blocks)
        return blocks + self.outside.forward_s + self.outside.backward_s

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["links"] = dict(self.links)
        data["extra"] = dict(self.extra)
        data["overheads"]["steps_s"] = dict(self.overheads.steps_s)
        return data

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """The inverse of :meth:`as_dict`; raises ``ValueError`` on a different version or shape."""
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}, this tiermem reads {PROFILE_VERSION}")
        try:
            return cls(
                blocks=tuple(BlockStats(**b) for b in data["blocks"]),
                outside=BlockStats(**data["outside"]),
                params=tuple(ParamStats(**p) for p in data["params"]),
                order=tuple(int(i) for i in data["order"]),
                modules=tuple(tuple(int(i) for i in m) for m in data["modules"]),
                shared=tuple(int(i) for i in data["shared"]),
                links={str(k): float(v) for k, v in data["links"].items()},
                optimizer_s_per_byte=float(data["optimizer_s_per_byte"]),
                cpu=bool(data["cpu"]),
                device=str(data["device"]),
                threads=int(data["threads"]),
                min_bytes=int(data["min_bytes"]),
                key=str(data["key"]),
                version=int(data["version"]),
                profiling_s=float(data.get("profiling_s", 0.0)),
                extra=dict(data.get("extra", {})),
                param_block=tuple(int(i) for i in data.get("param_block", ())),
                overheads=Overheads(**data["overheads"]),
                element_wise=bool(data.get("element_wise", True)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile is missing or mistypes a field: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))
