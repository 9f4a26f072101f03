"""The tier configuration model: parsing, environment, validation, resolution, round trips.

Machines are faked with MachineProbe, so these tests need neither CUDA nor torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tiermem.config import (
    ActivationsConfig,
    Config,
    DeviceConfig,
    DiskSpace,
    DistributedConfig,
    HostConfig,
    MachineProbe,
    ModelStatesConfig,
    NvmeConfig,
    SchedulerConfig,
)
from tiermem.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's own TIERMEM_* or torchrun's variables must not change what these tests see."""
    for name in list(os.environ):
        if name.upper().startswith("TIERMEM_") or name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def problems_of(data: Any, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data, env={} if env is None else env)
    return info.value.problems


def write(tmp_path: Path, text: str, name: str = "tiers.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cpu_machine(**overrides: Any) -> MachineProbe:
    """A CPU-only machine with 10 GiB available of 16 GiB and one 100 GiB filesystem."""
    fields: dict[str, Any] = {
        "available_ram": 10 * GiB,
        "total_ram": 16 * GiB,
        "disk_space": lambda path: DiskSpace(filesystem=1, free=100 * GiB),
        "cuda_free": lambda index: pytest.fail("a CPU machine must not be asked for CUDA memory"),
    }
    fields.update(overrides)
    return MachineProbe(**fields)


# -- defaults ----------------------------------------------------------------------------------


def test_defaults_match_the_documented_values() -> None:
    c = Config()
    assert c.device == DeviceConfig(capacity="auto", device="auto", max_inflight=None)
    assert c.host == HostConfig(capacity="auto", pinned="auto", max_inflight=None)
    assert c.nvme == NvmeConfig(
        paths=(),
        backend="auto",
        block_size=MiB,
        queue_depth=32,
        capacity="auto",
        checksum=False,
        direct="auto",
        max_inflight=None,
    )
    assert c.scheduler == SchedulerConfig(loop="uvloop", max_inflight=512 * MiB)
    assert c.activations == ActivationsConfig(policy="auto", min_bytes=MiB)
    assert c.model_states == ModelStatesConfig(chunk_size="auto", step_thread="auto")
    assert c.distributed == DistributedConfig(timeout_s=600.0, backend="auto")


def test_empty_dict_and_empty_file_give_the_defaults(tmp_path: Path) -> None:
    assert Config.from_dict({}, env={}) == Config()
    assert Config.load(write(tmp_path, ""), env={}) == Config()


# -- parsing every key -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "value", "stored"),
    [
        ("device", "capacity", "8GiB", 8 * GiB),
        ("device", "capacity", 4096, 4096),
        ("device", "capacity", "auto", "auto"),
        ("device", "device", "cpu", "cpu"),
        ("device", "device", "cuda", "cuda"),
        ("device", "device", "cuda:3", "cuda:3"),
        ("device", "device", "cuda:03", "cuda:3"),
        ("device", "max_inflight", "64MiB", 64 * MiB),
        ("device", "max_inflight", None, None),
        ("host", "capacity", "1.5GiB", 3 * GiB // 2),
        ("host", "pinned", True, True),
        ("host", "pinned", False, False),
        ("host", "pinned", "auto", "auto"),
        ("host", "max_inflight", 1 << 20, 1 << 20),
        ("nvme", "paths", ["/a", "/b"], ("/a", "/b")),
        ("nvme", "paths", [], ()),
        ("nvme", "backend", "kvikio", "kvikio"),
        ("nvme", "backend", "posix", "posix"),
        ("nvme", "block_size", "4KiB", 4 * KiB),
        ("nvme", "block_size", "256MiB", 256 * MiB),
        ("nvme", "block_size", 65536, 65536),
        ("nvme", "queue_depth", 1, 1),
        ("nvme", "queue_depth", 1024, 1024),
        ("nvme", "capacity", "10GB", 10 * 1000**3),
        ("nvme", "checksum", True, True),
        ("nvme", "direct", False, False),
        ("nvme", "direct", "auto", "auto"),
        ("nvme", "max_inflight", "1GiB", GiB),
        ("scheduler", "loop", "asyncio", "asyncio"),
        ("scheduler", "max_inflight", "1MiB", MiB),
        ("activations", "policy", "recompute", "recompute"),
        ("activations", "policy", "nvme", "nvme"),
        ("activations", "min_bytes", 0, 0),
        ("model_states", "chunk_size", "32MiB", 32 * MiB),
        ("model_states", "chunk_size", "auto", "auto"),
        ("model_states", "step_thread", "off", "off"),
        ("distributed", "timeout_s", 30, 30.0),
        ("distributed", "timeout_s", 0.5, 0.5),
        ("distributed", "backend", "gloo", "gloo"),
        ("distributed", "backend", "nccl", "nccl"),
    ],
)
def test_each_key_parses_to_its_stored_value(section: str, key: str, value: Any, stored: Any) -> None:
    config = Config.from_dict({section: {key: value}}, env={})
    assert getattr(getattr(config, section), key) == stored


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("device", "capacity", "8 XB", 'device.capacity: "8 XB" is not a size; use bytes'),
        ("device", "capacity", -1, "device.capacity: -1 is not a size"),
        ("device", "capacity", 1.5, "device.capacity: 1.5 is not a size"),
        ("device", "device", "gpu", 'device.device: "gpu" is not a device; use "auto", "cpu", "cuda"'),
        ("device", "device", "cuda:x", 'device.device: "cuda:x" is not a device'),
        ("device", "max_inflight", 0, "device.max_inflight: 0 must be more than 0 bytes"),
        ("host", "pinned", "yes", 'host.pinned: "yes" is not "auto" or a boolean; use "auto", true or false'),
        ("host", "capacity", True, "host.capacity: true is not a size"),
        ("nvme", "paths", "/mnt/x", 'nvme.paths: "/mnt/x" is not a list of paths'),
        ("nvme", "paths", ["/a", 3], "nvme.paths: entry 1 (3) is not a directory path"),
        ("nvme", "paths", ["/a", "/a/"], 'nvme.paths: "/a/" is listed twice'),
        ("nvme", "backend", "gds", 'nvme.backend: "gds" is not a known backend; use one of "auto", "kvikio"'),
        (
            "nvme",
            "block_size",
            3000,
            "nvme.block_size: 3000 is not a multiple of 4096; use a power of two between 4KiB and 256MiB "
            'such as "1MiB"',
        ),
        ("nvme", "block_size", 12288, "nvme.block_size: 12288 is not a power of two"),
        ("nvme", "block_size", "512MiB", 'nvme.block_size: "512MiB" is larger than 256MiB'),
        ("nvme", "block_size", 0, "nvme.block_size: 0 is smaller than 4KiB"),
        ("nvme", "queue_depth", 0, "nvme.queue_depth: 0 is out of range; use an integer from 1 to 1024"),
        ("nvme", "queue_depth", 1025, "nvme.queue_depth: 1025 is out of range"),
        ("nvme", "queue_depth", "32", 'nvme.queue_depth: "32" is not an integer'),
        ("nvme", "queue_depth", True, "nvme.queue_depth: true is not an integer"),
        ("nvme", "checksum", "auto", 'nvme.checksum: "auto" is not a boolean; use true or false'),
        ("nvme", "checksum", 1, "nvme.checksum: 1 is not a boolean"),
        (
            "scheduler",
            "loop",
            "trio",
            'scheduler.loop: "trio" is not a known event loop; use one of "uvloop"',
        ),
        ("scheduler", "max_inflight", 0, "scheduler.max_inflight: 0 must be more than 0 bytes"),
        ("scheduler", "max_inflight", None, "scheduler.max_inflight: null is not a size"),
        ("activations", "policy", "swap", 'activations.policy: "swap" is not a known policy'),
        ("activations", "min_bytes", "lots", 'activations.min_bytes: "lots" is not a size'),
        ("model_states", "chunk_size", 0, "model_states.chunk_size: 0 must be more than 0 bytes"),
        ("model_states", "step_thread", "yes", 'model_states.step_thread: "yes" is not a known step-thread setting'),
        (
            "distributed",
            "timeout_s",
            0,
            "distributed.timeout_s: 0 is out of range; use a number of seconds more than 0 and at most 604800",
        ),
        ("distributed", "timeout_s", -5, "distributed.timeout_s: -5 is out of range"),
        ("distributed", "timeout_s", float("nan"), "distributed.timeout_s: NaN is out of range"),
        ("distributed", "timeout_s", float("inf"), "distributed.timeout_s: Infinity is out of range"),
        ("distributed", "timeout_s", "10m", 'distributed.timeout_s: "10m" is not a number of seconds'),
        ("distributed", "timeout_s", True, "distributed.timeout_s: true is not a number of seconds"),
        ("distributed", "backend", "mpi", 'distributed.backend: "mpi" is not a known backend; use one of "auto"'),
    ],
)
def test_bad_values_name_the_key_and_what_is_accepted(section: str, key: str, value: Any, expected: str) -> None:
    (problem,) = problems_of({section: {key: value}})
    assert problem.startswith(expected), problem


