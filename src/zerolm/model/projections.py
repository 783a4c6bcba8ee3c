"""A layer's weights and their matmuls: `Linear` declares a linear layer's parameters as flax's DenseGeneral does (the
same names, logical axes and initial values) and returns them, `linear` applies them, and the parallel residual
block's projections (`fused_in`, `fused_out`) put two branches' matmuls into one, so that tensor parallelism
reduces once where two matmuls reduce twice (a custom VJP, `projections`, for the input's gradient)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zerolm.config.model import ResolvedModelConfig

# The parallel block's input projections (`projections`: a custom VJP, whose matmuls a policy that looks for dots
# does not see) are weight matmuls' outputs by name (zerolm.model.decoder.REMAT_POLICIES).
PROJECTIONS = "projections"


def named(init, *axes: str):
    """An initializer whose parameter carries logical axis names (metadata; see zerolm.parallel.sharding)."""
    return nn.with_logical_partitioning(init, axes)


class Weights(NamedTuple):
    """A linear layer's parameters: `kernel` (d_in, *features), `bias` (*features) or None."""

    kernel: jax.Array
    bias: jax.Array | None


class Linear(nn.Module):
    """A linear layer's parameters, declared as flax's DenseGeneral declares them (the same names, logical axes and
    initial values) and returned, not applied (`linear` applies them): so that the parallel residual block can put
    two branches' projections into one matmul (`fused_out`; `fused_in`, backward)."""

    d_in: int
    features: tuple[int, ...]
    axes: tuple[str, ...]  # the kernel's logical axes, the input's first; the bias has the features'
    kernel_init: Callable
    use_bias: bool

    @nn.compact
    def __call__(self) -> Weights:
        flat = (self.d_in, math.prod(self.features))  # DenseGeneral draws the kernel as a matrix, then reshapes it
        shape = (self.d_in, *self.features)
        kernel = self.param("kernel", named(lambda rng, _, dtype=jnp.float32: self.kernel_init(rng, flat, dtype)
                                             .reshape(shape), *self.axes), shape, jnp.float32)
        bias = self.param("bias", named(nn.initializers.zeros, *self.axes[1:]), self.features,
                          jnp.float32) if self.use_bias else None
        return Weights(kernel, bias)


def linear(x_BxTxN: jax.Array, w: Weights, dtype: jnp.dtype, name: str = "") -> jax.Array:
    """x's last axis times the kernel, plus the bias, in `dtype` (what flax's Dense computes)."""
    with jax.named_scope(name) if name else contextlib.nullcontext():  # its matmul named in the HLO, as flax names it
        x, kernel, bias = nn.dtypes.promote_dtype(x_BxTxN, w.kernel, w.bias, dtype=dtype)
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return y if bias is None else y + bias


def proj_init(cfg: ResolvedModelConfig):
    """GPT-2 scales the residual projections' init by 1/sqrt(2 * n_layer)."""
    return nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer))


def tp_groups(cfg: ResolvedModelConfig) -> int:
    """How many equal groups of columns every tensor-parallel split of a block keeps whole: gcd(n_head, n_kv_head,
    MLP width), which any tp the model allows divides (it splits whole query and key/value heads and the MLP's
    units: zerolm.config.model.tp_split_problem)."""
    return math.gcd(cfg.n_head, cfg.n_kv_head, cfg.mlp_hidden)


def _grouped(x: jax.Array, groups: int, axis: int) -> jax.Array:
    """x's last axis (a kernel's output columns, which tensor parallelism splits) in `groups`, the groups moved to
    `axis` and each group's columns (of every axis between) flattened after it: a kernel (d, *lead, n) as
    (d, groups, ·) with axis 1, a projection's output (B, T, *lead, n) as (B, T, groups, ·) with axis 2."""
    *rest, n = x.shape
    return jnp.moveaxis(x.reshape(*rest, groups, n // groups), -2, axis).reshape(*rest[:axis], groups, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def projections(x_BxTxD: jax.Array, kernels: tuple[jax.Array, ...], groups: int) -> tuple[jax.Array, ...]:
    """x times each kernel (d, *lead, n), each its own matmul (as `linear`'s), whose backward pass makes x's gradient
    one matmul over every kernel's columns: one sum, so that tensor parallelism reduces it once where a matmul each
    reduces it once each. The columns go in `groups` (`_grouped`), which keep a tp device's columns on it."""
    return tuple(lax.dot_general(x_BxTxD, k, (((x_BxTxD.ndim - 1,), (0,)), ((), ()))) for k in kernels)


def _projections_fwd(x_BxTxD, kernels, groups):
    return projections(x_BxTxD, kernels, groups), (x_BxTxD, kernels)


def _projections_bwd(groups, residuals, grads):
    x_BxTxD, kernels = residuals
    g_BxTxGxC = jnp.concatenate([_grouped(g, groups, 2) for g in grads], axis=-1)
    kernel_DxGxC = jnp.concatenate([_grouped(k, groups, 1) for k in kernels], axis=-1)
    dx = jnp.einsum("btgc,dgc->btd", g_BxTxGxC, kernel_DxGxC)
    return dx, tuple(jnp.tensordot(x_BxTxD, g, axes=((0, 1), (0, 1))) for g in grads)


projections.defvjp(_projections_fwd, _projections_bwd)


def fused_in(x_BxTxD: jax.Array, weights: list[Weights], groups: int, dtype: jnp.dtype) -> list[jax.Array]:
    """`[linear(x, w, dtype) for w in weights]`, x's gradient made in one matmul (`projections`), the outputs named
    for the remat policies that keep weight matmuls' (PROJECTIONS)."""
    x, *kernels = nn.dtypes.promote_dtype(x_BxTxD, *[w.kernel for w in weights], dtype=dtype)
    outs = [checkpoint_name(y, PROJECTIONS) for y in projections(x, tuple(kernels), groups)]
    return [y if w.bias is None else y + w.bias.astype(dtype) for y, w in zip(outs, weights, strict=True)]


def fused_out(parts: list[tuple[jax.Array, Weights]], groups: int, dtype: jnp.dtype) -> jax.Array:
    """The sum of `linear(y, w, dtype)` over the (y, w) parts as one matmul, so that the sum is made before tensor
    parallelism's reduction (one all-reduce where two matmuls need two): each y (B, T, n) and kernel (n, D) in
    `groups` groups of n (whole heads, whole blocks of the MLP's units), the groups concatenated."""
    ys, kernels = [], []
    for y, w in parts:
        B, T, n = y.shape
        ys.append(y.reshape(B, T, groups, n // groups))
        kernels.append(w.kernel.reshape(groups, n // groups, -1))
    y_BxTxGxC, kernel = nn.dtypes.promote_dtype(jnp.concatenate(ys, axis=-1), jnp.concatenate(kernels, axis=1),
                                                 dtype=dtype)
    out_BxTxD = jnp.einsum("btgc,gcd->btd", y_BxTxGxC, kernel)
    for _, w in parts:
        out_BxTxD = out_BxTxD if w.bias is None else out_BxTxD + w.bias.astype(dtype)
    return out_BxTxD
