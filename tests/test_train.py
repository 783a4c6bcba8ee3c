"""The `make train` path, end to end, in a subprocess."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import runs
from conftest import REPO, TINY, small_config
from xla_flags import cpu_flags
from zerolm.config.section import ConfigError
from zerolm.data.corpus import default_documents
from zerolm.data.prepare import prepare
from zerolm.data.tokenizer import train_bpe
from zerolm.train.trainer import train


@pytest.mark.slow
def test_main_zero_trains_logs_and_samples(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "XLA_FLAGS": cpu_flags(8, fast_compile=False)}  # 40 steps
    proc = subprocess.run(
        [sys.executable, str(REPO / "main_zero.py"), "--config", str(TINY), "--set", "train.steps=40",
         "--set", "train.eval_every=20", "--set", "train.warmup_steps=5", "--set", f"logging.dir={tmp_path}",
         "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
         "--set", "sample.tokens=16", "--set", "sample.every=20", "--plot"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 41))  # 1-based, as checkpoints and messages
    assert all(k in records[0] for k in ("grad_norm", "lr", "tokens_per_s", "data_wait_s"))
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    assert "step 20: val loss " in proc.stdout + proc.stderr
    entropy = float(proc.stdout.split("unigram entropy ")[1].split()[0])
    assert losses[0] > entropy  # starts near log(vocab)
    assert np.mean(losses[-5:]) < entropy - 0.3  # has learned more than unigram statistics
    sample = [line for line in proc.stdout.splitlines() if line.startswith("sample: ")]
    assert sample and sample[0].startswith("sample: And God said,") and len(sample[0]) > len("sample: And God said,") + 10
    assert "tok_s" in proc.stderr + proc.stdout  # the live progress bar
    assert "WARNING" not in proc.stderr  # no library's log lines (orbax's handler override was one)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["40", "zerolm.lock"]  # the final checkpoint
    # The start-up summary: sizes, per-device bytes, FLOPs, and the compiled step's collectives.
    assert "32 sequences = 4,096 tokens per step" in proc.stdout
    assert "per device: params 4.1 MiB, gradient accumulator 4.1 MiB, optimizer state" in proc.stdout
    assert "MFU: unknown peak for device kind 'cpu'" in proc.stdout
    grad_line = next(line for line in proc.stdout.splitlines() if line.startswith("collectives per step: grad: "))
    assert "reduce-scatter over dp" in grad_line and "INSIDE" not in grad_line
    # A sample every sample.every steps (not again at the last step: the final one is printed after it).
    assert "step 20: sample: And God said," in proc.stdout + proc.stderr
    assert "step 40: sample:" not in proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"plot: {tmp_path / 'metrics.png'}"
    assert (tmp_path / "metrics.png").stat().st_size > 10_000


def test_default_corpus():
    docs = default_documents()
    assert len(docs) == 1189 and docs[0].startswith("In the beginning God created")


def test_training_refuses_a_dataset_prepared_for_another_model(tmp_path):
    prepare("default", tmp_path / "ds", seq_len=32, progress=False)
    cfg = small_config(f"data.dataset={tmp_path / 'ds'}")  # model.seq_len 16
    with pytest.raises(ConfigError, match=rf"^data.dataset: {tmp_path}/ds was prepared with seq_len 32, but model.seq_len is 16$"):
        train(cfg)
    other = tmp_path / "other.json"
    train_bpe(["some other text entirely"] * 10, 300).save(str(other))
    cfg = small_config(f"data.dataset={tmp_path / 'ds'}", "model.seq_len=32", f"data.tokenizer={other}")
    with pytest.raises(ConfigError, match=rf"^data.tokenizer: {other} \(sha256 \w+\) is not the tokenizer "):
        train(cfg)
    cfg = small_config(f"data.dataset={tmp_path / 'ds'}", "model.seq_len=32", "model.vocab_size=1000")
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 1000 is smaller than the dataset's tokenizer"):
        train(cfg)
    with pytest.raises(ConfigError, match=rf"^data.dataset: {tmp_path}/nope/manifest.json: no manifest"):
        train(small_config(f"data.dataset={tmp_path / 'nope'}"))


@pytest.mark.slow
def test_validation_loss_of_a_checkpoint_is_the_same_on_1_2_and_8_devices(tmp_path):
    import functools
    import io

    import jax

    from zerolm.checkpoint.store import Checkpoints
    from zerolm.data.dataset import default_dataset_dir
    from zerolm.data.shards import PreparedDataset
    from zerolm.eval.heldout import make_evaluator
    from zerolm.model.losses import token_losses
    from zerolm.parallel.build import build_step
    from zerolm.parallel.mesh import make_mesh

    sets = ["model.vocab_size=auto", "train.steps=4", "train.warmup_steps=1", "train.global_batch_size=16",
            "train.micro_batch_size=2",
            "train.eval_sequences=37", f"logging.dir={tmp_path / 'log'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "sample.tokens=0"]
    summary = train(small_config(*sets), out=io.StringIO())
    losses = {}
    for n in (1, 2, 8):
        cfg = small_config(*sets, "model.vocab_size=2048", device_count=n)
        model, zero, _ = build_step(cfg, make_mesh(n, 1, jax.devices()[:n]))
        state, _ = Checkpoints(tmp_path / "ckpt", read_only=True).restore(4, zero, cfg.model.model_dump())
        rows = PreparedDataset(default_dataset_dir(cfg)).split("val").read(np.arange(37))  # 37: a padded last batch
        evaluate = make_evaluator(functools.partial(token_losses, model), zero.table.param_shardings,
                                  zero.table.row_sharding, rows, n * cfg.train.micro_batch_size)
        losses[n] = evaluate(state.params)
    assert losses[8] == pytest.approx(summary["val_loss"], rel=1e-6)  # what training logged
    assert losses[1] == pytest.approx(losses[8], rel=1e-5) and losses[2] == pytest.approx(losses[8], rel=1e-5), losses


@pytest.mark.slow
def test_a_restart_loads_the_train_step_from_the_compilation_cache(tmp_path):
    """train.compilation_cache: the second run finds the gradient step and the update compiled on disk."""
    cmd = [sys.executable, str(REPO / "main_zero.py"), "--config", str(TINY), "--set", "train.steps=2",
           "--set", "train.warmup_steps=1", "--set", f"logging.dir={tmp_path / 'log'}", "--set", "sample.tokens=0",
           "--set", f"train.compilation_cache={tmp_path / 'xla'}"]
    env = {**os.environ, "JAX_LOG_COMPILES": "1", "XLA_FLAGS": cpu_flags(2)}
    runs = [subprocess.run([*cmd, "--set", f"checkpoint.dir={tmp_path / f'ckpt{i}'}"], capture_output=True, text=True,
                           cwd=REPO, env=env, timeout=300) for i in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[1].stderr[-2000:]
    assert any(p.name.startswith("jit_grad_step") for p in (tmp_path / "xla").iterdir())
    for program in ("jit_grad_step", "jit__update"):
        assert f"Persistent compilation cache hit for '{program}'" not in runs[0].stderr
        assert f"Persistent compilation cache hit for '{program}'" in runs[1].stderr


def test_the_compilation_cache_keeps_xla_autotune_results_out(tmp_path):
    """On an H100 another run's per-fusion autotune results, found beside the cache, stopped a run at its first
    step (compilation_cache.use); the whole-program cache stays on."""
    import jax

    from zerolm.train import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_enable_xla_caches")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        compilation_cache.use(str(tmp_path / "xla"))
        assert jax.config.jax_persistent_cache_enable_xla_caches == "none"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_profile_of_two_steps_writes_a_trace(tmp_path):
    import io

    out = io.StringIO()
    train(small_config("model.vocab_size=auto", "train.steps=4", "train.warmup_steps=1", "train.global_batch_size=16",
                     "train.micro_batch_size=2", "logging.profile=2-3", f"logging.dir={tmp_path / 'log'}",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", "sample.tokens=0"), out=out)
    traces = list((tmp_path / "log" / "profile").rglob("*.trace.json.gz"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    assert list((tmp_path / "log" / "profile").rglob("*.xplane.pb"))  # what TensorBoard / XProf open
    assert f"profile of steps 2-3 in {tmp_path / 'log' / 'profile'}" in out.getvalue()


def test_seq_len_longer_than_the_default_corpus_is_one_line(tmp_path):
    proc = runs.train(tmp_path, "model.seq_len=2000000", steps=2, expect=2)
    assert proc.stderr.strip().startswith("error: model.seq_len: 2000000: the default dataset cannot be prepared for "
                                          "it: default: too little text for one training sample of seq_len + 1 = "
                                          "2000001 tokens")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_step_the_device_cannot_hold_is_one_line_and_exit_2(tmp_path):
    """A model whose parameters alone are 4 TiB: XLA's allocation fails on the device (RESOURCE_EXHAUSTED, here
    the CPU's; a GPU's as it runs, a TPU's as it compiles) and the run stops with one line naming the keys that
    size the step, before it writes a checkpoint or a metric."""
    proc = runs.train(tmp_path, "model.vocab_size=268435456", "model.d_model=4096", "model.n_head=32",
                      "model.n_layer=1", steps=4, devices=1, expect=2)
    assert proc.stderr.strip().startswith("error: the training step does not fit in device memory (the device ran "
                                          "out: Out of memory allocating 4398046511104 bytes); lower "
                                          "train.micro_batch_size (now 1), recompute more (model.remat, now none"), \
        proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list((tmp_path / "ckpt").glob("[0-9]*")) and not (tmp_path / "log" / "metrics.jsonl").exists()


@pytest.mark.parametrize("after_s", [1.0, 2.5])
def test_ctrl_c_while_starting_is_one_line_and_130(tmp_path, after_s):
    """Ctrl-C while JAX and the rest are imported or the step compiles: one line, exit 130, never a traceback
    and never a run that goes on (a KeyboardInterrupt swallowed inside a callback is still seen)."""
    proc = subprocess.Popen(runs.command(tmp_path, steps=200), env=runs.env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, 75), err[-2000:]  # 75: it had reached the loop, and saved
    assert "Traceback" not in err, err[-3000:]
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1] == ("zerolm: interrupted before the first step; nothing was saved; "
                                                "exiting with code 130")


def test_a_profile_range_past_the_run_says_what_it_traces():
    from zerolm.observe.profiling import Profiler

    said = []

    class Bar:
        def write(self, text, file=None):
            said.append(text)

    assert Profiler((2, 100), 0, 5, None, Bar(), None).steps == (2, 5)
    assert Profiler((8, 9), 0, 5, None, Bar(), None).steps is None
    assert said == ["profile: tracing steps 2-5 (steps 2-100 asked for; this run trains steps 1-5)",
                    "profile: steps 8-9 asked for, but this run trains steps 1-5: nothing is traced"]


@pytest.mark.parametrize("swallower", ["_xla_gc_callback", "discover_pjrt_plugins"])
def test_ctrl_c_inside_a_library_function_that_swallows_it_is_delivered_again_outside_it(swallower):
    """Raised inside JAX's gc callback, a KeyboardInterrupt is printed as "Exception ignored" and lost; inside
    JAX's plugin discovery (a bare except around each plugin's initialize), logged with its traceback and lost
    (seen in the suite: a Ctrl-C 1 s into a run). The handler instead records it and sends SIGINT again, which
    lands outside the function."""
    from zerolm.core import interrupts

    delivered = []
    previous = signal.signal(signal.SIGINT, lambda *a: delivered.append(True))
    try:
        def inside():
            return interrupts._on_sigint(signal.SIGINT, sys._getframe())

        inside.__code__ = inside.__code__.replace(co_name=swallower)
        assert inside() is None  # not raised in here
        deadline = time.monotonic() + 5
        while not delivered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert delivered and interrupts.interrupted_early()
        with pytest.raises(KeyboardInterrupt):  # anywhere else it raises at once
            interrupts._on_sigint(signal.SIGINT, sys._getframe())
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupts._interrupted = False


def test_hooks_run_at_their_every_the_last_step_and_a_stop():
    """Evaluation runs every N and at the last step; a save also at a preemption's step; a sample never at the
    last step (the run's closing line is one)."""
    from zerolm.train.loop import Hook

    def steps(hook, n=10, stop=None):
        return [s for s in range(1, n + 1) if hook.due(s, s == n, s == stop)]

    nothing = lambda *a: {}  # noqa: E731
    assert steps(Hook(4, nothing)) == [4, 8, 10]
    assert steps(Hook(4, nothing, at_last=False)) == [4, 8]
    assert steps(Hook(5, nothing, at_last=False)) == [5]
    assert steps(Hook(4, nothing, at_stop=True), stop=6) == [4, 6, 8, 10]
    assert steps(Hook(0, nothing, at_last=False)) == []


def test_your_own_hook_runs_at_its_every_and_its_numbers_are_logged_at_that_step(tmp_path):
    """train(cfg, hooks=[Hook(2, fn)]) through the real sharded step: fn sees the state after each 2nd update and the
    last (its step counter says so), what it returns is in metrics.jsonl at that step and in the run's summary."""
    import io

    import jax

    from zerolm.train.loop import Hook

    seen = []

    def norm_of_params(step, state, stopping):
        seen.append((step, int(state.step), stopping))
        return {"params_norm": float(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(state.params)))}

    sets = ["model.vocab_size=auto", "train.steps=5", "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=2",
            "train.eval_every=100", f"logging.dir={tmp_path / 'log'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "checkpoint.every=100", "sample.tokens=0"]
    summary = train(small_config(*sets), out=io.StringIO(), hooks=[Hook(2, norm_of_params)])
    assert seen == [(2, 2, False), (4, 4, False), (5, 5, False)]
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["params_norm"] for r in rows if "params_norm" in r}
    assert sorted(logged) == [2, 4, 5] and logged[4] != logged[2] > 0
    assert summary["params_norm"] == logged[5]


