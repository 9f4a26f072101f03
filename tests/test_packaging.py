"""The package installs like a package: a wheel built from this tree, installed (not editable) into a fresh
virtual environment, has every module of the source tree and every data file, imports them all, and runs
``tiermem config show`` and a two-step ``tiermem train``.

Nothing is downloaded: the wheel is built with the setuptools already installed (``--no-build-isolation``),
installed with ``--no-deps --no-index``, and the new environment reuses the packages this interpreter sees
(torch and the rest) through a ``.pth`` file naming links to them, the installed ``tiermem`` left out (an
editable install of this tree would otherwise answer the imports). The children run outside the repository,
and the test checks that every module they import lies inside the new environment.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: install name -> source folder: tiers/ and schedulers/ install as tiermem.tiers and tiermem.schedulers
ROOTS = {"tiermem": "tiermem", "tiermem.tiers": "tiers", "tiermem.schedulers": "schedulers"}
#: what the build reads besides the package folders (pyproject's readme and license-files, setup.py)
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in")
#: a tiny model: two steps in seconds
TRAIN = ["--steps", "2", "--batch-size", "2", "--layers", "2", "--d-model", "32", "--heads", "2"]
TRAIN += ["--vocab", "64", "--seq-len", "16", "--json"]


def source_modules() -> set[str]:
    """Every module of the source tree by its installed name (``tiers/nvme.py`` is ``tiermem.tiers.nvme``)."""
    modules = set()
    for name, folder in ROOTS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules.add(".".join([name, *parts]))
    return modules


def source_data_files() -> set[str]:
    """Every file git tracks inside the package folders that is not Python, by its path in the wheel."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", *ROOTS.values()], cwd=ROOT, check=True, capture_output=True
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked data files are unknown")
    installed_as = {folder: name.replace(".", "/") for name, folder in ROOTS.items()}
    files = set()
    for name in filter(None, listed.split("\0")):
        if name.endswith(".py"):
            continue
        folder, _, rest = name.partition("/")
        files.add(f"{installed_as[folder]}/{rest}")
    return files


def run(args: list[str], *, cwd: pathlib.Path, env: dict[str, str] | None = None, timeout: float = 120):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def build_wheel(tmp: pathlib.Path) -> pathlib.Path:
    """The wheel of a copy of this tree (the build writes build/ and *.egg-info where it runs)."""
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ROOTS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    dist = tmp / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src],
        cwd=tmp,
        env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    (wheel,) = dist.glob("tiermem-*.whl")
    return wheel


def link_site_packages(into: pathlib.Path) -> list[pathlib.Path]:
    """For each site-packages directory this interpreter uses, a directory of links to its entries except
    tiermem's own (the package, its dist-info, an editable install's finder and .pth). Other .pth files stay: the
    new environment adds each directory with ``site.addsitedir``, which runs them as at home."""
    farms = []
    for i, directory in enumerate(site.getsitepackages()):
        directory = pathlib.Path(directory)
        if not directory.is_dir():
            continue
        farm = into / f"site{i}"
        farm.mkdir(parents=True)
        for entry in directory.iterdir():
            lowered = entry.name.lower()
            if "tiermem" in lowered:
                continue
            (farm / entry.name).symlink_to(entry)
        farms.append(farm)
    return farms


def make_venv(tmp: pathlib.Path) -> pathlib.Path:
    """A fresh virtual environment on the base interpreter that sees this interpreter's packages, not tiermem."""
    venv = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip()
    farms = link_site_packages(tmp / "links")
    # after the environment's own site-packages on sys.path: the wheel's tiermem comes first in any case
    lines = "".join(f"import site; site.addsitedir({str(farm)!r})\n" for farm in farms)
    (pathlib.Path(purelib) / "_reused_packages.pth").write_text(lines)
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path, dict[str, str]]:
    """(virtual environment, a work directory outside the repository, the children's environment)."""
    tmp = tmp_path_factory.mktemp("packaging")
    wheel = build_wheel(tmp)
    venv = make_venv(tmp)
    work = tmp / "work"
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "TIERMEM_", "VIRTUAL_ENV"))}
    env.update(
        PYTHONNOUSERSITE="1",
        XDG_CACHE_HOME=str(tmp / "cache"),  # the profile cache of `tiermem train`
        TMPDIR=str(work),  # the default NVMe directory
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        PIP_NO_INPUT="1",
    )
    python = venv / "bin" / "python"
    run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-warn-script-location", wheel],
        cwd=work,
        env=env,
    )
    return venv, work, env


IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import tiermem
    failed = {}
    names = {"tiermem"}
    def record(name):
        failed[name] = repr(sys.exc_info()[1])
    for info in pkgutil.walk_packages(tiermem.__path__, "tiermem.", onerror=record):
        names.add(info.name)
        try:
            importlib.import_module(info.name)
        except Exception as error:
            failed[info.name] = repr(error)
    files = {name: getattr(module, "__file__", None) for name, module in sys.modules.items()
             if name == "tiermem" or name.startswith("tiermem.")}
    print(json.dumps({"names": sorted(names), "failed": failed, "files": files}))
    """
)


def test_the_wheel_has_every_module_and_data_file_and_imports_them(installed):
    venv, work, env = installed
    result = run([venv / "bin" / "python", "-c", IMPORT_ALL], cwd=work, env=env)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert not found["failed"], f"modules of the installed package that do not import: {found['failed']}"
    missing = source_modules() - set(found["names"])
    assert not missing, (
        f"modules of the source tree missing from the wheel (setup.py's package list): {sorted(missing)}"
    )
    outside = {
        name: file
        for name, file in found["files"].items()
        if not file or venv.resolve() not in pathlib.Path(file).resolve().parents
    }
    assert not outside, f"imported from outside the new environment (not the wheel's tiermem): {outside}"
    package_dir = pathlib.Path(found["files"]["tiermem"]).parent.parent
    absent = {name for name in source_data_files() if not (package_dir / name).is_file()}
    assert not absent, f"data files of the source tree missing from the wheel: {sorted(absent)}"
    licenses = list(package_dir.glob("tiermem-*.dist-info/licenses/LICENSE"))
    assert licenses and licenses[0].read_text() == (ROOT / "LICENSE").read_text(), "the wheel lacks LICENSE"


def test_the_installed_command_shows_the_configuration(installed):
    venv, work, env = installed
    script = venv / "bin" / "tiermem"
    assert script.is_file(), "the wheel installs no `tiermem` command"
    result = run([script, "config", "show"], cwd=work, env=env)
    assert "[device]" in result.stdout and "[nvme]" in result.stdout, result.stdout


def test_the_installed_command_trains_two_steps(installed):
    venv, work, env = installed
    result = run([venv / "bin" / "tiermem", "train", *TRAIN], cwd=work, env=env)
    summary = json.loads(result.stdout)
    assert summary["steps"] == 2 and len(summary["losses"]) == 2, summary
    assert all(loss == loss for loss in summary["losses"]), summary["losses"]  # no NaN
