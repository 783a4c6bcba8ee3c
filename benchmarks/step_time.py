"""zerolm.compile.step_time's modeled step against the newest H100 step measured for each config (BENCHMARKS.md:
125m and 1_3b from "H100, third session", 2026-11-27; 350m and 760m from "One device through the normal path",
2026-11-24, the only time they were measured): each config compiled for target h100 as it ran (dp = 1, seq_len
2048, mixed precision, ZeRO-1, two accumulation steps), one compile at a time. The modeled MFU is an upper bound;
'-' where it passes 100%.

    python benchmarks/step_time.py                 # every row (the 1_3b compile takes minutes on 2 cores)
    python benchmarks/step_time.py --configs 125m
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # XLA's GPU compiler runs without a GPU

# config -> (remat, micro-batch, measured step s, measured on), BENCHMARKS.md's H100 tables
MEASURED = {"125m": ("none", 16, 0.167, "2026-11-27"), "350m": ("full", 32, 0.903, "2026-11-24"),
            "760m": ("full", 16, 0.837, "2026-11-24"), "1_3b": ("none", 8, 0.566, "2026-11-27")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(MEASURED), choices=list(MEASURED))
    args = parser.parse_args()
    from zerolm.compile import aot, step_time
    from zerolm.core import platforms
    from zerolm.core.hardware import preset
    from zerolm.data.dataset import load_planned
    from zerolm.parallel.build import build_and_compile
    from zerolm.parallel.mesh import make_mesh

    target = aot.parse_target("h100")
    platforms.no_device_needed()
    devices = aot.target_devices(target)
    print("| config | remat | micro-batch | measured (s) | measured on | modeled (s) | modeled ÷ measured | "
          "FLOPs ÷ model's | modeled MFU | measured MFU |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name in args.configs:
        remat, micro, measured, date = MEASURED[name]
        cfg = load_planned(f"configs/{name}.yaml", ["mesh.dp=1", "zero.stage=1", f"model.remat={remat}",
                                                    f"train.micro_batch_size={micro}",
                                                    f"train.global_batch_size={2 * micro}"], device_count=1)
        built = build_and_compile(cfg, make_mesh(1, 1, devices), None)
        m = step_time.of_step(built, preset("h100"))
        measured_mfu = m.model_flops_per_token * m.tokens_per_step / measured / m.peak_flops
        print(f"| {name} | {remat} | {micro} | {measured:.3f} | {date} | {m.step_s:.3f} | {m.step_s / measured:.2f} | "
              f"{m.flops_ratio:.3f} | {'-' if m.mfu is None else format(m.mfu, '.1%')} | {measured_mfu:.1%} |", flush=True)


if __name__ == "__main__":
    main()
