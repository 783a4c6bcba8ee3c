"""How long the training step takes to compile, with the layers in a scan or unrolled, cold and warm cache.

    JAX_PLATFORMS=cpu python -m benchmarks.compiler.compile_time [--config 1_3b] [--targets cpu h100 v3-32]
        [--micro-batch 2] [--set K=V ...] [--write BENCHMARKS.md]

For each target (`cpu`: this machine's CPU as one device; otherwise a `zerolm compile` target, compiled
ahead of time) and each layer loop (`model.scan_layers` true and false), compiles the step's programs
(zerolm.parallel.build.compile_step) in a fresh process with an empty persistent compilation cache (cold), then
again in another fresh process on that cache (warm: the programs are loaded, not compiled). Prints the
seconds of the compile alone (not the process start or the import of JAX) and the step's compiled peak.
A compile for a TPU or GPU target (ahead of time, no device) is never stored in JAX's persistent cache:
its warm figure is a second cold one; a run on the device itself loads its programs from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib import REPO, config_path
from benchmarks.lib.markdown import write_block

CHILD = r"""
import json, sys, time
from zerolm.compile import aot
from zerolm.train import compilation_cache
from zerolm.config.load import load_config
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.build import build_step, compile_step, step_peak
import jax
config, target, scan, micro, cache = sys.argv[1:6]
sets = sys.argv[6:]
compilation_cache.use(cache)
if target == "cpu":
    devices = jax.devices()[:1]
else:
    devices = aot.target_devices(aot.parse_target(target))
cfg = load_config(config, [*sets, f"model.scan_layers={scan}", f"train.micro_batch_size={micro}", "mesh.dp=auto"],
                  device_count=len(devices))
_, zero, _ = build_step(cfg, make_mesh(cfg.dp, cfg.mesh.tp, devices))
hits = compilation_cache.Hits.listen().hits
t0 = time.perf_counter()
compiled = compile_step(zero, cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps, keep_refusals=True)
seconds = time.perf_counter() - t0
peak = step_peak(compiled, zero, cfg)
print(json.dumps({"seconds": seconds, "peak": peak, "loaded": compilation_cache.Hits.hits - hits,
                  "programs": len(compiled.programs.items()), "remat": cfg.model.remat}))
"""


def measure(config: str, target: str, scan: str, micro: int, cache: str, sets: list[str]) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", CHILD, config, target, scan, str(micro), cache, *sets], env=env,
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="1_3b")
    p.add_argument("--targets", nargs="+", default=["cpu", "h100", "v3-32"])
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="config overrides")
    p.add_argument("--write", type=Path, help="put the table into this markdown file between its markers")
    args = p.parse_args()
    config = str(config_path(args.config))
    lines = [f"`python -m benchmarks.compiler.compile_time --config {args.config} --targets {' '.join(args.targets)} "
             f"--micro-batch {args.micro_batch}" + "".join(f" --set {s}" for s in args.set) + "`", "",
             "| target | layer loop | remat | cold compile (s) | warm cache (s) | programs loaded warm | compiled peak (GiB) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for target in args.targets:
        for scan in ("true", "false"):
            with tempfile.TemporaryDirectory() as cache:
                cold = measure(config, target, scan, args.micro_batch, cache, args.set)
                warm = measure(config, target, scan, args.micro_batch, cache, args.set)
            peak = "refused" if cold["peak"] is None else f"{cold['peak'] / 2**30:.2f}"
            row = (f"| {target} | {'scan' if scan == 'true' else 'unrolled'} | {cold['remat']} | {cold['seconds']:.1f} | "
                   f"{warm['seconds']:.1f} | {warm['loaded']} of {warm['programs']} | {peak} |")
            print(row, flush=True)
            lines.append(row)
    print("\n".join(lines))
    if args.write:
        marker = f"compile_time:{args.config}" + "".join(f":{s}" for s in args.set)
        write_block(args.write, f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", lines)


if __name__ == "__main__":
    main()
