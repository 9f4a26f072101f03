"""The layering rules of docs/ARCHITECTURE.md, checked: who may import whom."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The leaf vocabulary every layer may import; it imports nothing else of tiermem.
LEAVES = {"tiermem", "tiermem.errors", "tiermem.units"}
PLANNER_PURE = {
    "tiermem.planner",
    "tiermem.planner.activation_costs",
    "tiermem.planner.candidates",
    "tiermem.planner.costmodel",
    "tiermem.planner.errors",
    "tiermem.planner.profile",
    "tiermem.planner.raises",
    "tiermem.planner.scan",
    "tiermem.planner.state_costs",
}


def _loaded_after_import(module: str) -> set[str]:
    """The tiermem modules a fresh interpreter has loaded after ``import module``."""
    code = f"import sys, json, {module}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('tiermem'))))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", ["tiermem.planner.search", "tiermem.planner.costmodel"])
def test_the_planner_loads_no_registry_scheduler_tier_offloader_or_manager(module):
    loaded = _loaded_after_import(module)
    layout = {m for m in loaded if m == "tiermem.layout" or m.startswith("tiermem.layout.")}
    unexpected = loaded - LEAVES - layout - PLANNER_PURE - {"tiermem.planner.search"}
    assert not unexpected, f"importing {module} loaded mechanism modules: {sorted(unexpected)}"
    # and the ones the issue names, explicitly (a rename above must not hide them)
    for name in (
        "tiermem.registry",
        "tiermem.schedulers",
        "tiermem.tiers",
        "tiermem.activations.offloader",
        "tiermem.states.manager",
    ):
        assert name not in loaded


def test_the_layout_vocabulary_imports_only_units_errors_and_itself():
    for path in sorted((ROOT / "tiermem" / "layout").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if name.startswith("tiermem"):
                    assert name in LEAVES or name.startswith("tiermem.layout"), f"{path.name} imports {name}"
    loaded = _loaded_after_import("tiermem.layout.placement")
    assert all(m in LEAVES or m.startswith("tiermem.layout") for m in loaded), sorted(loaded)
