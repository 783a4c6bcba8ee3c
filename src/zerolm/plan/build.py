"""A plan's model: from a config (zerolm's exact layouts), or from a parameter count (GPT-3's shapes)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from zerolm.plan.spec import Model, PlanError
from zerolm.plan.states import ExactStates

# GPT-3's shapes (Brown et al. 2020, Table 2.1): params -> (layers, d_model, heads), for --params alone.
GPT3 = ((125e6, 12, 768, 12), (350e6, 24, 1024, 16), (760e6, 24, 1536, 16), (1.3e9, 24, 2048, 32),
        (2.7e9, 32, 2560, 32), (6.7e9, 32, 4096, 32), (13e9, 40, 5140, 40), (175e9, 96, 12288, 96))


@dataclasses.dataclass(frozen=True)
class Shape:
    """What `zerolm plan --params N` is told of the model's shape (None: derived from N, or GPT-3's nearest)."""

    layers: int | None = None
    width: int | None = None
    heads: int | None = None


def model_from_params(n: int, shape: Shape, seq_len: int, vocab: int, remat: str) -> Model:
    """A model of N parameters: the shape given, or solved from N (the width for a given depth, the depth for a
    given width), or GPT-3's nearest size's."""
    layers, width, heads = shape.layers, shape.width, shape.heads
    if n <= 0:
        raise PlanError(f"--params: {n} is not a positive parameter count")
    padded = -(-vocab // 128) * 128
    if layers is None and width is None:
        _, layers, width, default_heads = min(GPT3, key=lambda r: abs(math.log(r[0] / n)))
        heads = heads or default_heads
    elif width is None:  # N ≈ 12·L·d² + (V + s)·d: solve for d
        assert layers is not None
        a, b = 12 * layers, padded + seq_len
        width = max(64, round((-b + math.sqrt(b * b + 4 * a * n)) / (2 * a) / 64) * 64)
    elif layers is None:
        layers = max(1, round((n - (padded + seq_len) * width) / (12 * width * width)))
    assert layers is not None and width is not None  # each branch above gives both
    heads = heads or max(1, width // 128)
    for flag, value in (("--layers", layers), ("--width", width), ("--heads", heads), ("--seq-len", seq_len)):
        if value <= 0:
            raise PlanError(f"{flag}: {value} is not positive")
    embeddings = (padded + seq_len) * width
    if embeddings >= n:
        raise PlanError(f"--params: {n:,} cannot hold a {layers} × {width} model: its embeddings alone are "
                        f"{embeddings:,} parameters ({padded:,} vocabulary + {seq_len:,} positions × {width}); give a "
                        "larger N, or a smaller --width / --vocab")
    # Tensor parallelism splits the blocks, not the embeddings (zerolm.parallel.sharding.RULES); LayerNorms ignored.
    return Model(n, n - embeddings, layers, width, heads, seq_len, padded, remat=remat,
                 source=f"--params {n:,} (shape {layers} layers × {width}, {heads} heads)")


def from_config(cfg, dp: int, tp: int) -> tuple[Model, Any]:
    """(Model, a factory (dp, tp) -> exact model-state bytes of zerolm's layouts on that mesh)."""
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from zerolm.model import decoder as gpt_model
    from zerolm.parallel import auto
    from zerolm.parallel.mesh import DP, TP
    from zerolm.parallel.optim import make_optimizer
    from zerolm.parallel.sharding import Table, param_spec

    # What build_step builds, on no devices: only the parameters' shapes are read, which neither the
    # compute dtype, the attention nor the layer loop changes.
    shapes = auto.for_shapes(cfg.model)
    gpt = gpt_model.GPT(shapes)
    init_fn = functools.partial(gpt_model.init_params, gpt)
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    axes = gpt_model.logical_axes(gpt)
    tx, _ = make_optimizer(cfg.train)

    def states(dp_: int, tp_: int) -> ExactStates:
        mesh = AbstractMesh((dp_, tp_), (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto))
        return ExactStates(Table(mesh, abstract, axes, tx))

    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    split = sum(a.size for a, logical in zip(jax.tree.leaves(abstract), jax.tree.leaves(axes, is_leaf=is_spec), strict=True)
                if TP in param_spec(logical))
    model = Model(gpt_model.count_params(abstract), split, cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head,
                  cfg.model.seq_len, cfg.model.padded_vocab_size, 4 if cfg.model.dtype == "float32" else 2,
                  cfg.model.loss_chunk, "full" if cfg.model.remat == "full" else "none", source=f"config {cfg.name}",
                  param_bytes=2 if cfg.zero.precision == "mixed" else 4,
                  acc_bytes=2 if cfg.zero.accumulate_dtype == "bfloat16" else 4, attention=cfg.model.attention,
                  attention_block=cfg.model.attention_block, document_mask=cfg.model.document_mask,
                  scan_layers=cfg.model.scan_layers, dtype=cfg.model.dtype, position=cfg.model.position,
                  attention_dropout=cfg.model.attention_dropout,
                  kv_heads=shapes.n_kv_head, mlp_width=shapes.mlp_hidden, gated_mlp=cfg.model.mlp == "swiglu",
                  parallel_residual=cfg.model.parallel_residual, shared_norm=cfg.model.shared_norm,
                  residual_dropout=bool(cfg.model.residual_dropout),
                  matmul_params=gpt_model.count_params(abstract, matmul_only=True))
    return model, states
