"""The one command line: `zerolm <subcommand>`."""

from __future__ import annotations

import argparse
import sys

from zerolm import train
from zerolm.data import prepare


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="zerolm", description="GPT pretraining in JAX with ZeRO-1.")
    sub = parser.add_subparsers(dest="command", required=True)
    train.build_parser(sub.add_parser("train", help="train a model (same as python main_zero.py)"))
    prepare.add_arguments(sub.add_parser("prepare", help="tokenize raw text into training shards"))
    ckpt = sub.add_parser("checkpoints", help="list a run's checkpoints and the one --resume auto would take")
    ckpt.add_argument("dir", help="a run's checkpoint directory, e.g. checkpoints/tiny")
    args = parser.parse_args(argv)
    if args.command == "train":
        return train.main(argv[1:])
    if args.command == "checkpoints":
        return _checkpoints(args.dir)
    return prepare.main_args(args)


def _checkpoints(directory: str) -> int:
    from pathlib import Path

    from zerolm.checkpoint import CheckpointError, describe

    if "://" not in directory and not Path(directory).is_dir():
        print(f"error: {directory}: no such checkpoint directory", file=sys.stderr)
        return 2
    try:
        print(describe(directory))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
