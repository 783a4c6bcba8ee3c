"""Weight averaging: the moving average training keeps (`train.ema`, zerolm.parallel.optim.with_ema) through the
real sharded step (dp 8 at ZeRO stages 1 and 3, dp 4 × tp 2, scan and unrolled layers, mixed precision) against one
device and against the debiased recurrence in numpy; its bytes per device split over dp; and (the slow tier) its
exact resume after kill -9, and a resume that would drop it refused."""

import functools

import jax
import numpy as np
import pytest

from conftest import requires_devices, small_config, small_step
from helpers import to_accum_layout
from zerolm.parallel.optim import MasterWeights, ema_of
from zerolm.parallel.sharding import from_views

pytestmark = requires_devices(8)

DECAY = 0.6  # small, so that three steps move the average well away from each step's parameters
STEPS = 3


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(jax.device_get(tree))])


@functools.cache
def ema_run(stage: int, *sets: str, dp: int = 8, tp: int = 1):
    """STEPS AdamW steps (at an lr that moves the weights well apart) with train.ema: (the float32 weights after
    each step, the EMA after the last, the EMA as working parameters (Zero.ema_params)), each flattened to one
    numpy vector."""
    cfg, _, zero, init_fn = small_step(f"zero.stage={stage}", f"train.ema={DECAY}", "train.global_batch_size=16",
                                       "train.micro_batch_size=2", "train.lr=1e-2", "train.warmup_steps=0", *sets,
                                       dp=dp, tp=tp)
    state = zero.init(init_fn, jax.random.key(0))
    rng = np.random.default_rng(0)
    A, M, T1 = cfg.accum_steps, cfg.train.micro_batch_size, cfg.model.seq_len + 1
    weights = []
    for _ in range(STEPS):
        rows = rng.integers(0, cfg.model.vocab_size, (dp * A * M, T1)).astype(np.int32)
        state, _ = zero.step(state, jax.device_put(to_accum_layout(rows, dp, A, M), zero.table.batch_sharding))
        master = state.opt_state.master if isinstance(state.opt_state, MasterWeights) else None
        weights.append(_flat(state.params if master is None else from_views(zero.table.layouts, master)))
    ema = _flat(from_views(zero.table.layouts, ema_of(state.opt_state)))
    return weights, ema, _flat(zero.ema_params(state))


def debiased(weights: list[np.ndarray], decay: float) -> np.ndarray:
    """The mean of the weights after each step, weighted by decay^(t - i) and normalised (what with_ema keeps)."""
    t = len(weights)
    w = np.array([decay ** (t - 1 - i) for i in range(t)])
    return np.tensordot(w / w.sum(), np.stack(weights).astype(np.float64), axes=1)


@pytest.mark.parametrize("stage, sets, dp, tp", [
    (1, ("model.attention=xla", "model.scan_layers=true"), 8, 1),
    (3, ("model.attention=blockwise", "model.attention_block=8", "model.scan_layers=false"), 8, 1),
    (3, ("model.attention=xla", "model.scan_layers=true"), 4, 2),
], ids=["stage1-dp8-xla-scan", "stage3-dp8-blockwise-unrolled", "stage3-dp4-tp2-xla-scan"])
def test_the_ema_through_the_sharded_step_is_one_devices(stage, sets, dp, tp):
    """The EMA after three steps on the mesh equals one device's, and both equal the debiased recurrence over
    the weights each step left (so it is neither the last weights nor a plain mean of them)."""
    weights, ema, as_params = ema_run(stage, *sets, dp=dp, tp=tp)
    one_weights, one_ema, _ = ema_run(1, *sets, dp=1)
    moved = np.max(np.abs(one_ema))
    np.testing.assert_allclose(ema, one_ema, rtol=2e-5, atol=2e-5 * moved)
    np.testing.assert_allclose(ema, debiased(weights, DECAY), rtol=1e-5, atol=1e-6 * moved)
    np.testing.assert_array_equal(as_params, ema)  # fp32: the working parameters' dtype, gathered
    assert np.max(np.abs(ema - weights[-1])) > 1e-3 and np.max(np.abs(ema - np.mean(weights, axis=0))) > 1e-3


def test_in_mixed_precision_the_ema_follows_the_float32_master_weights():
    """zero.precision=mixed: the average is of the float32 master weights (not of the bfloat16 working copies),
    and ema_params gives it in the working dtype."""
    weights, ema, as_params = ema_run(1, "zero.precision=mixed")
    np.testing.assert_allclose(ema, debiased(weights, DECAY), rtol=1e-5, atol=1e-6 * np.max(np.abs(ema)))
    bf16 = jax.numpy.bfloat16
    np.testing.assert_array_equal(as_params, ema.astype(bf16).astype(np.float32))
    assert not np.array_equal(ema, ema.astype(bf16).astype(np.float32))


def test_without_train_ema_the_optimizer_keeps_none():
    _, _, zero, init_fn = small_step()
    state = zero.init(init_fn, jax.random.key(0))
    assert ema_of(state.opt_state) is None and zero.ema_params(state) is None


