"""`zerolm launch-local --processes P --devices-per-process D -- TRAIN_ARGS`: a multi-process run on
this machine, as a slice or a cluster would run it (zerolm.train.launch_local)."""

from __future__ import annotations

import argparse

from zerolm.commands import OneLineParser, train
from zerolm.core.errors import UsageError

HINT = "put the train arguments after --: zerolm launch-local --processes P --devices-per-process D -- --config ..."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", type=int, required=True, help="number of processes (P)")
    p.add_argument("--devices-per-process", type=int, required=True, help="CPU devices per process (D)")
    p.add_argument("--slices", type=int, default=1,
                   help="group the processes as N slices of P/N consecutive processes each (Multislice, as a TPU VM "
                        "of slice i runs: MEGASCALE_SLICE_ID=i), and train with mesh.slices=N (default: %(default)s)")
    p.add_argument("--grace", type=float, default=3.0,
                   help="when a process dies, seconds the others get to exit on their own before they are killed "
                        "(default: %(default)s)")
    p.add_argument("train_args", nargs="*", metavar="-- TRAIN_ARGS", help="arguments of `zerolm train`, after --")


def hint(argv: list[str]) -> str:
    return "" if "--" in argv else f"; {HINT}"


def run(args: argparse.Namespace) -> int:
    from zerolm.train import launch_local as launch

    if args.processes < 1:
        raise UsageError(f"--processes {args.processes}: must be at least 1")
    if args.devices_per_process < 1:
        raise UsageError(f"--devices-per-process {args.devices_per_process}: must be at least 1")
    for flag in ("--coordinator", "--num-processes", "--process-id", "--distributed"):
        if flag in args.train_args:
            raise UsageError(f"{flag}: set by launch-local itself; leave it out of the train arguments")
    if args.slices < 1 or args.processes % args.slices:
        raise UsageError(f"--slices {args.slices}: must be a positive divisor of --processes {args.processes} "
                         "(each slice is a whole number of processes)")
    if args.slices > 1:
        if any(a.startswith("mesh.slices=") for a in args.train_args):
            raise UsageError("--set mesh.slices: set by launch-local --slices; leave it out of the train arguments")
        args.train_args = [*args.train_args, "--set", f"mesh.slices={args.slices}"]
    # The config the processes will load, validated once here for all their devices, before any starts.
    train_args, _ = train.add_arguments(OneLineParser(prog="zerolm train")).parse_known_args(args.train_args)
    log_dir = train.config_of(train_args, args.processes * args.devices_per_process).log_dir
    return launch.launch(launch.Processes(args.processes, args.devices_per_process, args.slices), args.train_args,
                         log_dir, grace=args.grace)
