"""The one command line: `zerolm <subcommand>`."""

from __future__ import annotations

import argparse
import sys

from zerolm import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerolm", description="GPT pretraining in JAX with ZeRO-1.")
    sub = parser.add_subparsers(dest="command", required=True)
    train.build_parser(sub.add_parser("train", help="train a model (same as python main_zero.py)"))
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        return train.main(sys.argv[2:] if argv is None else argv[1:])
    parser.error(f"unknown command {args.command}")
    return 2
