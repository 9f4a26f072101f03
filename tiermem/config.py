"""The tier configuration: what each tier may hold and how bytes move between them.

A configuration comes from a TOML file, a dict, ``TIERMEM_<SECTION>_<KEY>`` environment
variables, or nothing (the embedded defaults). It is read in two stages so that a file can
be checked anywhere but sized for the machine it runs on:

1. **Parsing** (:meth:`Config.load`, :meth:`Config.from_dict`, :meth:`Config.coerce`) checks
   every key against the schema below and reports *every* problem in one
   :class:`~tiermem.errors.ConfigError`; unknown sections and keys are errors, because a typo
   that is silently ignored leaves a run with a setting nobody asked for.
2. **Resolution** (:meth:`Config.resolve`) replaces the ``"auto"`` values that depend on the
   machine (device, capacities, pinning, NVMe paths) with concrete ones, reading the machine
   through an injectable :class:`MachineProbe` so tests can fake any machine.

Sizes are stored as ints (bytes); ``"auto"`` stays the string ``"auto"`` until resolved.
The schema lives on the section dataclasses themselves (each field carries its ``_Rule``),
so adding a setting is one line in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from tiermem.errors import ConfigError
from tiermem.tiers.rundir import DEFAULT_DIR_NAME
from tiermem.units import format_size, parse_size

__all__ = [
    "AUTO",
    "ENV_PREFIX",
    "ActivationsConfig",
    "Config",
    "DeviceConfig",
    "DiskSpace",
    "HostConfig",
    "MachineProbe",
    "ModelStatesConfig",
    "NvmeConfig",
    "SchedulerConfig",
]

AUTO: Literal["auto"] = "auto"
"""The value that asks tiermem to choose a setting for the machine."""

ENV_PREFIX = "TIERMEM_"
"""Environment variables ``TIERMEM_<SECTION>_<KEY>`` set any key the file/dict leaves out."""

_KiB = 1024
_MiB = 1024**2
_MIN_BLOCK, _MAX_BLOCK = 4 * _KiB, 256 * _MiB
_ENV_TRUE = frozenset({"1", "true", "yes"})
_ENV_FALSE = frozenset({"0", "false", "no"})
# Under tempfile.gettempdir(); the runtime makes a private run dir inside. Not an importable
# name: a "tiermem" directory in the current directory would shadow the package.
_DEFAULT_NVME_DIR = DEFAULT_DIR_NAME


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

    return _Rule(parse, from_env)


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


def _paths_from_env(text: str) -> Any:
    # Like PATH: separated by os.pathsep, empty pieces ignored.
    return [piece for piece in text.split(os.pathsep) if piece]


_DEVICE_RULE = _Rule(_parse_device)
_PATHS_RULE = _Rule(_parse_paths, _paths_from_env)
_BLOCK_SIZE_RULE = _Rule(_parse_block_size)
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
    """[device]: the compute device (``cuda:N`` or the CPU) and its byte budget."""

    NAME: ClassVar[str] = "device"
    capacity: int | Literal["auto"] = _setting(AUTO, _size_rule(auto=True))
    device: str = _setting(AUTO, _DEVICE_RULE)
    max_inflight: int | None = _setting(None, _TIER_INFLIGHT)


@dataclass(frozen=True)
class HostConfig(_Section):
    """[host]: host RAM, pinned (page-locked) when the device is CUDA."""

    NAME: ClassVar[str] = "host"
    capacity: int | Literal["auto"] = _setting(AUTO, _size_rule(auto=True))
    pinned: bool | Literal["auto"] = _setting(AUTO, _bool_rule(auto=True))
    max_inflight: int | None = _setting(None, _TIER_INFLIGHT)


@dataclass(frozen=True)
class NvmeConfig(_Section):
    """[nvme]: files striped over ``paths``; ``paths == ()`` means a private temp directory."""

    NAME: ClassVar[str] = "nvme"
    paths: tuple[str, ...] = _setting((), _PATHS_RULE)
    backend: Literal["auto", "kvikio", "aio", "posix"] = _setting(AUTO, _choice_rule("backend", AUTO, "kvikio", "aio", "posix"))  # noqa: E501
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


_SECTIONS: dict[str, type[_Section]] = {
    cls.NAME: cls
    for cls in (DeviceConfig, HostConfig, NvmeConfig, SchedulerConfig, ActivationsConfig, ModelStatesConfig)
}


def _suggest(name: str, known: list[str], label: str) -> str:
    """The closest known name (typos are the usual cause) and the full list to pick from."""
    close = difflib.get_close_matches(name, known, n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    return f"{guess}{label}: {', '.join(known)}"


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskSpace:
    """Free bytes on the filesystem holding a path; ``filesystem`` (``st_dev``) identifies it,
    so two paths on one filesystem are not counted twice."""

    filesystem: int
    free: int


def _disk_space(path: str) -> DiskSpace:
    """Free space where ``path`` will live: the nearest existing ancestor (it may not exist yet)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return DiskSpace(os.stat(probe).st_dev, shutil.disk_usage(probe).free)


