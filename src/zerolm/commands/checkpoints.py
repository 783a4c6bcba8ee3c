"""`zerolm checkpoints DIR` (or DIR/<step>): a run's checkpoints, each checked, and the one `--resume auto`
would take (zerolm.checkpoint.describe)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zerolm.checkpoint import CheckpointError, describe
from zerolm.exitcodes import EXIT_USAGE
from zerolm.storage import StorageError, StorageFault, check

HELP = "list a run's checkpoints and the one --resume auto would take"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a run's checkpoint directory, e.g. checkpoints/tiny or gs://bucket/run")


def run(args: argparse.Namespace) -> int:
    if "://" not in args.dir and not Path(args.dir).is_dir():
        print(f"error: {args.dir}: no such checkpoint directory", file=sys.stderr)
        return EXIT_USAGE
    try:
        check(args.dir, "DIR")
        print(describe(args.dir))
    except (CheckpointError, StorageError, StorageFault) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0
