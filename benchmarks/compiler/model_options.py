"""What ALiBi, dropout and the Llama layout cost, by the compilers (no TPU or GPU needed): the 1_3b config's step compiled for a
target as shipped (learned positions, no dropout) and with each option, the seed's own config and llama_1b (the
Llama layout at TinyLlama-1.1B's shape); per variant,
the attention the target resolves to, the step's peak per device, the bytes its collectives move per device
per step, and (`--census`, for a GPU target: one device has no collectives) the bytes its kernels move per
step (`zerolm compile --json [--census]`, each in its own process).

    JAX_PLATFORMS=cpu python -m benchmarks.compiler.model_options [--targets v3-32 v5p-32 h100] [--variants ...]

A compile of 1_3b takes one to a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.lib import REPO

# The plan these were compared at (1_3b's until it shipped its fastest plan: BENCHMARKS.md, "The fastest plan
# that fits"): ZeRO-1, micro-batch 2, full remat.
PLAN = ["zero.stage=1", "train.micro_batch_size=2", "model.remat=full"]
VARIANTS = {
    "learned": ("configs/1_3b.yaml", PLAN),
    "alibi": ("configs/1_3b.yaml", ["model.position=alibi", *PLAN]),
    "dropout 0.1 (residual, attention)": ("configs/1_3b.yaml", ["model.residual_dropout=0.1",
                                                                "model.attention_dropout=0.1", *PLAN]),
    "1_3b_seed (alibi, no bias, dropout, 1024)": ("configs/1_3b_seed.yaml", []),
    "llama_1b (rope, rmsnorm, swiglu, 4 kv heads, untied)": ("configs/llama_1b.yaml", PLAN),
}


def compile_report(config: str, target: str, sets: list[str]) -> dict | str:
    census = ["--census"] if not target.startswith("v") else []
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "compile", "--config", config, "--target", target,
                           "--json", *census, *[a for s in sets for a in ("--set", s)]], capture_output=True,
                          text=True, cwd=REPO)
    if proc.returncode not in (0, 4):
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    return json.loads(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", nargs="+", default=["v3-32", "v5p-32", "h100"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="more overrides for every variant, after its own (e.g. a smaller model, for a quick run)")
    args = p.parse_args()
    print("| target | variant | attention | micro-batch | remat | peak per device (program) | fits | "
          "collective bytes per device per step | kernels' bytes per step (GPU) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for target in args.targets:
        for name in args.variants:
            config, sets = VARIANTS[name]
            r = compile_report(config, target, [*sets, *args.set])
            if isinstance(r, str):
                print(f"| {target} | {name} | - | - | - | {r} | - | - | - |", flush=True)
                continue
            sent = sum(c["bytes_per_run"] or 0 for c in r["collectives"])
            print(f"| {target} | {name} | {r['attention']} | {r['micro_batch']} | {r['remat']} | "
                  f"{r['peak_bytes_per_device'] / 2**30:.2f} GiB ({r['peak_program']}) | "
                  f"{'yes' if r['fits'] else 'NO'} | {f'{sent / 1e9:.2f} GB' if r['collectives'] else '-'} | "
                  f"{f'{moved / 1e9:.1f} GB' if (moved := (r.get('census') or {}).get('bytes')) else '-'} |", flush=True)


if __name__ == "__main__":
    main()
