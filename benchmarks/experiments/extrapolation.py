"""ALiBi's length extrapolation, measured on a model trained here: the tiny config (4 layers, 128 wide, seq_len
128, 300 steps on the King James Bible) trained with learned positions and with ALiBi (the seed model's
settings: no biases, exact GELU), then each evaluated on the same held-out text at 1x, 2x and 4x its
trained context (`zerolm eval --seq-len`: consecutive held-out samples joined).

    JAX_PLATFORMS=cpu python -m benchmarks.experiments.extrapolation [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib import REPO

SEED_MODEL = ["model.position=alibi", "model.bias=false", "model.activation=gelu"]


def zerolm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerolm.cli", *args], capture_output=True, text=True, cwd=REPO)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="(default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="more settings for every `zerolm train` of the experiment, after its own (a smaller model, for a quick run)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in (("learned", []), ("alibi", SEED_MODEL)):
            run = Path(tmp) / name
            train = zerolm("train", "--config", "configs/tiny.yaml", *[a for s in [
                *sets, f"train.steps={args.steps}", f"checkpoint.dir={run / 'ckpt'}", f"logging.dir={run / 'log'}",
                "sample.tokens=0", "logging.wandb=disabled", *args.set] for a in ("--set", s)])
            if train.returncode:
                raise SystemExit(train.stderr[-2000:])
            cells = []
            for n in (128, 256, 512):
                out = zerolm("eval", "--checkpoint", str(run / "ckpt"), "--seq-len", str(n), "--sequences", "32",
                             "--json")
                cells.append(f"{json.loads(out.stdout)['loss']:.4f}" if out.returncode == 0 else
                             "refused: " + out.stderr.strip().split(": ", 2)[-1].split(";")[0])
            rows.append((name, cells))
    print(f"\ntiny config, {args.steps} steps; held-out loss per token over the split's first 32 sequences of each "
          "length (consecutive samples joined)\n")
    print("| positions | 1x (128) | 2x (256) | 4x (512) |")
    print("|---|---|---|---|")
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
