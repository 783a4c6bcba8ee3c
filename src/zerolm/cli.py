"""The one command line: `zerolm <subcommand>`.

Every mistake on the command line is one line on stderr that names the flag, then exit code 2:
argparse's own errors (a missing or malformed flag) included, through `OneLineParser`.
"""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single `error: ...` line (the usage is one `--help` away)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    from zerolm.interrupts import guarded

    argv = sys.argv[1:] if argv is None else argv
    return guarded(lambda: _main(argv), "interrupted" if argv[:1] != ["train"] else
                   "interrupted before the first step; nothing was saved")


def _main(argv: list[str]) -> int:
    from zerolm import comms, evaluate, export, launch, plan, plot, sample, train
    from zerolm.data import prepare

    parser = OneLineParser(prog="zerolm", description="GPT pretraining in JAX with ZeRO-1.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train.build_parser(sub.add_parser("train", help="train a model (same as python main_zero.py)"))
    prepare.add_arguments(sub.add_parser("prepare", help="tokenize raw text into training shards"))
    ckpt = sub.add_parser("checkpoints", help="list a run's checkpoints and the one --resume auto would take")
    ckpt.add_argument("dir", help="a run's checkpoint directory, e.g. checkpoints/tiny")
    launch.add_arguments(sub.add_parser(
        "launch-local", help="a multi-process run on this machine: zerolm launch-local --processes P "
                             "--devices-per-process D -- TRAIN_ARGS"))
    evaluate.add_arguments(sub.add_parser("eval", help="the held-out loss and perplexity of a checkpoint"))
    sample.add_arguments(sub.add_parser("sample", help="continue a prompt with a checkpoint's model (KV cache)"))
    plot.add_arguments(sub.add_parser("plot", help="loss, throughput, MFU and lr of runs, as a PNG"))
    export.add_arguments(sub.add_parser("export-hf", help="a checkpoint as a Hugging Face GPT-2 model directory"))
    plan.add_arguments(sub.add_parser("plan", help="per-device memory of ZeRO stages 0-3, the micro-batch that fits, "
                                                   "and the step time, before launching"))
    comms.add_arguments(sub.add_parser("comms", help="every collective of the compiled training step, beside the "
                                                     "planner's prediction"))
    args, extra = parser.parse_known_args(argv)
    if extra:
        hint = f"; {launch.HINT}" if args.command == "launch-local" and "--" not in argv else ""
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    commands = {"train": lambda: train.main(argv[1:]), "checkpoints": lambda: _checkpoints(args.dir),
                "launch-local": lambda: _launch_local(args), "prepare": lambda: prepare.main_args(args),
                "eval": lambda: evaluate.main_args(args), "sample": lambda: sample.main_args(args),
                "plot": lambda: plot.main_args(args), "export-hf": lambda: export.main_args(args),
                "plan": lambda: plan.main_args(args), "comms": lambda: comms.main_args(args)}
    return commands[args.command]()


def _launch_local(args) -> int:
    from zerolm.config import ConfigError
    from zerolm.launch import launch

    try:
        return launch(args.processes, args.devices_per_process, args.train_args, grace=args.grace)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


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
