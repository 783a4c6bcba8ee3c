"""Tensor parallelism on the (dp, tp) mesh, composed with ZeRO-1: the same numbers as dp = 8 and as one
device, one dp reduction per step (after the loop; tp collectives inside it, over tp only), and
1/(dp·tp) of the optimizer state per device."""


import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import REPO, TINY, requires_devices, small_config, small_step
from helpers import to_accum_layout
from zerolm.compile import collectives as comms
from zerolm.compile import hlo
from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.model import decoder as gpt_model
from zerolm.parallel import sharding
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.sharding import is_layout

pytestmark = requires_devices(8)
LAYOUTS = [(8, 1), (4, 2), (2, 4)]


def _setup(cfg, dp, tp, devices=None, mode="reduce_scatter", rules=sharding.RULES, scatter="auto"):
    cfg = cfg.with_values({"zero.grad_reduce": mode, "zero.scatter": scatter})
    mesh = make_mesh(dp, tp, devices if devices is not None else jax.devices()[:dp * tp])
    _, zero, init_fn = build_step(cfg, mesh, rules=rules)
    return zero, zero.init(init_fn, jax.random.key(0))


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


@pytest.mark.slow
@pytest.mark.parametrize("mode, rules", [("all_reduce", sharding.RULES), ("reduce_scatter", sharding.RULES),
                                         ("reduce_scatter", sharding.VOCAB_PARALLEL_RULES)])
