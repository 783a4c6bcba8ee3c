"""What a `lax.psum_scatter` over dp becomes in the TPU compiler, per TPU generation (libtpu, ahead of
time, no TPU needed): a reduce-scatter, the v4/v5p `all-reduce-scatter` fusion, or an all-reduce
followed by a slice (each device receiving the whole reduced array).

    python benchmarks/tpu_reduce_scatter.py [--rows 8192] [--cols 1024] [--flag xla_tpu_...=true ...] [--targets ...]
        [--two-stage INNER]

--two-stage INNER writes the same reduce-scatter as two, on dp factored into (outer, INNER) mesh axes:
a psum_scatter over `outer`, then one over `inner` (each device still ends with its own block, in dp
order). That is how a reduce-scatter survives on slices where the one-stage form becomes an all-reduce.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zerolm import aot, hlo

TARGETS = ("v2-8", "v3-8", "v4-8", "v5e-8", "v5p-8", "v6e-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--flag", action="append", default=[], metavar="NAME=VALUE", help="a compiler option")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), help="default: %(default)s")
    parser.add_argument("--two-stage", type=int, metavar="INNER", help="scatter over dp = outer × INNER in two steps")
    args = parser.parse_args()
    options = {k: v.lower() == "true" if v.lower() in ("true", "false") else v
               for k, v in (f.split("=", 1) for f in args.flag)} or None
    print(f"psum_scatter{' in two stages (inner ' + str(args.two_stage) + ')' if args.two_stage else ''} of "
          f"f32[{args.rows},{args.cols}] per device over dp (its whole: "
          f"{args.rows * args.cols * 4 / 2**20:.0f} MiB); bytes are each collective's result per device")
    for name in args.targets:
        target = aot.parse_target(name)
        devices = aot.target_devices(target)
        os.environ["TPU_ACCELERATOR_TYPE"] = name
        n = len(devices)
        if args.two_stage:
            mesh = Mesh(np.array(devices).reshape(n // args.two_stage, args.two_stage), ("outer", "inner"),
                        axis_types=(AxisType.Auto,) * 2)
            dp = ("outer", "inner")

            def body(x):
                outer = lax.psum_scatter(x[0], "outer", scatter_dimension=0, tiled=True)
                return lax.psum_scatter(outer, "inner", scatter_dimension=0, tiled=True)
        else:
            mesh, dp = Mesh(np.array(devices).reshape(n), ("dp",), axis_types=(AxisType.Auto,)), "dp"

            def body(x):
                return lax.psum_scatter(x[0], "dp", scatter_dimension=0, tiled=True)
        scatter = jax.shard_map(body, mesh=mesh, in_specs=P(dp), out_specs=P(dp))
        x = jax.ShapeDtypeStruct((n, args.rows, args.cols), jnp.float32, sharding=NamedSharding(mesh, P(dp)))
        text = jax.jit(scatter).lower(x).compile(options).as_text()
        found = ", ".join(f"{c.op} {c.bytes / 2**20:.2f} MiB" for c in hlo.collectives(text))
        print(f"  {name:6s} ({n} devices, {devices[0].device_kind}): {found}")


if __name__ == "__main__":
    main()
