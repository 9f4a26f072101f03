"""``tiermem config check FILE`` and ``tiermem config show [FILE]``.

``check`` answers "will this file work here?": it parses the file, applies the ``TIERMEM_*``
environment as a run would, and resolves it for this machine (RAM, CUDA, disks), printing
``OK: FILE`` or every problem at once. ``--static`` skips the machine, for checking a file
meant for another one. ``show`` prints what a run would use: the configuration as TOML with
every machine-dependent ``auto`` replaced by its value and a comment saying why, including the
NVMe backend and O_DIRECT, which it learns by opening the NVMe tier as a run would
(:mod:`tiermem.app.config_explain`).

Problems surface as a ConfigError, which ``tiermem.cli.main`` prints without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tiermem import distributed
from tiermem.config import Config, MachineProbe
from tiermem.errors import ConfigError, StoragePathError
from tiermem.tiers.rundir import check_own_directories, default_parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check`` and ``show`` actions to the ``config`` parser."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate a tier configuration file",
        description="Validate a tier configuration file; print OK or every problem, one per line.",
    )
    check.add_argument("file", help="the TOML file")
    check.add_argument(
        "--static",
        action="store_true",
        help="check the file only, not whether it fits this machine (RAM, CUDA devices, disks)",
    )
    show = actions.add_parser(
        "show",
        help="print a configuration with every auto resolved",
        description="Print the configuration a run would use, as TOML, with every auto resolved.",
    )
    show.add_argument("file", nargs="?", help="the TOML file (default: the defaults plus TIERMEM_* variables)")


def run(args: argparse.Namespace) -> int:
    """Carry out ``check`` or ``show``; a bad configuration raises ConfigError (exit status 1)."""
    if args.action == "check":
        _check(args.file, static=args.static)
        print(f"OK: {args.file}")
        return 0
    config = Config.coerce(args.file)
    from tiermem.app.config_explain import explain  # opens an NVMe tier: imports torch

    ranks = distributed.detect()
    explained = explain(config, MachineProbe.detect(), ranks)
    print(f"# tiermem configuration from {config.source}, resolved for this machine")
    if ranks.multi_process:  # capacities are per rank (NOTE [ Ranks ] rules 2 and 3)
        print(
            f"# {ranks.describe()} ({ranks.local_world_size} on this machine): capacities are this rank's; "
            f"its NVMe files go to {', '.join(ranks.rank_paths(explained.config.nvme.paths))}"
        )
    print(explained.to_toml(), end="")
    return 0


def _check(file: str, *, static: bool) -> None:
    """Every problem at once: the file's values, then (unless ``static``) what this machine says of
    them and of its NVMe paths, the paths checked even when a value did not parse."""
    problems: list[str] = []
    config: Config | None = None
    try:
        config = Config.coerce(file)
    except ConfigError as exc:
        problems += exc.problems
    if not static:
        if config is not None:
            try:
                config.resolve()
            except ConfigError as exc:
                problems += exc.problems
        problems += _path_problems(config.nvme.paths if config is not None else _paths_as_written(file))
    if problems:
        raise ConfigError(problems, file)


def _paths_as_written(file: str) -> tuple[str, ...]:
    """``[nvme] paths`` of a file whose other values do not parse (for checking them too)."""
    try:
        with open(file, "rb") as f:
            paths = tomllib.load(f).get("nvme", {}).get("paths", ())
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(p for p in paths if isinstance(p, str)) if isinstance(paths, list) else ()


def _path_problems(paths: tuple[str, ...]) -> list[str]:
    """A problem for each NVMe path that would stop a run from opening its NVMe tier here, judged
    as the tier judges them (``resolve_parents`` in ``tiermem.tiers.nvme_store``), and without
    touching them: a configured path must be a writable directory; tiermem's own default
    directory (``[]``, or written out by ``tiermem config show``) may be missing, since a run makes
    it, but not unmakable, and not someone else's (NOTE [ Run directory rules ] rule 6)."""
    default = default_parent()
    problems = []
    for path in paths or (default,):
        full = os.path.abspath(os.path.expanduser(path))
        if full == default:
            problems += _default_path_problems(full)
        elif not os.path.isdir(full):
            what = "is not a directory" if os.path.exists(full) else "does not exist"
            problems.append(f"nvme.paths: {full!r} {what}; create it or point [nvme] paths elsewhere")
        elif not _writable(full):
            problems.append(f"nvme.paths: {full!r} is not writable (read-only filesystem or no permission)")
    return problems


def _default_path_problems(default: str) -> list[str]:
    """The default directory: private to the user where it exists; where it does not, a run makes
    it and its missing parents, which needs the nearest existing one to be a writable directory."""
    try:
        check_own_directories(default, create_parent=False)
    except StoragePathError as exc:
        return [f"nvme.paths: {exc}"]
    except OSError:
        pass  # nothing to inspect there (a parent is no directory): judged below
    if os.path.isdir(default):
        return [] if _writable(default) else [f"nvme.paths: {default!r} is not writable (no permission)"]
    nearest = os.path.dirname(default)
    while not os.path.exists(nearest) and os.path.dirname(nearest) != nearest:
        nearest = os.path.dirname(nearest)
    if os.path.isdir(nearest) and _writable(nearest):
        return []  # made on demand by the run, as it would be now
    why = "is not writable" if os.path.isdir(nearest) else "is not a directory"
    return [
        f"nvme.paths: tiermem's default directory {default!r} is missing and cannot be made: {nearest!r} {why}; "
        "set TMPDIR to a writable directory or point [nvme] paths at one"
    ]


def _writable(directory: str) -> bool:
    """Whether this process may make files in ``directory`` (mode bits and a read-only mount)."""
    return os.access(directory, os.W_OK | os.X_OK) and not os.statvfs(directory).f_flag & os.ST_RDONLY
