"""``tiermem config check|show`` and the ``tiermem`` entry point: exit codes, output, no tracebacks.

The machine is faked (MachineProbe.detect is patched), so results do not depend on this
host's RAM, GPUs or disks, and torch is never imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiermem.cli
from tiermem.cli import COMMANDS, main
from tiermem.config import DiskSpace, MachineProbe
from tiermem.units import format_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GiB = 1024**3
MiB = 1024**2
PROJECT_ROOT = Path(__file__).resolve().parent.parent
FAKE_MACHINE = MachineProbe(available_ram=10 * GiB, total_ram=16 * GiB, disk_space=lambda path: DiskSpace(1, 100 * GiB))


@pytest.fixture(autouse=True)
def _fake_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU machine with 10 of 16 GiB available; no stray TIERMEM_* from the developer's shell."""
    for name in list(os.environ):
        if name.upper().startswith("TIERMEM_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(MachineProbe, "detect", classmethod(lambda cls, environ=None: FAKE_MACHINE))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tiers.toml"
    path.write_text(text)
    return str(path)


BAD_FILE = '[nvme]\nblock_size = 3000\nqueue_depth = 0\n[scheduler]\nloop = "trio"\n[gpu]\nx = 1\n'


def test_check_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, '[device]\ncapacity = "2GiB"\n[nvme]\nqueue_depth = 8\n')
    assert main(["config", "check", path]) == 0
    out, err = capsys.readouterr()
    assert out == f"OK: {path}\n"
    assert err == ""


def test_check_reports_every_problem_one_per_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, BAD_FILE)
    assert main(["config", "check", path]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == f"tiermem config: 4 problem(s) in {path}:"
    keys = [line.removeprefix("  - ").split(":")[0] for line in lines[1:]]
    assert keys == ["nvme.block_size", "nvme.queue_depth", "scheduler.loop", "gpu"]
    assert "Traceback" not in err


def test_check_reports_machine_and_path_problems_with_the_values_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every problem at once: a path that does not exist is reported beside a value that does not
    parse, and beside one this machine cannot give."""
    missing = tmp_path / "nope"
    for capacity, first in (('"lots"', "device.capacity"), ('"99TiB"', "device.capacity")):
        path = write(tmp_path, f'[device]\ncapacity = {capacity}\n[nvme]\npaths = ["{missing}"]\n')
        assert main(["config", "check", path]) == 1
        lines = capsys.readouterr().err.splitlines()
        assert lines[0] == f"tiermem config: 2 problem(s) in {path}:", lines
        assert lines[1].startswith(f"  - {first}:") and lines[2].startswith("  - nvme.paths:"), lines
        assert str(missing) in lines[2] and "does not exist" in lines[2]


def test_check_reports_missing_and_malformed_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.toml")
    assert main(["config", "check", missing]) == 1
    assert f"{missing}: cannot read the file" in capsys.readouterr().err
    malformed = write(tmp_path, "[nvme]\nqueue_depth = = 3\n")
    assert main(["config", "check", malformed]) == 1
    err = capsys.readouterr().err
    assert f"{malformed}: not valid TOML" in err and "line 2" in err


def test_check_resolves_for_this_machine_unless_static(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, '[device]\ndevice = "cuda:0"\n[host]\ncapacity = "20GiB"\n')
    assert main(["config", "check", path]) == 1
    err = capsys.readouterr().err
    assert 'device.device: "cuda:0" needs CUDA' in err
    assert main(["config", "check", "--static", path]) == 0
    assert capsys.readouterr().out == f"OK: {path}\n"
    too_big = write(tmp_path, '[device]\ncapacity = "10GiB"\n[host]\ncapacity = "10GiB"\n')
    assert main(["config", "check", too_big]) == 1
    assert "device.capacity + host.capacity: device (10GiB) + host (10GiB) = 20GiB exceeds this machine's RAM" in (
        capsys.readouterr().err
    )


def test_show_prints_the_resolved_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, '[host]\ncapacity = "1GiB"\n[nvme]\nchecksum = true\n')
    assert main(["config", "show", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# tiermem configuration from {path}, resolved for this machine\n")
    shown = tomllib.loads(out)
    # 80% of 10 GiB minus host; a tier's max_inflight left out is the scheduler's
    assert shown["device"] == {"capacity": 8 * GiB - GiB, "device": "cpu", "max_inflight": 512 * MiB}
    assert shown["host"] == {"capacity": GiB, "pinned": False, "max_inflight": 512 * MiB}
    assert shown["nvme"]["capacity"] == 90 * GiB
    assert shown["nvme"]["checksum"] is True
    assert shown["nvme"]["paths"] and all(os.path.isabs(p) for p in shown["nvme"]["paths"])
    # the planner's choice, not the machine's; where chunk steps compute (NOTE [ Step threads ])
    assert shown["model_states"] == {"chunk_size": "auto", "step_thread": "auto", "speculative_steps": "auto"}


def test_show_without_a_file_uses_defaults_and_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERMEM_SCHEDULER_LOOP", "asyncio")
    assert main(["config", "show"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["scheduler"]["loop"] == "asyncio"
    assert shown["device"]["capacity"] == 4 * GiB


def test_show_under_torchrun_says_the_capacities_and_directories_are_this_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """NOTE [ Ranks ] rules 2 and 3: the shown paths are the configured ones; the header names
    this rank's directories under them."""
    (tmp_path / "nv").mkdir()
    path = write(tmp_path, f'[nvme]\npaths = ["{tmp_path / "nv"}"]\n')
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["config", "show", path]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[1]
    assert header.startswith("# rank 1 of 2") and header.endswith(str(tmp_path / "nv" / "rank1")), header
    assert tomllib.loads(out)["nvme"]["paths"] == [str(tmp_path / "nv")]
    assert not (tmp_path / "nv" / "rank1").exists()  # show creates nothing


def test_show_reports_problems_like_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", write(tmp_path, BAD_FILE)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "4 problem(s)" in err and "nvme.block_size: 3000 is not a multiple of 4096" in err


def test_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "config" in capsys.readouterr().out
    assert main(["config", "--help"]) == 0
    out = capsys.readouterr().out
    assert "check" in out and "show" in out
    assert main(["config", "check", "--help"]) == 0
    assert "--static" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["no-such-command"]) == 2
    assert main(["config"]) == 2
    assert "required" in capsys.readouterr().err