def test_every_problem_in_a_file_is_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[nvme]\nblock_size = 3000\nqueue_depth = 0\n[scheduler]\nloop = "trio"\n[activations]\npolicy = "keep"\n',
    )
    with pytest.raises(ConfigError) as info:
        Config.load(path, env={})
    problems = info.value.problems
    assert [p.split(":")[0] for p in problems] == ["nvme.block_size", "nvme.queue_depth", "scheduler.loop"]
    assert info.value.source == str(path)
    assert str(path) in str(info.value) and "3 problem(s)" in str(info.value)


def test_unknown_sections_and_keys_are_errors_with_a_suggestion() -> None:
    problems = problems_of({"nvmee": {"paths": []}, "nvme": {"blocksize": "1MiB"}, "nvme_x": 1})
    assert problems[0].startswith("nvmee: unknown section; did you mean nvme? sections are: device, host")
    assert problems[1].startswith("nvme.blocksize: unknown key in [nvme]; did you mean block_size? keys are:")
    assert problems[2].startswith("nvme_x: unknown section")


def test_a_section_that_is_not_a_table_is_an_error() -> None:
    (problem,) = problems_of({"nvme": "fast"})
    assert problem.startswith('nvme: expected a table of settings [nvme], got "fast"')


def test_malformed_toml_names_the_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[nvme]\nqueue_depth = = 3\n")
    with pytest.raises(ConfigError) as info:
        Config.load(path, env={})
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}: not valid TOML:")
    assert "line 2" in problem and "column" in problem


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.toml", tmp_path):
        with pytest.raises(ConfigError) as info:
            Config.load(path, env={})
        assert info.value.problems[0].startswith(f"{path}: cannot read the file")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[nvme]")
    with pytest.raises(ConfigError, match="not UTF-8"):
        Config.load(binary, env={})


