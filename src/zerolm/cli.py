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
    args = parser.parse_args(argv)
    if args.command == "train":
        return train.main(argv[1:])
    return prepare.main_args(args)


if __name__ == "__main__":
    sys.exit(main())
