"""The package list, derived: every package under the three source folders ships (pyproject.toml has the rest).

The folders tiers/ and schedulers/ install as tiermem.tiers and tiermem.schedulers (an embedded library must
not claim generic top-level module names), which ``[tool.setuptools.packages.find]`` cannot express: it names a
package after its folder. So each root is searched here and its subpackages are mapped under its install name;
a new subpackage (a folder with an ``__init__.py``) ships without anyone listing it, and so does every data file
inside a package (``py.typed`` today). tests/test_packaging.py builds the wheel and checks both.
"""

from __future__ import annotations

import os

from setuptools import find_packages, setup

#: install name -> source folder (relative to this file)
ROOTS = {"tiermem": "tiermem", "tiermem.tiers": "tiers", "tiermem.schedulers": "schedulers"}
#: never shipped as package data
NOT_DATA = (".py", ".pyc", ".pyo")


def package_dirs() -> dict[str, str]:
    """Every package under ROOTS, by install name, with its source folder."""
    here = os.path.dirname(os.path.abspath(__file__))
    dirs: dict[str, str] = {}
    for name, folder in ROOTS.items():
        dirs[name] = folder
        for sub in find_packages(os.path.join(here, folder)):
            dirs[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return dirs


def package_data(dirs: dict[str, str]) -> dict[str, list[str]]:
    """Every non-Python file directly in a package's folder (hidden files and caches left out)."""
    here = os.path.dirname(os.path.abspath(__file__))
    data: dict[str, list[str]] = {}
    for name, folder in dirs.items():
        files = sorted(
            entry.name
            for entry in os.scandir(os.path.join(here, folder))
            if entry.is_file() and not entry.name.startswith(".") and not entry.name.endswith(NOT_DATA)
        )
        if files:
            data[name] = files
    return data


DIRS = package_dirs()
setup(packages=sorted(DIRS), package_dir=DIRS, package_data=package_data(DIRS))
