"""Weight averaging: the moving average training keeps (`train.ema`, zerolm.parallel.optim.with_ema) through the
real sharded step (dp 8 at ZeRO stages 1 and 3, dp 4 × tp 2, scan and unrolled layers, mixed precision) against one
device and against the debiased recurrence in numpy; its bytes per device split over dp; and (the slow tier) its
exact resume after kill -9, `val_loss_ema`, and `zerolm average` (the mean of a run's last checkpoints, or its
EMA, written as a checkpoint that eval, sample and train.init_from read)."""

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


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
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
    cfg = Config.model_validate(meta.full_config).with_values({"mesh.dp": 8, "mesh.tp": 1})
    _, zero, _ = build_step(cfg, make_mesh(8))
    state, _ = ckpts.restore(step, zero, cfg.model.model_dump(), cfg.train.ema)
    parts = {"params": _flat(state.params)}
    if isinstance(state.opt_state, MasterWeights):
        parts["master"] = _flat(from_views(zero.table.layouts, state.opt_state.master))
    if (ema := ema_of(state.opt_state)) is not None:
        parts["ema"] = _flat(from_views(zero.table.layouts, ema))
    return parts


def average(capsys, *args) -> tuple[int, str, str]:
    """`zerolm average ARGS` in this process: (exit code, stdout, stderr)."""
    from zerolm.commands import main

    capsys.readouterr()
    code = main(["average", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


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
    from zerolm.checkpoint.compatible import check_compatible
    from zerolm.checkpoint.errors import CheckpointError
    from zerolm.checkpoint.meta import CheckpointMeta

    cfg = small_config("train.ema=0.9")
    meta = CheckpointMeta(step=4, time=0, config=cfg.model_dump(), dp=8, accum_steps=1, dataset={}, tokens_seen=0,
                          loss=None, wandb_id="x")
    check_compatible(meta, "ckpt/4", cfg.model.model_dump(), "fp32", 0.9)
    for other, says in ((0.99, "the config says 0.99"), (None, "the config says null")):
        with pytest.raises(CheckpointError, match=f"ckpt/4: the checkpoint was trained with train.ema=0.9, {says}; "
                                                  "resume with --set train.ema=0.9 "):
            check_compatible(meta, "ckpt/4", cfg.model.model_dump(), "fp32", other)


@pytest.mark.slow
def test_the_average_of_a_mixed_precision_run_is_the_mean_of_its_float32_master_weights(ema_trained, tmp_path,
                                                                                          capsys):
    """--last 3: the mean of steps 8, 12 and 16's float32 master weights (not of their bfloat16 params), in the
    written checkpoint's master weights exactly and in its params as their bfloat16 rounding; the source is only
    read; `zerolm eval`, `zerolm sample` and train.init_from read the average like any checkpoint."""
    from runs import snapshot
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.commands import main

    before = snapshot(ema_trained / "ckpt")
    out = tmp_path / "lawa"
    code, stdout, _ = average(capsys, "--checkpoints", ema_trained / "ckpt", "--last", 3, "--out", out)
    assert code == 0 and stdout.startswith(f"averaged the float32 master weights of 3 checkpoint(s) of "
                                           f"{ema_trained / 'ckpt'} (steps 8, 12, 16) into {out / '0'}\n")
    assert snapshot(ema_trained / "ckpt") == before
    masters = np.stack([float32_parts(ema_trained / "ckpt", s)["master"] for s in (8, 12, 16)])
    want = np.mean(masters.astype(np.float64), axis=0).astype(np.float32)
    got = float32_parts(out, 0)
    np.testing.assert_array_equal(got["master"], want)
    np.testing.assert_array_equal(got["params"], want.astype(jax.numpy.bfloat16).astype(np.float32))
    assert not np.array_equal(want, masters[-1])
    meta = Checkpoints(out, read_only=True).meta(0)
    assert meta.averaged == {"checkpoints": str(ema_trained / "ckpt"), "steps": [8, 12, 16], "of": "master weights"}

    assert main(["eval", "--checkpoint", str(out), "--sequences", "16"]) == 0
    assert main(["sample", "--checkpoint", str(out), "--prompt", "And God said", "--max-new-tokens", "4"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"step 0 of {out}: val loss ") and "\nAnd God said" in said
    assert _init_from(out, "zero.precision=mixed") == pytest.approx(got["params"], abs=0)


def _init_from(checkpoint, *sets: str) -> np.ndarray:
    """The params a fresh run on dp 8 with train.init_from=checkpoint starts from (zerolm.checkpoint.warm_start)."""
    from conftest import TINY
    from runs import SMALL
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.checkpoint.warm_start import initial_state
    from zerolm.config.load import load_config
    from zerolm.parallel.build import build_step
    from zerolm.parallel.mesh import make_mesh

    cfg = load_config(TINY, [*SMALL, "model.vocab_size=2048", f"train.init_from={checkpoint}", *sets], device_count=8)
    _, zero, init_fn = build_step(cfg, make_mesh(8))
    data_id = Checkpoints(checkpoint, read_only=True).meta(0).dataset
    return _flat(initial_state(cfg, zero, init_fn, data_id, lambda line: None).params)


@pytest.mark.slow
def test_the_average_of_a_float32_run_is_the_mean_of_its_params(trained_run, tmp_path, capsys):
    code, stdout, _ = average(capsys, "--checkpoints", trained_run / "ckpt", "--steps", "16,12", "--out",
                              tmp_path / "avg")
    assert code == 0 and "averaged the params of 2 checkpoint(s)" in stdout and "(steps 12, 16)" in stdout
    params = np.stack([float32_parts(trained_run / "ckpt", s)["params"] for s in (12, 16)])
    want = np.mean(params.astype(np.float64), axis=0).astype(np.float32)
    np.testing.assert_array_equal(float32_parts(tmp_path / "avg", 0)["params"], want)
    np.testing.assert_array_equal(_init_from(tmp_path / "avg"), want)


@pytest.mark.slow
def test_the_ema_written_out_evaluates_as_training_logged_it(ema_trained, tmp_path, capsys):
    """--ema: the newest checkpoint's moving average, as a checkpoint whose `zerolm eval` loss is the val_loss_ema
    training logged at that step."""
    import json

    from zerolm.commands import main

    out = tmp_path / "ema"
    code, stdout, _ = average(capsys, "--checkpoints", ema_trained / "ckpt", "--ema", "--out", out)
    assert code == 0 and stdout.startswith("averaged the moving averages (train.ema) of 1 checkpoint(s)")
    np.testing.assert_array_equal(float32_parts(out, 0)["master"], float32_parts(ema_trained / "ckpt", 16)["ema"])
    assert main(["eval", "--checkpoint", str(out), "--json"]) == 0
    loss = json.loads(capsys.readouterr().out)["loss"]
    logged = validation(ema_trained)[16]
    assert loss == pytest.approx(logged["val_loss_ema"], rel=1e-5) and loss != pytest.approx(logged["val_loss"],
                                                                                            rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--checkpoints", "{missing}", "--last", "2"], "--checkpoints: {missing}: no such checkpoint directory"),
    (["--checkpoints", "{empty}", "--last", "2"], "--checkpoints: {empty}: no checkpoint here"),
    (["--checkpoints", "{ema}", "--last", "5"], "--last 5: {ema} keeps 4 checkpoint(s) (steps 4, 8, 12, 16)"),
    (["--checkpoints", "{ema}", "--steps", "8,7"], "--steps: {ema} holds no checkpoint of step 7 (its steps: 4, 8, "),
    (["--checkpoints", "{ema}", "--ema", "--out", "{ema}"], "--out: {ema} is the source {ema}: the checkpoints"),
    (["--checkpoints", "{ema}", "--last", "2", "--out", "{ema}/avg"], "--out: {ema}/avg is inside the source"),
    (["--checkpoints", "{plain}", "--ema"], "--ema: {plain}/16 holds no moving average of its parameters"),
    (["--checkpoints", "{two}", "--last", "2"], "{two}/8: model.n_layer is 3 there and 2 in {two}/16: an "
                                                  "average is of checkpoints of one model"),
], ids=["missing", "empty", "too-few", "no-such-step", "out-is-source", "out-inside-source", "no-ema", "two-models"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(ema_trained, trained_run, tmp_path, capsys, args, says):
    import shutil

    from runs import snapshot
    from test_evaluate import copy_with_config

    two = tmp_path / "two"
    copy_with_config(trained_run, two, "model", n_layer=3)  # its step 16, recorded as a 3-layer model's, as 8
    (two / "ckpt" / "16").rename(two / "ckpt" / "8")
    shutil.copytree(trained_run / "ckpt" / "16", two / "ckpt" / "16")
    (tmp_path / "empty").mkdir()
    places = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "ema": ema_trained / "ckpt",
              "plain": trained_run / "ckpt", "two": two / "ckpt"}
    args = [a.format(**places) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "avg")]
    before = {name: snapshot(p) for name, p in places.items() if p.exists()}
    code, stdout, stderr = average(capsys, *args, *out)
    assert (code, stdout) == (2, "") and stderr.startswith("error: " + says.format(**places))
    assert stderr.count("\n") == 1
    assert {name: snapshot(p) for name, p in places.items() if p.exists()} == before
    assert not (tmp_path / "avg").exists() and not (ema_trained / "ckpt" / "avg").exists()
