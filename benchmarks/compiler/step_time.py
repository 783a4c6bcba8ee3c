"""zerolm's modeled GPU steps against the newest H100 step measured for each config (the current rows of
benchmarks/results/train_h100.json: 125m and 1_3b from 2026-11-27, 350m and 760m from 2026-11-24, the only time they
were measured; BENCHMARKS.md, "Against PyTorch on one GPU"): each config compiled for target h100 as it ran (dp = 1, seq_len 2048, mixed precision, ZeRO-1,
two accumulation steps), one compile at a time, and modeled two ways:

- the kernel model (zerolm.compile.gpu_time): every kernel at the rate its class reached on the H100 step it is
  calibrated on (125m none/16, zerolm.compile.gpu_time.CALIBRATION), a prediction for the others;
- the bound (zerolm.compile.step_time): every matmul at the card's peak, nothing else costing time; its MFU an
  upper bound, '-' where it passes 100%.

    python -m benchmarks.compiler.step_time                       # every row (the 1_3b compile takes minutes on 2 cores)
    python -m benchmarks.compiler.step_time --configs 125m 1_3b
    python -m benchmarks.compiler.step_time --fit                 # the calibration: prints H100_REACHED from 125m's profile
    python -m benchmarks.compiler.step_time --configs 125m 1_3b --card h200   # the same steps on an H200 (modeled only)
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # XLA's GPU compiler runs without a GPU

from benchmarks.lib.results import current, load

# config -> (remat, micro-batch): the H100 step modeled for each config, its time and date read from the recorded results
MEASURED = {"125m": ("none", 16), "350m": ("full", 32), "760m": ("full", 16), "1_3b": ("none", 8)}


def measured(name: str) -> tuple[float, str]:
    """(step seconds, date) of the config's current H100 row at MEASURED's remat and micro-batch."""
    remat, micro = MEASURED[name]
    row = current(load("train_h100"))[(name, micro)]
    assert row["remat"] == remat, row
    return row["step_s"], row["date"]


def compiled(name: str, card: str):
    """The config's step as MEASURED ran it, compiled for one GPU of kind `card`."""
    from zerolm.compile import aot
    from zerolm.core import platforms
    from zerolm.data.dataset import load_planned
    from zerolm.parallel.build import build_and_compile
    from zerolm.parallel.mesh import make_mesh

    platforms.no_device_needed()
    devices = aot.target_devices(aot.parse_target(card))
    remat, micro = MEASURED[name]
    cfg = load_planned(f"configs/{name}.yaml", ["mesh.dp=1", "zero.stage=1", f"model.remat={remat}",
                                                f"train.micro_batch_size={micro}",
                                                f"train.global_batch_size={2 * micro}"], device_count=1)
    return build_and_compile(cfg, make_mesh(1, 1, devices), None)


def fit() -> None:
    """Solve the classes' rates on the calibration step (125m none/16 on an H100) and print them."""
    from zerolm.compile import gpu_time
    from zerolm.core.hardware import GPU_TYPES, chip

    calibration = gpu_time.CALIBRATION
    assert calibration.config == "125m" and MEASURED["125m"] == ("none", 16)
    h100 = chip("H100")
    assert h100 is not None
    card = gpu_time.calibrate(compiled("125m", "h100").compiled.texts, "h100", h100.flops,
                              GPU_TYPES["h100"].memory_bandwidth(), calibration)
    print(f"H100_REACHED = {card.reached!r}  # {calibration.source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(MEASURED), choices=list(MEASURED))
    parser.add_argument("--card", default="h100", choices=("h100", "h200"), help="the GPU modeled (default: h100; "
                        "the measured steps are an H100's)")
    parser.add_argument("--fit", action="store_true", help="print the kernel model's calibrated rates and stop")
    args = parser.parse_args()
    if args.fit:
        fit()
        return
    from zerolm.compile import gpu_time, step_time
    from zerolm.core.hardware import GPU_TYPES, preset

    print(f"| config | remat | micro-batch | measured on an H100 (s) | measured on | {args.card}: kernel model (s) | "
          "÷ measured | matmul, attention, reductions, elementwise, copies | bound (s) | bound ÷ measured | "
          "FLOPs ÷ model's | measured MFU |")
    print("|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|")
    for name in args.configs:
        (remat, micro), (step_s, date) = MEASURED[name], measured(name)
        built = compiled(name, args.card)
        kernel = gpu_time.step(built.compiled.texts, gpu_time.card(GPU_TYPES[args.card]))
        bound = step_time.of_step(built, preset(args.card))
        shares = kernel.shares()
        split = ", ".join(f"{shares[c]:.0%}" for c in ("matmul", "attention", "reduction", "elementwise", "copy"))
        measured_mfu = bound.model_flops_per_token * bound.tokens_per_step / step_s / bound.peak_flops
        print(f"| {name} | {remat} | {micro} | {step_s:.3f} | {date} | {kernel.step_s:.3f} | "
              f"{kernel.step_s / step_s:.2f} | {split} | {bound.step_s:.3f} | {bound.step_s / step_s:.2f} | "
              f"{bound.flops_ratio:.3f} | {measured_mfu:.1%} |", flush=True)


if __name__ == "__main__":
    main()
