"""Weight averaging against the last checkpoint: the validation loss of a run's final checkpoint, of the mean of its
last K checkpoints (LAWA, `zerolm average --last K`) and of the moving average it kept (`train.ema`, written out by
`zerolm average --ema`), all through the commands a user runs.

    python -m benchmarks.experiments.averaging                                   # tiny, 300 steps, a checkpoint every 20 (CPU)
    python -m benchmarks.experiments.averaging --steps 12 --every 2 --ema 0.8 --write BENCHMARKS.md --machine "dev-cpu (2 cores)"

One `zerolm train` of `--config` for `--steps` steps with `train.ema=--ema`, a checkpoint every `--every` steps of
which the last `--last` are kept; then `zerolm average --last K` and `zerolm average --ema` of its checkpoints, and
`zerolm eval` of the final checkpoint and of both averages on the same validation sequences (the run's
train.eval_sequences). The table also shows what the run itself logged at its end (val_loss and val_loss_ema, which
`zerolm eval` of the final checkpoint and of the written EMA must repeat). `--set` passes more settings to the run
(e.g. a constant lr: `--set train.min_lr_ratio=1.0`, which LAWA's paper trains with). `--dry-run` prints the
commands and runs nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="tiny", help="a config in configs/ (its name)")
    p.add_argument("--steps", type=int, default=300, help="train.steps")
    p.add_argument("--every", type=int, default=20, help="checkpoint.every")
    p.add_argument("--last", type=int, default=5, help="K: the checkpoints LAWA averages (Kaddour 2022: 5)")
    p.add_argument("--ema", type=float, default=0.98, help="train.ema: the moving average's decay")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more settings of the run")
    p.add_argument("--dir", default=None, help="where the run and the averages are written (default: a temporary "
                                               "directory, removed at the end)")
    p.add_argument("--machine", default="dev-cpu (2 cores)", help="the machine's name in the table")
    p.add_argument("--write", default=None, metavar="MD", help="write the table into this markdown file")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p.parse_args(argv)


def commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """Each command of the measurement, by what it makes."""
    zerolm = [sys.executable, "-m", "zerolm.cli"]
    sets = [f"train.steps={args.steps}", f"train.ema={args.ema}", f"checkpoint.every={args.every}",
            f"checkpoint.keep={args.last}", f"checkpoint.dir={work / 'ckpt'}", f"logging.dir={work / 'log'}",
            "sample.tokens=0", "logging.wandb=disabled", "train.compilation_cache=null", *args.set]
    ckpt = str(work / "ckpt")
    return {
        "train": [*zerolm, "train", "--config", str(REPO / "configs" / f"{args.config}.yaml"),
                  *[a for s in sets for a in ("--set", s)], "--resume", "never"],
        "lawa": [*zerolm, "average", "--checkpoints", ckpt, "--last", str(args.last), "--out", str(work / "lawa")],
        "ema": [*zerolm, "average", "--checkpoints", ckpt, "--ema", "--out", str(work / "ema")],
        **{f"eval {name}": [*zerolm, "eval", "--checkpoint", str(where), "--json"]
           for name, where in (("final", work / "ckpt"), ("lawa", work / "lawa"), ("ema", work / "ema"))},
    }


def run(cmd: list[str]) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc.stdout, time.perf_counter() - t0


def measure(args: argparse.Namespace, work: Path) -> dict:
    cmds = commands(args, work)
    _, train_s = run(cmds["train"])
    for name in ("lawa", "ema"):
        run(cmds[name])
    evals = {name: json.loads(run(cmds[f"eval {name}"])[0]) for name in ("final", "lawa", "ema")}
    logged = [json.loads(line) for line in (work / "log" / "metrics.jsonl").read_text().splitlines()]
    last_val = [r for r in logged if "val_loss" in r][-1]
    averaged = json.loads((work / "lawa" / "0" / "meta" / "metadata").read_text())["averaged"]
    return {"evals": evals, "logged": last_val, "train_s": train_s, "lawa_steps": averaged["steps"],
            "sequences": evals["final"]["sequences"], "tokens": evals["final"]["tokens"]}


def table(args: argparse.Namespace, result: dict) -> list[str]:
    ev, logged = result["evals"], result["logged"]
    extra = f" {' '.join(args.set)}" if args.set else ""
    command = (f"python -m benchmarks.experiments.averaging --config {args.config} --steps {args.steps} --every {args.every} "
               f"--last {args.last} --ema {args.ema}" + "".join(f" --set {s}" for s in args.set) + " --write BENCHMARKS.md")
    return [
        "```", command, "```",
        f"{args.machine}, jax {version('jax')}, {datetime.date.today()}; {args.config}{extra}, {args.steps} steps "
        f"({result['train_s']:.0f} s with its evaluations and saves), a checkpoint every {args.every}; "
        f"`zerolm eval` on {result['sequences']} validation sequences ({result['tokens']:,} tokens).",
        "",
        "| weights | checkpoints | val loss | perplexity | against the final checkpoint | logged by the run |",
        "|---|---|---|---|---|---|",
        f"| final checkpoint | step {args.steps} | {ev['final']['loss']:.4f} | {ev['final']['perplexity']:.2f} | — "
        f"| {logged['val_loss']:.4f} |",
        f"| LAWA, mean of the last {args.last} | steps {', '.join(map(str, result['lawa_steps']))} | "
        f"{ev['lawa']['loss']:.4f} | {ev['lawa']['perplexity']:.2f} | {ev['lawa']['loss'] - ev['final']['loss']:+.4f} "
        "| — |",
        f"| EMA, decay {args.ema} | step {args.steps}'s | {ev['ema']['loss']:.4f} | {ev['ema']['perplexity']:.2f} | "
        f"{ev['ema']['loss'] - ev['final']['loss']:+.4f} | {logged.get('val_loss_ema', float('nan')):.4f} |",
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        for cmd in commands(args, Path(args.dir or "WORK")).values():
            print(shlex.join(cmd))
        return
    with tempfile.TemporaryDirectory(prefix="zerolm-averaging-") as tmp:
        result = measure(args, Path(args.dir) if args.dir else Path(tmp))
    lines = table(args, result)
    print("\n".join(lines))
    if args.write:
        key = f"averaging:{args.config}:{args.steps}" + "".join(f":{s}" for s in args.set)
        write_block(Path(args.write), f"<!-- {key}:begin -->", f"<!-- {key}:end -->", lines)


if __name__ == "__main__":
    main()
