"""ZeRO-1 against the plain programs it replaces: same numbers, one reduction, 1/dp of the state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from conftest import REPO, requires_devices, small_config, small_model
from helpers import bytes_per_device, to_accum_layout, zero_settings
from zerolm.compile import collectives as comms
from zerolm.compile import hlo
from zerolm.config.load import load_config
from zerolm.model import decoder as gpt_model
from zerolm.parallel import auto
from zerolm.parallel.auto import for_device
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.naive_step import naive_data_parallel_step
from zerolm.parallel.optim import make_optimizer
from zerolm.parallel.scatter import two_stage_reduce_scatter
from zerolm.parallel.sharding import is_layout, plan_layout
from zerolm.parallel.zero import Objective, Zero


def plan(abstract, dp):
    return jax.tree.map(lambda a: plan_layout(a.shape, dp), abstract)

pytestmark = requires_devices(8)
MODES = ["all_reduce", "reduce_scatter"]


def _rows(n, cfg, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (n, cfg.model.seq_len + 1)).astype(np.int32)


def _zero(cfg, tx, mode, dp=8):
    model, init_fn, loss_fn, abstract = small_model(cfg.model)
    zero = Zero(make_mesh(dp), Objective(loss_fn, abstract), tx, zero_settings(grad_reduce=mode))
    return zero, zero.init(init_fn, jax.random.key(0)), loss_fn


def _batch(zero, rows, accum, micro):
    return jax.device_put(to_accum_layout(rows, zero.table.dp, accum, micro), zero.table.batch_sharding)


def _rel(a_tree, b_tree):
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a_tree, b_tree))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("mode, chunk, model", [
    ("all_reduce", 0, ()), ("reduce_scatter", 0, ()), ("reduce_scatter", 12, ()),
    # the other layer loops and attentions: the whole suite's (the unit tier keeps the three above)
    pytest.param("reduce_scatter", 12, ("model.scan_layers=false",), marks=pytest.mark.slow),
    pytest.param("reduce_scatter", 12, ("model.scan_layers=false", "model.attention=blockwise", "model.attention_block=8"),
                 marks=pytest.mark.slow),
    pytest.param("reduce_scatter", 12, ("model.scan_layers=false", "model.remat=full"), marks=pytest.mark.slow)],
    ids=lambda v: "-".join(s.split("=")[-1] for s in v) if isinstance(v, tuple) else str(v))
def test_sgd_step_matches_single_device(mode, chunk, model):
    """chunk 12: the fused, chunked loss inside shard_map (2 × 16 targets per micro-step, a padded chunk)
    against the plain loss on one device (its layers in a scan, XLA's attention). `model`: the layers
    unrolled, with XLA's or the blockwise attention, with full remat."""
    cfg = small_config("train.global_batch_size=32", "train.micro_batch_size=2", f"model.loss_chunk={chunk}", *model)
    zero, state, _ = _zero(cfg, optax.sgd(0.1), mode)
    loss_fn = small_model(small_config("model.loss_chunk=0").model)[2]
    rows = _rows(32, cfg)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = zero(state, _batch(zero, rows, accum=2, micro=2))

    with jax.default_device(jax.devices()[0]):
        ref_loss, grads = jax.value_and_grad(loss_fn)(before, jnp.asarray(rows))
        ref = jax.tree.map(lambda p, g: p - 0.1 * g, before, grads)
    after = jax.tree.map(np.asarray, state.params)
    assert _rel(after, ref) < 1e-6
    # The update itself (after - before) is a much smaller number, so float32 reordering of the
    # sums (8 devices x 2 micro-steps vs one batch of 32) shows at ~1e-6 of it: bound it at 1e-5.
    assert _rel(jax.tree.map(np.subtract, after, before), jax.tree.map(np.subtract, ref, before)) < 1e-5
    assert metrics["loss"] == pytest.approx(float(ref_loss), rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_adamw_three_steps_match_single_device(mode):
    cfg = small_config("train.global_batch_size=16", "train.micro_batch_size=1", "train.steps=10",
                       "train.warmup_steps=2", "train.lr=1e-2")
    tx, _ = make_optimizer(cfg.train)
    zero, state, loss_fn = _zero(cfg, tx, mode)
    params = jax.device_put(jax.tree.map(np.asarray, state.params), jax.devices()[0])
    opt = tx.init(params)
    ref_step = jax.jit(lambda p, o, b: _adam_ref(loss_fn, tx, p, o, b))
    for i in range(3):
        rows = _rows(16, cfg, seed=i)
        state, _ = zero(state, _batch(zero, rows, accum=2, micro=1))
        params, opt = ref_step(params, opt, rows)
    # Adam divides by sqrt(v): where a gradient entry is ~0 its float32 reordering noise is amplified
    # to O(lr) in one update. Each step moves a parameter by at most ~lr = 1e-2; we allow 1% of one
    # step's movement on any parameter and 1e-4 relative over the whole tree.
    np.testing.assert_allclose(np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.params)]),
                               np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)]), rtol=0, atol=1e-4)
    assert _rel(state.params, params) < 1e-4


