"""`zerolm checkpoints DIR` (or DIR/<step>): a run's checkpoints, each checked, and the one `--resume auto`
would take (zerolm.checkpoint.listing.describe)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerolm.core.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a run's checkpoint directory, e.g. checkpoints/tiny or gs://bucket/run")


def run(args: argparse.Namespace) -> int:
    from zerolm.checkpoint.listing import describe
    from zerolm.core.storage import check

    if "://" not in args.dir and not Path(args.dir).is_dir():
        raise UsageError(f"{args.dir}: no such checkpoint directory")
    check(args.dir, "DIR")
    print(describe(args.dir))
    return 0
