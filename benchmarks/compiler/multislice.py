"""Multislice, compiled by the TPU compiler here (no TPU needed): what each device sends per step over the
data-center network (DCN) between slices and over its slice's own links (ICI), zerolm's `mesh.slices: N`
against a ZeRO over every device of all slices, and the step time modeled with both.

    python -m benchmarks.compiler.multislice [--configs 1_3b 6_7b] [--target v5e-64] [--slices 2 4]
        [--global-batch 512] [--set K=V] [--json FILE] [--write BENCHMARKS.md]

For each config and slice count: zerolm's step compiled for N slices of the target (aot.compile_for with
mesh.slices=N: what `zerolm compile --target TYPE --slices N` does) at one accumulation step and at two (the
micro-batch halved: the DCN bytes must not grow with it), and the same config as one ZeRO over every device
of the N slices (mesh dp = N x the slice's devices, laid out slice by slice with
`mesh_utils.create_hybrid_device_mesh`; a mesh zerolm itself refuses, `mesh.slices` being 1 on several slices).
The bytes are read off the compiled programs (zerolm.compile.collectives.link_bytes: DCN, each cross-slice
transfer's send operand; ICI, each collective's result), per device per step; the step time is
zerolm.compile.step_time's model on the target's planner preset, the DCN bytes at its per-host data-center
network bandwidth (zerolm.core.hardware). Every compile is run as `model.remat=full` at the global batch given
(MaxText's multislice setup that the DCN goal quotes: 512 x 2048 tokens, remat full).

A 1.3B compile for 2 x v5e-64 takes about a minute on 2 CPU cores; a 6.7B one for 4 slices several.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.lib import config_path
from benchmarks.lib.markdown import write_block


def compile_row(config: str, target_name: str, slices: int, micro: int, sets: list[str], flat: bool) -> dict:
    """One compile: zerolm's mesh.slices (flat False) or a ZeRO over every device of the slices (flat True)."""
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    from zerolm.compile import aot, step_time
    from zerolm.compile import collectives as comms
    from zerolm.compile.micro_batch_search import preset_for
    from zerolm.core.hardware import preset
    from zerolm.data.dataset import load_planned
    from zerolm.parallel.build import build_and_compile

    target = aot.parse_target(target_name)
    devices = aot.target_devices(target, slices)
    path = str(config_path(config))
    sets = [*sets, "model.remat=full", f"train.micro_batch_size={micro}"]
    if not flat:
        cfg = load_planned(path, [*sets, f"mesh.slices={slices}"], device_count=len(devices))
        report = aot.compile_for(cfg, target, devices)
        model = report.step_model
        return {"config": Path(config).stem, "target": target_name, "slices": slices,
                "layout": f"zerolm mesh.slices={slices}",
                "stage": report.stage, "micro_batch": micro, "accum_steps": report.accum_steps,
                "dcn_gb": report.dcn_bytes_per_device_per_step / 1e9,
                "ici_gb": report.ici_bytes_per_device_per_step / 1e9,
                "step_s": model.step_s if model else None, "dcn_s": model.dcn_s if model else None,
                "peak_gib": report.peak_bytes_per_device / 2**30, "fits": report.fits}
    cfg = load_planned(path, [*sets, "mesh.slices=1"], device_count=len(devices))
    per_slice = len(devices) // slices
    grid = mesh_utils.create_hybrid_device_mesh((per_slice, 1), (slices, 1), devices)
    mesh = Mesh(np.asarray(grid), ("dp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    built = build_and_compile(cfg, mesh, aot.usable_bytes(target, devices[0]))
    links = sum((comms.link_bytes(t) for t in built.compiled.texts.values()), comms.LinkBytes())
    model = step_time.of_step(built, preset(preset_for(target) or "")) if not built.compiled.refused else None
    return {"config": Path(config).stem, "target": target_name, "slices": slices, "layout": "ZeRO over every device",
            "stage": built.cfg.zero.stage, "micro_batch": micro, "accum_steps": built.cfg.accum_steps,
            "dcn_gb": links.dcn / 1e9, "ici_gb": links.ici / 1e9,
            "step_s": model.step_s if model else None, "dcn_s": model.dcn_s if model else None,
            "peak_gib": None, "fits": None}


def table(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| config | slices × target | layout | ZeRO stage | micro × accum | DCN GB | ICI GB | modeled step (s) | "
             "of it DCN (s) |", "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        step = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        dcn = "-" if r["dcn_s"] is None else f"{r['dcn_s']:.3f}"
        lines.append(f"| {r['config']} | {r['slices']} × {r['target']} | {r['layout']} | {r['stage']} | "
                     f"{r['micro_batch']} × {r['accum_steps']} | {r['dcn_gb']:.4f} | {r['ici_gb']:.2f} | {step} | {dcn} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["1_3b", "6_7b"], help="configs/NAME.yaml (default: %(default)s)")
    p.add_argument("--target", default="v5e-64", help="one slice's TPU type (default: %(default)s)")
    p.add_argument("--slices", type=int, nargs="+", default=[2, 4], help="slice counts (default: %(default)s)")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per step (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a config override")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--write", type=Path, help="write the table into this file's multislice block")
    args = p.parse_args()
    from zerolm.compile import aot

    per_slice = aot.parse_target(args.target).devices
    sets = [*args.set, f"train.global_batch_size={args.global_batch}"]
    rows = []
    for config in args.configs:
        for slices in args.slices:
            per_rank = args.global_batch // (slices * per_slice)
            for flat, micro in ((False, per_rank), (False, per_rank // 2), (True, per_rank)):
                if micro < 1:
                    continue
                row = compile_row(config, args.target, slices, micro, sets, flat)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    command = ("python -m benchmarks.compiler.multislice --configs " + " ".join(args.configs) + f" --target {args.target} "
               "--slices " + " ".join(map(str, args.slices)) + f" --global-batch {args.global_batch}"
               + "".join(f" --set {s}" for s in args.set))
    text = table(rows, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write:
        write_block(args.write, f"<!-- multislice:{args.target}:begin -->", f"<!-- multislice:{args.target}:end -->",
                    text.splitlines())


if __name__ == "__main__":
    main()
