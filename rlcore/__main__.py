"""`python -m rlcore`: the command line (see rlcore/cli.py)."""

from rlcore.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
