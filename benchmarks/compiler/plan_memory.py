"""The planner's per-device memory against what XLA allocates for the compiled gradient step.

    python -m benchmarks.compiler.plan_memory [--micro 1 4 8]

On one device of this machine's backend, compiles zerolm's gradient step for a small model at a few
micro-batch sizes and prints XLA's own memory analysis beside `zerolm plan`'s numbers:
- arguments: the parameters (planned: params_bytes);
- output: the reduced gradient (planned: grads_bytes, the float32 accumulator);
- temporaries: what the step allocates besides them (planned: activation_bytes, which leaves out
  XLA's workspace, the backward pass's transient gradients and a scheduler's own choices).
The compute dtype is float32 here (the CPU's), so the planner is asked for 4-byte activations.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from zerolm.commands import plan as commands_plan
from zerolm.config.load import load_config
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.sharding import with_shardings

SHAPE = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=256", "model.dtype=float32",
         "model.vocab_size=2048", "mesh.dp=1"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--remat", choices=("none", "full"), default="none")
    args = p.parse_args()
    device = jax.devices()[0]
    print(f"{device.device_kind}, jax {jax.__version__}; model: {' '.join(SHAPE)}; remat {args.remat}")
    print(f"{'micro':>5} {'XLA args':>10} {'planned':>10} {'XLA output':>11} {'planned':>10} {'XLA temp':>10} "
          f"{'planned':>10} {'ratio':>6}")
    for micro in args.micro:
        sets = [*SHAPE, f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}",
                f"model.remat={args.remat}"]
        cfg = load_config("configs/tiny.yaml", sets, device_count=1)
        _, zero, _ = build_step(cfg, make_mesh(1, 1, [device]))
        params = with_shardings(zero.abstract_params, zero.table.param_shardings)
        batch = jax.ShapeDtypeStruct((1, micro, cfg.model.seq_len + 1), np.int32, sharding=zero.table.batch_sharding)
        xla = zero.programs.grad.lower(params, batch).compile().memory_analysis()
        parser = argparse.ArgumentParser()
        commands_plan.add_arguments(parser)
        planned = commands_plan.build(parser.parse_args(["--config", "configs/tiny.yaml", "--dp", "1", "--device", "v4",
                                                *[a for s in sets for a in ("--set", s)]])).memory(1, micro)
        mib = lambda n: f"{n / 2**20:8.1f}Mi"
        print(f"{micro:5d} {mib(xla.argument_size_in_bytes)} {mib(planned['params_bytes'])} "
              f"{mib(xla.output_size_in_bytes)}  {mib(planned['grads_bytes'])} {mib(xla.temp_size_in_bytes)} "
              f"{mib(planned['activation_bytes'])} {xla.temp_size_in_bytes / planned['activation_bytes']:6.2f}")


if __name__ == "__main__":
    main()