def _adam_ref(loss_fn, tx, params, opt, rows):
    grads = jax.grad(loss_fn)(params, rows)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_accumulation_equals_one_big_micro_batch(mode):
    """k micro-steps of m rows per device == 1 micro-step of k*m rows per device."""
    rows = _rows(64, small_config())
    results = []
    for accum, micro in [(4, 2), (1, 8)]:
        cfg = small_config("train.global_batch_size=64", f"train.micro_batch_size={micro}")
        zero, state, _ = _zero(cfg, optax.sgd(0.1), mode)
        state, metrics = zero(state, _batch(zero, rows, accum, micro))
        results.append((jax.tree.map(np.asarray, state.params), float(metrics["loss"])))
    (p_acc, l_acc), (p_one, l_one) = results
    assert _rel(p_acc, p_one) < 1e-6
    assert l_acc == pytest.approx(l_one, rel=1e-6)


@pytest.mark.parametrize("accum, chunk", [(1, 0), (4, 0), (8, 0), (4, 6)])  # chunk 6: the fused, chunked loss
@pytest.mark.parametrize("mode", MODES)
def test_exactly_one_gradient_reduction_per_step(mode, accum, chunk):
    cfg = small_config(f"train.global_batch_size={8 * accum}", "train.micro_batch_size=1", f"model.loss_chunk={chunk}")
    zero, state, loss_fn = _zero(cfg, optax.adamw(1e-3), mode)
    batch = _batch(zero, _rows(8 * accum, cfg), accum, 1)
    n_params = gpt_model.count_params(state.params)

    grad_ops = comms.read(hlo.compiled_text(zero.programs.grad, state.params, batch))
    assert not [c for c in grad_ops if c.in_loop], "a collective inside the accumulation loop"
    reductions = [c for c in grad_ops if c.op in ("all-reduce", "reduce-scatter") and c.elements > 1]
    if mode == "all_reduce":
        # One all-reduce carries every gradient (and the scalar loss, fused into the same op).
        assert [c.op for c in reductions] == ["all-reduce"]
        assert reductions[0].elements in (n_params, n_params + 1)
    else:
        # One reduce-scatter per parameter leaf: together, one reduction of the whole gradient.
        assert {c.op for c in reductions} == {"reduce-scatter"}
        padded = sum(np.prod(lay.view_shape) for lay in jax.tree.leaves(zero.table.layouts, is_leaf=is_layout))
        assert sum(c.elements for c in reductions) * zero.table.dp == padded
        assert len(reductions) == len(jax.tree.leaves(state.params))
    assert all(c.elements == 1 for c in grad_ops if c not in reductions)  # only the scalar loss mean

    assert comms.read(hlo.compiled_text(zero.programs.reshard, state.params)) == []
    grads, _ = zero.programs.grad(state.params, batch)
    grads = zero.programs.reshard(grads) if mode == "all_reduce" else grads
    update_ops = comms.read(hlo.compiled_text(zero.programs.update, grads, zero.programs.reshard(state.params),
                                                   state.opt_state, state.step, state.params))
    gathered = sum(c.elements for c in update_ops if c.op == "all-gather")
    assert gathered >= n_params * (zero.table.dp - 1) / zero.table.dp  # the new params, gathered back to every device


@pytest.mark.slow
def test_checker_sees_the_naive_per_micro_step_reduction():
    """Negative control: a single jit over the accumulation scan reduces inside the loop."""
    cfg = small_config("train.global_batch_size=32", "train.micro_batch_size=1")
    model, init_fn, loss_fn, _ = small_model(cfg.model)
    mesh = make_mesh(8)
    tx = optax.adamw(1e-3)
    params = init_fn(jax.random.key(0))
    step = naive_data_parallel_step(mesh, loss_fn, tx)
    zero = Zero(mesh, Objective(loss_fn, jax.eval_shape(init_fn, jax.random.key(0))), tx, zero_settings())
    ops = comms.read(hlo.compiled_text(step, params, tx.init(params), _batch(zero, _rows(32, cfg), 4, 1)))
    assert [c for c in ops if c.in_loop and c.op == "all-reduce"]


