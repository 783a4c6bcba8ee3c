"""`zerolm plan`: per-device memory of ZeRO stages 0-3, the micro-batch that fits, and the step time,
before launching (zerolm.plan)."""

from __future__ import annotations

import argparse
import functools
import math
import os

from zerolm.commands import print_report
from zerolm.config import load_config
from zerolm.data.dataset import load_planned
from zerolm.hardware import preset
from zerolm.plan import (
    PRECISIONS,
    STAGES,
    AnalyticStates,
    Parallelism,
    PlanError,
    Planner,
    describe,
    from_config,
    model_from_params,
)


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
    where.add_argument("--global-batch", type=int, help="sequences per step (default: the config's, else 256)")
    where.add_argument("--micro-batch", type=int, help="sequences per device per micro-step for the memory table "
                                                       "(default: the config's, else 1)")
    where.add_argument("--precision", choices=sorted(PRECISIONS),
                       help="the stage table's accounting: fp32 (4 + 4 + 8 bytes per parameter) or mixed (the ZeRO "
                            "paper's 2 + 2 + 12); default: the config's zero.precision, else fp32")
    where.add_argument("--remat", choices=("none", "full"), help="default: the config's model.remat, else none")
    where.add_argument("--efficiency", type=float, default=0.5,
                       help="share of the peak FLOP/s the compute reaches (default: %(default)s)")
    where.add_argument("--memory-fraction", type=float,
                       help="share of device memory a plan may use (default: on a TPU preset what the TPU compiler "
                            "allows, as `zerolm compile` checks; on a GPU, the share JAX's allocator takes: 0.75 unless "
                            "XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise)")
    where.add_argument("--stage", type=int, choices=STAGES, default=1, help="stage for the step time (default: 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def build(args) -> Planner:
    """The planner the command line asks for; PlanError / ConfigError for bad input."""
    device = preset(args.device)
    for flag in ("params", "dp", "tp", "global_batch", "micro_batch", "layers", "width", "heads", "seq_len", "vocab"):
        value = getattr(args, flag)
        if value is not None and not math.isfinite(value):
            raise PlanError(f"--{flag.replace('_', '-')}: {value} is not a number of parameters, devices or sequences")
        if value is not None and value <= 0:
            raise PlanError(f"--{flag.replace('_', '-')}: {value:g} is not positive")
    if not 0 < args.efficiency <= 1:
        raise PlanError(f"--efficiency: {args.efficiency} is not in (0, 1]")
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        raise PlanError(f"--memory-fraction: {args.memory_fraction} is not in (0, 1]")
    if (args.config is None) == (args.params is None):
        raise PlanError("give the model as --config FILE or as --params N (one of them)")
    if args.set and args.config is None:
        raise PlanError("--set needs --config")
    cfg = load_config(args.config, args.set) if args.config is not None else None
    tp = args.tp or (cfg.mesh.tp if cfg else 1)
    if cfg is not None and (cfg.model.n_head % tp or (4 * cfg.model.d_model) % tp):
        raise PlanError(f"--tp: {tp} does not divide the {cfg.model.n_head} heads and the MLP width "
                        f"{4 * cfg.model.d_model} of {args.config}")
    dp = args.dp or (cfg.mesh.dp if cfg and cfg.mesh.dp != "auto" else max(1, device.per_node // tp))
    global_batch = args.global_batch or (cfg.train.global_batch_size if cfg else 256)
    if global_batch % dp:
        why = "" if args.dp else f" (dp defaults to one {device.name} node of {device.per_node} devices; give --dp)"
        raise PlanError(f"--dp: the global batch of {global_batch} sequences does not divide over dp = {dp}{why}")
    per_rank = global_batch // dp
    if args.micro_batch:
        micro = args.micro_batch
        if per_rank % micro:
            raise PlanError(f"--micro-batch: {micro} does not divide the {per_rank} sequences of each of the "
                            f"dp = {dp} ranks (global batch {global_batch})")
    else:  # the configured micro-batch, or the largest below it that divides a rank's share
        wanted = cfg.train.micro_batch_size if cfg else 1
        micro = max(b for b in range(1, min(wanted, per_rank) + 1) if per_rank % b == 0)
    if cfg is not None:
        sets = [f"mesh.dp={dp}", f"mesh.tp={tp}", f"train.global_batch_size={global_batch}",
                f"train.micro_batch_size={micro}"] + ([f"model.remat={args.remat}"] if args.remat else [])
        cfg = load_planned(args.config, [*args.set, *sets])
        model, factory = from_config(cfg, dp, tp)
    else:
        model = model_from_params(int(args.params), args.layers, args.width, args.heads, args.seq_len, args.vocab,
                                  args.remat or "none")
        if model.n_head % tp or (4 * model.d_model) % tp:
            raise PlanError(f"--tp: {tp} does not divide the {model.n_head} heads and the MLP width "
                            f"{4 * model.d_model}")
        factory = functools.partial(AnalyticStates, model)
    precision = args.precision or (cfg.zero.precision if cfg is not None else "fp32")
    return Planner(model, factory, device, Parallelism(dp, tp, global_batch), precision, micro,
                   efficiency=args.efficiency, memory_fraction=args.memory_fraction)


def run(args: argparse.Namespace) -> int:
    # The plan needs shapes, not devices: without this, a machine with libtpu installed (the `tpu` extra)
    # but no TPU would have jax probe for one and print libtpu's warnings.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    planner = build(args)
    print_report(planner.report(args.stage), args.json, describe)
    return 0