def test_sections_built_directly_are_checked_and_normalised() -> None:
    assert NvmeConfig(block_size="2MiB", paths=["/x"]).block_size == 2 * MiB
    assert NvmeConfig(paths=["/x"]).paths == ("/x",)
    assert dataclasses.replace(SchedulerConfig(), max_inflight="1GiB").max_inflight == GiB
    with pytest.raises(ConfigError) as info:
        NvmeConfig(block_size=3000, queue_depth=0)
    assert [p.split(":")[0] for p in info.value.problems] == ["nvme.block_size", "nvme.queue_depth"]
    with pytest.raises(ConfigError, match="nvme: expected a NvmeConfig, got dict"):
        Config(nvme={"paths": []})  # type: ignore[arg-type]


# -- environment -------------------------------------------------------------------------------


def test_environment_sets_what_the_file_leaves_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERMEM_NVME_PATHS", os.pathsep.join(["/mnt/a", "", "/mnt/b"]))
    monkeypatch.setenv("TIERMEM_DEVICE_CAPACITY", "8GiB")
    monkeypatch.setenv("TIERMEM_DEVICE_MAX_INFLIGHT", "none")
    monkeypatch.setenv("TIERMEM_HOST_PINNED", "no")
    monkeypatch.setenv("TIERMEM_NVME_CHECKSUM", "yes")
    monkeypatch.setenv("TIERMEM_NVME_DIRECT", "auto")
    monkeypatch.setenv("TIERMEM_NVME_QUEUE_DEPTH", "64")
    monkeypatch.setenv("TIERMEM_SCHEDULER_LOOP", "asyncio")
    monkeypatch.setenv("TIERMEM_MODEL_STATES_CHUNK_SIZE", "16MiB")
    monkeypatch.setenv("TIERMEM_ACTIVATIONS_MIN_BYTES", "")  # empty = unset
    monkeypatch.setenv("TIERMEM_DISTRIBUTED_TIMEOUT_S", "90")
    monkeypatch.setenv("TIERMEM_DISTRIBUTED_BACKEND", "gloo")
    monkeypatch.setenv("TIERMEM_KEEP_MALLOC", "1")  # read by tiermem.malloc, not a setting: accepted
    c = Config.coerce(None)
    assert c.nvme.paths == ("/mnt/a", "/mnt/b")
    assert c.device.capacity == 8 * GiB
    assert c.device.max_inflight is None
    assert c.host.pinned is False
    assert c.nvme.checksum is True
    assert c.nvme.direct == "auto"
    assert c.nvme.queue_depth == 64
    assert c.scheduler.loop == "asyncio"
    assert c.model_states.chunk_size == 16 * MiB
    assert c.activations.min_bytes == MiB
    assert c.distributed == DistributedConfig(timeout_s=90.0, backend="gloo")
    (problem,) = problems_of({}, env={"TIERMEM_DISTRIBUTED_TIMEOUT_S": "soon"})
    assert problem.startswith('distributed.timeout_s: "soon" is not a number of seconds') and "TIMEOUT_S" in problem


