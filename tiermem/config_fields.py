"""The tier configuration's schema: one frozen dataclass per TOML section, each field carrying
the rule that reads it, so adding a setting is one line in one place.

A rule (:class:`_Rule`) checks one value from TOML or a dict and normalises it (sizes to
ints, ``"cuda"`` device names to ``cuda:N``), or raises ``ValueError("<what is wrong>; <what is
accepted>")``; it also turns ``TIERMEM_*`` environment text into what TOML would have given.
A section checks every field when it is built, however it is built.

Capacities are per rank: in a multi-process job (torchrun, FSDP2) each rank has the budgets
of ``[device]``, ``[host]`` and ``[nvme]`` for itself, and its NVMe files in ``<path>/rank<R>``
under each path (NOTE [ Ranks ] in ``tiermem.distributed``). Reading files, dicts and
the environment, and resolving ``"auto"`` for a machine, live in :mod:`tiermem.config`, which
re-exports every public name here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from tiermem.errors import ConfigError
from tiermem.units import parse_size

__all__ = [
    "AUTO",
    "ENV_PREFIX",
    "OTHER_ENV_VARS",
    "SIZE_SETTINGS",
    "ActivationsConfig",
    "DeviceConfig",
    "DistributedConfig",
    "HostConfig",
    "ModelStatesConfig",
    "NvmeConfig",
    "SchedulerConfig",
    "TraceConfig",
]

AUTO: Literal["auto"] = "auto"
"""The value that asks tiermem to choose a setting for the machine."""

ENV_PREFIX = "TIERMEM_"
"""Environment variables ``TIERMEM_<SECTION>_<KEY>`` set any key the file/dict leaves out."""

OTHER_ENV_VARS: dict[str, str] = {
    "TIERMEM_TRACE": "the short name for [trace] path",
    "TIERMEM_KEEP_MALLOC": "1 leaves glibc's malloc thresholds as they are (tiermem.malloc)",
}
"""The ``TIERMEM_*`` variables tiermem reads that are no ``<SECTION>_<KEY>`` setting, and what each
does. Every other ``TIERMEM_*`` name is a setting or a typo: reading the environment reports a
typo, since a variable that silently does nothing leaves a run without what was asked. A new
variable read outside the configuration belongs here (``tests/test_config.py`` checks it)."""

_KiB = 1024
_MiB = 1024**2
_MIN_BLOCK, _MAX_BLOCK = 4 * _KiB, 256 * _MiB
_ENV_TRUE = frozenset({"1", "true", "yes"})
_ENV_FALSE = frozenset({"0", "false", "no"})


# --------------------------------------------------------------------------------------------
# Rules: how one setting is read. ``parse`` takes a TOML/dict value and returns the stored value
# or raises ValueError("<what is wrong>; <what is accepted>"). ``from_env`` turns environment
# text into the value TOML would have given (it never raises; ``parse`` reports bad text).
# --------------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """Render a value the way the user wrote it in TOML (``"x"``, ``true``, ``[1, 2]``)."""
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _same_text(text: str) -> Any:
    return text


@dataclass(frozen=True)
class _Rule:
    """The schema of one setting: its parser for TOML/dict values and for environment text."""

    parse: Callable[[Any], Any]
    from_env: Callable[[str], Any] = _same_text
    #: a byte count: ``tiermem config show`` says it as a size ("1GiB") beside the exact number
    size: bool = False


def _setting(default: Any, rule: _Rule) -> Any:
    """A dataclass field that carries its rule, so the dataclass *is* the schema."""
    return field(default=default, metadata={"rule": rule})


_SIZE_HINT = 'bytes as an integer or a string such as "512MiB" or "8GiB"'


def _size_rule(*, auto: bool = False, optional: bool = False, positive: bool = False) -> _Rule:
    """A byte size; optionally ``"auto"``, optionally absent/None (= use [scheduler] max_inflight)."""
    accepted = _SIZE_HINT + (' or "auto"' if auto else "")
    if optional:
        accepted += ", or leave it out to use [scheduler] max_inflight"

    def parse(value: Any) -> Any:
        if auto and value == AUTO:
            return AUTO
        if optional and value is None:
            return None
        try:
            nbytes = parse_size(value)
        except ValueError:
            raise ValueError(f"{_show(value)} is not a size; use {accepted}") from None
        if positive and nbytes == 0:
            raise ValueError(f"{_show(value)} must be more than 0 bytes; use {accepted}")
        return nbytes

    def from_env(text: str) -> Any:
        return None if optional and text.strip().lower() in ("none", "null") else text

    return _Rule(parse, from_env, size=True)


def _parse_block_size(value: Any) -> int:
    # O_DIRECT needs 4 KiB alignment (TRAPS 5); a power of two keeps blocks aligned inside a file.
    hint = 'use a power of two between 4KiB and 256MiB such as "1MiB"'
    try:
        nbytes = parse_size(value)
    except ValueError:
        raise ValueError(f"{_show(value)} is not a size; {hint}") from None
    if nbytes % _MIN_BLOCK:
        raise ValueError(f"{_show(value)} is not a multiple of 4096; {hint}")
    if nbytes < _MIN_BLOCK:
        raise ValueError(f"{_show(value)} is smaller than 4KiB; {hint}")
    if nbytes > _MAX_BLOCK:
        raise ValueError(f"{_show(value)} is larger than 256MiB; {hint}")
    if nbytes & (nbytes - 1):
        raise ValueError(f"{_show(value)} is not a power of two; {hint}")
    return nbytes


def _int_rule(low: int, high: int) -> _Rule:
    accepted = f"use an integer from {low} to {high}"

    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{_show(value)} is not an integer; {accepted}")
        if not low <= value <= high:
            raise ValueError(f"{value} is out of range; {accepted}")
        return value

    def from_env(text: str) -> Any:
        try:
            return int(text.strip())
        except ValueError:
            return text

    return _Rule(parse, from_env)


def _seconds_rule(low: float, high: float) -> _Rule:
    """A duration in seconds: an int or a float, more than ``low`` and at most ``high``."""
    accepted = f"use a number of seconds more than {low:g} and at most {high:g} (e.g. 600)"

    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{_show(value)} is not a number of seconds; {accepted}")
        if not low < value <= high:  # also refuses NaN
            raise ValueError(f"{_show(value)} is out of range; {accepted}")
        return float(value)

    def from_env(text: str) -> Any:
        try:
            return float(text.strip())
        except ValueError:
            return text

    return _Rule(parse, from_env)


def _bool_rule(*, auto: bool = False) -> _Rule:
    accepted = ('"auto", ' if auto else "") + "true or false (1/0/yes/no in the environment)"

    def parse(value: Any) -> Any:
        if isinstance(value, bool) or (auto and value == AUTO):
            return value
        what = '"auto" or a boolean' if auto else "a boolean"
        raise ValueError(f"{_show(value)} is not {what}; use {accepted}")

    def from_env(text: str) -> Any:
        word = text.strip().lower()
        if word in _ENV_TRUE:
            return True
        if word in _ENV_FALSE:
            return False
        return AUTO if auto and word == AUTO else text

    return _Rule(parse, from_env)


def _choice_rule(what: str, *choices: str) -> _Rule:
    accepted = "use one of " + ", ".join(_show(c) for c in choices)

    def parse(value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise ValueError(f"{_show(value)} is not a known {what}; {accepted}")

    return _Rule(parse)


_DEVICE_RE = re.compile(r"^(?:auto|cpu|cuda(?::([0-9]+))?)$")


def _parse_device(value: Any) -> str:
    match = _DEVICE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f'{_show(value)} is not a device; use "auto", "cpu", "cuda" or "cuda:N" with N a device index')
    index = match.group(1)
    return f"cuda:{int(index)}" if index is not None else value


def _parse_paths(value: Any) -> tuple[str, ...]:
    hint = 'use a list of directories such as ["/mnt/nvme0/tiermem"], or [] for a private temp directory'
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{_show(value)} is not a list of paths; {hint}")
    seen: set[str] = set()
    for i, path in enumerate(value):
        if not isinstance(path, str) or not path.strip():
            raise ValueError(f"entry {i} ({_show(path)}) is not a directory path; {hint}")
        normal = os.path.normpath(path)
        if normal in seen:
            raise ValueError(f"{_show(path)} is listed twice; list each directory once")
        seen.add(normal)
    return tuple(value)


def _parse_trace_path(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f'{_show(value)} is not a file path; use a path such as "trace.json", or "" for no trace')
    return value


def _paths_from_env(text: str) -> Any:
    # Like PATH: separated by os.pathsep, empty pieces ignored.
    return [piece for piece in text.split(os.pathsep) if piece]


_DEVICE_RULE = _Rule(_parse_device)
_PATHS_RULE = _Rule(_parse_paths, _paths_from_env)
_BLOCK_SIZE_RULE = _Rule(_parse_block_size, size=True)
_TIER_INFLIGHT = _size_rule(optional=True, positive=True)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Section:
    """Base of the section dataclasses: checks and normalises its fields when built.

    Built directly (``NvmeConfig(block_size="2MiB")``, ``dataclasses.replace``) a section is
    held to the same rules as one read from a file, so no unchecked value reaches a tier.
    """

    NAME: ClassVar[str]

    def __post_init__(self) -> None:
        problems = []
        for f in dataclasses.fields(self):
            try:
                object.__setattr__(self, f.name, f.metadata["rule"].parse(getattr(self, f.name)))
            except ValueError as exc:
                problems.append(f"{self.NAME}.{f.name}: {exc}")
        if problems:
            raise ConfigError(problems, f"[{self.NAME}]")

    @classmethod
    def rules(cls) -> dict[str, _Rule]:
        """Each key of this section and the rule that reads it."""
        return {f.name: f.metadata["rule"] for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        """The section as plain TOML-able values (lists, not tuples; ``None`` kept)."""
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in plain.items()}


@dataclass(frozen=True)
class DeviceConfig(_Section):
    """[device]: the compute device (``cuda:N`` or the CPU) and its byte budget (per rank)."""

    NAME: ClassVar[str] = "device"
    capacity: int | Literal["auto"] = _setting(AUTO, _size_rule(auto=True))
    device: str = _setting(AUTO, _DEVICE_RULE)
    max_inflight: int | None = _setting(None, _TIER_INFLIGHT)


@dataclass(frozen=True)
class HostConfig(_Section):
    """[host]: host RAM (per rank), pinned (page-locked) when the device is CUDA."""

    NAME: ClassVar[str] = "host"
    capacity: int | Literal["auto"] = _setting(AUTO, _size_rule(auto=True))
    pinned: bool | Literal["auto"] = _setting(AUTO, _bool_rule(auto=True))
    max_inflight: int | None = _setting(None, _TIER_INFLIGHT)


@dataclass(frozen=True)
class NvmeConfig(_Section):
    """[nvme]: files striped over ``paths``; ``paths == ()`` means a private temp directory.
    ``capacity`` is per rank; rank R of a multi-process job uses ``<path>/rank<R>``."""

    NAME: ClassVar[str] = "nvme"
    paths: tuple[str, ...] = _setting((), _PATHS_RULE)
    backend: Literal["auto", "kvikio", "aio", "posix"] = _setting(
        AUTO, _choice_rule("backend", AUTO, "kvikio", "aio", "posix")
    )
    block_size: int = _setting(_MiB, _BLOCK_SIZE_RULE)
    queue_depth: int = _setting(32, _int_rule(1, 1024))
    capacity: int | Literal["auto"] = _setting(AUTO, _size_rule(auto=True))
    checksum: bool = _setting(False, _bool_rule())
    direct: bool | Literal["auto"] = _setting(AUTO, _bool_rule(auto=True))
    max_inflight: int | None = _setting(None, _TIER_INFLIGHT)


@dataclass(frozen=True)
class SchedulerConfig(_Section):
    """[scheduler]: the event loop that owns all moves, and its default in-flight byte bound."""

    NAME: ClassVar[str] = "scheduler"
    loop: Literal["uvloop", "asyncio"] = _setting("uvloop", _choice_rule("event loop", "uvloop", "asyncio"))
    max_inflight: int = _setting(512 * _MiB, _size_rule(positive=True))


@dataclass(frozen=True)
class ActivationsConfig(_Section):
    """[activations]: what happens to saved activations; smaller ones than ``min_bytes`` stay."""

    NAME: ClassVar[str] = "activations"
    policy: Literal["auto", "keep", "recompute", "host", "nvme"] = _setting(
        AUTO, _choice_rule("policy", AUTO, "keep", "recompute", "host", "nvme")
    )
    min_bytes: int = _setting(_MiB, _size_rule())


@dataclass(frozen=True)
class ModelStatesConfig(_Section):
    """[model_states]: chunking of parameters/gradients/optimizer states (``auto``: the planner)."""

    NAME: ClassVar[str] = "model_states"
    chunk_size: int | Literal["auto"] = _setting(AUTO, _size_rule(auto=True, positive=True))
    #: where chunk steps compute (NOTE [ Step threads ] in tiermem.states.step_thread)
    step_thread: Literal["auto", "on", "off"] = _setting(AUTO, _choice_rule("step-thread setting", AUTO, "on", "off"))
    #: whether an undeclared loop's backward may step NVMe chunks ahead into copies of their homes
    #: (NOTE [ Speculative steps ] in tiermem.states.speculation): ``auto`` where the loop allows
    speculative_steps: Literal["auto", "off"] = _setting(AUTO, _choice_rule("speculative-steps setting", AUTO, "off"))


@dataclass(frozen=True)
class DistributedConfig(_Section):
    """[distributed]: the process group tiermem sets up itself (``tiermem train`` under torchrun).

    ``timeout_s`` bounds how long a rank waits in a collective for the others: a rank that died
    or hangs ends the job after at most that long, with an error naming the cause. It must also
    cover the longest stretch one rank works alone while the others wait (planning, a
    checkpoint), and it bounds the start too (``init_process_group`` waits that long for every
    rank to arrive). ``backend``: ``auto`` is gloo without CUDA and ``cpu:gloo,cuda:nccl`` with
    it. A process group the program made itself (``init_process_group``) is used as it is.
    """

    NAME: ClassVar[str] = "distributed"
    timeout_s: float = _setting(600.0, _seconds_rule(0, 7 * 24 * 3600))
    # "cpu:gloo,cuda:nccl" is what auto means with CUDA (``tiermem config show`` writes it out).
    backend: Literal["auto", "gloo", "nccl", "cpu:gloo,cuda:nccl"] = _setting(
        AUTO, _choice_rule("backend", AUTO, "gloo", "nccl", "cpu:gloo,cuda:nccl")
    )


@dataclass(frozen=True)
class TraceConfig(_Section):
    """[trace]: a timeline trace of the run (NOTE [ Timeline trace ] in ``tiermem.tracing``), written to
    ``path`` as Chrome trace JSON from the runtime's start to its end (``""``: none; also
    ``TIERMEM_TRACE=path``); once the file reaches ``max_size`` further events are dropped and counted."""

    NAME: ClassVar[str] = "trace"
    path: str = _setting("", _Rule(_parse_trace_path))
    max_size: int = _setting(1024 * _MiB, _size_rule(positive=True))


_SECTIONS: dict[str, type[_Section]] = {
    cls.NAME: cls
    for cls in (
        DeviceConfig,
        HostConfig,
        NvmeConfig,
        SchedulerConfig,
        ActivationsConfig,
        ModelStatesConfig,
        DistributedConfig,
        TraceConfig,
    )
}

#: The ``"section.key"`` settings that are byte counts (their rules say so).
SIZE_SETTINGS = frozenset(
    f"{n}.{key}" for n, cls in _SECTIONS.items() for key, rule in cls.rules().items() if rule.size
)