def test_the_ema_bytes_per_device_divide_by_dp():
    """train.ema adds one float32 copy of the parameters to the optimizer state, split over dp like Adam's moments:
    the optimizer bytes `zerolm plan --config` counts and the optimizer state `zerolm compile` counts live beside
    the step (live_outside) grow by 4·N/dp per device, and its counter's 4 bytes (this model's leaves all divide by
    dp: no padding)."""
    from zerolm.parallel.build import live_outside
    from zerolm.plan.build import from_config
    from zerolm.plan.spec import PRECISIONS

    for dp in (8, 4, 1):
        grows = []
        for stage in (1, 3):
            on, off = (small_config(f"zero.stage={stage}", *ema) for ema in (["train.ema=0.999"], []))
            model, on_states = from_config(on, dp, 1)
            _, off_states = from_config(off, dp, 1)
            n = model.params
            planned = (on_states(dp, 1)(stage, PRECISIONS["fp32"]).optimizer
                       - off_states(dp, 1)(stage, PRECISIONS["fp32"]).optimizer)
            compiled = [live_outside(small_step(f"zero.stage={stage}", *ema, dp=dp)[2], 2, 16, 1)["grad"]
                        for ema in (["train.ema=0.999"], [])]
            assert planned == compiled[0] - compiled[1]
            grows.append(planned)
        assert grows == [4 * n // dp + 4] * 2, dp


# The slow tier: runs in subprocesses (tests/runs.py's SMALL: 16 steps, a checkpoint every 4).

EMA = ("zero.precision=mixed", "train.ema=0.9", "checkpoint.keep=5", "train.eval_every=8")


@pytest.fixture(scope="module")
def ema_trained(tmp_path_factory):
    """A mixed-precision run with train.ema 0.9, evaluated at steps 8 and 16; checkpoints 4, 8, 12 and 16 kept."""
    import runs

    run_dir = tmp_path_factory.mktemp("ema")
    runs.train(run_dir, *EMA)
    return run_dir


def validation(run_dir) -> dict[int, dict]:
    import json

    records = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "val_loss" in r}


def float32_parts(ckpt_dir, step: int) -> dict[str, np.ndarray]:
    """A checkpoint restored whole onto the 8 devices as a resume restores it: its params and, where it has them,
    its float32 master weights and its EMA, each flattened (read without zerolm.checkpoint.average)."""
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.config.tree import Config
    from zerolm.parallel.build import build_step
    from zerolm.parallel.mesh import make_mesh

    ckpts = Checkpoints(ckpt_dir, read_only=True)
    meta = ckpts.meta(step)
    cfg = Config.model_validate(meta.full_config).resolve(mesh__dp=8, mesh__tp=1)
    _, zero, _ = build_step(cfg, make_mesh(8))
    state, _ = ckpts.restore(step, zero, cfg.model.model_dump(), cfg.train.ema)
    parts = {"params": _flat(state.params)}
    if isinstance(state.opt_state, MasterWeights):
        parts["master"] = _flat(from_views(zero.table.layouts, state.opt_state.master))
    if (ema := ema_of(state.opt_state)) is not None:
        parts["ema"] = _flat(from_views(zero.table.layouts, ema))
    return parts


@pytest.mark.slow
def test_kill_9_then_resume_with_an_ema_is_bit_identical(ema_trained, tmp_path):
    """The EMA lives in the optimizer state, so a checkpoint saves it: a run killed (-9) and resumed logs the same
    losses and the same validation losses of its parameters and of their EMA, and ends with the same EMA, bit for
    bit, as the run that was never stopped."""
    from runs import kill_9_after, losses, train

    kill_9_after(tmp_path, *EMA, before_step=int(np.random.default_rng().integers(6, 15)))
    train(tmp_path, *EMA)
    assert losses(tmp_path) == losses(ema_trained)
    keys = ("val_loss", "val_loss_ema", "val_perplexity_ema")
    assert {s: [r[k] for k in keys] for s, r in validation(tmp_path).items()} == \
        {s: [r[k] for k in keys] for s, r in validation(ema_trained).items()}
    resumed, straight = float32_parts(tmp_path / "ckpt", 16), float32_parts(ema_trained / "ckpt", 16)
    assert set(straight) == {"params", "master", "ema"}
    for part in straight:
        np.testing.assert_array_equal(resumed[part], straight[part])


@pytest.mark.slow
def test_a_resume_that_would_drop_the_ema_is_refused_in_one_line(ema_trained):
    """A run with train.ema, resumed without it, stops before compiling, naming the setting that keeps it; its
    checkpoints stay as they were (not taken for damaged and moved aside)."""
    from runs import snapshot, train

    before = snapshot(ema_trained / "ckpt")
    proc = train(ema_trained, *EMA, "train.ema=null", steps=20, expect=2)
    assert proc.stderr.strip().splitlines() == [
        f"error: {ema_trained / 'ckpt' / '16'}: the checkpoint was trained with train.ema=0.9, the config says null; "
        "resume with --set train.ema=0.9 (the moving average lives in the optimizer state and goes on with the decay "
        "it began with: zerolm does not start, stop or change one mid-run)"]
    assert snapshot(ema_trained / "ckpt") == before


def test_another_ema_decay_is_refused_as_a_resume_without_one():
    from zerolm.checkpoint.meta import CheckpointMeta
    from zerolm.checkpoint.store import CheckpointError, check_compatible

    cfg = small_config("train.ema=0.9")
    meta = CheckpointMeta(step=4, time=0, config=cfg.model_dump(), dp=8, accum_steps=1, dataset={}, tokens_seen=0,
                          loss=None, wandb_id="x")
    check_compatible(meta, "ckpt/4", cfg.model.model_dump(), "fp32", 0.9)
    for other, says in ((0.99, "the config says 0.99"), (None, "the config says null")):
        with pytest.raises(CheckpointError, match=f"ckpt/4: the checkpoint was trained with train.ema=0.9, {says}; "
                                                  "resume with --set train.ema=0.9 "):
            check_compatible(meta, "ckpt/4", cfg.model.model_dump(), "fp32", other)
