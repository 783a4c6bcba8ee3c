"""What a `lax.psum_scatter` over dp becomes in the TPU compiler, per TPU generation (libtpu, ahead of
time, no TPU needed): a reduce-scatter, the v4/v5p `all-reduce-scatter` fusion, or an all-reduce
followed by a slice (each device receiving the whole reduced array).

    python -m benchmarks.compiler.tpu_reduce_scatter [--rows 8192] [--cols 1024] [--dtype float32] [--layers L] [--flag xla_tpu_...=true ...] [--targets ...]
        [--two-stage [INNER]]

--two-stage INNER runs zerolm's `two_stage_reduce_scatter` instead (zero.scatter=two_stage): the same
reduce-scatter as two over dp sub-groups, the second over INNER consecutive dp positions (0: the
inner `zerolm.parallel.scatter.two_stage_inner` picks for the slice). That is how a reduce-scatter survives where
the one-stage form becomes an all-reduce. The mesh is zerolm's (`zerolm.parallel.mesh.make_mesh`).
"""

from __future__ import annotations

import argparse
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerolm.compile import aot
from zerolm.compile import collectives as comms
from zerolm.parallel.mesh import DP, make_mesh
from zerolm.parallel.scatter import two_stage_inner, two_stage_reduce_scatter

TARGETS = ("v2-8", "v3-8", "v4-8", "v5e-8", "v5p-8", "v6e-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layers", type=int, default=0, help="scatter (LAYERS, rows, cols) on its rows, as a "
                                                              "stacked layer kernel (default: (rows, cols))")
    parser.add_argument("--flag", action="append", default=[], metavar="NAME=VALUE", help="a compiler option")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), help="default: %(default)s")
    parser.add_argument("--two-stage", type=int, metavar="INNER", nargs="?", const=0,
                        help="zerolm's two-stage reduce-scatter, the second stage over INNER dp positions "
                             "(none or 0: zerolm's choice for the slice)")
    args = parser.parse_args()
    options = {k: v.lower() == "true" if v.lower() in ("true", "false") else v
               for k, v in (f.split("=", 1) for f in args.flag)} or None
    shape = (args.layers,) * bool(args.layers) + (args.rows, args.cols)
    axis = len(shape) - 2
    print(f"psum_scatter{' in two stages' if args.two_stage is not None else ''} of "
          f"{args.dtype}[{','.join(map(str, shape))}] per device over dp, on its rows (its whole: "
          f"{math.prod(shape) * jnp.dtype(args.dtype).itemsize / 2**20:.2f} MiB); bytes are each collective's "
          "result per device")
    for name in args.targets:
        target = aot.parse_target(name)
        devices = aot.target_devices(target)
        os.environ["TPU_ACCELERATOR_TYPE"] = name
        n = len(devices)
        mesh = make_mesh(n, 1, devices)
        inner = (args.two_stage or two_stage_inner(mesh)) if args.two_stage is not None else None

        def body(x, inner=inner):
            if inner is None:
                return lax.psum_scatter(x[0], DP, scatter_dimension=axis, tiled=True)
            return two_stage_reduce_scatter(x[0], axis, n, inner)
        scatter = jax.shard_map(body, mesh=mesh, in_specs=P(DP), out_specs=P(DP, None))
        x = jax.ShapeDtypeStruct((n, *shape), args.dtype, sharding=NamedSharding(mesh, P(DP)))
        text = jax.jit(scatter).lower(x).compile(options).as_text()
        found = ", ".join(f"{c.op} {c.bytes / 2**20:.2f} MiB" for c in comms.read(text))
        print(f"  {name:6s} ({n} devices, {devices[0].device_kind}{', inner ' + str(inner) if inner else ''}): {found}")


if __name__ == "__main__":
    main()
