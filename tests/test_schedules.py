"""The lr schedules (`train.schedule: cosine | wsd | constant`): each step's lr through the real sharded step
(zerolm.parallel.build.build_step) against the schedule written out here, and the parameters against one device
stepping AdamW with that written-out lr; the combinations refused at load. (Decay branches, which start a wsd
decay from another run's checkpoint: test_branch.py.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY, requires_devices, small_config, small_model, small_step
from helpers import to_accum_layout
from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.parallel.optim import decay_mask

STEPS, WARMUP, LR, MIN = 8, 2, 1e-2, 0.1


def written_out(schedule: str, decay: int = 0, shape: str = "linear", length: int = STEPS) -> list[float]:
    """The lr of steps 1..STEPS (step s: s - 1 updates before it), from the schedules' definitions."""
    lrs = []
    for t in range(STEPS):
        if t < WARMUP:
            lrs.append(LR * t / WARMUP)
        elif schedule == "constant":
            lrs.append(LR)
        elif schedule == "cosine":
            lrs.append(LR * (MIN + (1 - MIN) * 0.5 * (1 + math.cos(math.pi * (t - WARMUP) / (length - WARMUP)))))
        else:
            done = min(max((t - (length - decay)) / decay, 0.0), 1.0)
            lrs.append(LR * (MIN + (1 - MIN) * (1 - (math.sqrt(done) if shape == "sqrt" else done))))
    return lrs


def sets(schedule: str, decay: int = 0, shape: str = "linear") -> tuple[str, ...]:
    return (f"train.schedule={schedule}", f"train.decay_shape={shape}", f"train.steps={STEPS}",
            f"train.warmup_steps={WARMUP}", f"train.lr={LR}", f"train.min_lr_ratio={MIN}",
            f"train.decay_steps={decay or 'null'}", "train.global_batch_size=16", "train.micro_batch_size=2")


def batches(cfg):
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        yield rng.integers(0, cfg.model.vocab_size, (16, cfg.model.seq_len + 1)).astype(np.int32)


def sharded_run(settings: tuple[str, ...], dp: int, tp: int):
    """STEPS steps of the step training builds: (the lr each step logged, the parameters, the initial ones)."""
    cfg, _, zero, init_fn = small_step(*settings, dp=dp, tp=tp)
    state = zero.init(init_fn, jax.random.key(0))
    initial = jax.device_get(state.params)
    lrs = []
    for rows in batches(cfg):
        A, M = cfg.accum_steps, cfg.train.micro_batch_size
        state, metrics = zero.step(state, jax.device_put(to_accum_layout(rows, dp, A, M), zero.table.batch_sharding))
        lrs.append(float(metrics["lr"]))
    return cfg, lrs, jax.device_get(state.params), initial


def one_device_run(cfg, initial, lrs: list[float]):
    """The same steps on one device: AdamW (clipped, its decay mask) at the lrs given, looked up by count."""
    table = jnp.asarray(lrs, jnp.float32)
    t = cfg.train
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(lambda count: table[count], b1=t.beta1, b2=t.beta2, eps=t.eps,
                                 weight_decay=t.weight_decay, mask=decay_mask))
    loss_fn = small_model(small_config("model.scan_layers=true", "model.attention=xla").model)[2]
    with jax.default_device(jax.devices()[0]):
        params = jax.tree.map(jnp.asarray, initial)
        opt = tx.init(params)
        step = jax.jit(lambda p, o, rows: _adamw_step(loss_fn, tx, p, o, rows))
        for rows in batches(cfg):
            params, opt = step(params, opt, rows)
    return jax.device_get(params)


def _adamw_step(loss_fn, tx, params, opt, rows):
    updates, opt = tx.update(jax.grad(loss_fn)(params, rows), opt, params)
    return optax.apply_updates(params, updates), opt


LAYOUTS = [  # (dp, tp, settings): ZeRO stages 1 and 3, dp 8 and dp 4 x tp 2, each attention and layer loop on CPU
    (8, 1, ("zero.stage=1", "model.attention=xla", "model.scan_layers=true")),
    (4, 2, ("zero.stage=3", "model.attention=blockwise", "model.attention_block=8", "model.scan_layers=false")),
]


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
@requires_devices(8)
@pytest.mark.parametrize("schedule, decay, shape, layout", [
    pytest.param("wsd", 3, "linear", 0, id="wsd-linear-dp8-stage1-xla-scan"),
    pytest.param("wsd", 3, "linear", 1, id="wsd-linear-dp4xtp2-stage3-blockwise-unrolled"),
    pytest.param("wsd", 3, "sqrt", 0, id="wsd-sqrt-dp8-stage1-xla-scan"),
    pytest.param("constant", 0, "", 1, id="constant-dp4xtp2-stage3-blockwise-unrolled"),
    pytest.param("cosine", 0, "", 1, id="cosine-dp4xtp2-stage3-blockwise-unrolled")])
