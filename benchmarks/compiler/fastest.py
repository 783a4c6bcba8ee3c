"""`zerolm compile --fastest`'s table for a config and a target, and zerolm's step beside MaxText's.

    python -m benchmarks.compiler.fastest search [--config 1_3b] [--target v3-32] [--stages 1,2,3] [--remats ...] [--write BENCHMARKS.md]
    python -m benchmarks.compiler.fastest search --from FILE ...   # a saved `zerolm compile --fastest --json`
    python -m benchmarks.compiler.fastest maxtext [--config 1_3b] [--target v3-32] [--write BENCHMARKS.md]

`search` runs `zerolm compile --config configs/NAME.yaml --target TARGET --fastest --json` (or reads its
output from --from) and writes every compiled candidate as a markdown row: peak, fits, the compiled matmul
FLOPs per token over the model's 6·N + 12·L·d·T, every collective's bytes per device per step and those the
schedule leaves exposed, zerolm.compile.step_time's modeled step, tokens/s and MFU; the winner in bold.

`maxtext` compiles the config as shipped and at the plans compared with MaxText's FSDP step (stage 1
at micro-batch 2; stages 2 and 3 at one micro-batch of 16: a v3-32 core's whole share of 512 sequences),
each by zerolm.compile.fastest_plan.compile_plan (what `--fastest` compiles for a candidate), beside MaxText's figures as
quoted in MAXTEXT below (a MaxText compile for a v3-32 by the same libtpu, made outside this repository;
MaxText is not run here).

A 1_3b compile for v3-32 takes 20-90 s on 2 CPU cores; the default search makes 20-30.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.lib import REPO, config_path
from benchmarks.lib.markdown import write_block

# MaxText's GPT-3 XL step (its FSDP, full remat) for a v3-32, compiled by the same libtpu (0.0.42.1) outside this repository: micro-batch -> (FLOPs per
# token, collective bytes per device per step, peak GiB per device). Those FLOPs are that compile's own count,
# not zerolm.compile.step_time's (dot and convolution FLOPs only): by that count zerolm's stage-1 step is REFERENCE_ZEROLM.
MAXTEXT = {2: (1.152e10, 67.90e9, 2.67), 16: (1.152e10, 8.49e9, 12.97)}
REFERENCE_ZEROLM = 1.061e10
# The plans compared with MaxText's: (label, --set overrides)
COMPARED = (("stage 1, micro-batch 2 × 8, full remat", ["zero.stage=1", "train.micro_batch_size=2", "model.remat=full"]),
            ("stage 2, micro-batch 16 × 1, full remat", ["zero.stage=2", "train.micro_batch_size=16", "model.remat=full"]),
            ("stage 3, micro-batch 16 × 1, full remat", ["zero.stage=3", "train.micro_batch_size=16", "model.remat=full"]))


def _search_json(args: argparse.Namespace) -> dict:
    if args.source:
        return json.loads(Path(args.source).read_text())
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the GPU compiler needs its plugin
    cmd = [sys.executable, "-m", "zerolm.cli", "compile", "--config", str(config_path(args.config)), "--target",
           args.target, "--fastest", "--stages", args.stages, "--remats", args.remats, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode not in (0, 4):
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def search_lines(r: dict, command: str) -> list[str]:
    winner = r["winner"]
    lines = [f"`{command}`", "",
             f"{r['compiles']} compiles, {r['pruned']} candidates pruned by the planner's memory; the fastest that "
             f"fits: `{' '.join('--set ' + s for s in winner) if winner else 'none'}`", "",
             "| stage | micro-batch | remat | block | peak (GiB) | fits | FLOPs ÷ model's | sent GB | exposed GB | "
             "modeled step (s) | tokens/s | MFU |",
             "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in r["candidates"]:
        m = c["model"]
        sets = [f"zero.stage={c['stage']}", f"train.micro_batch_size={c['micro']}", f"model.remat={c['remat']}"] + \
            ([f"model.attention_block={c['block']}"] if c["block"] is not None else [])
        bold = "**" if winner is not None and sorted(sets) == sorted(winner) else ""
        peak = "refused" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 2**30:.2f}"
        sent = sum(p["bytes"] for p in m["programs"].values()) if m else 0  # = m["sent_bytes"]
        timing = (f"{m['flops_ratio']:.3f} | {sent / 1e9:.2f} | {m['exposed_bytes'] / 1e9:.2f} | "
                  f"{bold}{m['step_s']:.3f}{bold} | {m['tokens_per_s']:,.0f} | {'-' if m['mfu'] is None else format(m['mfu'], '.1%')}" if m else "- | - | - | - | - | -")
        lines.append(f"| {c['stage']} | {c['micro']} | {c['remat']} | {c['block'] if c['block'] is not None else '-'} | "
                     f"{peak} | {'yes' if c['fits'] else 'no'} | {timing} |")
    return lines


def maxtext_lines(config: str, target: str) -> list[str]:
    from zerolm.compile import aot
    from zerolm.compile import fastest_plan as fastest

    t = aot.parse_target(target)
    devices = aot.target_devices(t)
    path = f"configs/{config}.yaml"
    lines = [f"`python -m benchmarks.compiler.fastest maxtext --config {config} --target {target}`", "",
             "| step | peak per device (GiB) | fits | FLOPs per token | ÷ zerolm's model FLOPs | collective bytes per "
             "device per step (GB) |", "|---|---:|---|---:|---:|---:|"]
    model_flops = 0.0
    for label, sets in (*COMPARED, (f"**shipped `{path}`**", [])):
        c, _ = fastest.compile_plan(str(config_path(config)), sets, t, devices)
        m = c.model
        assert m is not None, f"{label}: the compiler refused a program"
        model_flops = m.model_flops_per_token
        shipped = "" if sets else f" ({c.sets()[0]}, micro-batch {c.micro}, remat {c.remat})"
        lines.append(f"| zerolm {label}{shipped} | {c.peak_bytes / 2**30:.2f} | {'yes' if c.fits else 'no'} | "  # type: ignore[operator]
                     f"{m.flops_per_token:.4g} | {m.flops_ratio:.3f} | {m.sent_bytes / 1e9:.2f} |")
        micro = int(sets[1].split("=")[1]) if sets else None
        if micro in MAXTEXT and sets[0] != "zero.stage=2":
            flops, sent, peak = MAXTEXT[micro]
            lines.append(f"| MaxText FSDP, micro-batch {micro} × {16 // micro}, full remat (quoted) | {peak:.2f} | "
                         f"yes | {flops:.4g}\\* | - | {sent / 1e9:.2f} |")
    return [*lines, "", f"\\* the MaxText compile's own FLOP count, not zerolm.compile.step_time's: by it zerolm's stage-1 step is {REFERENCE_ZEROLM:.4g} "
            f"({REFERENCE_ZEROLM / model_flops:.3f}x zerolm's model FLOPs, the figure zerolm.compile.step_time now gives it "
            f"too; MaxText {MAXTEXT[2][0] / REFERENCE_ZEROLM:.3f}x "
            "zerolm's). MaxText's figures are quoted from a compile for a v3-32 by the same libtpu made "
            "outside this repository; MaxText is not run here."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["search", "maxtext"])
    parser.add_argument("--config", default="1_3b")
    parser.add_argument("--target", default="v3-32")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--remats", default="none,dots_attention,dots,full")
    parser.add_argument("--from", dest="source", help="a saved `zerolm compile --fastest --json` of the same command")
    parser.add_argument("--write", type=Path, help="write the table into this markdown file, between its markers")
    args = parser.parse_args()
    if args.what == "search":
        narrowed = "".join(f" --{k} {getattr(args, k)}" for k in ("stages", "remats")
                           if getattr(args, k) != parser.get_default(k))
        shown = args.config if args.config.endswith(".yaml") else f"configs/{args.config}.yaml"
        command = f"zerolm compile --config {shown} --target {args.target} --fastest{narrowed}"
        lines = search_lines(_search_json(args), command)
    else:
        from zerolm.core import platforms

        platforms.no_device_needed()
        lines = maxtext_lines(args.config, args.target)
    print("\n".join(lines))
    if args.write:
        key = f"fastest:{args.config}:{args.target}" if args.what == "search" else f"maxtext:{args.config}:{args.target}"
        write_block(args.write, f"<!-- {key}:begin -->", f"<!-- {key}:end -->", lines)


if __name__ == "__main__":
    main()
