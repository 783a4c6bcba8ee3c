"""How the one reduce-scatter over dp runs: the algorithms, and the rule that picks one for a mesh.

`lax.psum_scatter` over the dp axis ("collective") is the reduce-scatter everywhere but where the TPU
compiler turns it into an all-reduce of the whole array: on v2/v3, and on v4 and later slices beyond one
host (docs/performance-notes.md has the measurements). There the same sum runs as two `psum_scatter`s
over dp sub-groups ("two_stage"), which the compiler keeps as reduce-scatters, or as dp − 1 neighbour
exchanges ("ring"). All three send a reduce-scatter's bytes and give each device its own block, in dp
order; zerolm.parallel.zero's reduction calls the one zerolm.parallel.auto.scatter picks (zero.scatter).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from zerolm.parallel.mesh import DP


def _dp_per_host(mesh: Mesh) -> int:
    """The dp positions the first device's host holds."""
    axis, host = mesh.axis_names.index(DP), mesh.devices.flat[0].process_index
    return len({c[axis] for c, d in np.ndenumerate(mesh.devices) if d.process_index == host})


def two_stage_inner(mesh: Mesh) -> int:
    """The second stage's group size for `two_stage_reduce_scatter` on `mesh`'s dp axis: as many dp
    positions as one host holds (the first device's host: 4 on multi-host v4/v5e/v5p slices, 8 on v3-32,
    where it is measured to compile to reduce-scatters, docs/performance-notes.md), where that is a proper divisor of
    dp; else dp's largest proper divisor. 1 when dp is prime (one stage). The positions need not be one
    host's: the mesh orders devices along the torus, not by host."""
    dp, per_host = mesh.shape[DP], _dp_per_host(mesh)
    if 1 < per_host < dp and dp % per_host == 0:
        return per_host
    smallest_factor = next((f for f in range(2, dp) if dp % f == 0), dp)
    return dp // smallest_factor


def reduce_scatter(scatter: str, dp: int, inner: int | None) -> Callable[[jax.Array, int], jax.Array]:
    """`f(x, axis)`: x summed over dp and scattered along `axis` (tiled), as `scatter` (resolved) says."""
    if scatter == "two_stage":
        assert inner is not None
        return functools.partial(two_stage_reduce_scatter, dp=dp, inner=inner)
    if scatter == "ring":
        return functools.partial(ring_reduce_scatter, dp=dp)
    return lambda x, axis: lax.psum_scatter(x, DP, scatter_dimension=axis, tiled=True)


def two_stage_groups(dp: int, inner: int) -> tuple[list[list[int]], list[list[int]]]:
    """The dp positions of `two_stage_reduce_scatter`'s two stages: first the dp // inner positions `inner`
    apart, then the `inner` consecutive ones."""
    outer = dp // inner
    return ([[i + k * inner for k in range(outer)] for i in range(inner)],
            [[o * inner + i for i in range(inner)] for o in range(outer)])


def two_stage_reduce_scatter(x: jax.Array, axis: int, dp: int, inner: int) -> jax.Array:
    """`psum_scatter(x, 'dp', scatter_dimension=axis, tiled=True)` as two psum_scatters over dp sub-groups.

    dp = outer × inner. Device o·inner + i first sums, with the `outer` devices i, i + inner, ... (a
    stride of inner), the o-th of x's `outer` chunks (its own block and the inner − 1 blocks after it),
    then, with the `inner` devices o·inner, ..., o·inner + inner − 1, the i-th block of that chunk: block
    o·inner + i of the whole sum, its own, in dp order. Each device sends x·(outer − 1)/outer then
    x/outer·(inner − 1)/inner: (dp − 1)/dp of x, a reduce-scatter's bytes. The TPU compiler keeps both
    as reduce-scatters where it makes the one-stage form an all-reduce of the whole (the measurements:
    docs/performance-notes.md). A stage over groups of one is skipped (inner 1 or dp: one stage). An
    array of 3 or more axes whose blocks are not whole TPU tiles of rows runs in a 2-D form that makes
    them so (`_tile_rows_reduce_scatter`)."""
    block = x.shape[axis] // dp
    tile = 32 // x.dtype.itemsize  # rows of a TPU tile: 8 of float32, 16 of bfloat16
    if x.ndim >= 3 and block % tile:
        return _tile_rows_reduce_scatter(x, axis, dp, inner, tile)
    for groups in two_stage_groups(dp, inner):
        if len(groups[0]) > 1:
            x = lax.psum_scatter(x, DP, scatter_dimension=axis, axis_index_groups=groups, tiled=True)
    return x


def _tile_rows_reduce_scatter(x: jax.Array, axis: int, dp: int, inner: int, tile: int) -> jax.Array:
    """`two_stage_reduce_scatter` of x on `axis`, run on a 2-D form whose blocks are whole TPU tiles of rows.

    The TPU compiler (beyond one host) makes the second stage an all-reduce of its whole input when a
    block of an array of 3 or more axes is not a whole number of tiles along the scatter axis (125m's
    d_model 768 over dp 32: 24 bfloat16 rows; docs/performance-notes.md). Here the scatter axis goes
    first and each of its rows is cut in s, so that a device's block is block·s rows, a multiple of
    the tile, and still its own rows in order; the result is put back in x's layout. It costs a
    transposed copy of x (temporary); the layout of the optimizer state is unchanged."""
    block = x.shape[axis] // dp
    s = tile // math.gcd(block, tile)
    moved = jnp.moveaxis(x, axis, 0)
    rest = math.prod(moved.shape[1:])
    if rest % s:
        s = 1  # rows that do not cut evenly: the 2-D form alone
    out = two_stage_reduce_scatter(moved.reshape(moved.shape[0] * s, rest // s), 0, dp, inner)
    return jnp.moveaxis(out.reshape((block,) + moved.shape[1:]), 0, axis)


def ring_reduce_scatter(x: jax.Array, axis: int, dp: int) -> jax.Array:
    """`psum_scatter(x, 'dp', scatter_dimension=axis, tiled=True)` as a ring of dp − 1 `ppermute`s.

    Device i ends with block i of the sum: a partial sum of block b starts on device b + 1, travels
    right, and each device it reaches adds its own block b. Every device sends (dp − 1)/dp of x, a
    reduce-scatter's bytes, in dp − 1 hops (`two_stage_reduce_scatter` takes 2 collectives). The TPU
    compiler keeps collective-permutes where it makes a one-stage reduce-scatter an all-reduce.
    Unrolled, so that no collective sits in a loop (and the compiler may overlap them)."""
    if dp == 1:
        return x
    n = x.shape[axis] // dp
    me = lax.axis_index(DP)
    right = [(j, (j + 1) % dp) for j in range(dp)]

    def block(b):
        return lax.dynamic_slice_in_dim(x, (b % dp) * n, n, axis=axis)

    partial = block(me + dp - 1)
    for s in range(1, dp):
        partial = lax.ppermute(partial, DP, right) + block(me + 2 * dp - s - 1)
    return partial