def test_file_values_win_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERMEM_SCHEDULER_LOOP", "asyncio")
    monkeypatch.setenv("TIERMEM_NVME_QUEUE_DEPTH", "64")
    c = Config.load(write(tmp_path, '[scheduler]\nloop = "uvloop"\n'))
    assert c.scheduler.loop == "uvloop"  # the file's
    assert c.nvme.queue_depth == 64  # the environment's
    assert Config.coerce({"nvme": {"queue_depth": 8}}).nvme.queue_depth == 8


def test_a_bad_file_value_is_reported_once_even_if_the_environment_sets_the_key() -> None:
    problems = problems_of({"nvme": {"queue_depth": 0}}, env={"TIERMEM_NVME_QUEUE_DEPTH": "bad"})
    assert problems == ["nvme.queue_depth: 0 is out of range; use an integer from 1 to 1024"]


def test_bad_and_unknown_environment_variables_are_errors() -> None:
    problems = problems_of(
        {},
        env={
            "TIERMEM_NVME_QUEUE_DEPTH": "lots",
            "TIERMEM_NVME_BLOCKSIZE": "1MiB",
            "TIERMEM_HOST_PINNED": "maybe",
            "TIERMEM_KEEP_MALLOC": "1",
            "TIERMEM_TRACE": "",
        },
    )
    assert problems == [
        'host.pinned: "maybe" is not "auto" or a boolean; use "auto", true or false (1/0/yes/no in the '
        "environment) (from environment variable TIERMEM_HOST_PINNED)",
        "nvme.blocksize: environment variable TIERMEM_NVME_BLOCKSIZE names no setting; did you mean "
        "TIERMEM_NVME_BLOCK_SIZE? the variables of [nvme] are: TIERMEM_NVME_PATHS, TIERMEM_NVME_BACKEND, "
        "TIERMEM_NVME_BLOCK_SIZE, TIERMEM_NVME_QUEUE_DEPTH, TIERMEM_NVME_CAPACITY, TIERMEM_NVME_CHECKSUM, "
        "TIERMEM_NVME_DIRECT, TIERMEM_NVME_MAX_INFLIGHT",
        'nvme.queue_depth: "lots" is not an integer; use an integer from 1 to 1024 '
        "(from environment variable TIERMEM_NVME_QUEUE_DEPTH)",
    ]


def test_a_typo_in_an_environment_variables_section_is_an_error_with_a_suggestion() -> None:
    """Like a typo in its key: TIERMEM_NVEM_CAPACITY set nothing and said nothing."""
    env = {"TIERMEM_NVEM_CAPACITY": "2GiB", "TIERMEM_MODELSTATES_CHUNK_SIZE": "1MiB", "TIERMEM_LOG": "debug"}
    problems = problems_of({}, env=env)
    assert [p.split(";")[:2] for p in problems] == [
        ["TIERMEM_LOG: environment variable names no setting", " settings are TIERMEM_<SECTION>_<KEY> with SECTION one "
         "of DEVICE, HOST, NVME, SCHEDULER, ACTIVATIONS, MODEL_STATES, DISTRIBUTED, TRACE, and tiermem also reads "
         "TIERMEM_TRACE, TIERMEM_KEEP_MALLOC"],
        ["TIERMEM_MODELSTATES_CHUNK_SIZE: environment variable names no setting",
         " did you mean TIERMEM_MODEL_STATES_CHUNK_SIZE? settings are TIERMEM_<SECTION>_<KEY> with SECTION one of "
         "DEVICE, HOST, NVME, SCHEDULER, ACTIVATIONS, MODEL_STATES, DISTRIBUTED, TRACE, and tiermem also reads "
         "TIERMEM_TRACE, TIERMEM_KEEP_MALLOC"],
        ["TIERMEM_NVEM_CAPACITY: environment variable names no setting",
         " did you mean TIERMEM_NVME_CAPACITY? settings are TIERMEM_<SECTION>_<KEY> with SECTION one of "
         "DEVICE, HOST, NVME, SCHEDULER, ACTIVATIONS, MODEL_STATES, DISTRIBUTED, TRACE, and tiermem also reads "
         "TIERMEM_TRACE, TIERMEM_KEEP_MALLOC"],
    ]  # fmt: skip
    assert all(p.endswith("; fix its name or unset it") for p in problems)
    # tiermem's variables that are not settings stay accepted, empty or not
    assert Config.from_dict({}, env={"TIERMEM_KEEP_MALLOC": "1", "TIERMEM_TRACE": ""}) == Config()