def test_top_level_help_imports_no_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "tiermem.cli.config_cmd", raising=False)
    assert main(["--help"]) == 0
    assert "tiermem.cli.config_cmd" not in sys.modules


def test_command_table_modules_follow_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every listed module that exists has add_arguments and run; missing ones are left out."""
    import importlib

    present = [c for c in COMMANDS.values() if tiermem.cli._available(c)]
    assert "tiermem.cli.config_cmd" in [c.module for c in present]
    for command in present:
        module = importlib.import_module(command.module)
        assert callable(module.add_arguments) and callable(module.run)
    monkeypatch.setitem(COMMANDS, "nope", tiermem.cli.Command("tiermem.cli.nope_cmd", "not written yet"))
    assert main(["nope"]) == 2


def test_python_dash_m_reports_a_bad_file_without_a_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, BAD_FILE)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TIERMEM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "tiermem", "config", "check", path],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "nvme.block_size: 3000 is not a multiple of 4096" in result.stderr
    assert result.stdout == ""


def test_check_refuses_nvme_paths_that_cannot_be_used(tmp_path, capsys):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    config = tmp_path / "tiers.toml"
    config.write_text(f'[nvme]\npaths = ["{tmp_path / "missing"}", "{afile}", "{tmp_path}"]\n')
    assert main(["config", "check", str(config)]) == 1
    err = capsys.readouterr().err
    assert "missing' does not exist" in err and "a-file' is not a directory" in err
    assert str(tmp_path) + "' " not in err  # the usable one is not reported


def _temp_dir(monkeypatch: pytest.MonkeyPatch, directory: Path) -> str:
    """Point the system temp dir at ``directory``; returns tiermem's default NVMe directory there."""
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    return str(directory / f"tiermem-nvme-{os.geteuid()}")


