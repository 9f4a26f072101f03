"""The docs inside the repository, checked: every citation in code and docs resolves in it.

Comments cite traps as ``TRAPS N`` (defined in docs/TRAPS.md) and invariants as ``NOTE [ Name ]``
(defined where the code keeps them, as a ``# NOTE [ Name ]`` heading). A citation that points
outside the repository, or at a trap or NOTE that does not exist, sends a reader nowhere.
"""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAPS_DOC = ROOT / "docs" / "TRAPS.md"
ARCHITECTURE_DOC = ROOT / "docs" / "ARCHITECTURE.md"

# Spelled in two parts so that this file does not mention what it looks for.
OUTSIDE = ("../" + "shared", "/work/" + "shared", "DESIGN" + ".md")
#: "TRAPS 4", "TRAPS 18, 25", "TRAPS 5 and 22", "TRAPS 1-14"; a comment may wrap after "TRAPS".
TRAPS_CITATION = re.compile(r"\bTRAPS(?:\s|#)+(\d+(?:\s*(?:,|and|-|–)\s*\d+)*)\b")
TRAP_DEFINITION = re.compile(r"^(\d+)\. \*\*", re.MULTILINE)
#: A line that is only a NOTE heading (in a docstring or a comment).
NOTE_DEFINITION = re.compile(r"^[ \t]*# NOTE \[ (.+?) \][ \t]*$", re.MULTILINE)
NOTE_CITATION = re.compile(r"NOTE \[\s*([^\]\[]+?)\s*\]")
#: A line break and what continues a comment, docstring or implicitly joined string on the next line.
WRAP = re.compile(r"""(?:["'][ \t]*\n[ \t]*f?["']|[ \t]*\n[ \t]*(?:#+[ \t]*)?)""")
LINK = re.compile(r"\]\(([^)\s]+)\)")


#: This file: its patterns and examples ("NOTE [ Name ]") are no citations.
SELF = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()


@functools.cache
def tracked_texts() -> dict[str, str]:
    """Every file git tracks that exists in the working tree, as text (this one left out)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    texts = {}
    for name in out.decode().split("\0"):
        path = ROOT / name
        if name and name != SELF and path.is_file():
            texts[name] = path.read_bytes().decode("utf-8", errors="replace")
    assert texts, "git ls-files listed nothing"
    return texts


def cited_in(name: str) -> bool:
    """Files whose citations must resolve: code, docs, configuration and CI scripts."""
    return name.endswith((".py", ".md", ".toml")) or name.startswith(".ci/")


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def defined_traps() -> set[int]:
    return {int(n) for n in TRAP_DEFINITION.findall(TRAPS_DOC.read_text())}


def cited_traps(numbers: str) -> list[int]:
    """The trap numbers one citation names ("18, 25", "5 and 22", "1-14"), ranges expanded."""
    cited: list[int] = []
    for part in re.split(r"\s*(?:,|\band\b)\s*", numbers):
        bounds = re.split(r"\s*[-–]\s*", part)
        cited += range(int(bounds[0]), int(bounds[-1]) + 1)
    return cited


def test_nothing_points_outside_the_repository():
    found = [
        f"{name}:{line_of(text, text.index(needle))}: {needle}"
        for name, text in tracked_texts().items()
        for needle in OUTSIDE
        if needle in text
    ]
    assert not found, "citations outside the repository (point at README.md or docs/ instead):\n" + "\n".join(found)


def test_traps_are_numbered_once_from_one():
    numbers = [int(n) for n in TRAP_DEFINITION.findall(TRAPS_DOC.read_text())]
    assert numbers == list(range(1, len(numbers) + 1)), numbers


def test_every_cited_trap_is_defined():
    defined = defined_traps()
    assert len(defined) >= 29, "docs/TRAPS.md defines fewer traps than the code cites"
    broken = []
    for name, text in tracked_texts().items():
        if not cited_in(name):
            continue
        for match in TRAPS_CITATION.finditer(text):
            missing = [n for n in cited_traps(match.group(1)) if n not in defined]
            if missing:
                broken.append(f"{name}:{line_of(text, match.start())}: {match.group(0)!r} (undefined: {missing})")
    assert not broken, "TRAPS citations that docs/TRAPS.md does not define:\n" + "\n".join(broken)


def note_definitions() -> dict[str, list[str]]:
    """NOTE name -> where it is defined (file:line)."""
    defined: dict[str, list[str]] = {}
    for name, text in tracked_texts().items():
        if name.endswith(".py"):
            for match in NOTE_DEFINITION.finditer(text):
                defined.setdefault(match.group(1), []).append(f"{name}:{line_of(text, match.start())}")
    return defined


def fold(text: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with wrapped lines joined by one space (WRAP), and for each fold the offset in the
    folded text after which original offsets are ``shift`` larger."""
    shifts: list[tuple[int, int]] = []
    shift = 0
    for match in WRAP.finditer(text):
        shift += len(match.group(0)) - 1
        shifts.append((match.end() - shift, shift))
    return WRAP.sub(" ", text), shifts


def original_offset(shifts: list[tuple[int, int]], offset: int) -> int:
    shift = 0
    for after, total in shifts:
        if after > offset:
            break
        shift = total
    return offset + shift


def test_every_cited_note_is_defined():
    defined = note_definitions()
    assert "Managed object rules" in defined, sorted(defined)
    broken = []
    for name, text in tracked_texts().items():
        if not cited_in(name):
            continue
        # A citation may wrap: "NOTE\n    [ Name ]" in a docstring, "(NOTE\n# [ Name ])" in a comment,
        # '"NOTE [ Two "\n "words ]"' in a message made of two string literals.
        folded, shifts = fold(text)
        for match in NOTE_CITATION.finditer(folded):
            cited = " ".join(match.group(1).split())
            if cited not in defined:
                line = line_of(text, original_offset(shifts, match.start()))
                broken.append(f"{name}:{line}: NOTE [ {cited} ]")
    assert not broken, "NOTE citations with no '# NOTE [ Name ]' heading anywhere:\n" + "\n".join(broken)


def test_every_note_is_defined_once():
    twice = {name: places for name, places in note_definitions().items() if len(places) > 1}
    assert not twice, f"NOTE headings defined more than once (a citation could not tell which): {twice}"


def test_readme_links_both_docs_and_they_exist():
    readme = (ROOT / "README.md").read_text()
    links = set(LINK.findall(readme))
    for doc in (ARCHITECTURE_DOC, TRAPS_DOC):
        relative = doc.relative_to(ROOT).as_posix()
        assert relative in links, f"README.md does not link {relative}"
        assert doc.is_file(), f"{relative} is missing"


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md", "docs/TRAPS.md"])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        resolved = (path.parent / target.split("#", 1)[0]).resolve()
        assert resolved.exists(), f"{doc} links {target}, which does not exist"


def test_bench_readme_is_current_results_in_at_most_400_lines():
    """bench/README.md holds the latest result per benchmark; history lives in git log."""
    text = (ROOT / "bench" / "README.md").read_text()
    assert len(text.splitlines()) <= 400
    # a dated diary ("session 16", "2026-11-25: ...") is what the 400 lines replaced
    assert not re.search(r"\bsession \d+\b|\b20\d\d-\d\d-\d\d\b", text, re.IGNORECASE)
