"""`zerolm average --checkpoints DIR --last K --out OUT` (or `--steps A,B,C`, or `--ema`): the mean of a run's
checkpoints' float32 weights, or the moving average training kept, as a checkpoint that eval, sample, export-hf
and train.init_from read (zerolm.checkpoint.average)."""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of checkpoints >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoints", required=True, metavar="DIR",
                        help="a run's checkpoint directory (local or gs://; any mesh, tp and ZeRO stage); only read")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--last", type=_positive, default=None, metavar="K",
                       help="its newest K checkpoints (latest weight averaging: K = 5 in Kaddour 2022)")
    which.add_argument("--steps", default=None, metavar="A,B,...", help="these steps' checkpoints")
    parser.add_argument("--ema", action="store_true",
                        help="average the moving average each checkpoint's optimizer state keeps (a run with "
                             "train.ema) instead of its weights; without --last or --steps: the newest checkpoint's")
    parser.add_argument("--out", required=True, metavar="OUT",
                        help="the checkpoint directory to write (local or gs://): step 0 of the source run's config")
    parser.add_argument("--overwrite", action="store_true", help="move an existing OUT aside and write anew")
    return parser


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout  # (read when it runs: a caller may have replaced sys.stdout since the import)
    from zerolm.core import platforms

    platforms.no_device_needed()  # on the host's CPU: it must not take a GPU or TPU that a run is using

    from zerolm.checkpoint.average import AverageError, Averaging, average, parse_steps
    from zerolm.core.storage import check

    if args.last is None and args.steps is None and not args.ema:
        raise AverageError("say which checkpoints to average: --last K (the newest K) or --steps A,B,... "
                           "(or --ema: the newest checkpoint's moving average)")
    check(args.checkpoints, "--checkpoints")
    check(args.out, "--out")
    steps = parse_steps(args.steps) if args.steps is not None else None
    done = average(Averaging(args.checkpoints, args.out, args.last, steps, args.ema, args.overwrite),
                   say=lambda line: print(line, file=out, flush=True))
    what = {"params": "params", "master weights": "float32 master weights", "ema": "moving averages (train.ema)"}
    print(f"averaged the {what[done.of]} of {len(done.steps)} checkpoint(s) of {done.source} (step"
          f"{'s' if len(done.steps) > 1 else ''} {', '.join(map(str, done.steps))}) into {done.where}", file=out)
    print(f"evaluate it: zerolm eval --checkpoint {args.out}; start a run from it: --set train.init_from={args.out}",
          file=out)
    return 0
