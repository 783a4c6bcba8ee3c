"""`zerolm` and `python -m zerolm.cli`: the entry point of the command line (zerolm.commands).

Before anything imports JAX, the platforms it may open are chosen for this machine (zerolm.core.platforms)."""

import sys

from zerolm.commands import main as run_command_line
from zerolm.core import platforms


def main(argv: list[str] | None = None) -> int:
    platforms.choose()
    return run_command_line(argv)


if __name__ == "__main__":
    sys.exit(main())
