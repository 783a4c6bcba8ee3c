"""ZeRO stages 1-3 compiled by the TPU compiler (no TPU needed): per stage, the step's peak per device and the
bytes each collective moves; the largest micro-batch of each stage; what the collectives overlap. The planner
beside the compiler throughout.

    python -m benchmarks.compiler.zero_stages stages [--config 1_3b] [--target v3-32] [--stages 1 2 3] [--set K=V] [--write BENCHMARKS.md]
    python -m benchmarks.compiler.zero_stages fit [--configs 2_7b 6_7b] [--target v3-32] [--set K=V] [--write BENCHMARKS.md]
    python -m benchmarks.compiler.zero_stages overlap [--config 6_7b] [--target v3-32] [--write BENCHMARKS.md]

`stages` compiles the config's step at each stage for the target slice (aot.compile_for: what `zerolm compile`
does) and puts beside it `zerolm plan`'s step peak for that stage (plan.Planner.step_peak) and its count of
each collective (plan.traffic.predicted_collectives: bytes per device, summed over the HLO instructions of
one kind, over one span, in or out of the loop; once, and per optimizer step).

`fit` asks, for each config and stage, the compiler's largest micro-batch the way `zerolm compile
--largest-micro-batch` does (zerolm.compile.micro_batch_search.search: the planner's advice compiled, then up while it fits, or
down until one does), and puts the planner's peak beside each compile: whether its advice is ever refused,
and how far its count is from the compiler's.

`overlap` reads the scheduled grad program for its asynchronous collectives and the matmuls scheduled
between each start and done (zerolm.compile.collectives.read_async), once as libtpu schedules by default and once
with its asynchronous collective fusion (OVERLAP_FLAGS, what MaxText sets), each in its own process.
`stages` and `fit` compile as libtpu schedules by default, unless LIBTPU_INIT_ARGS says otherwise (`zerolm
compile` appends OVERLAP_FLAGS at stage 3: zero.tpu_async_collectives; the 6.7B's micro-batch 4 then peaks
at 13.19 GiB, not 12.87).

A compile takes 15-60 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.compiler.plan_vs_compile import planned
from benchmarks.lib import REPO, config_path
from benchmarks.lib.markdown import write_block
from zerolm.compile import aot
from zerolm.compile import collectives as comms
from zerolm.compile import micro_batch_search as advice
from zerolm.config.load import load_config
from zerolm.core import tpu_flags
from zerolm.parallel.build import build_and_compile
from zerolm.parallel.mesh import make_mesh
from zerolm.plan import SAFETY_MARGIN

GIB = 2**30
# libtpu's asynchronous collective fusion: collectives split into a start and a done that a matmul runs between
# (what zerolm sets at ZeRO-3 on a TPU, zero.tpu_async_collectives; this benchmark compiles with and without).
OVERLAP_FLAGS = " ".join(tpu_flags.ASYNC_COLLECTIVES)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def stage_rows(config: str, target: str, stage: int, extra: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(the memory row, the collectives' rows) of one stage (`extra`: more --set overrides)."""
    t = aot.parse_target(target)
    devices = aot.target_devices(t)
    sets = [f"zero.stage={stage}", *extra]
    cfg = load_config(config_path(config), [*sets, "mesh.dp=auto"], device_count=len(devices))
    r = aot.compile_for(cfg, t, devices).to_json()
    micro = r["micro_batch"]
    plan = planned(config, target, micro, r["remat"], r["mesh"]["dp"], r["attention"], stage=stage, sets=sets)
    programs = " / ".join(f"{name} {_gib(p['peak_bytes'])}" for name, p in r["programs"].items())
    memory = (f"| {stage} | {micro} × {r['accum_steps']} | {programs} | **{_gib(r['peak_bytes_per_device'])}** "
              f"({r['peak_program']}) | {_gib(plan['total_bytes'])} ({plan['program']}) | "
              f"{plan['total_bytes'] / r['peak_bytes_per_device']:.2f} | {'fits' if r['fits'] else 'DOES NOT FIT'} |")
    collectives = []
    for p in r["predicted"]:
        if p["bytes"] <= 4:
            continue  # the loss's mean
        found, per_step = p["found_bytes"], p["found_bytes_per_step"]
        ratio = f"{per_step / p['bytes_per_step']:.3f}" if per_step else "-"
        collectives.append(f"| {stage} | {p['program']} | {p['op']} | {'+'.join(p['span'] or ['dp'])} | "
                           f"{'in the loop' if p['in_loop'] else 'once'} | {found or 0:,} | {per_step or 0:,} | "
                           f"{p['bytes_per_step']:,} | {ratio} |")
    return [memory], collectives


