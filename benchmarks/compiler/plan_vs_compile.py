"""`zerolm plan`'s step peak per device against the TPU or GPU compiler's (`zerolm compile`), config by config.

    python -m benchmarks.compiler.plan_vs_compile [--configs 125m 350m 760m 1_3b] [--targets v3-32 v4-32 v5e-64 v5p-64]
        [--settings 1:full 4:full 1:none ...] [--cache runs/plan_vs_compile.jsonl] [--write BENCHMARKS.md]
    python -m benchmarks.compiler.plan_vs_compile --from-cache --write BENCHMARKS.md   # every cached compile
    python -m benchmarks.compiler.plan_vs_compile --advice --write BENCHMARKS.md       # advised against the compiler's largest

For each config, target slice and setting (micro-batch:remat, at ZeRO-1, the config's precision, attention and
reduce-scatter as resolved for the target), compiles the step with libtpu ahead of time
(aot.compile_for: the peak of its programs by the documented rule) and asks the planner for its
prediction of the same step (plan.Planner.step_peak). Compiles are cached in --cache (keyed by every
setting and what the target resolves), so the table can be printed again without compiling. No TPU
is needed; a compile takes about 25 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.lib import config_path
from benchmarks.lib.markdown import write_block
from zerolm.commands import plan as commands_plan
from zerolm.compile import aot
from zerolm.compile import micro_batch_search as zerolm_advice
from zerolm.config.load import load_config
from zerolm.parallel import auto
from zerolm.parallel.auto import for_device
from zerolm.parallel.mesh import make_mesh
from zerolm.plan import SAFETY_MARGIN

BEGIN, END = "<!-- plan_vs_compile:begin -->", "<!-- plan_vs_compile:end -->"


def cached(cache: Path, config: str, target: str, micro: int, remat: str, devices: list) -> dict | None:
    """A compile of this setting in the cache, if one was made with what the target resolves today."""
    cfg = load_config(config_path(config), [f"train.micro_batch_size={micro}", f"model.remat={remat}",
                                                 "mesh.dp=auto", "zero.stage=1"], device_count=len(devices))
    attention = for_device(cfg.model, devices[0]).attention  # auto, as the slice resolves it
    scatter = auto.scatter(cfg.zero.scatter, make_mesh(cfg.dp, cfg.mesh.tp, devices))  # likewise
    key = {"config": config, "target": target, "micro": micro, "remat": remat}
    if cache.exists():
        for line in cache.read_text().splitlines():
            row = json.loads(line)
            if row["key"] == key and row["attention"] == attention and row.get("scatter") == scatter:
                return row
    return None


def compiled(cache: Path, config: str, target: str, micro: int, remat: str) -> dict:
    t = aot.parse_target(target)
    devices = aot.target_devices(t)
    row = cached(cache, config, target, micro, remat, devices)
    if row is not None:
        return row
    cfg = load_config(config_path(config), [f"train.micro_batch_size={micro}", f"model.remat={remat}",
                                                 "mesh.dp=auto", "zero.stage=1"], device_count=len(devices))
    return store(cache, config, target, micro, remat, aot.compile_for(cfg, t, devices).to_json())


def store(cache: Path, config: str, target: str, micro: int, remat: str, r: dict) -> dict:
    key = {"config": config, "target": target, "micro": micro, "remat": remat}
    row = {"key": key, "peak": r["peak_bytes_per_device"], "peak_program": r["peak_program"], "fits": r["fits"],
           "usable": r["usable_bytes_per_device"], "programs": r["programs"], "precision": r["precision"],
           "attention": r["attention"], "scatter": r["scatter"], "accum": r["accum_steps"], "dp": r["mesh"]["dp"]}
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def planned(config: str, target: str, micro: int, remat: str, dp: int, attention: str, stage: int = 1,
            sets: tuple[str, ...] | list[str] = ()) -> dict:
    parser = argparse.ArgumentParser()
    commands_plan.add_arguments(parser)
    preset = zerolm_advice.preset_for(aot.parse_target(target))
    args = parser.parse_args(["--config", str(config_path(config)), "--device", preset, "--dp", str(dp),
                              "--micro-batch", str(micro), "--remat", remat, "--set", f"model.attention={attention}",
                              *(a for s in sets for a in ("--set", s))])
    return commands_plan.build(args).step_peak(micro, stage)


ADVICE_BEGIN, ADVICE_END = "<!-- plan_advice:begin -->", "<!-- plan_advice:end -->"


def advice(cache: Path, config: str, target: str) -> tuple[str, list[str]]:
    """The planner's largest micro-batch for `config` as shipped on `target`, and the compiler's largest
    (zerolm.compile.micro_batch_search.search: the advice compiled, then up while it fits or down until one does), with the
    compiles cached: (a table row, the advice the compiler refuses)."""
    t = aot.parse_target(target)
    devices = aot.target_devices(t)
    # micro-batch 1 to load it: the shipped micro-batch need not divide the sequences per rank of every slice
    cfg = load_config(config_path(config), ["mesh.dp=auto", "train.micro_batch_size=1"], device_count=len(devices))
    attention = for_device(cfg.model, devices[0]).attention
    remat = cfg.model.remat
    per_rank = cfg.train.global_batch_size // cfg.dp
    known = {b: {"peak_bytes": c["peak"], "fits": c["fits"], "accum_steps": c["accum"]}
             for b in range(1, per_rank + 1) if per_rank % b == 0
             for c in [cached(cache, config, target, b, remat, devices)] if c is not None}
    found = zerolm_advice.search(config_path(config), ["mesh.dp=auto"], t, known=known,
                                 on_compile=lambda b, r: store(cache, config, target, b, remat, r.to_json()))
    cells = "; ".join(f"{b}: {c['peak_bytes'] / 2**30:.2f} GiB {'fits' if c['fits'] else 'DOES NOT FIT'}"
                      for b, c in sorted(found.compiled.items()))
    a, largest = found.advised, found.largest
    problems = []
    if a is not None and (largest is None or a > largest):
        problems.append(f"{config} on {target}: micro-batch {a} advised, the compiler refuses it")
    verdict = "REFUSED" if problems else "exact" if a == largest else f"safe, {largest} fits"
    row = (f"| {config} | {target} | {cfg.dp} | {per_rank} | {remat} | {attention} | "
           f"{a if a is not None else 'none'} | {largest if largest is not None else 'none'} | {cells} | {verdict} |")
    return row, problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["125m", "350m", "760m", "1_3b"],
                   help="shipped configs by name (configs/NAME.yaml), or YAML files")
    p.add_argument("--targets", nargs="+", default=["v3-32", "v4-32", "v5e-64", "v5p-64"])
    p.add_argument("--settings", nargs="+", default=["1:full", "4:full", "1:none"], help="micro-batch:remat")
    p.add_argument("--cache", type=Path, default=Path("runs/plan_vs_compile.jsonl"))
    p.add_argument("--write", type=Path, help="put the table into this markdown file between its markers")
    p.add_argument("--compile-only", action="store_true", help="fill the cache, print nothing")
    p.add_argument("--from-cache", action="store_true", help="the table of every cached compile of --configs "
                                                             "and --targets (none compiled)")
    p.add_argument("--advice", action="store_true",
                   help="the planner's advised micro-batch per config and target (the configs as shipped), compiled, "
                        "and the next one up compiled (default targets: v3-32 v4-32 v5e-64 v5p-64)")
    args = p.parse_args()
    if args.advice:
        targets = args.targets
        lines = ["| config | target | dp | sequences per rank | remat | attention | the planner advises | "
                 "the compiler's largest | compiled | advice |",
                 "|---|---|---:|---:|---|---|---:|---:|---|---|"]
        problems: list[str] = []
        for config in args.configs:
            for target in targets:
                row, found = advice(args.cache, config, target)
                lines.append(row)
                problems += found
                print(row, flush=True)
        exact = sum(" exact |" in line for line in lines)
        lines.append(f"\n{f'No advice is refused by the compiler; {exact} of {len(lines) - 2} are its largest.' if not problems else 'Advice the compiler refuses: ' + '; '.join(problems)}")
        print(lines[-1].strip())
        if args.write:
            write_block(args.write, ADVICE_BEGIN, ADVICE_END, lines)
        return
    if args.compile_only:
        for config in args.configs:
            for target in args.targets:
                for setting in args.settings:
                    micro, remat = setting.split(":")
                    c = compiled(args.cache, config, target, int(micro), remat)
                    print(config, target, setting, f"{c['peak'] / 2**30:.2f} GiB", flush=True)
        return
    lines = ["| config | target | micro | remat | precision | attention | reduce-scatter as | compiled peak (program) | "
             "planned | planned/compiled |", "|---|---|---:|---|---|---|---|---:|---:|---:|"]
    under, over, over_refused = 0.0, 0.0, 0.0
    if args.from_cache:  # every cached compile of these configs and targets, with the attention it ran
        rows = [json.loads(line) for line in args.cache.read_text().splitlines()]
        rows = sorted((r for r in rows if r["key"]["config"] in args.configs and r["key"]["target"] in args.targets
                       and "scatter" in r),  # compiled before the scatter was recorded: out of date
                      key=lambda r: (args.configs.index(r["key"]["config"]), args.targets.index(r["key"]["target"]),
                                     r["key"]["remat"], r["key"]["micro"], r["attention"]))
    else:
        rows = [compiled(args.cache, c, t, int(s.split(":")[0]), s.split(":")[1])
                for c in args.configs for t in args.targets for s in args.settings]
    for c in rows:
        config, target, micro, remat = (c["key"][k] for k in ("config", "target", "micro", "remat"))
        plan = planned(config, target, micro, remat, c["dp"], c["attention"])
        ratio = plan["total_bytes"] / c["peak"]
        under = max(under, c["peak"] / plan["total_bytes"] - 1)
        if c["fits"]:
            over = max(over, ratio - 1)
        else:
            over_refused = max(over_refused, ratio - 1)
        lines.append(f"| {config} | {target} | {micro} | {remat} | {c['precision']} | {c['attention']} | "
                     f"{c['scatter']} | {c['peak'] / 2**30:.2f} GiB ({c['peak_program']}) | {plan['total_bytes'] / 2**30:.2f} GiB "
                     f"({plan['program']}) | {ratio:.2f} |")
        print(lines[-1], flush=True)
    lines.append(f"\nThe largest under-count, compiled/planned − 1: {under:.1%}; the planner's safety margin "
                 f"(plan.SAFETY_MARGIN) is {SAFETY_MARGIN:.0%}{'' if under <= SAFETY_MARGIN else ': SMALLER THAN IT'}. "
                 f"The largest over-count of a step that fits: {over:.0%} (of a step the compiler refuses, "
                 f"which it rematerializes as far as it can before refusing: {over_refused:.0%}).")
    print(lines[-1].strip())
    if args.write:
        write_block(args.write, BEGIN, END, lines)


if __name__ == "__main__":
    main()
