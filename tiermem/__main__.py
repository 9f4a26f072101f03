"""``python -m tiermem``: the same command line as the ``tiermem`` script."""

from tiermem.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