def test_indivisible_shapes_put_one_dpth_of_optimizer_state_on_each_device():
    # d_model 20, 3 layers, 13 positions, 5 heads: no leading dimension divides by 8.
    cfg = small_config("model.d_model=20", "model.n_head=5", "model.n_layer=3", "model.seq_len=13",
                       "model.vocab_size=100")
    _, init_fn, _, abstract = small_model(cfg.model)
    layouts = jax.tree.leaves(plan(abstract, 8), is_leaf=is_layout)
    assert any(lay.axis is None for lay in layouts), "the test needs leaves that must be blockified"
    assert any(lay.axis not in (None, 0) for lay in layouts), "the test needs leaves split on a later axis"

    tx = optax.adamw(1e-3)
    zero, state, _ = _zero(cfg, tx, "reduce_scatter")
    per_device = bytes_per_device(state.opt_state)
    replicated_total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(tx.init, abstract)))
    padding = 2 * 4 * sum(lay.padding for lay in layouts)  # mu and nu, float32
    assert len(per_device) == 8
    for nbytes in per_device.values():
        # count (a replicated int32 scalar) is the one non-sharded leaf.
        assert nbytes <= (replicated_total + padding) / 8 + 4
    assert max(per_device.values()) == min(per_device.values())


@pytest.mark.parametrize("dp", [8, 16, 64])
def test_125m_padding_under_one_percent(dp):
    cfg = load_config(REPO / "configs" / "125m.yaml", ["train.micro_batch_size=1"], device_count=dp)
    model = gpt_model.GPT(for_device(cfg.model))
    abstract = jax.eval_shape(functools.partial(gpt_model.init_params, model), jax.random.key(0))
    layouts = jax.tree.leaves(plan(abstract, dp), is_leaf=is_layout)
    total = sum(lay.size for lay in layouts)
    assert sum(lay.padding for lay in layouts) / total < 0.01


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (12, 768), (50304, 768), (13, 20), (2, 9, 8)])
def test_layout_round_trip(shape):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    lay = plan_layout(shape, 8)
    view = lay.to_view(jnp.asarray(x))
    assert view.shape == lay.view_shape and view.shape[lay.scatter_dim] % 8 == 0
    np.testing.assert_array_equal(lay.from_view(view), x)


def _mixed(cfg, tx, mode="reduce_scatter", accumulate_dtype=jnp.float32):
    model, init_fn, loss_fn, abstract = small_model(cfg.model)
    zero = Zero(make_mesh(8), Objective(loss_fn, abstract), tx,
                zero_settings(grad_reduce=mode, precision="mixed", accumulate_dtype=accumulate_dtype))
    return zero, zero.init(init_fn, jax.random.key(0)), loss_fn


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mixed_precision_keeps_master_weights_sharded_and_steps_them_like_fp32(mode):
    """ZeRO's stage-1 mixed precision: bfloat16 working params, float32 master weights in the dp-sharded
    optimizer state; three AdamW steps land where a float32 reference computed from the same bfloat16
    weights lands, to bfloat16's precision."""
    cfg = small_config("train.global_batch_size=16", "train.micro_batch_size=1", "train.steps=10",
                       "train.warmup_steps=2", "train.lr=1e-2")
    tx, _ = make_optimizer(cfg.train)
    zero, state, loss_fn = _mixed(cfg, tx, mode)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    master = state.opt_state.master
    assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
    n = gpt_model.count_params(state.params)
    per_device = bytes_per_device(master)
    assert max(per_device.values()) <= 4 * n / 8 * 1.05  # 1/dp of the float32 master weights each
    # The master weights start as the float32 init; the working params are them rounded to bfloat16.
    _, init_fn, _, _ = small_model(cfg.model)
    init = init_fn(jax.random.key(0))
    np.testing.assert_allclose(_flat(zero.table, master), _flat_params(init), rtol=1e-6)  # jit vs eager init

    params = jax.device_put(init, jax.devices()[0])
    opt = tx.init(params)
    ref_step = jax.jit(lambda p, o, b: _adam_ref(
        lambda q, r: loss_fn(jax.tree.map(lambda x: x.astype(jnp.bfloat16), q), r), tx, p, o, b))
    for i in range(3):
        rows = _rows(16, cfg, seed=i)
        state, metrics = zero(state, _batch(zero, rows, accum=2, micro=1))
        params, opt = ref_step(params, opt, rows)
        assert np.isfinite(float(metrics["loss"]))
    got = _flat(zero.table, state.opt_state.master)
    want = _flat_params(params)
    # One step moves a parameter by at most ~lr = 1e-2; bfloat16 gradients (8 bits of mantissa) put
    # ~1% noise on each step's direction, amplified by Adam where a gradient is ~0.
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-3)
    moved = np.linalg.norm(want - _flat_params(init))
    assert np.linalg.norm(got - want) < 0.05 * moved
    np.testing.assert_array_equal(_flat_params(state.params), got.astype(jnp.bfloat16).astype(np.float32))