def test_each_schedule_steps_the_sharded_step_at_its_written_out_lr(schedule, decay, shape, layout):
    """Warmup 2, 8 steps: wsd's last 3 decay (linear or 1 - sqrt) to lr * 0.1; constant stays at lr; cosine as
    before. The lr each step logs is the written-out one, and the parameters are one device's stepped at it."""
    dp, tp, layout_sets = LAYOUTS[layout]
    cfg, lrs, params, initial = sharded_run((*sets(schedule, decay, shape or "linear"), *layout_sets), dp, tp)
    expected = written_out(schedule, decay, shape)
    assert lrs == pytest.approx(expected, rel=1e-6, abs=1e-12)
    reference = one_device_run(cfg, initial, expected)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)  # AdamW: ~lr per step at most; float32 sums


def test_wsd_holds_lr_until_its_decay_then_ends_at_the_minimum():
    """The shape on its own, past the run's steps: the stable part is lr itself (as constant's), the decay
    reaches lr * min_lr_ratio at the schedule's length and stays there."""
    from zerolm.parallel.optim import lr_schedule

    train = load_config(TINY, ["train.schedule=wsd", "train.decay_steps=4", "train.steps=10", "train.warmup_steps=2",
                               "train.min_lr_ratio=0"]).train
    constant = load_config(TINY, ["train.schedule=constant", "train.steps=10", "train.warmup_steps=2"]).train
    wsd, flat = lr_schedule(train), lr_schedule(constant)
    assert [wsd(t) for t in range(2, 7)] == [flat(t) for t in range(2, 7)] == [np.float32(train.lr)] * 5
    assert [float(wsd(t)) for t in (7, 8, 9, 10, 11)] == pytest.approx([0.75 * train.lr, 0.5 * train.lr,
                                                                       0.25 * train.lr, 0.0, 0.0])


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, list(overrides), device_count=8)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_impossible_schedules_are_refused_at_load_naming_the_keys():
    assert _error(["train.schedule=wsd"]) == (
        f"{TINY} (--set train.schedule): train.decay_steps: null, and train.schedule is wsd, which decays over the "
        "schedule's last train.decay_steps steps; set it (20% of the schedule is usual)")
    assert _error(["train.decay_steps=60"]) == (
        f"{TINY} (--set train.decay_steps): train.decay_steps: 60 is set and train.schedule is cosine, which has no "
        "decay of a set length; set train.schedule=wsd, or train.decay_steps=null")
    assert _error(["train.schedule=constant", "train.decay_steps=60"]).startswith(
        f"{TINY} (--set train.decay_steps): train.decay_steps: 60 is set and train.schedule is constant")
    # the tiny config: 300 steps, a warmup of 20
    assert _error(["train.schedule=wsd", "train.decay_steps=290"]) == (
        f"{TINY} (--set train.decay_steps): train.decay_steps: 290 after train.warmup_steps 20 is longer than the lr "
        "schedule (train.steps 300): wsd's decay ends the schedule and starts after its warmup")
    assert _error(["train.schedule=wsd", "train.decay_steps=100", "train.schedule_steps=100"]).endswith(
        "train.decay_steps: 100 after train.warmup_steps 20 is longer than the lr schedule (train.schedule_steps "
        "100): wsd's decay ends the schedule and starts after its warmup")
    assert _error(["train.schedule=linear"]).startswith(f"{TINY} (--set train.schedule): train.schedule: ")
    assert _error(["train.decay_shape=cosine"]).startswith(f"{TINY} (--set train.decay_shape): train.decay_shape: ")
    # what fits: a decay right after the warmup, and one of the whole schedule without a warmup
    assert load_config(TINY, ["train.schedule=wsd", "train.decay_steps=280"]).train.decay_steps == 280
    assert load_config(TINY, ["train.schedule=wsd", "train.decay_steps=300", "train.warmup_steps=0"]).train.schedule \
        == "wsd"
