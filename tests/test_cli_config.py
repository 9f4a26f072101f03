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

import tiermem.cli
from tiermem.cli import COMMANDS, main
from tiermem.config import DiskSpace, MachineProbe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GiB = 1024**3
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
    assert "host.capacity: device (10GiB) + host (10GiB) = 20GiB exceeds this machine's RAM (16GiB)" in (
        capsys.readouterr().err
    )


def test_show_prints_the_resolved_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, '[host]\ncapacity = "1GiB"\n[nvme]\nchecksum = true\n')
    assert main(["config", "show", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# tiermem configuration from {path}, resolved for this machine\n")
    shown = tomllib.loads(out)
    assert shown["device"] == {"capacity": 8 * GiB - GiB, "device": "cpu"}  # 80% of 10 GiB minus host
    assert shown["host"] == {"capacity": GiB, "pinned": False}
    assert shown["nvme"]["capacity"] == 90 * GiB
    assert shown["nvme"]["checksum"] is True
    assert shown["nvme"]["paths"] and all(os.path.isabs(p) for p in shown["nvme"]["paths"])
    assert shown["model_states"] == {"chunk_size": "auto"}  # the planner's choice, not the machine's


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
