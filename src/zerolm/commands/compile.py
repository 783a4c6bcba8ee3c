"""`zerolm compile --config FILE --target TYPE`: the real step compiled for a TPU slice or an NVIDIA GPU on
this machine (no TPU or GPU needed); does it fit, and what does it send (zerolm.compile.aot)? `--census`: where
its bytes go, kernel by kernel (zerolm.compile.bytes_moved).

`--largest-micro-batch`: the largest micro-batch that fits instead, compiled up from the planner's advice
(zerolm.compile.micro_batch_search); exit 4 if not even one sequence fits.

Exit codes: 0 it fits; 4 (`EXIT_DOES_NOT_FIT`) it compiles but does not fit the slice's HBM, or the
compiler refuses a program for its size; 2 bad input (an unknown target, a mesh that does not match
the slice, a bad config) or no libtpu on this machine.
"""

from __future__ import annotations

import argparse

from zerolm.commands import print_report
from zerolm.core.exitcodes import EXIT_DOES_NOT_FIT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a zerolm YAML config")
    parser.add_argument("--target", required=True, metavar="TYPE",
                        help="a TPU accelerator type as gcloud names it: v2-8, v3-8, v3-32, v4-64, v5litepod-16 "
                             "(or v5e-16), v5p-128, v6e-64, ...; or an NVIDIA GPU: h100, h100-pcie, h200, a100-80g, "
                             "a100-80g-pcie, b200, and NAME-N for N of them in one host (h100-8)")
    parser.add_argument("--slices", type=int, default=None, metavar="N",
                        help="compile for N slices of TYPE joined by the data-center network (Cloud TPU Multislice, "
                             "v4 and later; sets mesh.slices): the report gives each device's bytes over DCN and ICI")
    parser.add_argument("--census", action="store_true",
                        help="also print where the step's bytes go: each kind of kernel, its executions and bytes")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    parser.add_argument("--largest-micro-batch", action="store_true",
                        help="find the largest micro-batch that fits: compile the planner's advice, then up while "
                             "it fits (or down until one does)")
    parser.add_argument("--fastest", action="store_true",
                        help="search ZeRO stage x micro-batch x remat (and the attention block) for the fastest step "
                             "that fits, by zerolm.compile.step_time's model of each compiled candidate "
                             "(zerolm.compile.fastest_plan)")
    parser.add_argument("--stages", default="1,2,3", help="--fastest: the ZeRO stages to search (default 1,2,3)")
    parser.add_argument("--remats", default="none,dots_attention,dots,full",
                        help="--fastest: the remat policies to search (default none,dots_attention,dots,full)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from zerolm.compile import aot
    from zerolm.config.load import load_config
    from zerolm.config.section import ConfigError
    from zerolm.core import platforms
    from zerolm.data.dataset import load_planned

    target = aot.parse_target(args.target)
    platforms.no_device_needed()  # libtpu and XLA's GPU compiler compile for the target under JAX's CPU backend
    if args.slices is not None:
        if args.slices < 1:
            raise ConfigError(f"--slices: {args.slices} is not a positive number of slices")
        args.set = [*args.set, f"mesh.slices={args.slices}"]
    cfg = load_config(args.config, args.set)
    slices = cfg.mesh.slices
    if cfg.mesh.dp != "auto" and cfg.dp * cfg.mesh.tp != target.devices:
        raise ConfigError(f"mesh: dp × tp = {cfg.dp} × {cfg.mesh.tp} = {cfg.dp * cfg.mesh.tp} devices, but "
                          f"{target.name} has {target.devices}" + (" (a slice's: mesh.dp is the dp inside one)"
                                                                   if slices > 1 else "")
                          + " (set mesh.dp=auto, or match the slice)")
    if target.devices % cfg.mesh.tp:
        raise ConfigError(f"mesh.tp: {cfg.mesh.tp} does not divide the {target.devices} devices of {target.name}")
    if args.fastest:
        return _fastest(args, target, cfg.zero.tpu_async_collectives)
    _libtpu_flags(target, cfg.zero.tpu_async_collectives, [cfg.zero.stage], args.json)
    if args.largest_micro_batch:
        from zerolm.compile import micro_batch_search as advice

        found = advice.search(args.config, args.set, target, on_compile=lambda b, r: None if args.json else print(
            f"micro-batch {b}: {r.peak_bytes_per_device / 2**30:.2f} GiB {'fits' if r.fits else 'does not fit'}",
            flush=True))
        print_report(found, args.json, advice.describe)
        return 0 if found.largest is not None else EXIT_DOES_NOT_FIT
    cfg = load_planned(args.config, args.set, device_count=target.devices * slices)
    devices = aot.target_devices(target, slices)
    report = aot.compile_for(cfg, target, devices, census=args.census)
    print_report(report, args.json, aot.describe)
    return 0 if report.fits else EXIT_DOES_NOT_FIT


def _libtpu_flags(target, setting: str, stages: list[int], quiet: bool) -> None:
    """libtpu's asynchronous collective fusion where zero.tpu_async_collectives wants it (zerolm.core.tpu_flags),
    set before the compiler describes the slice (libtpu reads its flags once); its line before the report."""
    from zerolm.core import tpu_flags

    applied = tpu_flags.apply(setting, stages) if target.platform == "tpu" else None
    if applied and not quiet:
        print(applied.line(), flush=True)


def _fastest(args: argparse.Namespace, target, async_collectives: str) -> int:
    import dataclasses

    from zerolm.compile import fastest_plan as fastest
    from zerolm.config.section import ConfigError

    try:
        stages = tuple(int(x) for x in args.stages.split(","))
    except ValueError:
        raise ConfigError(f"--stages: {args.stages!r} is not a list of ZeRO stages such as 1,2,3") from None
    remats = tuple(args.remats.split(","))
    if bad := [x for x in stages if x not in fastest.STAGES] + [x for x in remats if x not in fastest.REMAT_ORDER]:
        raise ConfigError(f"--stages/--remats: {', '.join(map(str, bad))} not among stages 1,2,3 or remats "
                          f"{','.join(fastest.REMAT_ORDER)}")
    _libtpu_flags(target, async_collectives, list(stages), args.json)  # one process: stages 1-2 compile with them too
    if not args.json:
        print(fastest.HEADER, flush=True)
    found = fastest.search(args.config, args.set, target, stages=stages, remats=remats,
                           on_compile=lambda c: None if args.json else print(fastest.row(c), flush=True))
    if args.json:
        import json

        winner = found.winner
        print(json.dumps({"config": found.config, "target": found.target, "compiles": len(found.candidates),
                          "pruned": found.pruned, "winner": winner.sets() if winner else None,
                          "candidates": [{**{k: v for k, v in dataclasses.asdict(c).items() if k != "model"},
                                          "model": c.model.to_json() if c.model else None}
                                         for c in found.candidates]}))
    else:
        print("\n".join(fastest.describe(found, table=False)))
    return 0 if found.winner is not None else EXIT_DOES_NOT_FIT
