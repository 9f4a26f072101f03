"""The layering rules of docs/ARCHITECTURE.md, checked: who may import whom."""

from __future__ import annotations

import ast
import io
import json
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The leaf vocabulary every layer may import; it imports nothing else of tiermem.
LEAVES = {"tiermem", "tiermem.errors", "tiermem.units"}
PLANNER_PURE = {
    "tiermem.planner",
    "tiermem.planner.activation_costs",
    "tiermem.planner.candidates",
    "tiermem.planner.costmodel",
    "tiermem.planner.early_steps",
    "tiermem.planner.errors",
    "tiermem.planner.profile",
    "tiermem.planner.no_fit",
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


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_core_never_imports_the_drivers():
    """``tiermem/app/`` and ``tiermem/cli/`` sit on top: only they import themselves."""
    drivers = ("tiermem.app", "tiermem.cli")
    for path in sorted(p for folder in LIBRARY for p in folder.rglob("*.py")):
        relative = path.relative_to(ROOT).parts
        if relative[:2] in {("tiermem", "app"), ("tiermem", "cli")} or relative == ("tiermem", "__main__.py"):
            continue
        wrong = sorted(n for n in _imported_modules(path) if n.startswith(drivers))
        assert not wrong, f"{path.relative_to(ROOT)} imports the drivers {wrong}: the core must not"


#: What the library is made of (tests/ and bench/ are not library code).
LIBRARY = [ROOT / "tiermem", ROOT / "tiers", ROOT / "schedulers"]
#: Sizes worth a second look; advice, not law: a module is split along a real seam, never to fit
#: a number (docs/ARCHITECTURE.md), so the report below prints and never fails.
ADVISED_MODULE_LINES = 600
ADVISED_FUNCTION_LINES = 100


def _library_modules() -> list[pathlib.Path]:
    return sorted(p for folder in LIBRARY for p in folder.rglob("*.py"))


def _large_pieces() -> list[str]:
    found = []
    for path in _library_modules():
        lines = path.read_text().splitlines()
        if len(lines) > ADVISED_MODULE_LINES:
            found.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > ADVISED_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    return found


def test_large_modules_and_functions_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the modules over ~600 lines and functions over ~100, for a reviewer to judge."""
    found = _large_pieces()
    assert all(isinstance(line, str) for line in found)
    if found:
        with capsys.disabled():
            print("\nlarge pieces (advice, see docs/ARCHITECTURE.md):\n  " + "\n  ".join(found))


#: Names that would mean managed-object code reaches past the registry (docs/ARCHITECTURE.md rule 4).
DOOR_BYPASSES = ("tiermem.schedulers", "tiermem.tiers")


def _door_bypass(node: ast.AST) -> list[str]:
    """``registry.scheduler`` / ``registry.tiers`` (the machinery behind the door) or ``<handle>.obj.home``
    (an object's raw allocation), where ``node`` is one."""
    if not isinstance(node, ast.Attribute) or not isinstance(node.value, (ast.Attribute, ast.Name)):
        return []
    owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
    if owner == "registry" and node.attr in ("scheduler", "tiers"):
        return [f"registry.{node.attr}"]
    if owner == "obj" and node.attr == "home":  # handle.obj.home, or obj.home on a ManagedObject
        return [".obj.home"]
    return []


@pytest.mark.parametrize("package", ["states", "activations", "checkpoint"])
def test_states_and_activations_reach_bytes_only_through_the_registry(package):
    offenders = []
    for path in sorted((ROOT / "tiermem" / package).rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                names = []
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.startswith(DOOR_BYPASSES)]
            offenders += [f"{path.name}:{node.lineno} uses {what}" for what in _door_bypass(node)]
    assert not offenders, offenders


def test_every_module_is_named_in_the_module_map_and_every_name_exists() -> None:
    """docs/ARCHITECTURE.md's module map stays true: drift either way fails."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    mapped = doc.split("## Module map", 1)[1]
    named: set[str] = set()
    package = ""
    for line in mapped.splitlines():
        if line.startswith("`") and line.rstrip().endswith("/`:"):
            package = line.strip().strip(":").strip("`")
        elif line.startswith("- `") and package:
            named.add(f"{package}{line[3:].split('`', 1)[0]}")
    present = {str(p.relative_to(ROOT)) for p in _library_modules()}
    missing, gone = sorted(present - named), sorted(named - present)
    assert not missing, f"add a line for each of these to docs/ARCHITECTURE.md's module map: {missing}"
    assert not gone, f"docs/ARCHITECTURE.md's module map names modules that no longer exist: {gone}"


#: A citation of a numbered rule and where it lives ("rule 3", "rules 1-3 of" a named NOTE).
_RULE_CITATION = re.compile(r"\brules? \d+(?:[-,] ?\d+)*(?:,? (?:of|in|there)\b[^,;:)]*)?", re.IGNORECASE)


def test_no_comment_is_only_a_rule_number():
    """A comment says why in words; "# rule 4" alone makes the reader go and look it up."""
    bare = []
    for path in _library_modules():
        source = path.read_text()
        lines = source.splitlines()
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT or not re.search(r"\brules? \d", token.string):
                continue
            row = token.start[0] - 1
            neighbours = [lines[i].lstrip() for i in (row - 1, row + 1) if 0 <= i < len(lines)]
            if any(n.startswith("#") for n in neighbours) and lines[row].lstrip().startswith("#"):
                continue  # a line of a longer comment: the reason is in the lines around it
            words = re.sub(r"NOTE \[[^\]]*\]", "", _RULE_CITATION.sub("", token.string))
            if len(re.findall(r"[A-Za-z]{2,}", words)) < 3:
                bare.append(f"{path.relative_to(ROOT)}:{token.start[0]}: {token.string.strip()}")
    assert not bare, "say why in words instead of citing only a rule number:\n" + "\n".join(bare)


def test_no_module_writes_into_another_objects_dict():
    """State goes through constructors and attributes, never ``obj.__dict__[name] = ...``: a
    reader finds who sets what by reading ``__init__`` and attribute assignments."""
    writes = re.compile(r"__dict__\s*\[[^\]]+\]\s*=(?!=)|__dict__\.(?:__setitem__|update|setdefault)\(")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _library_modules()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if writes.search(line)
    ]
    assert not found, "\n".join(found)
