"""What a configuration means on this machine: every setting the machine decides, made concrete,
and why (``tiermem config show``).

:meth:`Config.resolve` makes the capacities, the device, pinning and the NVMe paths concrete.
Three more settings are decided only when a run starts, by the parts that use them:

- ``[nvme] backend`` and ``direct``: the NVMe tier probes the backend with a real write and read,
  and opens its data files with O_DIRECT where the filesystem takes it (NOTE [ NVMe tier layout
  and I/O ] rule 3). :func:`probe_storage` asks the tier itself: it opens an NvmeTier of no
  capacity on the configured paths (this rank's directories in a multi-process job), reads its
  ``describe()`` and closes it again, which removes every file and directory it made. So what
  ``config show`` says is what a run gets, not a second guess at it.
- ``[scheduler] loop``: ``uvloop`` falls back to asyncio's loop where uvloop is not installed.
- ``[distributed] backend``: ``auto`` is gloo without CUDA and ``cpu:gloo,cuda:nccl`` with it.

Tier ``max_inflight`` left out means the scheduler's: it is shown as that value. Settings the
planner decides per run (``chunk_size``, the activation policy) stay ``auto``, saying so.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import tomli_w

from tiermem.config import AUTO, Config, MachineProbe, NvmeConfig
from tiermem.config_fields import SIZE_SETTINGS
from tiermem.distributed import RankContext, resolve_backend
from tiermem.units import format_size

__all__ = ["Explained", "StorageFacts", "explain", "probe_storage"]


@dataclass(frozen=True)
class StorageFacts:
    """What the NVMe tier decides on this machine: the backend that runs, whether its files do
    O_DIRECT, and why each; ``notes``: what else it warned about (a path on tmpfs)."""

    backend: str
    backend_why: str
    direct: bool
    direct_why: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Explained:
    """A configuration with every machine setting concrete, and per ``"section.key"`` why."""

    config: Config
    why: dict[str, str]

    def to_toml(self) -> str:
        """The configuration as TOML, each decided setting followed by ``# why`` on its line
        (on the opening line of a multi-line array), a byte count by its size in words first
        (``# 1GiB``: the number stays exact, as a run reads it); ``None`` values are left out, as
        in :meth:`Config.to_toml`."""
        parts = []
        for name, table in self.config.to_dict().items():
            lines = [f"[{name}]"]
            for key, value in table.items():
                if value is None:
                    continue
                text = tomli_w.dumps({key: value}).rstrip("\n").split("\n")
                why = self.why.get(f"{name}.{key}")
                if f"{name}.{key}" in SIZE_SETTINGS and isinstance(value, int):
                    why = format_size(value) + (f"; {why}" if why else "")
                if why:
                    text[0] += "  # " + " ".join(why.split())
                lines.extend(text)
            parts.append("\n".join(lines) + "\n")
        return "\n".join(parts)


def probe_storage(nvme: NvmeConfig, subdirectory: str | None) -> StorageFacts:
    """Open the NVMe tier ``nvme`` (resolved) describes, with no capacity, and report what it decided.

    Everything it makes (run directories, a rank's directory, the default directory) is removed
    when it closes. A tier that cannot open (a missing path, a backend asked for by name that
    cannot run here) is reported as such, with the setting as configured."""
    from tiermem.errors import TiermemWarning
    from tiermem.tiers.nvme import NvmeTier

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TiermemWarning)
        try:
            tier = NvmeTier(
                nvme.paths,
                0,
                backend=nvme.backend,
                block_size=nvme.block_size,
                queue_depth=nvme.queue_depth,
                checksum=nvme.checksum,
                direct=nvme.direct,
                subdirectory=subdirectory,
            )
        except (OSError, ValueError, RuntimeError) as exc:  # StorageError, BackendUnavailableError
            why = f"CANNOT RUN HERE: {exc}"
            return StorageFacts(str(nvme.backend), why, nvme.direct is True, why)
    notes = tuple(str(w.message) for w in caught if issubclass(w.category, TiermemWarning))
    try:
        facts = tier.describe()
    finally:
        tier.close()
    where = ", ".join(sorted({f"{fs['fstype']} at {fs['mountpoint']}" for fs in facts["filesystems"]}))
    direct_why = f"{facts['direct_reason'] or ('O_DIRECT' if facts['direct'] else 'buffered')} ({where})"
    return StorageFacts(facts["backend"], facts["backend_reason"], facts["direct"], direct_why, notes)


def explain(
    config: Config,
    probe: MachineProbe,
    ranks: RankContext | None = None,
    *,
    storage: Callable[[NvmeConfig, str | None], StorageFacts] = probe_storage,
) -> Explained:
    """``config`` resolved for ``probe`` (raises ConfigError like :meth:`Config.resolve`), with the
    settings decided at run time made concrete too (``storage`` opens the NVMe tier), and why."""
    ranks = RankContext() if ranks is None else ranks
    resolved = config.resolve(probe)
    why: dict[str, str] = {}
    why.update(_device_and_host(config, resolved, probe))
    nvme, nvme_why = _nvme(config.nvme, resolved.nvme, probe, storage(resolved.nvme, ranks.subdirectory))
    why.update(nvme_why)
    scheduler = resolved.scheduler
    loop, why["scheduler.loop"] = _loop(scheduler.loop)
    inflight = {}
    for name in ("device", "host", "nvme"):
        section = nvme if name == "nvme" else getattr(resolved, name)
        if section.max_inflight is None:
            inflight[name] = dataclasses.replace(section, max_inflight=scheduler.max_inflight)
            why[f"{name}.max_inflight"] = "no override: [scheduler] max_inflight"
        else:
            inflight[name] = section
    backend = resolve_backend(resolved.distributed.backend, probe.cuda_available)
    if config.distributed.backend == AUTO:
        why["distributed.backend"] = (
            "auto: CUDA here, so NCCL for CUDA tensors and gloo for CPU ones"
            if probe.cuda_available
            else "auto: no CUDA device here, so gloo"
        )
    why["model_states.chunk_size"] = (
        "the planner's choice for each run (plan='auto'), not the machine's"
        if config.model_states.chunk_size == AUTO
        else ""
    )
    model_states = resolved.model_states
    if config.model_states.step_thread == AUTO:
        why["model_states.step_thread"], machine_says = _step_thread_why()
        if machine_says is not None:  # the machine alone decides: show what it decides
            model_states = dataclasses.replace(model_states, step_thread=machine_says)
    if config.activations.policy == AUTO:
        why["activations.policy"] = "per block, the plan's choice (or TBA's adaptive keep), not the machine's"
    final = dataclasses.replace(
        resolved,
        device=inflight["device"],
        host=inflight["host"],
        nvme=inflight["nvme"],
        scheduler=dataclasses.replace(scheduler, loop=loop),
        distributed=dataclasses.replace(resolved.distributed, backend=backend),
        model_states=model_states,
    )
    return Explained(final, {key: text for key, text in why.items() if text})


def _step_thread_why() -> tuple[str, str | None]:
    """What ``auto`` decides on this machine (its cores), and the setting when the machine alone
    decides it ("off" below the cores the step thread needs); else the run decides the rest."""
    import torch

    from tiermem.states.step_thread import AUTO_MIN_CORES, usable_cores

    cores = usable_cores()
    if cores < AUTO_MIN_CORES:
        return (
            f"auto: this process may use {cores} core (the step thread needs {AUTO_MIN_CORES}), so chunk steps inline",
            "off",
        )
    threads = torch.get_num_threads()
    spare = "leave" if cores > threads else "leave no"
    return (
        f"auto: {cores} cores here, which torch's {threads} intra-op threads {spare} core to spare: chunk "
        "steps go to the step thread where a core is spare or the model computes on an accelerator, "
        "inline where a CPU model's compute takes every core, and fused steps over host homes inline",
        None,
    )


def _ranks(probe: MachineProbe) -> str:
    return f", shared by {probe.local_world_size} ranks on this machine" if probe.local_world_size > 1 else ""


def _device_and_host(config: Config, resolved: Config, probe: MachineProbe) -> dict[str, str]:
    why: dict[str, str] = {}
    device = resolved.device.device
    cuda = device.startswith("cuda")
    if config.device.device == AUTO:
        why["device.device"] = (
            f"auto: CUDA device {device} of {probe.cuda_device_count} (LOCAL_RANK={probe.local_rank})"
            if cuda
            else "auto: torch sees no CUDA device here, so the CPU stands in for the device"
        )
    else:
        why["device.device"] = "as configured"
    ram = format_size(probe.available_ram)
    if config.device.capacity == AUTO:
        if cuda:
            why["device.capacity"] = f"auto: 90% of the memory free on {device} now"
        elif config.host.capacity == AUTO:
            why["device.capacity"] = (
                f"auto: 40% of the RAM available now ({ram}{_ranks(probe)}); without CUDA device and host share one RAM"
            )
        else:
            why["device.capacity"] = f"auto: 80% of the RAM available now ({ram}{_ranks(probe)}) less the host's"
    else:
        why["device.capacity"] = "as configured"
    if config.host.capacity == AUTO:
        if cuda:
            why["host.capacity"] = f"auto: half the RAM available now ({ram}{_ranks(probe)})"
        elif config.device.capacity == AUTO:
            why["host.capacity"] = f"auto: 40% of the RAM available now ({ram}{_ranks(probe)})"
        else:
            why["host.capacity"] = f"auto: 80% of the RAM available now ({ram}{_ranks(probe)}) less the device's"
    else:
        why["host.capacity"] = "as configured"
    if config.host.pinned == AUTO:
        why["host.pinned"] = (
            "auto: the device is CUDA, so one page-locked pool of the host capacity, registered once"
            if resolved.host.pinned
            else "auto: no CUDA device, so nothing gains from page-locked memory"
        )
    else:
        why["host.pinned"] = "as configured"
    return why


def _nvme(
    config: NvmeConfig, resolved: NvmeConfig, probe: MachineProbe, facts: StorageFacts
) -> tuple[NvmeConfig, dict[str, str]]:
    why: dict[str, str] = {}
    why["nvme.paths"] = (
        "default: a private directory under the temporary directory" if not config.paths else ("as configured")
    )
    if config.capacity == AUTO:
        why["nvme.capacity"] = f"auto: 90% of the free space on the filesystems of the paths{_ranks(probe)}"
    else:
        why["nvme.capacity"] = "as configured"
    notes = "; ".join(facts.notes)
    why["nvme.backend"] = facts.backend_why + (f"; {notes}" if notes else "")
    why["nvme.direct"] = ("auto: " if config.direct == AUTO else "") + facts.direct_why
    return dataclasses.replace(resolved, backend=facts.backend, direct=facts.direct), why


def _loop(requested: str) -> tuple[str, str]:
    """The event loop the scheduler will run (``_new_loop`` in ``schedulers/asyncio_scheduler.py``)."""
    if requested != "uvloop":
        return requested, "as configured"
    if importlib.util.find_spec("uvloop") is None:
        why = "not available on Windows" if sys.platform == "win32" else "not installed"
        return "asyncio", f"uvloop asked for, but it is {why}: asyncio's own loop runs"
    return "uvloop", "uvloop is installed"
