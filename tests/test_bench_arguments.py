"""The benchmark scripts' directory options (bench/arguments.py): a missing or wrong directory is
named at the command line, and every script's option that says where its files go is checked so."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench_modules import BENCH, bench_module

DIRECTORY_OPTIONS = {"--path", "--nvme-path", "--dir"}


@pytest.fixture
def arguments() -> Iterator[ModuleType]:
    with bench_module("arguments") as module:
        yield module


def test_a_directory_must_exist_and_be_one(arguments, tmp_path):
    assert arguments.directory(str(tmp_path)) == str(tmp_path)
    assert arguments.directory_path(str(tmp_path)) == tmp_path
    with pytest.raises(argparse.ArgumentTypeError, match=r"missing: no such directory \(make it first"):
        arguments.directory(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match=r"file: not a directory"):
        arguments.directory(str(tmp_path / "file"))


def _directory_options(script: Path) -> list[tuple[str, str | None]]:
    """Each user-facing directory option of ``script`` and the name its ``type=`` gives."""
    found = []
    for node in ast.walk(ast.parse(script.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        names = {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
        keywords = {keyword.arg: keyword.value for keyword in node.keywords}
        hidden = "help" in keywords and ast.unparse(keywords["help"]) == "argparse.SUPPRESS"
        for name in names & DIRECTORY_OPTIONS:
            if not hidden:  # a worker's option, given by its parent
                found.append((name, ast.unparse(keywords["type"]) if "type" in keywords else None))
    return found


def test_every_scripts_directory_option_is_checked():
    options = {script.name: _directory_options(script) for script in sorted(BENCH.glob("*.py"))}
    assert sum(len(found) for found in options.values()) >= 13  # the scan finds them
    unchecked = {
        name: found
        for name, found in options.items()
        if any(kind not in ("arguments.directory", "arguments.directory_path") for _, kind in found)
    }
    assert unchecked == {}


def test_a_script_names_a_missing_directory_at_the_command_line(tmp_path):
    missing = tmp_path / "missing"
    out = subprocess.run(
        [sys.executable, str(BENCH / "io_vs_fio.py"), "--path", str(missing)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert f"argument --path: {missing}: no such directory" in out.stderr
    assert "Traceback" not in out.stderr and not missing.exists()
