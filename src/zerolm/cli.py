"""`zerolm` and `python -m zerolm.cli`: the entry point of the command line (zerolm.commands)."""

import sys

from zerolm.commands import main

if __name__ == "__main__":
    sys.exit(main())