def test_every_tiermem_variable_the_library_names_is_a_setting_or_accepted() -> None:
    """A TIERMEM_* name the code reads outside the configuration must be in OTHER_ENV_VARS, or
    setting it would be refused as a typo."""
    import re

    import tiermem
    from tiermem.config_fields import _SECTIONS, OTHER_ENV_VARS

    settings = {f"TIERMEM_{name.upper()}_{key.upper()}" for name, cls in _SECTIONS.items() for key in cls.rules()}
    root = Path(tiermem.__file__).parent.parent
    named = {
        match
        for directory in ("tiermem", "tiers", "schedulers")
        for source in (root / directory).rglob("*.py")
        for match in re.findall(r"TIERMEM_[A-Z0-9_]*[A-Z0-9]", source.read_text())
    }
    assert {"TIERMEM_KEEP_MALLOC", "TIERMEM_MODEL_STATES_STEP_THREAD"} <= named  # the scan finds them
    assert named - settings <= set(OTHER_ENV_VARS)


def test_coerce_accepts_every_documented_form(tmp_path: Path) -> None:
    path = write(tmp_path, "[nvme]\nqueue_depth = 4\n")
    assert Config.coerce(str(path), env={}).nvme.queue_depth == 4
    assert Config.coerce(path, env={}).nvme.queue_depth == 4
    assert Config.coerce({"nvme": {"queue_depth": 5}}, env={}).nvme.queue_depth == 5
    config = Config()
    assert Config.coerce(config) is config
    assert Config.coerce(None, env={}) == Config()
    with pytest.raises(TypeError, match=r"expected a path to a TOML file, a dict, a tiermem\.Config or None"):
        Config.coerce(42)  # type: ignore[arg-type]


# -- resolution --------------------------------------------------------------------------------


def test_cpu_machine_splits_available_ram_between_device_and_host() -> None:
    r = Config().resolve(cpu_machine())
    assert r.device.device == "cpu"
    assert r.device.capacity == 4 * GiB  # 40% of 10 GiB
    assert r.host.capacity == 4 * GiB
    assert r.host.pinned is False


def test_cpu_machine_gives_the_auto_tier_what_the_explicit_one_leaves() -> None:
    r = Config.from_dict({"device": {"capacity": "3GiB"}}, env={}).resolve(cpu_machine())
    assert (r.device.capacity, r.host.capacity) == (3 * GiB, 8 * GiB - 3 * GiB)
    r = Config.from_dict({"host": {"capacity": "9GiB"}}, env={}).resolve(cpu_machine())
    assert (r.device.capacity, r.host.capacity) == (0, 9 * GiB)  # 80% of 10 GiB - 9 GiB, at least 0


def test_cpu_machine_rejects_device_plus_host_beyond_ram() -> None:
    config = Config.from_dict({"device": {"capacity": "10GiB"}, "host": {"capacity": "7GiB"}}, env={})
    with pytest.raises(ConfigError) as info:
        config.resolve(cpu_machine())
    assert info.value.problems == [
        "device.capacity + host.capacity: device (10GiB) + host (7GiB) = 17GiB exceeds this machine's RAM (16GiB); "
        'on the CPU both tiers share one RAM: lower [device] capacity or [host] capacity, or set one of them to "auto"'
    ]