def _flat_params(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])


def _flat(table, views):
    from zerolm.parallel.sharding import from_views
    return _flat_params(from_views(table.layouts, jax.tree.map(np.asarray, views)))


def test_mixed_precision_reduces_and_gathers_in_bfloat16_once_per_step():
    """Half the bytes of fp32 for the reduce-scatter and the all-gather; still one reduction, after the loop.

    Read in the program as JAX hands it to the compiler: XLA's CPU backend widens bfloat16 collectives
    to float32 when it compiles them (TPU keeps them: tests/test_compile.py)."""
    cfg = small_config("train.global_batch_size=32", "train.micro_batch_size=1")
    zero, state, _ = _mixed(cfg, optax.adamw(1e-3))
    batch = _batch(zero, _rows(32, cfg), 4, 1)
    assert not [c for c in comms.read(hlo.compiled_text(zero.programs.grad, state.params, batch)) if c.in_loop]
    grad_ops = comms.read(zero.programs.grad.lower(state.params, batch).as_text(dialect="hlo"))
    reductions = [c for c in grad_ops if c.elements > 1]
    assert {c.op for c in reductions} == {"reduce-scatter"}
    assert len(reductions) == len(jax.tree.leaves(state.params))
    assert all(c.result_type.startswith("bf16") for c in reductions)
    padded = sum(np.prod(lay.view_shape) for lay in jax.tree.leaves(zero.table.layouts, is_leaf=is_layout))
    assert sum(c.bytes for c in reductions) * zero.table.dp == 2 * padded
    # The update's all-gather is the partitioner's (not in the program before compiling): its dtype
    # is checked on the TPU compiler.
    assert "reshard" not in zero.program_inputs(1, cfg.model.seq_len, 4)  # the master weights replace the params' view


@pytest.mark.slow
def test_bfloat16_accumulation_is_one_rounding_per_micro_step():
    """zero.accumulate_dtype=bfloat16: the same step, its gradient summed in bfloat16 (a looser match)."""
    cfg = small_config("train.global_batch_size=64", "train.micro_batch_size=1")
    rows = _rows(64, cfg)
    results = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        zero, state, _ = _mixed(cfg, optax.sgd(0.1), accumulate_dtype=dtype)
        grads, metrics = zero.programs.grad(state.params, _batch(zero, rows, 8, 1))
        results[dtype] = _flat(zero.table, grads)
    f32, bf16 = results[jnp.float32], results[jnp.bfloat16]
    assert 0 < np.linalg.norm(bf16 - f32) / np.linalg.norm(f32) < 2e-2


@pytest.mark.parametrize("precision", ["fp32"])  # mixed: on the TPU compiler (tests/test_compile.py)
def test_ring_reduce_scatter_is_the_same_sum_in_neighbour_exchanges(precision):
    """zero.scatter=ring (TPU v2/v3's reduce-scatter): the gradient of psum_scatter, as dp − 1 collective-
    permutes per leaf that together send a reduce-scatter's bytes, none in a loop."""
    cfg = small_config("train.global_batch_size=32", "train.micro_batch_size=1")
    model, init_fn, loss_fn, abstract = small_model(cfg.model)
    grads = {}
    for scatter in ("collective", "ring"):
        zero = Zero(make_mesh(8), Objective(loss_fn, abstract), optax.sgd(0.1), zero_settings(precision=precision, scatter=scatter))
        state = zero.init(init_fn, jax.random.key(0))
        batch = _batch(zero, _rows(32, cfg), 4, 1)
        grads[scatter] = _flat(zero.table, zero.programs.grad(state.params, batch)[0])
    assert zero.scatter == "ring"
    tol = 1e-6 if precision == "fp32" else 1e-2
    np.testing.assert_allclose(grads["ring"], grads["collective"], rtol=tol, atol=tol * np.abs(grads["collective"]).max())
    ops = comms.read(hlo.compiled_text(zero.programs.grad, state.params, batch))
    assert not [c for c in ops if c.in_loop]
    permutes = [c for c in ops if c.op == "collective-permute"]
    assert not [c for c in ops if c.elements > 1 and c not in permutes]  # no reduce-scatter, no all-reduce
    assert len(permutes) == (zero.table.dp - 1) * len(jax.tree.leaves(state.params))
    assert {comms.axis_of(c, dict(zero.mesh.shape)) for c in permutes} == {("dp",)}
    padded = sum(np.prod(lay.view_shape) for lay in jax.tree.leaves(zero.table.layouts, is_leaf=is_layout))
    assert sum(c.elements for c in permutes) * zero.table.dp == padded * (zero.table.dp - 1)


