"""The tier configuration: what each tier may hold and how bytes move between them.

A configuration comes from a TOML file, a dict, ``TIERMEM_<SECTION>_<KEY>`` environment
variables, or nothing (the embedded defaults). It is read in two stages so that a file can
be checked anywhere but sized for the machine it runs on:

1. **Parsing** (:meth:`Config.load`, :meth:`Config.from_dict`, :meth:`Config.coerce`) checks
   every key against the schema (:mod:`tiermem.config_fields`) and reports *every* problem in one
   :class:`~tiermem.errors.ConfigError`; unknown sections and keys are errors, because a typo
   that is silently ignored leaves a run with a setting nobody asked for.
2. **Resolution** (:meth:`Config.resolve`) replaces the ``"auto"`` values that depend on the
   machine (device, capacities, pinning, NVMe paths) with concrete ones, reading the machine
   through an injectable :class:`MachineProbe` so tests can fake any machine.

Capacities are per rank. In a multi-process job an ``auto`` capacity is this rank's share of
what the machine's ranks share (RAM, disk space; its own GPU's memory), and an explicit one
must fit the machine as many times as it has ranks (NOTE [ Ranks ] in ``tiermem.distributed``).

Sizes are stored as ints (bytes); ``"auto"`` stays the string ``"auto"`` until resolved.
The schema lives on the section dataclasses themselves (each field carries its ``_Rule``),
so adding a setting is one line in one place; they are defined in :mod:`tiermem.config_fields`
and importable from here. This module reads files, dicts and the environment into them,
probes the machine and resolves ``"auto"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from tiermem.config_fields import (
    _SECTIONS,
    AUTO,
    ENV_PREFIX,
    OTHER_ENV_VARS,
    ActivationsConfig,
    DeviceConfig,
    DistributedConfig,
    HostConfig,
    ModelStatesConfig,
    NvmeConfig,
    SchedulerConfig,
    TraceConfig,
    _Section,
    _show,
)
from tiermem.errors import ConfigError
from tiermem.tiers.rundir import default_parent
from tiermem.units import format_size

log = logging.getLogger("tiermem")

__all__ = [
    "AUTO",
    "ENV_PREFIX",
    "ActivationsConfig",
    "Config",
    "DeviceConfig",
    "DiskSpace",
    "DistributedConfig",
    "HostConfig",
    "MachineProbe",
    "ModelStatesConfig",
    "NvmeConfig",
    "SchedulerConfig",
    "TraceConfig",
]


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

    ``cuda_free(index)`` (free bytes on ``cuda:index``) is called only for an ``auto`` CUDA device
    capacity, so faking a CPU machine needs no CUDA; ``disk_space(path)`` for each NVMe path (an
    ``auto`` capacity is a share of the free space, an explicit one must fit in it).
    ``local_world_size``: the ranks of this job on this machine, which share its RAM and disks
    (NOTE [ Ranks ] in ``tiermem.distributed``); ``auto`` capacities are each rank's share.
    """

    available_ram: int
    total_ram: int
    cuda_device_count: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    cuda_free: Callable[[int], int] = _cuda_free
    disk_space: Callable[[str], DiskSpace] = _disk_space

    @property
    def cuda_available(self) -> bool:
        """Whether torch can use at least one CUDA device here."""
        return self.cuda_device_count > 0

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> MachineProbe:
        """Probe this machine: RAM from psutil, CUDA from torch, this process's rank on the machine
        and how many ranks share it (``tiermem.distributed.detect``: ``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``, or an initialized process group)."""
        import psutil

        from tiermem.distributed import detect as detect_ranks

        environ = os.environ if environ is None else environ
        text = environ.get("LOCAL_RANK", "").strip() or "0"
        if not text.isdigit():
            raise ConfigError(
                [f"device.device: LOCAL_RANK={text!r} is not a non-negative integer (a device index)"],
                "the environment",
            )
        ranks = detect_ranks(environ)
        memory = psutil.virtual_memory()
        return cls(
            available_ram=int(memory.available),
            total_ram=int(memory.total),
            cuda_device_count=_cuda_device_count(),
            local_rank=ranks.local_rank,
            local_world_size=ranks.local_world_size,
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
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
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

        Resolved: device name, device/host/nvme capacities (per rank: ``auto`` is this rank's share
        of the machine, ``probe.local_world_size`` ranks), host pinning, nvme paths (absolute;
        ``[]`` becomes ``<tempdir>/tiermem-nvme-<uid>``; a rank's ``rank<R>`` under them is the
        runtime's). Left as they are: nvme backend and direct (chosen by a probe I/O in the NVMe
        tier), chunk_size (the planner), activation policy, tier max_inflight None (meaning the
        scheduler's) and [distributed] (used when tiermem makes the process group). Problems are
        collected into one ConfigError.
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

    Every ``TIERMEM_*`` name is tiermem's: one that names no setting (a typo in its section or
    its key) is a problem, with the closest name, as unknown keys in a file are, since a typo
    that is silently ignored leaves a run without what was asked. Only the variables tiermem
    reads elsewhere (``OTHER_ENV_VARS``) are not settings. An empty value counts as unset.
    """
    problems = []
    if env.get(ENV_PREFIX + "TRACE") and ("trace", "path") not in given and not env.get(ENV_PREFIX + "TRACE_PATH"):
        values["trace"]["path"] = env[ENV_PREFIX + "TRACE"]  # the short name for [trace] path
    for var in sorted(env):
        upper = var.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        rest = upper[len(ENV_PREFIX) :]
        name = next((s for s in _SECTIONS if rest.startswith(s.upper() + "_")), None)
        if name is None:
            if var not in OTHER_ENV_VARS:
                problems.append(_unknown_variable(var))
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


def _unknown_variable(var: str) -> str:
    """The problem of a ``TIERMEM_*`` variable that names no section: the closest variable tiermem
    knows (compared without the common prefix, which would make every name look close) and the
    shape of the names it reads."""
    known = [f"{ENV_PREFIX}{name.upper()}_{key.upper()}" for name, cls in _SECTIONS.items() for key in cls.rules()]
    known += list(OTHER_ENV_VARS)
    rest = var.upper()[len(ENV_PREFIX) :]
    close = difflib.get_close_matches(rest, [k[len(ENV_PREFIX) :] for k in known], n=1)
    guess = f"did you mean {ENV_PREFIX}{close[0]}? " if close else ""
    sections = ", ".join(name.upper() for name in _SECTIONS)
    return (
        f"{var}: environment variable names no setting; {guess}settings are {ENV_PREFIX}<SECTION>_<KEY> with "
        f"SECTION one of {sections}, and tiermem also reads {', '.join(OTHER_ENV_VARS)}; "
        "fix its name or unset it"
    )


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


def _ranks_here(probe: MachineProbe) -> str:
    """`` x N ranks on this machine`` for messages about a machine several ranks share, else ``""``."""
    return f" x {probe.local_world_size} ranks on this machine" if probe.local_world_size > 1 else ""


def _cuda_capacities(config: Config, index: int, probe: MachineProbe, problems: list[str]) -> tuple[Any, Any]:
    """With CUDA: device auto = 90% of free device memory (the rank's own GPU), host auto = 50%
    of available RAM shared among the ranks on this machine."""
    device_cap: Any = config.device.capacity
    host_cap: Any = config.host.capacity
    ranks = probe.local_world_size
    if device_cap == AUTO:
        try:
            device_cap = probe.cuda_free(index) * 9 // 10
        except (RuntimeError, OSError) as exc:
            problems.append(
                f"device.capacity: cannot read the free memory of cuda:{index} ({exc}); set [device] capacity to a size"
            )
    if host_cap == AUTO:
        host_cap = probe.available_ram // 2 // ranks
    elif host_cap * ranks > probe.total_ram:
        problems.append(
            f"host.capacity: {format_size(host_cap)}{_ranks_here(probe)} exceeds this machine's RAM "
            f'({format_size(probe.total_ram)}); lower it (it is per rank) or use "auto"'
            if ranks > 1
            else f"host.capacity: {format_size(host_cap)} exceeds this machine's RAM "
            f'({format_size(probe.total_ram)}); lower it or use "auto"'
        )
    return device_cap, host_cap


def _cpu_capacities(config: Config, probe: MachineProbe, problems: list[str]) -> tuple[int, int]:
    """Without CUDA device and host are one RAM (TRAPS 7): ``auto`` shares 80% of available RAM
    (40% each, or all of what the explicit other leaves) among the ranks on this machine, and
    explicit values (per rank) must fit in RAM that many times."""
    device_cap, host_cap = config.device.capacity, config.host.capacity
    ranks = probe.local_world_size
    share = probe.available_ram * 4 // 5 // ranks
    if device_cap == AUTO and host_cap == AUTO:
        device_cap = host_cap = probe.available_ram * 2 // 5 // ranks
    elif device_cap == AUTO:
        device_cap = max(0, share - int(host_cap))
    elif host_cap == AUTO:
        host_cap = max(0, share - int(device_cap))
    device_cap, host_cap = int(device_cap), int(host_cap)
    if (device_cap + host_cap) * ranks > probe.total_ram:
        problems.append(_beyond_ram(config, device_cap, host_cap, probe))
    elif config.device.capacity == AUTO and device_cap == 0:
        _warn_auto_empty("device", "host", host_cap, probe)
    elif config.host.capacity == AUTO and host_cap == 0:
        _warn_auto_empty("host", "device", device_cap, probe)
    return device_cap, host_cap


def _beyond_ram(config: Config, device_cap: int, host_cap: int, probe: MachineProbe) -> str:
    """The problem of CPU capacities that do not fit in RAM, keyed by the capacities the user set:
    only those can be lowered (an ``auto`` one is what an explicit one left, here nothing)."""
    ranks, ram = probe.local_world_size, format_size(probe.total_ram)
    per_rank = " (capacities are per rank)" if ranks > 1 else ""
    total = format_size((device_cap + host_cap) * ranks)
    explicit = [name for name in ("device", "host") if getattr(config, name).capacity != AUTO]
    if len(explicit) == 2:
        return (
            f"device.capacity + host.capacity: device ({format_size(device_cap)}) + host ({format_size(host_cap)})"
            f"{_ranks_here(probe)} = {total} exceeds this machine's RAM ({ram}); on the CPU both tiers share one "
            f'RAM: lower [device] capacity or [host] capacity{per_rank}, or set one of them to "auto"'
        )
    (name,) = explicit  # both auto share 80% of the available RAM, which always fits
    other = "host" if name == "device" else "device"
    capacity = format_size(device_cap if name == "device" else host_cap)
    amount = f"{capacity}{_ranks_here(probe)} = {total}" if ranks > 1 else capacity
    return (
        f"{name}.capacity: {amount} exceeds this machine's RAM ({ram}), which the device and host tiers share "
        f'on the CPU; lower [{name}] capacity{per_rank} or set it to "auto" ([{other}] capacity "auto" gets '
        f"what it leaves of 80% of the RAM available, {format_size(probe.available_ram)})"
    )


#: the warnings already given, by what they are about: a run resolves its configuration more than
#: once (``tiermem train`` before its runtime does), and one warning says it all
_WARNED: set[tuple[object, ...]] = set()


def _warn_once(key: tuple[object, ...], message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("tiermem config: %s", message)


def _warn_auto_empty(tier: str, other: str, other_cap: int, probe: MachineProbe) -> None:
    """An ``auto`` tier that the other tier's explicit capacity left with nothing: not an error (the
    configuration may never use that tier), but the first object put there would fail with a
    TierCapacityError telling the user to raise a capacity they never set, so say why now."""
    share = "this rank's share of " if probe.local_world_size > 1 else ""
    _warn_once(
        ("auto empty", tier, other_cap),
        f'[{tier}] capacity "auto" comes to 0 bytes: [{other}] capacity ({format_size(other_cap)}) takes all of '
        f"{share}80% of the RAM available now ({format_size(probe.available_ram)} of "
        f"{format_size(probe.total_ram)}), which the device and host tiers share on the CPU, so nothing can be "
        f"put on the {tier} tier. Lower [{other}] capacity, or set [{tier}] capacity to a size (device + host "
        "must fit in the RAM)",
    )


def _resolve_nvme(nvme: NvmeConfig, probe: MachineProbe, problems: list[str]) -> NvmeConfig:
    """Absolute paths (default ``<tempdir>/tiermem-nvme-<uid>``, private to the user; a multi-process
    job's ranks use ``<path>/rank<R>`` under them, decided by the runtime: ``tiermem.distributed``); capacity auto
    = 90% of the free space of the distinct filesystems holding them (two paths on one
    filesystem share its free space), shared among the ranks on this machine; an explicit
    capacity (per rank) must fit in that free space as many times as there are ranks."""
    paths = nvme.paths or (default_parent(),)
    paths = tuple(os.path.abspath(os.path.expanduser(p)) for p in paths)
    capacity: Any = nvme.capacity
    # filesystem -> (its free bytes, the first path on it): each filesystem counted once
    free_by_fs: dict[int, tuple[int, str]] = {}
    unread = False
    for path in paths:
        try:
            space = probe.disk_space(path)
        except OSError as exc:
            problems.append(f"nvme.paths: cannot read the free space for {_show(path)}: {exc.strerror or exc}")
            unread = True
            continue
        free_by_fs.setdefault(space.filesystem, (space.free, path))
    free = sum(fs_free for fs_free, _ in free_by_fs.values())
    if capacity == AUTO:
        capacity = free * 9 // 10 // probe.local_world_size
    elif not unread and capacity * probe.local_world_size > free:
        _warn_beyond_disk(capacity, free_by_fs, probe)
    return dataclasses.replace(nvme, paths=paths, capacity=capacity)


def _warn_beyond_disk(capacity: int, free_by_fs: dict[int, tuple[int, str]], probe: MachineProbe) -> None:
    """An explicit NVMe capacity the paths' filesystems have no room for now: the files grow as
    objects arrive, so the run would fail later, at the write that finds the disk full (a
    DiskFullError naming what to do). A warning, not a problem: free space is a fact of the
    moment (another job's files come and go, the ranks of a job start one after another, a dead
    run's files go at the next start), where RAM is a fact of the machine. Said once per capacity
    and paths, whatever the free space reads each time."""
    paths = tuple(sorted(path for _, path in free_by_fs.values()))
    _warn_once(("beyond disk", capacity, paths), _beyond_disk(capacity, free_by_fs, probe))


def _beyond_disk(capacity: int, free_by_fs: dict[int, tuple[int, str]], probe: MachineProbe) -> str:
    """What :func:`_warn_beyond_disk` says: the capacity, each filesystem's free space, what to do."""
    ranks = probe.local_world_size
    amount = format_size(capacity)
    if ranks > 1:
        amount += f"{_ranks_here(probe)} = {format_size(capacity * ranks)}"
    where = ", ".join(
        f"{format_size(fs_free)} free on the filesystem of {path}" for fs_free, path in free_by_fs.values()
    )
    if len(free_by_fs) > 1:
        where += f": {format_size(sum(fs_free for fs_free, _ in free_by_fs.values()))} in all"
    return (
        f"nvme.capacity: {amount} exceeds the free space of [nvme] paths ({where}); lower [nvme] capacity"
        + (" (it is per rank)" if ranks > 1 else "")
        + ', set it to "auto" (90% of the free space), free space there, or add [nvme] paths on other filesystems;'
        + " else the write that finds the disk full raises DiskFullError"
    )
