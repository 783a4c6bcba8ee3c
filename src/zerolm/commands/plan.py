"""`zerolm plan`: per-device memory of ZeRO stages 0-3, the micro-batch that fits, and the step time,
before launching (zerolm.plan)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from zerolm.commands import print_report
from zerolm.core import platforms

if TYPE_CHECKING:
    from zerolm.plan import Planner

# zerolm.plan.STAGES and sorted(zerolm.plan.PRECISIONS), which --help cannot import (zerolm.plan imports JAX);
# tests/test_commands.py checks they agree.
STAGE_CHOICES = (0, 1, 2, 3)
PRECISION_CHOICES = ("fp32", "mixed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("the model (a config, or a parameter count)")
    what.add_argument("--config", help="a zerolm YAML config: exact layouts of its model and optimizer")
    what.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    what.add_argument("--params", type=float, help="or: the parameter count N (e.g. 7.5e9)")
    what.add_argument("--layers", type=int, help="with --params: layers (default: GPT-3's shape nearest N)")
    what.add_argument("--width", type=int, help="with --params: d_model")
    what.add_argument("--heads", type=int, help="with --params: attention heads")
    what.add_argument("--seq-len", type=int, default=2048, help="with --params (default: %(default)s)")
    what.add_argument("--vocab", type=int, default=50257, help="with --params (default: %(default)s)")
    where = parser.add_argument_group("where and how")
    where.add_argument("--device", default="h100", help="device preset (default: %(default)s); one of: "
                       "v3-core, v3-chip, v4, v5e, v5p, a100, h100, h200")
    where.add_argument("--dp", type=int, help="data-parallel size (default: the config's mesh.dp, else one node)")
    where.add_argument("--tp", type=int, help="tensor-parallel size (default: the config's mesh.tp, else 1)")
    where.add_argument("--slices", type=int, help="TPU slices joined by the data-center network, dp × tp inside each "
                                                  "(Multislice; default: the config's mesh.slices, else 1)")
    where.add_argument("--global-batch", type=int, help="sequences per step (default: the config's, else 256)")
    where.add_argument("--micro-batch", type=int, help="sequences per device per micro-step for the memory table "
                                                       "(default: the config's, else 1)")
    where.add_argument("--precision", choices=PRECISION_CHOICES,
                       help="the stage table's accounting: fp32 (4 + 4 + 8 bytes per parameter) or mixed (the ZeRO "
                            "paper's 2 + 2 + 12); default: the config's zero.precision, else fp32")
    where.add_argument("--remat", choices=("none", "full"), help="default: the config's model.remat, else none")
    where.add_argument("--efficiency", type=float, default=0.5,
                       help="share of the peak FLOP/s the compute reaches (default: %(default)s)")
    where.add_argument("--memory-fraction", type=float,
                       help="share of device memory a plan may use (default: on a TPU preset what the TPU compiler "
                            "allows, as `zerolm compile` checks; on a GPU, the share JAX's allocator takes: 0.75 unless "
                            "XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise)")
    where.add_argument("--stage", type=int, choices=STAGE_CHOICES,
                       help="ZeRO stage for the step time and the advice (default: the config's zero.stage, else 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def build(args) -> Planner:
    """The planner the command line asks for (zerolm.plan.planner_for); PlanError / ConfigError for bad input."""
    from zerolm.plan import PlanRequest, planner_for

    fields = {f.name for f in dataclasses.fields(PlanRequest)} - {"sets"}
    return planner_for(PlanRequest(sets=tuple(args.set), **{name: getattr(args, name) for name in fields}))


def run(args: argparse.Namespace) -> int:
    platforms.no_device_needed()  # the plan traces shapes: it must not take a GPU or TPU that a run is using
    from zerolm.plan import describe

    planner = build(args)
    report = planner.report(args.stage)
    if args.config:  # what the compiler says is fastest: the exact command for this config and target
        from zerolm.compile.micro_batch_search import fastest_command

        sets = [*args.set, *([f"mesh.dp={args.dp}"] if args.dp else []),
                *([f"train.global_batch_size={args.global_batch}"] if args.global_batch else [])]
        report = dataclasses.replace(report, fastest_command=fastest_command(
            args.config, sets, planner.device.name, planner.layout.devices, planner.layout.slices))
    print_report(report, args.json, describe)
    return 0