def test_check_accepts_what_show_wrote_as_a_run_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`config show > t.toml && config check t.toml` failed: show writes the default NVMe directory
    out, check said it did not exist, and a run makes it. Check makes nothing."""
    default = _temp_dir(monkeypatch, tmp_path)
    assert main(["config", "show"]) == 0
    shown = write(tmp_path, capsys.readouterr().out)
    assert tomllib.loads(Path(shown).read_text())["nvme"]["paths"] == [default]
    assert main(["config", "check", shown]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"OK: {shown}\n"
    assert not os.path.exists(default)


def test_check_refuses_a_default_directory_a_run_could_not_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where a run would fail on the default directory, check says so: its parent is no directory
    (nothing can be made there), or it is not private to the user (NOTE [ Run directory rules ] 6)."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    monkeypatch.setattr("tempfile.tempdir", str(afile))  # TMPDIR would be skipped: gettempdir() checks it
    default = str(afile / f"tiermem-nvme-{os.geteuid()}")
    path = write(tmp_path, f'[nvme]\npaths = ["{default}"]\n')
    assert main(["config", "check", path]) == 1
    assert (
        f"nvme.paths: tiermem's default directory {default!r} is missing and cannot be made: {str(afile)!r} is not "
        "a directory; set TMPDIR to a writable directory or point [nvme] paths at one"
    ) in capsys.readouterr().err
    default = _temp_dir(monkeypatch, tmp_path)
    os.mkdir(default, 0o777)
    os.chmod(default, 0o777)  # writable by others: a run refuses it
    for text in (f'[nvme]\npaths = ["{default}"]\n', "[nvme]\npaths = []\n"):
        assert main(["config", "check", write(tmp_path, text)]) == 1
        err = capsys.readouterr().err
        assert f"nvme.paths: tiermem: refusing to use {default!r}: it is writable by group and others" in err, err


# -- config show: what the machine decides, and why (tiermem/app/config_explain.py) -------------------

MACHINE_KEYS = [
    ("device", "device"), ("device", "capacity"), ("device", "max_inflight"),
    ("host", "capacity"), ("host", "pinned"), ("host", "max_inflight"),
    ("nvme", "paths"), ("nvme", "backend"), ("nvme", "capacity"), ("nvme", "direct"), ("nvme", "max_inflight"),
    ("scheduler", "loop"), ("distributed", "backend"),
]  # fmt: skip


def comments(out: str) -> dict[str, str]:
    """``section.key`` -> the comment on the line that sets it."""
    found, section = {}, ""
    for line in out.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif " = " in line and "  # " in line:
            key, comment = line.split(" = ", 1)[0], line.split("  # ", 1)[1]
            found[f"{section}.{key}"] = comment
    return found


def test_show_makes_every_machine_setting_concrete_with_a_reason(tmp_path: Path, capsys) -> None:
    """Issue 21 item 4: backend and O_DIRECT as the NVMe tier decides them here (a real tier on the same
    path, opened the way a run opens it, agrees), the loop that will run, every tier's in-flight bound;
    each with why. Nothing is left behind in the NVMe directory."""
    from tiermem.tiers.nvme import NvmeTier

    (tmp_path / "nv").mkdir()
    path = write(tmp_path, f'[nvme]\npaths = ["{tmp_path / "nv"}"]\n')
    assert main(["config", "show", path]) == 0
    out = capsys.readouterr().out
    shown, why = tomllib.loads(out), comments(out)
    for section, key in MACHINE_KEYS:
        assert shown[section][key] != "auto", (section, key)
        assert why.get(f"{section}.{key}"), f"{section}.{key} has no reason: {out}"
    tier = NvmeTier([str(tmp_path / "nv")], 0)
    try:
        facts = tier.describe()
    finally:
        tier.close()
    assert (shown["nvme"]["backend"], shown["nvme"]["direct"]) == (facts["backend"], facts["direct"])
    assert why["nvme.backend"].startswith(facts["backend_reason"])
    assert why["nvme.direct"].startswith("auto: ")
    assert shown["scheduler"]["loop"] in ("uvloop", "asyncio")
    assert list((tmp_path / "nv").iterdir()) == []  # the probing tier removed what it made
    # What show prints is a configuration that reads back as what a run uses.
    from tiermem.config import Config

    Config.from_dict(shown, env={}).resolve(FAKE_MACHINE)


def test_show_says_when_the_default_nvme_directory_is_used_and_makes_no_rank_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert comments(out)["nvme.paths"].startswith("default: ")
    assert tomllib.loads(out)["nvme"]["paths"] == [str(tmp_path / f"tiermem-nvme-{os.geteuid()}")]
    assert list(tmp_path.iterdir()) == []  # neither the default directory nor rank1 in it stays


def test_show_falls_back_to_asyncio_where_uvloop_is_missing(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` fails, as in the scheduler
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["scheduler"]["loop"] == "asyncio"
    assert "not installed" in comments(out)["scheduler.loop"]


def test_show_names_a_backend_asked_for_by_name_that_cannot_run_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from tiermem.tiers.backends import kvikio_backend

    monkeypatch.setattr(kvikio_backend, "probe", lambda directory: (False, "kvikio is not installed"))
    (tmp_path / "nv").mkdir()
    assert (
        main(["config", "show", write(tmp_path, f'[nvme]\nbackend = "kvikio"\npaths = ["{tmp_path / "nv"}"]\n')]) == 0
    )
    out = capsys.readouterr().out
    assert tomllib.loads(out)["nvme"]["backend"] == "kvikio"
    why = comments(out)["nvme.backend"]
    assert why.startswith("CANNOT RUN HERE") and "kvikio is not installed" in why
    assert list((tmp_path / "nv").iterdir()) == []


def test_explain_on_a_cuda_machine_pins_and_uses_nccl(tmp_path: Path) -> None:
    """A faked CUDA machine and NVMe tier (explain's machine facts are injected): the capacities,
    pinning and distributed backend auto means there, each with why, and the result reads back."""
    from tiermem.app.config_explain import StorageFacts, explain
    from tiermem.config import Config

    cuda = MachineProbe(
        available_ram=10 * GiB,
        total_ram=16 * GiB,
        cuda_device_count=2,
        local_rank=1,
        cuda_free=lambda index: 20 * GiB,
        disk_space=lambda path: DiskSpace(1, 100 * GiB),
    )
    facts = StorageFacts("kvikio", "kvikio chosen by auto: probe I/O succeeded", True, "kvikio manages O_DIRECT itself")
    explained = explain(Config.from_dict({}, env={}), cuda, storage=lambda nvme, sub: facts)
    shown, why = tomllib.loads(explained.to_toml()), comments(explained.to_toml())
    assert shown["device"]["device"] == "cuda:1" and "LOCAL_RANK=1" in why["device.device"]
    assert shown["device"]["capacity"] == 18 * GiB and "90% of the memory free on cuda:1" in why["device.capacity"]
    assert shown["host"] == {"capacity": 5 * GiB, "pinned": True, "max_inflight": 512 * MiB}
    assert "page-locked" in why["host.pinned"]
    assert (shown["nvme"]["backend"], shown["nvme"]["direct"]) == ("kvikio", True)
    assert shown["distributed"]["backend"] == "cpu:gloo,cuda:nccl"
    assert Config.from_dict(shown, env={}) == explained.config


def test_show_says_off_where_the_machine_alone_decides_the_step_thread(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21 item 4, [model_states] step_thread: on one usable core 'auto' is the machine's
    decision ("off"), shown as such; from two cores the run decides part of it (where the model
    computes, torch's threads, the optimizer's flags), so it stays "auto" with what the machine
    decides in its comment."""
    import tiermem.states.step_thread as step_thread

    monkeypatch.setattr(step_thread, "usable_cores", lambda: 1)
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["model_states"]["step_thread"] == "off"
    assert comments(out)["model_states.step_thread"].startswith("auto: this process may use 1 core")
    monkeypatch.setattr(step_thread, "usable_cores", lambda: 2)
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["model_states"]["step_thread"] == "auto"
    comment = comments(out)["model_states.step_thread"]
    assert f"torch's {torch.get_num_threads()} intra-op threads" in comment
    assert "inline where a CPU model's compute takes every core" in comment


def test_show_says_every_size_as_a_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Byte counts stay exact numbers (what a run reads back) with the size in words first in their
    comment: ``[trace] max_size`` as 1GiB, a capacity as its GiB before the reason it was chosen."""
    from tiermem.config_fields import SIZE_SETTINGS

    path = write(tmp_path, '[host]\ncapacity = "1GiB"\n[trace]\nmax_size = "256MiB"\n')
    assert main(["config", "show", path]) == 0
    out = capsys.readouterr().out
    shown, why = tomllib.loads(out), comments(out)
    assert shown["trace"]["max_size"] == 256 * MiB and why["trace.max_size"] == "256MiB"
    assert why["host.capacity"].startswith("1GiB")
    assert why["device.capacity"].startswith(f"{format_size(shown['device']['capacity'])}; auto: ")
    assert why["nvme.block_size"] == "1MiB" and why["activations.min_bytes"] == "1MiB"
    assert {"trace.max_size", "nvme.block_size", "device.capacity", "model_states.chunk_size"} <= SIZE_SETTINGS
    for setting in SIZE_SETTINGS:
        section, key = setting.split(".")
        value = shown[section].get(key)
        if isinstance(value, int):
            assert why[setting].startswith(format_size(value)), (setting, why.get(setting))
