"""ZeRO-2 and ZeRO-3 (`zero.stage`): through the real sharded step (zerolm.parallel.build.build_step), each stage steps
like stage 1 and like one device, for each attention and layer loop that runs on CPU, with tp beside dp and
in mixed precision; and each stage's compiled step has the collectives the design says, where it says.
(Checkpoints across stages: test_checkpoint.py; two processes at stage 3: test_launch.py.)"""

import jax
import numpy as np
import pytest

from conftest import requires_devices, small_config, small_step
from helpers import to_accum_layout
from zerolm.compile import collectives as comms

pytestmark = requires_devices(8)

STEPS = 3
MICRO = ("train.micro_batch_size=2",)  # 16 sequences per step: 2 accumulation steps on dp 4 and 8


def run(stage: int, *sets: str, dp: int = 8, tp: int = 1, slices: int = 1):
    """STEPS AdamW steps of the same data from the same init: (losses, parameters as numpy, the last state)."""
    cfg, _, zero, init_fn = small_step(f"zero.stage={stage}", "train.global_batch_size=16", *MICRO, *sets, dp=dp, tp=tp,
                                       slices=slices)
    state = zero.init(init_fn, jax.random.key(0))
    rng = np.random.default_rng(0)
    A, M, T1 = cfg.accum_steps, cfg.train.micro_batch_size, cfg.model.seq_len + 1
    ranks = slices * dp
    got = []
    for _ in range(STEPS):
        rows = rng.integers(0, cfg.model.vocab_size, (ranks * A * M, T1)).astype(np.int32)
        batch = jax.device_put(to_accum_layout(rows, ranks, A, M), zero.table.batch_sharding)
        state, metrics = zero.step(state, batch)
        got.append(float(metrics["loss"]))
    return got, [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.device_get(state.params))], state


def assert_same(a, b, rtol):
    (la, pa, _), (lb, pb, _) = a, b
    np.testing.assert_allclose(la, lb, rtol=rtol)
    moved = max(np.max(np.abs(x)) for x in pa)
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_allclose(x, y, atol=rtol * moved, rtol=rtol)


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
@pytest.mark.parametrize("sets", [("model.attention=xla", "model.scan_layers=true"),
                                  ("model.attention=blockwise", "model.attention_block=8", "model.scan_layers=false"),
                                  # d_model 36: leaves no dp-8 axis divides (blockified): reduced after each
                                  # micro-step's backward pass, and stored whole over dp at stage 3
                                  ("model.d_model=36", "model.n_head=4", "model.remat=full")],
                         ids=["xla-scan", "blockwise-unrolled", "indivisible-remat-full"])
def test_stages_2_and_3_step_like_stage_1_and_one_device(sets):
    """Three AdamW steps of 2 accumulation steps on dp 8: stages 2 and 3 give stage 1's losses and parameters
    (only the float32 summation order differs), and so does one device."""
    one = run(1, *sets)
    for stage in (2, 3):
        assert_same(run(stage, *sets), one, rtol=1e-5)
    if sets[0] == "model.attention=xla":
        assert_same(run(1, *sets, dp=1), one, rtol=2e-5)


def test_stage_3_stores_each_device_its_block_of_the_parameters():
    """Stage 3's parameters live in the optimizer-state layout: each device holds 1/dp of every leaf the
    layout splits (all of this model's on dp 8), none whole."""
    *_, state = run(3)
    for leaf in jax.tree.leaves(state.params):
        assert leaf.sharding.shard_shape(leaf.shape) != leaf.shape
        assert sum(s.data.size for s in leaf.addressable_shards) == leaf.size


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_stages_with_tensor_parallelism_step_like_stage_1(precision):
    """(dp 4, tp 2): the tp collectives inside the loop, the dp reductions (and stage 3's gathers) beside them;
    in mixed precision (bfloat16 reductions and gathers) to bfloat16's resolution."""
    sets = (f"zero.precision={precision}",)
    one = run(1, *sets, dp=4, tp=2)
    for stage in (2, 3):
        assert_same(run(stage, *sets, dp=4, tp=2), one, rtol=1e-5 if precision == "fp32" else 2e-2)


def test_mixed_precision_stage_3_steps_like_stage_1():
    one = run(1, "zero.precision=mixed")
    assert_same(run(3, "zero.precision=mixed"), one, rtol=2e-2)


