"""The command line, `zerolm <command>`: one module per command, above the library.

A command module declares its flags (`add_arguments`), and its `run(args)` calls the library, prints,
and maps the library's exceptions to exit codes (`zerolm.exitcodes`). The library below never imports
from here, never parses flags, and prints only to a stream it is handed (tests/test_layout.py checks
the imports). Every mistake on the command line is one line on stderr that names the flag, then exit
code 2: argparse's own errors (a missing or malformed flag) included, through `OneLineParser`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable

from zerolm.exitcodes import EXIT_USAGE
from zerolm.interrupts import guarded

# `zerolm <name>`: the module of zerolm.commands that runs it, in the order --help lists them.
COMMANDS = {"train": "train", "launch-local": "launch_local", "prepare": "prepare", "checkpoints": "checkpoints",
            "eval": "eval", "sample": "sample", "plot": "plot", "export-hf": "export_hf", "plan": "plan",
            "comms": "comms", "compile": "compile"}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single `error: ...` line (the usage is one `--help` away)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def print_report(report: dict, as_json: bool, describe: Callable[[dict], list[str]]) -> None:
    """A report as JSON (without its private `_` keys) or as the lines `describe` makes of it."""
    if as_json:
        print(json.dumps({k: v for k, v in report.items() if not k.startswith("_")}, indent=1))
    else:
        print("\n".join(describe(report)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return guarded(lambda: _main(argv), "interrupted" if argv[:1] != ["train"] else
                   "interrupted before the first step; nothing was saved")


def _main(argv: list[str]) -> int:
    parser = OneLineParser(prog="zerolm", description="GPT pretraining in JAX with ZeRO-1.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    modules = {}
    for name, module in COMMANDS.items():
        modules[name] = importlib.import_module(f"zerolm.commands.{module}")
        modules[name].add_arguments(sub.add_parser(name, help=modules[name].HELP))
    args, extra = parser.parse_known_args(argv)
    if extra:
        hint = getattr(modules[args.command], "hint", lambda argv: "")(argv)
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return modules[args.command].run(args)
