"""The command line, `zerolm <command>`: one module per command, above the library.

A command module declares its flags (`add_arguments`), and its `run(args)` calls the library and
prints. The library below never imports from here, never parses flags, and prints only to a stream it
is handed (tests/test_layout.py checks the imports). Errors become exit codes here, in one place: a
`ZerolmError` (the user's input, or a run stopped for a reason the user acts on) is its one line on
stderr and its own exit code (zerolm.core.errors); argparse's errors (a missing or malformed flag) are one
line and exit code 2, through `OneLineParser`; any other exception is a bug of zerolm's: its traceback,
a line saying so, and exit code 70 (`EXIT_BUG`), never 2.

Each command module is imported only when its command runs (`zerolm --help` imports no JAX), and
imports the library in its `run`, not at its top: `zerolm <command> --help` imports no JAX either
(tests/test_commands.py checks both).

May import: core, config, model, parallel, data, checkpoint, plan, compile, observe, eval, hf, train, serve.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from zerolm.core.errors import ZerolmError
from zerolm.core.exitcodes import EXIT_BUG, EXIT_USAGE
from zerolm.core.interrupts import guarded

# `zerolm <name>`: the module of zerolm.commands that runs it, and its line in `zerolm --help` (in this order).
COMMANDS = {
    "train": ("train", "train a model (same as python main_zero.py)"),
    "launch-local": ("launch_local", "a multi-process run on this machine: zerolm launch-local --processes P "
                                     "--devices-per-process D -- TRAIN_ARGS"),
    "prepare": ("prepare", "tokenize raw text into training shards"),
    "contamination": ("contamination", "how much of each task a prepared dataset's training split holds (GPT-3's "
                                       "13-gram overlap), in parts on many hosts"),
    "checkpoints": ("checkpoints", "list a run's checkpoints and the one --resume auto would take"),
    "eval": ("eval", "the held-out loss and perplexity of a checkpoint"),
    "sample": ("sample", "continue a prompt with a checkpoint's model (KV cache)"),
    "serve": ("serve", "a checkpoint's model over HTTP: a page to try it and OpenAI's completions API"),
    "plot": ("plot", "loss, throughput, MFU and lr of runs, as a PNG"),
    "report": ("report", "a run's training log (model, data, hardware, speed, curves, tasks, where the time "
                         "went) as markdown and PNGs in RUN_DIR/report"),
    "export-hf": ("export_hf", "a checkpoint as a Hugging Face model directory (GPT-2, MPT, Llama, GPT-NeoX or GPT-J "
                               "by its layout)"),
    "import-hf": ("import_hf", "a local Hugging Face GPT-2, MPT, Llama or GPT-NeoX model directory as a checkpoint "
                               "train.init_from starts from"),
    "grow": ("grow", "a deeper model from a trained one (layers repeated), as a checkpoint train.init_from starts from"),
    "average": ("average", "the mean of a run's last checkpoints (or its train.ema), as a checkpoint eval, sample, "
                           "export-hf and train.init_from read"),
    "plan": ("plan", "per-device memory of ZeRO stages 0-3, the micro-batch that fits, and the step time, before "
                     "launching"),
    "comms": ("comms", "every collective of the compiled training step, beside the planner's prediction"),
    "compile": ("compile", "compile the training step for a TPU slice or NVIDIA GPUs (neither needed): fits or "
                           "not, per-device memory, collectives"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single `error: ...` line (the usage is one `--help` away)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def print_report(report, as_json: bool, describe: Callable[[Any], list[str]]) -> None:
    """A report (a record with `to_json()`) as JSON, or as the lines `describe` makes of it."""
    if as_json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print("\n".join(describe(report)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return guarded(lambda: _main(argv), "interrupted" if argv[:1] != ["train"] else
                   "interrupted before the first step; nothing was saved")


def _main(argv: list[str]) -> int:
    parser = OneLineParser(prog="zerolm", description="GPT pretraining in JAX with ZeRO stages 1-3.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    parsers = {name: sub.add_parser(name, help=line) for name, (_, line) in COMMANDS.items()}
    module = None
    if argv and argv[0] in COMMANDS:  # only the command that runs is imported
        module = importlib.import_module(f"zerolm.commands.{COMMANDS[argv[0]][0]}")
        module.add_arguments(parsers[argv[0]])
    args, extra = parser.parse_known_args(argv)  # without a command: its usage error (or --help), and exit
    assert module is not None
    if extra:
        hint = getattr(module, "hint", lambda argv: "")(argv)
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return run_command(module.run, args)


def run_command(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """A command's `run`, with its errors as exit codes (see the module docstring)."""
    try:
        return run(args)
    except ZerolmError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Exception:
        traceback.print_exc()
        print(f"zerolm: this is a bug in zerolm, not a mistake in your input (the traceback above says where); "
              f"exiting with code {EXIT_BUG}", file=sys.stderr, flush=True)
        return EXIT_BUG