def collectives(stage: int) -> dict[tuple[str, str, bool], int]:
    """(program, op, in a loop) -> bytes per step over dp, of the compiled step; and the report."""
    report = comms.report(small_config(f"zero.stage={stage}", *MICRO), jax.devices()[:8])
    found: dict[tuple[str, str, bool], int] = {}
    for c in report.collectives:
        if "dp" in c.axes and c.bytes > 4 and (c.program, c.op) != ("update", "all-reduce"):  # not the norms
            key = (c.program, c.op, c.in_loop)
            found[key] = found.get(key, 0) + (c.bytes_per_run or 0)
    for p in report.predicted:  # the planner's count of each stage's collectives, against the compiler's
        assert p.found_bytes is not None, p
        if p.within:
            assert (1 - p.within) * p.bytes_per_step <= p.found_bytes_per_step <= p.bytes_per_step, p
        else:
            assert (p.found_bytes, p.found_bytes_per_step) == (p.bytes, p.bytes_per_step), p
    return found


def test_each_stages_collectives_sit_where_the_design_says():
    """Stage 1: one reduce-scatter of the gradient, after the loop; the update's all-gather. Stage 2: the
    layers' reduce-scatters inside the loop (every micro-step), the other leaves' (embeddings, last LayerNorm)
    after it, the update's all-gather. Stage 3: also the layers' all-gathers inside the loop and the other
    leaves' before it; no all-gather in the update. Every one as `zerolm plan` counts it."""
    one, two, three = (collectives(stage) for stage in (1, 2, 3))
    rs = lambda loop: ("grad", "reduce-scatter", loop)  # noqa: E731
    assert set(one) == {rs(False), ("update", "all-gather", False)}
    assert set(two) == {rs(True), rs(False), ("update", "all-gather", False)}
    assert two[rs(True)] // 2 + two[rs(False)] == one[rs(False)]  # the same blocks; the layers' every micro-step
    assert two[("update", "all-gather", False)] == one[("update", "all-gather", False)]
    assert set(three) == {("grad", "all-gather", True), ("grad", "all-gather", False), rs(True), rs(False)}
    assert (three[rs(True)], three[rs(False)]) == (two[rs(True)], two[rs(False)])


def test_two_slices_step_like_one_slice_of_the_same_batch():
    """(slice 2, dp 4) — Multislice's mesh on 8 devices, the slices given as halves of them: stages 1 and 3 take
    the same steps as dp 8 on the same global batch (the reduce-scatter inside a slice, then the blocks averaged
    across the slices: only the float32 summation order differs)."""
    flat = run(1)
    for stage in (1, 3):
        assert_same(run(stage, dp=4, slices=2), flat, rtol=1e-5)


@pytest.mark.slow  # a sweep of the sharded step over layouts
@pytest.mark.parametrize("precision, stages", [("fp32", (1, 2)), ("mixed", (3,))])
def test_two_slices_with_tensor_parallelism_step_like_one_slice(precision, stages):
    """(slice 2, dp 2, tp 2) against (dp 4, tp 2), at every stage (float32 at 1 and 2, mixed precision at 3, whose
    float32 master weights are the most sharded); with dropout too (its masks follow each sample's row in the
    global batch, whichever slice reads it)."""
    sets = (f"zero.precision={precision}", "model.residual_dropout=0.1")
    flat = run(1, *sets, dp=4, tp=2)
    for stage in stages:
        assert_same(run(stage, *sets, dp=2, tp=2, slices=2), flat, rtol=1e-5 if precision == "fp32" else 2e-2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_across_slices_each_device_all_reduces_its_block_once_per_step(stage):
    """What crosses slices: one all-reduce of each device's block of the gradient (1/dp of it), after the loop, at
    every stage (not per micro-step, not the whole gradient); every other collective stays inside a slice (over dp),
    but the loss's 4 bytes. As `zerolm plan` counts them."""
    report = comms.report(small_config(f"zero.stage={stage}", "mesh.slices=2", *MICRO), jax.devices()[:8])
    across = [c for c in report.collectives if "slice" in c.axes]
    block = [c for c in across if c.bytes > 4]
    assert [(c.program, c.op, c.in_loop, c.axes) for c in block] == [("grad", "all-reduce", False, ("slice",))]
    gradient = sum(4 * x.size for x in jax.tree.leaves(report_params(stage)))
    assert block[0].bytes_per_run == pytest.approx(gradient / 4, rel=0.01)  # 1/dp, padding aside
    assert all(c.bytes <= 4 for c in across if c not in block)
    assert all(set(c.axes) <= {"dp"} for c in report.collectives if "slice" not in c.axes and c.bytes > 4)
    for p in report.predicted:
        assert (p.found_bytes, p.found_bytes_per_step) == (p.bytes, p.bytes_per_step) or p.within, p


def report_params(stage):
    cfg, _, zero, _ = small_step(f"zero.stage={stage}", *MICRO, dp=4, slices=2)
    return zero.abstract_params