@pytest.mark.slow
def test_a_run_shorter_than_its_warmup_runs_with_it_cut_records_it_and_resumes_on_the_same_schedule(tmp_path):
    """A smoke run of a config's 20-step warmup: one warning line, the cut warmup (3 of a 4-step schedule) in
    what the run records, and a resume after kill -9 that continues the same lr schedule."""
    from zerolm.checkpoint.store import Checkpoints
    from zerolm.observe import launches

    sets = ["train.warmup_steps=20", "train.schedule_steps=null", "checkpoint.every=2"]
    runs.kill_9_after(tmp_path, *sets, steps=4, before_step=4)  # the checkpoint of step 2 committed
    proc = runs.train(tmp_path, *sets, steps=4, extra_env={"WANDB_MODE": "offline"})
    assert [line for line in proc.stderr.splitlines() if "warning" in line] == [
        "warning: train.warmup_steps 20 is not shorter than the lr schedule (train.steps 4): this run warms up over "
        "3 step(s) (train.warmup_steps 3); train.schedule_steps keeps the full schedule in a short run"]
    assert f"resumed from {tmp_path / 'ckpt' / '2'}" in proc.stdout
    ckpts = Checkpoints(tmp_path / "ckpt", read_only=True)
    assert [ckpts.readable_meta(s).train["warmup_steps"] for s in (2, 4)] == [3, 3]
    assert [x.config["train"]["warmup_steps"] for x in launches.read(tmp_path / "log")] == [3, 3]
    record = next((tmp_path / "log" / "wandb").glob("offline-run-*/*.wandb")).read_bytes()  # its config, as JSON
    assert b'"warmup_steps":3,' in record and b'"warmup_steps":20' not in record
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    lr = 3.0e-3  # the tiny config's peak
    assert [r["lr"] for r in rows if "loss" in r] == pytest.approx([0, lr / 3, 2 * lr / 3, lr])