def test_cpu_ram_problems_name_the_capacity_the_user_set() -> None:
    """Only the explicit capacity can be lowered: host "auto" got what device left (nothing), and
    blaming host.capacity sent users to a key they never set."""
    for name, other in (("device", "host"), ("host", "device")):
        with pytest.raises(ConfigError) as info:
            Config.from_dict({name: {"capacity": "100TiB"}}, env={}).resolve(cpu_machine())
        assert info.value.problems == [
            f"{name}.capacity: 100TiB exceeds this machine's RAM (16GiB), which the device and host tiers share on "
            f'the CPU; lower [{name}] capacity or set it to "auto" ([{other}] capacity "auto" gets what it leaves '
            "of 80% of the RAM available, 10GiB)"
        ]
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"device": {"capacity": "9GiB"}}, env={}).resolve(cpu_machine(local_world_size=2))
    assert info.value.problems == [
        "device.capacity: 9GiB x 2 ranks on this machine = 18GiB exceeds this machine's RAM (16GiB), which the "
        'device and host tiers share on the CPU; lower [device] capacity (capacities are per rank) or set it to "auto" '
        '([host] capacity "auto" gets what it leaves of 80% of the RAM available, 10GiB)'
    ]


def test_an_auto_cpu_capacity_left_with_nothing_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TIERMEM_DEVICE_CAPACITY below the RAM but above the share of it left host "auto" at 0 bytes
    in silence; the first host use then failed, asking to raise a capacity nobody had set."""
    import tiermem.config

    monkeypatch.setattr(tiermem.config, "_WARNED", set())  # warnings already given in this process
    env = {"TIERMEM_DEVICE_CAPACITY": "12GiB"}
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        for _ in range(2):  # a run resolves more than once (tiermem train, then its runtime): warned once
            assert Config.from_dict({}, env=env).resolve(cpu_machine()).host.capacity == 0
    assert [r.getMessage() for r in caplog.records] == [
        'tiermem config: [host] capacity "auto" comes to 0 bytes: [device] capacity (12GiB) takes all of 80% of '
        "the RAM available now (10GiB of 16GiB), which the device and host tiers share on the CPU, so nothing can "
        "be put on the host tier. Lower [device] capacity, or set [host] capacity to a size (device + host must "
        "fit in the RAM)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        assert Config.from_dict({"host": {"capacity": "9GiB"}}, env={}).resolve(cpu_machine()).device.capacity == 0
        Config.from_dict({"device": {"capacity": "3GiB"}}, env={}).resolve(cpu_machine())  # leaves 5 GiB: quiet
        Config.from_dict({"host": {"capacity": 0}}, env={}).resolve(cpu_machine())  # an explicit 0 is meant
    assert [r.getMessage().split(":")[1] for r in caplog.records] == [' [device] capacity "auto" comes to 0 bytes']


def test_auto_capacities_are_each_ranks_share_of_the_machine() -> None:
    """NOTE [ Ranks ] rule 3: two ranks on this machine share its RAM and disks; explicit
    capacities are per rank and must fit the machine twice."""
    two = cpu_machine(local_world_size=2)
    r = Config().resolve(two)
    assert (r.device.capacity, r.host.capacity) == (2 * GiB, 2 * GiB)  # 40% of 10 GiB, halved
    assert r.nvme.capacity == 45 * GiB  # 90% of 100 GiB, halved
    r = Config.from_dict({"device": {"capacity": "1GiB"}}, env={}).resolve(two)
    assert (r.device.capacity, r.host.capacity) == (GiB, 4 * GiB - GiB)  # what the rank's share leaves
    config = Config.from_dict({"device": {"capacity": "5GiB"}, "host": {"capacity": "4GiB"}}, env={})
    assert config.resolve(cpu_machine()).device.capacity == 5 * GiB  # fits once
    with pytest.raises(ConfigError) as info:
        config.resolve(two)
    assert info.value.problems == [
        "device.capacity + host.capacity: device (5GiB) + host (4GiB) x 2 ranks on this machine = 18GiB exceeds "
        "this machine's RAM (16GiB); on the CPU both tiers share one RAM: lower [device] capacity or [host] "
        'capacity (capacities are per rank), or set one of them to "auto"'
    ]
    cuda = cpu_machine(cuda_device_count=2, local_rank=1, local_world_size=2, cuda_free=lambda index: 20 * GiB)
    r = Config().resolve(cuda)
    assert (r.device.device, r.device.capacity, r.host.capacity) == ("cuda:1", 18 * GiB, 5 * GiB // 2)
    with pytest.raises(ConfigError, match=r"host.capacity: 9GiB x 2 ranks on this machine exceeds this machine's RAM"):
        Config.from_dict({"host": {"capacity": "9GiB"}}, env={}).resolve(cuda)


def test_cuda_machine_uses_local_rank_device_memory_and_pinned_host() -> None:
    asked: list[int] = []

    def cuda_free(index: int) -> int:
        asked.append(index)
        return 20 * GiB

    probe = cpu_machine(cuda_device_count=2, local_rank=1, cuda_free=cuda_free)
    r = Config().resolve(probe)
    assert r.device.device == "cuda:1"
    assert asked == [1]
    assert r.device.capacity == 18 * GiB  # 90% of free device memory
    assert r.host.capacity == 5 * GiB  # 50% of available RAM
    assert r.host.pinned is True
    # Explicitly on the CPU, the CPU rules apply even where CUDA exists.
    r = Config.from_dict({"device": {"device": "cpu"}}, env={}).resolve(probe)
    assert (r.device.device, r.device.capacity, r.host.pinned) == ("cpu", 4 * GiB, False)
    assert Config.from_dict({"device": {"device": "cuda"}}, env={}).resolve(probe).device.device == "cuda:1"


def test_cuda_host_capacity_beyond_ram_is_rejected() -> None:
    config = Config.from_dict({"host": {"capacity": "32GiB"}}, env={})
    probe = cpu_machine(cuda_device_count=1, cuda_free=lambda i: GiB)
    with pytest.raises(ConfigError, match=r"host.capacity: 32GiB exceeds this machine's RAM \(16GiB\)"):
        config.resolve(probe)


def test_cuda_requested_without_cuda_is_a_problem_collected_with_the_others() -> None:
    config = Config.from_dict({"device": {"device": "cuda:0"}, "host": {"pinned": True}}, env={})
    probe = cpu_machine(disk_space=lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(ConfigError) as info:
        config.resolve(probe)
    default_nvme = os.path.join(tempfile.gettempdir(), f"tiermem-nvme-{os.geteuid()}")
    assert info.value.problems == [
        'device.device: "cuda:0" needs CUDA, but torch sees no CUDA device on this machine; use "auto" or "cpu"',
        "host.pinned: true needs CUDA (pinned memory is page-locked for CUDA copies) and this machine has no "
        'CUDA device; use "auto" or false',
        f'nvme.paths: cannot read the free space for "{default_nvme}": Permission denied',
    ]


def test_local_rank_beyond_the_device_count_is_a_problem() -> None:
    probe = cpu_machine(cuda_device_count=1, local_rank=3, cuda_free=lambda i: GiB)
    with pytest.raises(ConfigError, match=r'device.device: "auto" picked cuda:3 from LOCAL_RANK=3, but this'):
        Config().resolve(probe)


def test_nvme_capacity_counts_each_filesystem_once(tmp_path: Path) -> None:
    filesystems = {"a": 1, "b": 1, "c": 2}
    probe = cpu_machine(disk_space=lambda path: DiskSpace(filesystems[Path(path).name], 100 * GiB))
    one_fs = Config.from_dict({"nvme": {"paths": [str(tmp_path / "a"), str(tmp_path / "b")]}}, env={})
    assert one_fs.resolve(probe).nvme.capacity == 90 * GiB
    two_fs = Config.from_dict({"nvme": {"paths": [str(tmp_path / "a"), str(tmp_path / "c")]}}, env={})
    assert two_fs.resolve(probe).nvme.capacity == 180 * GiB


def test_an_nvme_capacity_beyond_the_free_space_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An explicit capacity larger than the disk's free space starts a run that fails at the write
    finding the disk full: said at once, as a warning (free space comes and goes, unlike RAM); like
    auto, the free space of each filesystem counts once, per rank."""
    filesystems = {"a": 1, "b": 1, "c": 2}
    probe = cpu_machine(disk_space=lambda path: DiskSpace(filesystems[Path(path).name], 100 * GiB))
    a, b, c = (str(tmp_path / name) for name in "abc")

    def warnings(paths: list[str], capacity: str, machine: MachineProbe = probe) -> list[str]:
        caplog.clear()
        config = Config.from_dict({"nvme": {"paths": paths, "capacity": capacity}}, env={})
        with caplog.at_level("WARNING", logger="tiermem"):
            config.resolve(machine)  # not a problem: the run starts
        return [r.getMessage() for r in caplog.records]

    assert warnings([a], "100GiB") == []  # all of the free space is the user's to give
    advice = (
        '; lower [nvme] capacity, set it to "auto" (90% of the free space), free space there, or add [nvme] '
        "paths on other filesystems; else the write that finds the disk full raises DiskFullError"
    )
    assert warnings([a, b], "1TiB") == [  # one filesystem: its free space once
        f"tiermem config: nvme.capacity: 1TiB exceeds the free space of [nvme] paths (100GiB free on the "
        f"filesystem of {a})" + advice
    ]
    assert warnings([a, b], "1TiB") == []  # said once a process: a run resolves its configuration more than once
    assert warnings([a, c], "200GiB") == []
    assert warnings([a, c], "201GiB") == [
        f"tiermem config: nvme.capacity: 201GiB exceeds the free space of [nvme] paths (100GiB free on the "
        f"filesystem of {a}, 100GiB free on the filesystem of {c}: 200GiB in all)" + advice
    ]
    assert warnings([a], "60GiB", cpu_machine(disk_space=probe.disk_space, local_world_size=2)) == [
        "tiermem config: nvme.capacity: 60GiB x 2 ranks on this machine = 120GiB exceeds the free space of [nvme] "
        f'paths (100GiB free on the filesystem of {a}); lower [nvme] capacity (it is per rank), set it to "auto" '
        "(90% of the free space), free space there, or add [nvme] paths on other filesystems; else the write that "
        "finds the disk full raises DiskFullError"
    ]