def test_tp_layouts_match_dp8_and_one_device(mode, rules):
    cfg = small_config("train.global_batch_size=16", "train.micro_batch_size=2", "train.steps=10",
                       "train.warmup_steps=2", "train.lr=1e-2")
    rows = [np.random.default_rng(i).integers(0, 100, (16, 17)).astype(np.int32) for i in range(3)]
    results = {}
    for dp, tp in [*LAYOUTS, (1, 1)]:
        zero, state = _setup(cfg, dp, tp, mode=mode, rules=rules)
        if tp > 1:  # the parameters really are split over tp: column-parallel c_fc, row-parallel c_proj
            assert state.params["h"]["mlp"]["c_fc"]["kernel"].sharding.spec == P(None, None, "tp")
            assert state.params["h"]["mlp"]["c_proj"]["kernel"].sharding.spec == P(None, "tp", None)
            assert state.params["h"]["attn"]["c_attn"]["kernel"].sharding.spec == P(None, None, None, "tp")
        losses = []
        for r in rows:
            state, metrics = zero(state, jax.device_put(to_accum_layout(r, dp, 16 // (2 * dp), 2), zero.table.batch_sharding))
            losses.append(float(metrics["loss"]))
        results[(dp, tp)] = losses, _flat(state.params)
    ref_losses, ref_params = results[(8, 1)]
    for layout, (losses, params) in results.items():
        # Only float32 summation order differs; Adam amplifies it where a gradient is ~0 (see test_zero).
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=str(layout))
        np.testing.assert_allclose(params, ref_params, rtol=0, atol=1e-4, err_msg=str(layout))
        assert np.linalg.norm(params - ref_params) / np.linalg.norm(ref_params) < 1e-5, layout


@pytest.mark.parametrize("dp, tp", [(4, 2), (2, 4)])
def test_one_dp_reduction_after_the_loop_and_tp_collectives_inside_it(dp, tp):
    cfg = small_config(f"train.global_batch_size={dp * 4}", "train.micro_batch_size=1")
    zero, state = _setup(cfg, dp, tp)
    batch = jax.device_put(to_accum_layout(np.zeros((dp * 4, 17), np.int32), dp, 4, 1), zero.table.batch_sharding)
    ops = comms.read(hlo.compiled_text(zero.programs.grad, state.params, batch))
    mesh_shape = dict(zero.mesh.shape)
    by_axis = [(c, comms.axis_of(c, mesh_shape)) for c in ops]
    assert not [c for c, axes in by_axis if c.in_loop and "dp" in axes], "a dp collective inside the accumulation loop"
    assert [axes for c, axes in by_axis if c.in_loop] and all(axes == ("tp",) for c, axes in by_axis if c.in_loop)
    dp_reductions = [c for c, axes in by_axis if axes == ("dp",) and c.op == "reduce-scatter"]
    assert len(dp_reductions) == len(jax.tree.leaves(state.params))  # one reduce-scatter per leaf, once
    # Each device reduces its own tp block of a tp-split leaf, the whole of the others: nothing is first
    # gathered over tp.
    per_device = sum(np.prod(lay.view_shape) // (tp if lay.tp_axis is not None and lay.axis is not None else 1)
                     for lay in jax.tree.leaves(zero.table.layouts, is_leaf=is_layout))
    assert sum(c.elements for c in dp_reductions) * dp == per_device
    # The one exception: a tp-split leaf with no axis dp divides beside its tp axis is blockified, and its
    # gradient is gathered whole over tp first (the biases at n_layer 2 on dp 4; docs/zero-questions.md).
    blockified = [lay for lay in jax.tree.leaves(zero.table.layouts, is_leaf=is_layout)
                  if lay.tp_axis is not None and lay.axis is None]
    tp_after = [c for c, axes in by_axis if not c.in_loop and axes == ("tp",)]
    assert {c.op for c in tp_after} <= {"all-gather"}
    assert sum(c.elements for c in tp_after) == sum(lay.size for lay in blockified)
    assert bool(blockified) == (dp == 4)  # the case is covered, and (2, 4) has none


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
@pytest.mark.parametrize("sets, per_layer", [
    # (the sequential block's 2 forward and 2 backward, Megatron's: test_comms)
    (("model.remat=full",), 5),  # the sequential block's 4; full remat reruns the attention's forward one
    (("model.parallel_residual=true",), 3),  # GPT-NeoX's: 1 forward, each norm's input gradient backward
    (("model.parallel_residual=true", "model.residual_dropout=0.1"), 4),  # each branch's own mask: 2 forward
    (("model.parallel_residual=true", "model.shared_norm=true", "model.scan_layers=false"), 2),  # GPT-J's: 1 + 1
    (("model.parallel_residual=true", "model.shared_norm=true", "model.remat=full", "model.n_kv_head=2",
      "model.mlp=swiglu", "model.mlp_hidden=64"), 2)],
    ids=["sequential-remat", "parallel", "parallel-dropout", "parallel-shared-unrolled",
         "parallel-shared-remat-gqa-swiglu"])
def test_the_parallel_residual_all_reduces_one_activation_per_layer_where_the_sequential_block_two(sets, per_layer):
    """dp 4 × tp 2: the tp all-reduces inside the accumulation loop, in activations (micro-batch × seq_len ×
    d_model) per layer and micro-step, from the compiled step, and no other collective in the loop; each all-reduce
    of GPT-J's block one activation (its two branches summed before the reduction, both ways); the planner's bytes
    (zerolm comms') are the compiler's."""
    from zerolm.plan.traffic import step_predictions

    cfg, model, zero, init_fn = small_step("train.global_batch_size=16", "train.micro_batch_size=1", *sets, dp=4, tp=2)
    state = zero.init(init_fn, jax.random.key(0))
    batch = jax.device_put(to_accum_layout(np.zeros((16, 17), np.int32), 4, 4, 1), zero.table.batch_sharding)
    ops = comms.read(hlo.compiled_text(zero.programs.grad, state.params, batch))
    reduced = [c for c in ops if c.in_loop and c.op == "all-reduce" and comms.axis_of(c, dict(zero.mesh.shape)) == ("tp",)]
    assert reduced == [c for c in ops if c.in_loop]  # nothing else moves in the loop (the fused kernels stay split)
    activation = cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.d_model
    assert sum(c.elements * c.runs for c in reduced) == per_layer * activation * cfg.accum_steps * cfg.model.n_layer
    if "model.shared_norm=true" in sets:
        assert {c.elements for c in reduced} == {activation}
    predicted = [p for p in step_predictions(cfg, model, zero) if p.span == ["tp"]]
    assert [p.bytes_per_step for p in predicted] == [sum(c.bytes * c.runs for c in reduced)]


def test_two_stage_reduce_scatter_over_dp_with_tp():
    """zero.scatter=two_stage on dp 4 × tp 2: the same gradient as one psum_scatter; both stages over dp
    pairs only (inner 2), each device's own tp block, after the loop."""
    cfg = small_config("train.global_batch_size=16", "train.micro_batch_size=1")
    rows = np.random.default_rng(0).integers(0, 100, (16, 17)).astype(np.int32)
    grads = {}
    for scatter in ("collective", "two_stage"):
        zero, state = _setup(cfg, 4, 2, scatter=scatter)
        batch = jax.device_put(to_accum_layout(rows, 4, 4, 1), zero.table.batch_sharding)
        grads[scatter] = _flat(zero.programs.grad(state.params, batch)[0])
    assert zero.scatter_inner == 2
    np.testing.assert_allclose(grads["two_stage"], grads["collective"], rtol=1e-6,
                               atol=1e-6 * np.abs(grads["collective"]).max())
    ops = comms.read(hlo.compiled_text(zero.programs.grad, state.params, batch))
    mesh_shape = dict(zero.mesh.shape)
    dp_reductions = [c for c in ops if c.op == "reduce-scatter"]
    assert {comms.axes_label(c, mesh_shape) for c in dp_reductions} == {("dp(2/4)",)}
    assert not [c for c in dp_reductions if c.in_loop]
    assert len(dp_reductions) == 2 * len(jax.tree.leaves(state.params))


def _opt_bytes_per_device(zero) -> int:
    """Bytes of AdamW's moments one device holds, from the shardings (nothing is allocated)."""
    total = 0
    for lay, view in zip(jax.tree.leaves(zero.table.layouts, is_leaf=is_layout), jax.tree.leaves(zero.table.view_shardings), strict=True):
        total += 2 * 4 * int(np.prod(view.shard_shape(lay.view_shape)))
    return total


@pytest.mark.parametrize("dp, tp", LAYOUTS)
def test_125m_optimizer_state_is_one_dp_tp_th_per_device(dp, tp):
    cfg = load_config(REPO / "configs" / "125m.yaml", ["train.micro_batch_size=1", "model.vocab_size=50257",
                                                      f"mesh.tp={tp}"], device_count=8)
    _, zero, _ = build_step(cfg, make_mesh(dp, tp))
    whole = 2 * 4 * gpt_model.count_params(zero.abstract_params)
    assert _opt_bytes_per_device(zero) <= whole / (dp * tp) * 1.01
    # Every leaf, tp-split or not, is split over all 8 devices: each holds 1/8 of its (padded) view.
    for lay, view in zip(jax.tree.leaves(zero.table.layouts, is_leaf=is_layout), jax.tree.leaves(zero.table.view_shardings), strict=True):
        assert np.prod(view.shard_shape(lay.view_shape)) * 8 == np.prod(lay.view_shape), lay


@pytest.mark.parametrize("overrides, devices, message", [
    (["mesh.tp=3"], 3, "mesh.tp: tp=3 does not divide model.n_head=4 (tensor parallelism splits whole attention heads)"),
    (["mesh.tp=16"], 8, "mesh.tp: tp=16 does not divide the 8 devices"),
    (["mesh.tp=2", "mesh.dp=2"], 8, "mesh.dp: dp × tp = 2 × 2 = 4, but there are 8 devices"),
])
def test_bad_tp_is_one_line(overrides, devices, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides, device_count=devices)
    assert str(e.value).endswith(message) and "\n" not in str(e.value)
