"""README.md as a user reads it: the code blocks marked runnable run as they are, and its "Errors" section
names every error class the package defines.

A block is marked by an HTML comment on the line before its fence, which GitHub does not show::

    <!-- runnable -->
    ```python
    ...
    ```

Each marked block runs in a fresh interpreter, outside the repository, with the defaults (no
``TIERMEM_*`` variables) and its files under a temporary directory. Blocks are written small enough to
run in seconds. (tests/test_docs.py checks the citations and links of the docs; this file runs them.)
"""

from __future__ import annotations

import ast
import builtins
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = "<!-- runnable -->"
#: the marker, the fence and the code up to the closing fence
RUNNABLE = re.compile(r"^<!-- runnable -->\n```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
SOURCE_FOLDERS = ("tiermem", "tiers", "schedulers")
#: error classes users never meet, and why
INTERNAL = {
    "UsageError": "tiermem bench's own argument errors, printed as a usage message",
    "SaveAbandoned": "an asynchronous save's writer gives up after the other side failed; that error is reported",
}


def readme() -> str:
    return README.read_text()


def section(text: str, heading: str) -> str:
    """The text of ``## heading`` up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def runnable_blocks() -> list[tuple[int, str]]:
    """(line of the fence, code) of every marked block."""
    text = readme()
    blocks = []
    for match in RUNNABLE.finditer(text):
        assert match.group(1) == "python", f"a runnable block must be ```python, got ```{match.group(1)}"
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(2)))
    return blocks


def test_every_marker_is_followed_by_a_python_block_and_the_quick_start_is_marked():
    text = readme()
    markers = re.findall(rf"^{re.escape(MARKER)}$", text, re.MULTILINE)
    assert len(markers) == len(runnable_blocks()), "a runnable marker not right before a ``` fence"
    quick = section(text, "Quick start")
    first_fence = quick.index("```python")
    assert quick[:first_fence].rstrip().endswith(MARKER), "the Quick start's first block is not marked runnable"


BLOCKS = runnable_blocks()


@pytest.mark.slow
@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_runnable_block_runs(line: int, code: str, tmp_path: pathlib.Path):
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TIERMEM_", "PYTHONPATH"))}
    env.update(TMPDIR=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONNOUSERSITE="1")
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, (
        f"README.md line {line}: the block exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )


def defined_error_classes() -> dict[str, str]:
    """Every exception or warning class the package defines (by bases, followed across files): name -> file."""
    bases: dict[str, tuple[list[str], str]] = {}
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                    bases[node.name] = (names, path.relative_to(ROOT).as_posix())

    def is_error(name: str, seen: frozenset[str] = frozenset()) -> bool:
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True
        if name not in bases or name in seen:
            return False
        return any(is_error(base, seen | {name}) for base in bases[name][0])

    return {name: file for name, (_, file) in bases.items() if is_error(name) and not name.startswith("_")}


def test_the_errors_section_names_every_error_class():
    errors = section(readme(), "Errors")
    defined = defined_error_classes()
    assert "TiermemError" in defined and "CheckpointError" in defined, sorted(defined)
    described = set(re.findall(r"^- `(?:[\w.]+\.)?(\w+)`", errors, re.MULTILINE))
    missing = {name: file for name, file in defined.items() if name not in INTERNAL and name not in described}
    assert not missing, f"error classes README.md's Errors section does not describe (a '- `Name`' item): {missing}"
    named = set(re.findall(r"`(?:[\w.]+\.)?(\w+(?:Error|Warning))`", errors))
    stale = {name for name in named - set(defined) if not hasattr(builtins, name)}
    assert not stale, f"README.md's Errors section names classes the package does not define: {sorted(stale)}"