def _cuda_free(index: int) -> int:
    import torch  # lazy: parsing a config must not import torch

    return int(torch.cuda.mem_get_info(index)[0])


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class MachineProbe:
    """The facts about a machine that resolution needs, injectable so tests can fake a machine.

    ``cuda_free(index)`` (free bytes on ``cuda:index``) and ``disk_space(path)`` are called
    only for the settings that need them, so faking a CPU machine needs neither CUDA nor disks.
    """

    available_ram: int
    total_ram: int
    cuda_device_count: int = 0
    local_rank: int = 0
    cuda_free: Callable[[int], int] = _cuda_free
    disk_space: Callable[[str], DiskSpace] = _disk_space

    @property
    def cuda_available(self) -> bool:
        """Whether torch can use at least one CUDA device here."""
        return self.cuda_device_count > 0

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> MachineProbe:
        """Probe this machine: RAM from psutil, CUDA from torch, ``LOCAL_RANK`` from the environment."""
        import psutil

        environ = os.environ if environ is None else environ
        text = environ.get("LOCAL_RANK", "").strip() or "0"
        if not text.isdigit():
            raise ConfigError(
                [f"device.device: LOCAL_RANK={text!r} is not a non-negative integer (a device index)"],
                "the environment",
            )
        memory = psutil.virtual_memory()
        return cls(
            available_ram=int(memory.available),
            total_ram=int(memory.total),
            cuda_device_count=_cuda_device_count(),
            local_rank=int(text),
        )


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """A whole tier configuration: one frozen dataclass per TOML section.

    ``Config()`` is the embedded default and reads no environment; use :meth:`coerce`,
    :meth:`load` or :meth:`from_dict` to also apply ``TIERMEM_*`` variables.
    ``source`` only names where it came from in error messages (not compared).
    """

    device: DeviceConfig = field(default_factory=DeviceConfig)
    host: HostConfig = field(default_factory=HostConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    model_states: ModelStatesConfig = field(default_factory=ModelStatesConfig)
    source: str = field(default="configuration", compare=False, repr=False)

    def __post_init__(self) -> None:
        wrong = [
            f"{name}: expected a {cls.__name__}, got {type(getattr(self, name)).__name__}"
            for name, cls in _SECTIONS.items()
            if not isinstance(getattr(self, name), cls)
        ]
        if wrong:
            raise ConfigError(wrong, self.source)

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, env: Mapping[str, str] | None = None, source: str = "configuration"
    ) -> Config:
        """Read ``{section: {key: value}}`` (what a TOML file holds), then ``TIERMEM_*`` variables
        from ``env`` (default ``os.environ``) for the keys ``data`` leaves out.

        Raises one ConfigError listing every problem.
        """
        if not isinstance(data, Mapping):
            raise ConfigError([f"configuration: expected a table of sections, got {_show(data)}"], source)
        values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        given: set[tuple[str, str]] = set()
        problems: list[str] = []
        for name, table in data.items():
            section = _SECTIONS.get(name)
            if section is None:
                problems.append(f"{name}: unknown section; " + _suggest(str(name), list(_SECTIONS), "sections are"))
                continue
            if not isinstance(table, Mapping):
                problems.append(f"{name}: expected a table of settings [{name}], got {_show(table)}")
                continue
            rules = section.rules()
            for key, value in table.items():
                rule = rules.get(key)
                if rule is None:
                    problems.append(
                        f"{name}.{key}: unknown key in [{name}]; " + _suggest(str(key), list(rules), "keys are")
                    )
                    continue
                given.add((name, key))
                try:
                    values[name][key] = rule.parse(value)
                except ValueError as exc:
                    problems.append(f"{name}.{key}: {exc}")
        problems += _read_env(os.environ if env is None else env, given, values)
        if problems:
            raise ConfigError(problems, source)
        sections = {name: _SECTIONS[name](**kwargs) for name, kwargs in values.items()}
        return cls(**sections, source=source)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None) -> Config:
        """Read a TOML file; an unreadable or malformed file is a ConfigError naming the file
        (and for bad TOML the line and column tomllib reports)."""
        name = os.fspath(path)
        try:
            with open(name, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError([f"{name}: cannot read the file: {exc.strerror or exc}"], name) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"{name}: not valid TOML: {exc}"], name) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError([f"{name}: not UTF-8 text (byte {exc.start}); save it as UTF-8"], name) from exc
        return cls.from_dict(data, env=env, source=name)

    @classmethod
    def coerce(
        cls,
        value: Config | Mapping[str, Any] | str | os.PathLike[str] | None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> Config:
        """Whatever a user may pass as a configuration: None (defaults + environment), a path to
        a TOML file, a dict, or a Config (returned as is)."""
        if value is None:
            return cls.from_dict({}, env=env, source="defaults and environment")
        if isinstance(value, Config):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value, env=env)
        if isinstance(value, (str, os.PathLike)):
            return cls.load(value, env=env)
        raise TypeError(
            "tiermem config: expected a path to a TOML file, a dict, a tiermem.Config or None, "
            f"got {type(value).__name__}"
        )

    # -- output -------------------------------------------------------------------------------

    def sections(self) -> tuple[_Section, ...]:
        """The sections in file order."""
        return tuple(getattr(self, name) for name in _SECTIONS)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain ``{section: {key: value}}``: sizes as ints, lists for paths, ``None`` kept;
        ``Config.from_dict(c.to_dict()) == c``."""
        return {section.NAME: section.to_dict() for section in self.sections()}

    def to_toml(self) -> str:
        """The configuration as TOML; ``None`` values (no such thing in TOML) are left out."""
        data = {
            name: {key: value for key, value in table.items() if value is not None}
            for name, table in self.to_dict().items()
        }
        return tomli_w.dumps(data)

    # -- resolution ---------------------------------------------------------------------------

    def resolve(self, probe: MachineProbe | None = None) -> Config:
        """A new Config with every machine-dependent ``"auto"`` made concrete for ``probe``
        (default: :meth:`MachineProbe.detect`).

        Resolved: device name, device/host/nvme capacities, host pinning, nvme paths (absolute;
        ``[]`` becomes ``<tempdir>/tiermem``). Left as they are: nvme backend and direct (chosen by
        a probe I/O in the NVMe tier), chunk_size (the planner), activation policy, and tier
        max_inflight None (meaning the scheduler's). Problems are collected into one ConfigError.
        """
        probe = MachineProbe.detect() if probe is None else probe
        problems: list[str] = []
        device, host = self.device, self.host
        name = _resolve_device_name(self.device.device, probe, problems)
        if self.host.pinned is True and not probe.cuda_available:
            problems.append(
                "host.pinned: true needs CUDA (pinned memory is page-locked for CUDA copies) and this "
                'machine has no CUDA device; use "auto" or false'
            )
        if name is not None:  # the capacity rules depend on the device: skip them if it is unusable
            is_cuda = name.startswith("cuda")
            if is_cuda:
                device_cap, host_cap = _cuda_capacities(self, int(name.split(":")[1]), probe, problems)
            else:
                device_cap, host_cap = _cpu_capacities(self, probe, problems)
            pinned = is_cuda if self.host.pinned == AUTO else self.host.pinned
            device = dataclasses.replace(self.device, device=name, capacity=device_cap)
            host = dataclasses.replace(self.host, capacity=host_cap, pinned=pinned)
        nvme = _resolve_nvme(self.nvme, probe, problems)
        if problems:
            raise ConfigError(problems, self.source)
        return dataclasses.replace(self, device=device, host=host, nvme=nvme)


def _read_env(env: Mapping[str, str], given: set[tuple[str, str]], values: dict[str, dict[str, Any]]) -> list[str]:
    """Fill ``values`` from ``TIERMEM_<SECTION>_<KEY>`` for keys not in ``given`` (the file wins).

    A name under a known section that names no key is a problem (a typo must not pass
    silently); other ``TIERMEM_*`` names (``TIERMEM_LOG``) are not settings and are skipped.
    An empty value counts as unset.
    """
    problems = []
    for var in sorted(env):
        upper = var.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        rest = upper[len(ENV_PREFIX) :]
        name = next((s for s in _SECTIONS if rest.startswith(s.upper() + "_")), None)
        if name is None:
            continue
        key = rest[len(name) + 1 :].lower()
        rules = _SECTIONS[name].rules()
        rule = rules.get(key)
        if rule is None:
            known = [f"{ENV_PREFIX}{name.upper()}_{k.upper()}" for k in rules]
            problems.append(
                f"{name}.{key}: environment variable {var} names no setting; "
                + _suggest(var, known, "the variables of [" + name + "] are")
            )
            continue
        text = env[var]
        if (name, key) in given or text == "":
            continue
        try:
            values[name][key] = rule.parse(rule.from_env(text))
        except ValueError as exc:
            problems.append(f"{name}.{key}: {exc} (from environment variable {var})")
    return problems


def _resolve_device_name(requested: str, probe: MachineProbe, problems: list[str]) -> str | None:
    """``auto`` -> ``cuda:<LOCAL_RANK>`` when CUDA is there, else ``cpu``; ``cuda`` -> ``cuda:<LOCAL_RANK>``.

    Returns None (after adding a problem) when the device cannot be used here.
    """
    if requested == "cpu" or (requested == AUTO and not probe.cuda_available):
        return "cpu"
    name = f"cuda:{probe.local_rank}" if requested in (AUTO, "cuda") else requested
    index = int(name.split(":")[1])
    if not probe.cuda_available:
        problems.append(
            f'device.device: "{requested}" needs CUDA, but torch sees no CUDA device on this machine; '
            'use "auto" or "cpu"'
        )
        return None
    if index >= probe.cuda_device_count:
        why = f"picked {name} from LOCAL_RANK={probe.local_rank}" if requested != name else f"names {name}"
        problems.append(
            f'device.device: "{requested}" {why}, but this machine has {probe.cuda_device_count} CUDA '
            f"device(s) (cuda:0 to cuda:{probe.cuda_device_count - 1}); name one of them"
        )
        return None
    return name


def _cuda_capacities(config: Config, index: int, probe: MachineProbe, problems: list[str]) -> tuple[Any, Any]:
    """With CUDA: device auto = 90% of free device memory, host auto = 50% of available RAM."""
    device_cap: Any = config.device.capacity
    host_cap: Any = config.host.capacity
    if device_cap == AUTO:
        try:
            device_cap = probe.cuda_free(index) * 9 // 10
        except (RuntimeError, OSError) as exc:
            problems.append(
                f"device.capacity: cannot read the free memory of cuda:{index} ({exc}); set [device] capacity to a size"
            )
    if host_cap == AUTO:
        host_cap = probe.available_ram // 2
    elif host_cap > probe.total_ram:
        problems.append(
            f"host.capacity: {format_size(host_cap)} exceeds this machine's RAM "
            f'({format_size(probe.total_ram)}); lower it or use "auto"'
        )
    return device_cap, host_cap


def _cpu_capacities(config: Config, probe: MachineProbe, problems: list[str]) -> tuple[int, int]:
    """Without CUDA device and host are one RAM (TRAPS 7): ``auto`` shares 80% of available RAM
    (40% each, or all of what the explicit other leaves), and explicit values must fit in RAM."""
    device_cap, host_cap = config.device.capacity, config.host.capacity
    share = probe.available_ram * 4 // 5
    if device_cap == AUTO and host_cap == AUTO:
        device_cap = host_cap = probe.available_ram * 2 // 5
    elif device_cap == AUTO:
        device_cap = max(0, share - int(host_cap))
    elif host_cap == AUTO:
        host_cap = max(0, share - int(device_cap))
    device_cap, host_cap = int(device_cap), int(host_cap)
    if device_cap + host_cap > probe.total_ram:
        problems.append(
            f"host.capacity: device ({format_size(device_cap)}) + host ({format_size(host_cap)}) = "
            f"{format_size(device_cap + host_cap)} exceeds this machine's RAM "
            f"({format_size(probe.total_ram)}); on the CPU both tiers share one RAM"
        )
    return device_cap, host_cap


def _resolve_nvme(nvme: NvmeConfig, probe: MachineProbe, problems: list[str]) -> NvmeConfig:
    """Absolute paths (default ``<tempdir>/tiermem``); capacity auto = 90% of the free space of the
    distinct filesystems holding them (two paths on one filesystem share its free space)."""
    paths = nvme.paths or (os.path.join(tempfile.gettempdir(), _DEFAULT_NVME_DIR),)
    paths = tuple(os.path.abspath(os.path.expanduser(p)) for p in paths)
    capacity: Any = nvme.capacity
    if capacity == AUTO:
        free_by_fs: dict[int, int] = {}
        for path in paths:
            try:
                space = probe.disk_space(path)
            except OSError as exc:
                problems.append(f"nvme.paths: cannot read the free space for {_show(path)}: {exc.strerror or exc}")
                continue
            free_by_fs.setdefault(space.filesystem, space.free)
        capacity = sum(free_by_fs.values()) * 9 // 10
    return dataclasses.replace(nvme, paths=paths, capacity=capacity)