def stages_table(args) -> tuple[str, list[str]]:
    memory = ["| stage | micro-batch × accumulation | peak per program (GiB) | compiled peak (GiB) | "
              "`zerolm plan` (GiB) | planned ÷ compiled | on the device |", "|---:|---|---|---:|---:|---:|---|"]
    collectives = ["| stage | program | collective | over | where | compiled bytes per device, per instruction | "
                   "per optimizer step | `zerolm plan`, per step | compiled ÷ planned |",
                   "|---:|---|---|---|---|---:|---:|---:|---:|"]
    for stage in args.stages:
        m, c = stage_rows(args.config, args.target, stage, tuple(args.set))
        memory += m
        collectives += c
        print("\n".join(m + c), flush=True)
    command = (f"`python -m benchmarks.compiler.zero_stages stages --config {args.config} --target {args.target} --stages "
               f"{' '.join(map(str, args.stages))}{''.join(' --set ' + s for s in args.set)}`")
    return f"zero_stages:{args.config}:{args.target}", [command, "", *memory, "", *collectives]


def fit_rows(config: str, target: str, stage: int, extra: tuple[str, ...] = ()) -> list[str]:
    """One row per micro-batch compiled in the search for `config`'s largest at `stage` (`extra`: more --set)."""
    t = aot.parse_target(target)
    sets = [f"zero.stage={stage}", "mesh.dp=auto", *extra]
    compiled: dict[int, dict] = {}

    def on_compile(micro: int, report: aot.CompileReport) -> None:
        plan = planned(config, target, micro, report.remat, report.mesh["dp"], report.attention, stage=stage,
                       sets=sets[:1])
        compiled[micro] = {"peak": report.peak_bytes_per_device, "fits": report.fits, "planned": plan["total_bytes"],
                           "planned_fits": plan["fits"], "remat": report.remat}
        print(f"  {config} stage {stage} micro {micro}: compiled {_gib(report.peak_bytes_per_device)} GiB "
              f"({'fits' if report.fits else 'does not fit'}), planned {_gib(plan['total_bytes'])}", flush=True)

    found = advice.search(str(config_path(config)), sets, t, on_compile=on_compile)
    rows = []
    for micro, c in sorted(compiled.items()):
        verdict = ("advised" if micro == found.advised else "") + (", the compiler's largest" if micro == found.largest
                                                                   else "")
        rows.append(f"| {config} | {stage} | {micro} | {c['remat']} | {_gib(c['peak'])} | "
                    f"{'fits' if c['fits'] else 'does not fit'} | {_gib(c['planned'])} | "
                    f"{c['planned'] / c['peak']:.2f} | {verdict.strip(', ') or '-'} |")
    if not compiled:
        rows.append(f"| {config} | {stage} | - | - | - | - | - | - | nothing compiled |")
    return rows


def fit_table(args) -> tuple[str, list[str]]:
    rows = ["| config | stage | micro-batch | remat | compiled peak (GiB) | on the device | `zerolm plan` (GiB) | "
            "planned ÷ compiled | |", "|---|---:|---:|---|---:|---|---:|---:|---|"]
    for config in args.configs:
        for stage in args.stages:
            rows += fit_rows(config, args.target, stage, tuple(args.set))
    command = (f"`python -m benchmarks.compiler.zero_stages fit --configs {' '.join(args.configs)} --target {args.target} "
               f"--stages {' '.join(map(str, args.stages))}{''.join(' --set ' + s for s in args.set)}`")
    note = (f"\"advised\": the planner's largest micro-batch (its peak with a {SAFETY_MARGIN:.0%} margin, "
            "`plan.SAFETY_MARGIN`, against the usable HBM); the search compiles it, then the next ones up while they "
            "fit, or down until one does.")
    return f"zero_stages_fit:{args.target}", [command, "", *rows, "", note]