@pytest.mark.parametrize("inner", [1, 2, 4, 8])
@pytest.mark.parametrize("shape, axis", [((16, 24), 0), ((16, 24), 1), ((3, 24, 16), 1), ((24, 3, 10), 0)],
                         ids=["rows", "columns", "3-axes-rows-cut", "3-axes-2d"])
def test_two_stage_reduce_scatter_is_psum_scatter(inner, shape, axis):
    """Each device ends with its own block of the sum, in dp order, for every factorization of dp = 8; the
    3-axis float32 arrays have blocks of 3 rows, not whole TPU tiles (8), so they take the 2-D form (rows
    cut in 8; rows of 30 that 8 does not cut)."""
    mesh = make_mesh(8)
    x = jnp.asarray(np.random.default_rng(inner).normal(size=(8, *shape)).astype(np.float32))
    on = jax.sharding.NamedSharding(mesh, P("dp"))

    def run(fn):
        return np.asarray(jax.jit(jax.shard_map(lambda v: fn(v[0], axis)[None], mesh=mesh, in_specs=P("dp"),
                                                out_specs=P("dp")))(jax.device_put(x, on)))

    want = run(lambda v, a: lax.psum_scatter(v, "dp", scatter_dimension=a, tiled=True))
    got = run(functools.partial(two_stage_reduce_scatter, dp=8, inner=inner))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.roll(got, 1, axis=0), want)  # the blocks land on their own devices


def test_two_stage_reduce_scatter_in_the_step():
    """zero.scatter=two_stage (the TPU's reduce-scatter, zerolm.parallel.auto.scatter): the same gradient as
    one psum_scatter, as two reduce-scatters per leaf over dp sub-groups (stride 4 pairs, then the 4
    consecutive positions: inner 4 on one host of dp 8), a reduce-scatter's bytes in all, none in a loop."""
    cfg = small_config("train.global_batch_size=32", "train.micro_batch_size=1")
    model, init_fn, loss_fn, abstract = small_model(cfg.model)
    grads = {}
    for scatter in ("collective", "two_stage"):
        zero = Zero(make_mesh(8), Objective(loss_fn, abstract), optax.sgd(0.1), zero_settings(scatter=scatter))
        state = zero.init(init_fn, jax.random.key(0))
        batch = _batch(zero, _rows(32, cfg), 4, 1)
        grads[scatter] = _flat(zero.table, zero.programs.grad(state.params, batch)[0])
    assert (zero.scatter, zero.scatter_inner) == ("two_stage", 4)
    assert auto.scatter("auto", zero.mesh) == "collective"  # on CPU (and GPU): the one-stage collective
    np.testing.assert_allclose(grads["two_stage"], grads["collective"], rtol=1e-6,
                               atol=1e-6 * np.abs(grads["collective"]).max())
    ops = comms.read(hlo.compiled_text(zero.programs.grad, state.params, batch))
    assert not [c for c in ops if c.in_loop]
    mesh_shape = dict(zero.mesh.shape)
    stages = {label: [c for c in ops if c.op == "reduce-scatter" and comms.axes_label(c, mesh_shape) == (label,)]
              for label in ("dp(2/8)", "dp(4/8)")}
    leaves = len(jax.tree.leaves(state.params))
    assert [len(s) for s in stages.values()] == [leaves, leaves]
    assert not [c for c in ops if c.elements > 1 and c.op != "reduce-scatter"]  # no all-reduce of the gradient
    padded = sum(np.prod(lay.view_shape) for lay in jax.tree.leaves(zero.table.layouts, is_leaf=is_layout))
    assert sum(c.elements for c in stages["dp(2/8)"]) == padded // 2
    assert sum(c.elements for c in stages["dp(4/8)"]) == padded // 8
    predicted = plan_predicted(zero)
    assert [(p["axes"], p["span"], p["bytes"]) for p in predicted if p["op"] == "reduce-scatter"] == [
        (["dp"], ["dp(2/8)"], padded // 2 * 4), (["dp"], ["dp(4/8)"], padded // 8 * 4)]


def plan_predicted(zero):
    from zerolm.plan import CountedStep, predicted_collectives
    counted = CountedStep("reduce_scatter", 4, scatter=zero.scatter, inner=zero.scatter_inner)
    return [p.to_json() for p in predicted_collectives(zero.table, counted)]