def test_resolve_makes_paths_concrete_and_leaves_non_machine_autos() -> None:
    r = Config().resolve(cpu_machine())
    assert r.nvme.paths == (os.path.join(tempfile.gettempdir(), f"tiermem-nvme-{os.geteuid()}"),)
    assert r.nvme.capacity == 90 * GiB
    assert (r.nvme.backend, r.nvme.direct, r.model_states.chunk_size, r.activations.policy) == ("auto",) * 4
    assert r.resolve(cpu_machine()) == r  # resolving twice changes nothing
    relative = Config.from_dict({"nvme": {"paths": ["~/nvme", "rel"]}}, env={}).resolve(cpu_machine())
    assert relative.nvme.paths == (os.path.expanduser("~/nvme"), os.path.abspath("rel"))


def test_real_disk_space_walks_up_to_an_existing_directory(tmp_path: Path) -> None:
    probe = MachineProbe(available_ram=GiB, total_ram=GiB)
    space = probe.disk_space(str(tmp_path / "not" / "yet"))
    assert space.filesystem == os.stat(tmp_path).st_dev
    assert space.free > 0


def test_detect_reads_ram_and_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiermem.config

    monkeypatch.setattr(tiermem.config, "_cuda_device_count", lambda: 0)  # keep torch out of this test
    probe = MachineProbe.detect({"LOCAL_RANK": "2"})
    assert probe.local_rank == 2 and probe.local_world_size == 1 and not probe.cuda_available
    probe = MachineProbe.detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (probe.local_rank, probe.local_world_size) == (1, 2)
    assert 0 < probe.available_ram <= probe.total_ram
    with pytest.raises(ConfigError, match="LOCAL_RANK='x' is not a non-negative integer"):
        MachineProbe.detect({"LOCAL_RANK": "x"})


# -- round trips -------------------------------------------------------------------------------


def test_to_dict_round_trips_defaults_custom_and_resolved() -> None:
    custom = Config.from_dict(
        {
            "device": {"capacity": "2GiB", "max_inflight": "64MiB"},
            "nvme": {"paths": ["/x", "/y"], "checksum": True, "block_size": "4MiB"},
            "scheduler": {"loop": "asyncio"},
        },
        env={},
    )
    for config in (Config(), custom, custom.resolve(cpu_machine())):
        data = config.to_dict()
        assert Config.from_dict(data, env={}) == config
        assert data["nvme"]["paths"] == list(config.nvme.paths)
    assert custom.to_dict()["device"] == {"capacity": 2 * GiB, "device": "auto", "max_inflight": 64 * MiB}


def test_to_toml_omits_none_and_loads_back(tmp_path: Path) -> None:
    config = Config.from_dict({"host": {"max_inflight": "8MiB"}, "nvme": {"paths": ["/x"]}}, env={})
    text = config.to_toml()
    data = tomllib.loads(text)
    assert "max_inflight" not in data["device"]
    assert data["host"]["max_inflight"] == 8 * MiB
    assert Config.load(write(tmp_path, text), env={}) == config
