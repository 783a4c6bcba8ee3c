"""Document-masked packing against plain packing: the loss curves and tokens per second of the same run.

    python -m benchmarks.experiments.document_mask [--config configs/tiny.yaml] [--steps 300] [--set K=V ...] [--write BENCHMARKS.md]
                                       [--marker document_mask]

Trains the same config (same seed, same data: the default corpus, whose documents are the Bible's
chapters) three times through `zerolm train`: without the mask; with model.document_mask (attention
inside each document, positions continuing); with it and positions restarting per document. Prints
per variant the training loss at a few steps, the mean over the last tenth of the run, the final
validation loss (each variant evaluated as it trains: masked variants see shorter contexts) and the
median tokens per second over the second half of the run, and (GPU, TPU) the peak device memory. The
attention each variant ran is the run header's. `--marker` names the table's markers in the written file
(one table per machine). JAX_PLATFORMS defaults to cpu; set it (cuda, tpu) to run on an accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.lib.markdown import write_block

VARIANTS = {"plain packing": ["model.document_mask=false"],
            "document mask": ["model.document_mask=true", "model.document_positions=continue"],
            "document mask, positions restart": ["model.document_mask=true", "model.document_positions=restart"]}


def run(config: str, sets: list[str], out: Path) -> tuple[list[dict], str]:
    args = [sys.executable, "-m", "zerolm.cli", "train", "--config", config, "--overwrite",
            "--set", f"checkpoint.dir={out / 'ckpt'}", "--set", f"logging.dir={out / 'log'}",
            "--set", "sample.tokens=0", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "WANDB_MODE": "disabled", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run(args, check=True, env=env, capture_output=True, text=True)
    metrics = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    return metrics, proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--set", action="append", default=[], metavar="K=V")
    p.add_argument("--out", type=Path, default=Path("runs/document_mask"))
    p.add_argument("--write", type=Path, help="put the table into this markdown file between its markers")
    p.add_argument("--marker", default="document_mask", help="the markers' name: <!-- NAME:begin -->")
    args = p.parse_args()
    at = sorted({s for s in (1, args.steps // 4, args.steps // 2, args.steps) if s >= 1})
    lines = [f"| variant | attention | {' | '.join(f'loss at {s}' for s in at)} | mean loss, last tenth | val loss "
             "| tokens/s | peak GiB |",
             "|---|---|" + "---:|" * (len(at) + 4)]
    for name, sets in VARIANTS.items():
        metrics, stdout = run(args.config, [f"train.steps={args.steps}", *args.set, *sets],
                              args.out / re.sub(r"\W+", "-", name))
        train = [m for m in metrics if "loss" in m]
        by_step = {m["step"]: m["loss"] for m in train}
        tail = [m["loss"] for m in train if m["step"] > args.steps * 0.9]
        val = [m["val_loss"] for m in metrics if "val_loss" in m]
        speed = statistics.median(m["tokens_per_s"] for m in train if m["step"] > args.steps // 2)
        peaks = [m["device_peak_bytes"] for m in train if m.get("device_peak_bytes")]
        attention = re.search(r"attention (\w+)", stdout)
        lines.append(f"| {name} | {attention.group(1) if attention else '?'} | "
                     f"{' | '.join(f'{by_step[s]:.3f}' for s in at)} | {statistics.mean(tail):.3f} | "
                     f"{val[-1] if val else float('nan'):.3f} | {speed:,.0f} | "
                     f"{f'{max(peaks) / 2**30:.2f}' if peaks else '-'} |")
        print(lines[-1], flush=True)
    if args.write:
        write_block(args.write, f"<!-- {args.marker}:begin -->", f"<!-- {args.marker}:end -->", lines)


if __name__ == "__main__":
    main()
