"""`zerolm` and `python -m zerolm.cli`: the entry point of the command line (zerolm.commands).

Before anything imports JAX, the platforms it may open are chosen for this machine (zerolm.platforms)."""

import sys

from zerolm import platforms
from zerolm.commands import main as run_command_line


def main(argv: list[str] | None = None) -> int:
    platforms.choose()
    return run_command_line(argv)


if __name__ == "__main__":
    sys.exit(main())