def overlap_report(config: str, target: str, sets: list[str]) -> dict:
    """The grad program's asynchronous collectives as this process's libtpu schedules them."""
    t = aot.parse_target(target)
    devices = aot.target_devices(t)
    cfg = load_config(config_path(config), ["mesh.dp=auto", *sets], device_count=len(devices))
    built = build_and_compile(cfg, make_mesh(cfg.dp, cfg.mesh.tp, devices), aot.usable_bytes(t, devices[0]))
    text = built.compiled.texts["grad"]
    in_loop = [c for c in comms.read(text) if c.in_loop and c.op in ("all-gather", "reduce-scatter")]
    return {"stage": built.zero.stage,
            "in_loop": {op: sum(c.op == op for c in in_loop) for op in ("all-gather", "reduce-scatter")},
            "in_loop_bytes": {op: sum(c.bytes for c in in_loop if c.op == op) for op in ("all-gather", "reduce-scatter")},
            "async": [{"ops": a.ops, "in_loop": a.in_loop, "bytes": a.bytes, "result": a.result_type.split("{")[0],
                       "overlaps": a.overlaps} for a in comms.read_async(text)]}


def overlap_table(args) -> tuple[str, list[str]]:
    lines = []
    for label, flags in (("libtpu's default schedule", ""), ("with `LIBTPU_INIT_ARGS` = OVERLAP_FLAGS", OVERLAP_FLAGS)):
        env = {**os.environ, "LIBTPU_INIT_ARGS": flags}
        out = subprocess.run([sys.executable, "-m", "benchmarks.compiler.zero_stages", "overlap-report", "--config",
                              args.config, "--target", args.target, *[a for s in args.set for a in ("--set", s)]], env=env, capture_output=True, text=True, check=True,
                             cwd=REPO).stdout
        r = json.loads(out.strip().splitlines()[-1])
        asynchronous = [a for a in r["async"] if a["in_loop"]]
        lines += [f"{label}: ZeRO-{r['stage']}, the layers' loop holds {r['in_loop']['all-gather']} all-gathers "
                  f"({r['in_loop_bytes']['all-gather'] / 2**20:,.0f} MiB per device) and "
                  f"{r['in_loop']['reduce-scatter']} reduce-scatters "
                  f"({r['in_loop_bytes']['reduce-scatter'] / 2**20:,.0f} MiB); asynchronous: {len(asynchronous)}"
                  + (" (each one blocks until done)" if not asynchronous else ":"), ""]
        if asynchronous:
            lines += ["| collective | delivers | MiB | scheduled between its start and its done |", "|---|---|---:|---|"]
            lines += [f"| {'+'.join(a['ops'])} | `{a['result']}` | {a['bytes'] / 2**20:,.0f} | "
                      f"{', '.join(a['overlaps']) or 'nothing'} |" for a in asynchronous]
            lines.append("")
    sets = "".join(f" --set {s}" for s in args.set)
    command = f"`python -m benchmarks.compiler.zero_stages overlap --config {args.config} --target {args.target}{sets}`"
    return f"zero_stages_overlap:{args.config}:{args.target}", [command, "", *lines]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("stages", "fit", "overlap", "overlap-report"):
        s = sub.add_parser(name)
        s.add_argument("--target", default="v3-32")
        if name == "fit":
            s.add_argument("--configs", nargs="+", default=["2_7b", "6_7b"])
        else:
            s.add_argument("--config", default="6_7b" if name.startswith("overlap") else "1_3b")
        s.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
        s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config key (the micro-batch and remat a table was compiled at)")
        s.add_argument("--write", type=Path, help="put the table into this markdown file between its markers")
    args = p.parse_args()
    if args.what == "overlap-report":
        print(json.dumps(overlap_report(args.config, args.target, args.set)))
        return
    tag, lines = {"stages": stages_table, "fit": fit_table, "overlap": overlap_table}[args.what](args)
    print("\n".join(lines))
    if args.write:
        write_block(args.write, f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->", lines)


if __name__ == "__main__":
    main()
