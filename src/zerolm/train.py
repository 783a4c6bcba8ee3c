"""The training loop: data, init or resume, the ZeRO-1 step, evaluation, checkpoints, metrics, a sample.

Exit codes of `zerolm train`: 0 done; 2 bad config, data, checkpoint or launch flags, or the checkpoint
directory is in use by another run; 3 a non-finite loss or gradient norm (or, with train.skip_nonfinite, too many
skipped updates in a row); 75 stopped by SIGTERM (preemption) or Ctrl-C: a checkpoint of the step
reached was saved, run again to resume; 76 a peer process of a multi-process run died: restart, the
run resumes from the last complete checkpoint; 130 a second Ctrl-C abandoned that save, or Ctrl-C
before the first step.

Steps are counted from 1 everywhere: step s is the s-th optimizer update, its line in metrics.jsonl
holds that update's loss, and the checkpoint named s holds the state after it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

import zerolm
from zerolm import comms, plot
from zerolm import model as gpt_model
from zerolm.checkpoint import (FORMAT, CheckpointError, Checkpoints, DamagedCheckpoint, SaveFailed, move_aside,
                               move_damaged, remove_unfinished)
from zerolm.cli import OneLineParser
from zerolm.config import Config, ConfigError, load_config
from zerolm.data.loader import BatchLoader
from zerolm.data.prepare import MANIFEST, PrepareError, prepare
from zerolm.data.shards import DataError, PreparedDataset
from zerolm.data.tokenizer import Tokenizer, cache_dir, from_file
from zerolm.evaluate import make_evaluator, perplexity
from zerolm.mesh import (DistributedError, bound_shutdown, exit_peer_lost, initialize_distributed, is_first_host, is_peer_failure,
                         make_mesh, on_process_0)
from zerolm.interrupts import EXIT_INTERRUPTED, interrupted_early
from zerolm.metrics import MetricsWriter
from zerolm.mfu import Accounting, flops_per_token
from zerolm.runlock import LEASE_FILE, LOCK_FILE, LockHeld, RunLock
from zerolm.sample import Sampling, generate
from zerolm.sharding import abstract_views, shard_bytes, with_shardings
from zerolm.zero import TrainState, Zero1, make_optimizer

EXIT_NONFINITE = 3
EXIT_SAVE_FAILED = 74  # EX_IOERR: a checkpoint could not be written (disk full); the one before stays the latest
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later; `--resume auto` continues from the saved step


class NonFiniteError(RuntimeError):
    pass


class Preempted(Exception):
    def __init__(self, step: int, why: str = "preempted"):
        super().__init__(f"{why}: checkpoint saved at step {step}")
        self.step = step


def default_dataset_dir(cfg: Config) -> Path:
    return cache_dir() / "datasets" / f"kjv-bpe{cfg.data.default_vocab_size}-seq{cfg.model.seq_len}"


def open_dataset(cfg: Config) -> PreparedDataset:
    """The run's prepared dataset; the default corpus is prepared on first use (by process 0)."""
    location = cfg.data.dataset
    if location == "default":
        location = default_dataset_dir(cfg)
        # Process 0 first; then any host whose disk still lacks it (hosts of a slice have their own disks).
        for turn in ("first", "rest"):
            if (turn == "first") == (jax.process_index() == 0) and not (location / MANIFEST).exists():
                try:
                    prepare("default", location, vocab_size=cfg.data.default_vocab_size, seq_len=cfg.model.seq_len,
                            progress=False, catch_sigterm=jax.process_count() == 1)
                except PrepareError as e:
                    raise ConfigError(f"model.seq_len: {cfg.model.seq_len}: the default dataset cannot be prepared "
                                      f"for it: {e}") from None
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"zerolm: default dataset prepared ({turn})")
    try:
        dataset = PreparedDataset(location)
    except DataError as e:
        raise ConfigError(f"data.dataset: {e}") from None
    if dataset.seq_len != cfg.model.seq_len:
        raise ConfigError(f"data.dataset: {location} was prepared with seq_len {dataset.seq_len}, "
                          f"but model.seq_len is {cfg.model.seq_len}")
    if cfg.data.tokenizer is not None:
        wanted = from_file(Path(cfg.data.tokenizer))
        have = dataset.manifest["tokenizer"]
        if wanted.sha256 != have["sha256"]:
            raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer} (sha256 {wanted.sha256[:12]}) is not the "
                              f"tokenizer {location} was prepared with ({have['name']}, sha256 {have['sha256'][:12]})")
    return dataset


def resolve_vocab(cfg: Config, dataset: PreparedDataset) -> Config:
    vocab = dataset.manifest["tokenizer"]["vocab_size"]
    if cfg.model.vocab_size == "auto":
        return cfg.resolve(model__vocab_size=vocab)
    if cfg.model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the dataset's tokenizer "
                          f"({dataset.manifest['tokenizer']['name']}, {vocab} tokens)")
    return cfg


def dataset_identity(cfg: Config, dataset: PreparedDataset) -> dict:
    """What must not change across a resume for the data order to continue exactly: the tokens (by
    tokenizer and shard layout, not by where the dataset lives, so a copied dataset still resumes),
    the sequence length and the seed."""
    shards = [(s["name"], s["samples"]) for s in dataset.manifest["splits"]["train"]["shards"]]
    return {"tokenizer_sha256": dataset.manifest["tokenizer"]["sha256"],
            "train_shards_sha256": hashlib.sha256(json.dumps(shards).encode()).hexdigest(),
            "train_samples": int(dataset.manifest["splits"]["train"]["samples"]),
            "seq_len": dataset.seq_len, "seed": cfg.train.seed}


class PreemptionWatch:
    """Has a SIGTERM or a Ctrl-C arrived? All processes agree on the step at which they stop.

    Ctrl-C is taken as SIGTERM: the step reached is saved and the run exits 75. A second Ctrl-C
    abandons that save and exits at once (130); the unfinished save is removed by the next run."""

    def __init__(self):
        if interrupted_early():  # a Ctrl-C during start-up that something swallowed
            raise KeyboardInterrupt
        self.flag = False
        self.interrupted = False
        self.multi = jax.process_count() > 1
        if not self.multi:  # jax.distributed's preemption notifier handles SIGTERM across processes
            self._previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous_int = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, signum, frame):
        self.flag = True

    def _on_sigint(self, signum, frame):
        if self.interrupted:
            print("\nzerolm: interrupted again: abandoned the save; the latest complete checkpoint stays the "
                  f"latest; exiting with code {EXIT_INTERRUPTED}", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        self.interrupted = True
        print("\nzerolm: interrupted: saving the step reached, then exiting (Ctrl-C again to abandon the save)",
              file=sys.stderr, flush=True)
        if self.multi:  # hand it to JAX's preemption notifier, which makes every process stop at one step
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.flag = True

    def reached(self, step: int) -> bool:
        return multihost_utils.reached_preemption_sync_point(step) if self.multi else self.flag

    @property
    def why(self) -> str:
        return "interrupted" if self.interrupted else "preempted"

    def close(self):
        if not self.multi:
            signal.signal(signal.SIGTERM, self._previous_term)
        signal.signal(signal.SIGINT, self._previous_int)


def start_state(cfg: Config, zero: Zero1, init_fn, data_id: dict, resume: str, overwrite: bool,
                say) -> tuple[Checkpoints, TrainState, str]:
    """The run's checkpoints, and a fresh sharded state or the newest intact checkpoint's.

    Refuses to start over existing checkpoints without --overwrite. A damaged checkpoint is moved
    aside and the one before it taken (`--resume auto`), or stops the run (`--resume strict`).
    Needs the directory's run lock. Closes the checkpoints if it raises."""
    directory = cfg.checkpoint_dir

    def open_checkpoints() -> Checkpoints:
        return Checkpoints(directory, keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every)

    def on_every_process(what: str, fn):
        result = on_process_0(fn, (CheckpointError, OSError))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"zerolm: {what}")
        return result

    ckpts = open_checkpoints()
    try:
        latest = ckpts.latest_step()
        if latest is not None and resume == "never":
            if not overwrite:
                raise CheckpointError(f"{directory}: already holds checkpoints (latest step {latest}); "
                                      "resume with --resume auto, or pass --overwrite to start over "
                                      "(the old checkpoints are moved aside, not deleted)")
            ckpts.close()
            aside = on_every_process("old checkpoints moved aside",
                                     lambda: move_aside(directory, keep=(LOCK_FILE, LEASE_FILE)))
            logs_aside = on_every_process("old logs moved aside", lambda: _move_logs_aside(cfg.log_dir))
            say(f"checkpoints: moved the old run aside to {aside}"
                + (f"; its metrics and logs ({', '.join(logs_aside[1])}) to {logs_aside[0]}" if logs_aside else ""))
            ckpts, latest = open_checkpoints(), None
        state = meta = None
        while latest is not None and resume != "never":
            try:
                ckpts.verify(latest)
                state, meta = ckpts.restore(latest, zero, cfg.model.model_dump())
                break
            except DamagedCheckpoint as e:
                if resume == "strict":
                    raise CheckpointError(f"{e} (--resume strict; --resume auto moves it aside and takes the "
                                          "newest intact checkpoint before it)") from None
                ckpts.close()
                target = on_every_process("damaged checkpoint moved aside", lambda: move_damaged(directory, latest))
                ckpts = open_checkpoints()
                before = ckpts.latest_step()
                say(f"checkpoints: step {latest} is damaged ({e.reason}); moved it aside to {target}; "
                    + (f"resuming from step {before}" if before is not None else "no intact checkpoint is left, "
                       "starting from scratch"))
                latest = before
        if state is None:
            return ckpts, zero.init(init_fn, jax.random.key(cfg.train.seed)), secrets.token_hex(4)
        _check_resumable(cfg, meta, data_id, ckpts.directory / str(latest))
    except BaseException:
        ckpts.close()
        raise
    saved_tp = meta.get("tp", 1)
    say(f"resumed from {ckpts.directory / str(latest)} (step {latest}, saved on dp={meta['dp']} tp={saved_tp})")
    saved_train = meta["config"]["train"]
    saved_schedule = saved_train["schedule_steps"] or saved_train["steps"]
    if saved_schedule != cfg.train.schedule_length:
        say(f"  note: the lr schedule changed length: {saved_schedule} -> {cfg.train.schedule_length} steps "
            "(set train.schedule_steps to keep it)")
    if meta["accum_steps"] != cfg.accum_steps or meta["dp"] != cfg.dp:
        say(f"  device count changed: dp {meta['dp']} -> {cfg.dp}; accumulation steps recomputed "
            f"{meta['accum_steps']} -> {cfg.accum_steps} (same global batch of {cfg.train.global_batch_size})")
    if saved_tp != cfg.mesh.tp:
        say(f"  tensor parallelism changed: tp {saved_tp} -> {cfg.mesh.tp}; parameters and optimizer state resharded")
    return ckpts, state, meta["wandb_id"]


def _move_logs_aside(log_dir: Path) -> tuple[Path, list[str]] | None:
    """With the old checkpoints, the old run's logs (metrics.jsonl, wandb/, the profile, the plot) go
    to `<logging.dir>.replaced-<time>/`. The lock and this launch's process logs stay."""
    if not log_dir.is_dir():
        return None
    keep = (LOCK_FILE, LEASE_FILE, *(p.name for p in log_dir.glob("process-*.log")))
    names = sorted(p.name for p in log_dir.iterdir() if p.name not in keep)
    if not names:
        return None
    return Path(move_aside(log_dir, keep=keep)), names


def _check_resumable(cfg: Config, meta: dict, data_id: dict, where) -> None:
    """The data order can continue only on the same data and the same global batch."""
    if meta["dataset"] != data_id:
        diff = [f"{k}: checkpoint {meta['dataset'].get(k)!r}, now {v!r}" for k, v in data_id.items()
                if meta["dataset"].get(k) != v]
        raise CheckpointError(f"{where}: the data differs from the checkpoint's, so the "
                              f"data order cannot continue: {'; '.join(diff)}")
    saved_batch = meta["config"]["train"]["global_batch_size"]
    if saved_batch != cfg.train.global_batch_size:
        raise CheckpointError(f"{where}: train.global_batch_size was {saved_batch}; "
                              f"resuming with {cfg.train.global_batch_size} would change the data order")


def use_compilation_cache(setting: str | None) -> None:
    """Point JAX's persistent compilation cache at train.compilation_cache, so a restarted run (after a
    preemption, say) loads its compiled programs instead of compiling them again."""
    if setting is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla") if setting == "default" else setting)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # the train step, not every tiny jit


def run(cfg: Config, out=sys.stdout, *, resume: str = "auto", overwrite: bool = False) -> dict[str, float]:
    """Train `cfg` (resuming per `resume`); returns the last train loss, val loss and unigram entropy."""
    mesh = make_mesh(cfg.dp, cfg.mesh.tp)
    is_main = is_first_host(mesh)
    say = (lambda *a: print(*a, file=out, flush=True)) if is_main else (lambda *a: None)
    use_compilation_cache(cfg.train.compilation_cache)
    dataset = open_dataset(cfg)
    cfg = resolve_vocab(cfg, dataset)
    train_split = dataset.split("train", cfg.data.skip_bad_samples)
    val_split = dataset.split("val", cfg.data.skip_bad_samples)
    train_split.verify()  # a missing or truncated shard stops the run now, not when first read
    val_split.verify()
    entropy = dataset.manifest["splits"]["train"]["unigram_entropy"]
    tokenizer = dataset.tokenizer() if cfg.sample.tokens else None  # fail now, not after training

    model, zero, init_fn = build_step(cfg, mesh)
    abstract_params = zero.abstract_params
    n_params = gpt_model.count_params(abstract_params)
    accounting = Accounting(flops_per_token(gpt_model.count_params(abstract_params, exclude_positions=True),
                                            cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len),
                            jax.device_count(), jax.devices()[0].device_kind)
    facts = {"params": n_params, "devices": jax.device_count(), "device_kind": accounting.device_kind,
             "processes": jax.process_count(), "mesh": {"dp": cfg.dp, "tp": cfg.mesh.tp},
             "accum_steps": cfg.accum_steps, "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_len,
             "flops_per_token": accounting.flops_per_token, "zerolm_version": zerolm.__version__}
    for line in _startup_summary(cfg, zero, accounting, n_params):
        say(line)
    say(f"data: {dataset.location}: {len(train_split)} train / {len(val_split)} val samples of "
        f"{cfg.model.seq_len + 1} tokens, tokenizer {dataset.manifest['tokenizer']['name']} "
        f"({dataset.manifest['tokenizer']['vocab_size']} tokens), unigram entropy {entropy:.3f} nats/token")
    evaluate = None
    n_val = min(cfg.train.eval_sequences, len(val_split))
    if n_val:
        evaluate = make_evaluator(functools.partial(gpt_model.token_losses, model), zero.param_shardings,
                                  zero.row_sharding, val_split.read(np.arange(n_val)),
                                  cfg.dp * cfg.train.micro_batch_size)
        if n_val < cfg.train.eval_sequences:
            say(f"note: evaluating on all {n_val} validation samples (train.eval_sequences asks for "
                f"{cfg.train.eval_sequences})")
    else:
        say("note: " + ("train.eval_sequences is 0" if len(val_split) else f"{dataset.location} has no validation "
                        "samples") + ": training without evaluation")
    sample = functools.partial(_sample_text, model, tokenizer, cfg) if tokenizer is not None else None

    data_id = dataset_identity(cfg, dataset)
    lock = on_process_0(lambda: RunLock.acquire(cfg.checkpoint_dir), (LockHeld,))
    try:
        # Two runs writing one logging.dir would each rewrite the other's metrics.jsonl.
        log_lock = (on_process_0(lambda: RunLock.acquire(str(cfg.log_dir), what="logging directory"), (LockHeld,))
                    if str(cfg.log_dir) != str(cfg.checkpoint_dir) else None)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        removed = on_process_0(lambda: remove_unfinished(cfg.checkpoint_dir), (OSError,))
        if removed:
            say(f"checkpoints: removed {len(removed)} unfinished save(s) of an earlier run that died while saving: "
                + ", ".join(removed))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("zerolm: checkpoint directory locked")
        ckpts, state, wandb_id = start_state(cfg, zero, init_fn, data_id, resume, overwrite, say)
        try:
            start = int(state.step)
            if start >= cfg.train.steps:
                say(f"nothing to do: {cfg.checkpoint_dir} is at step {start} and train.steps is {cfg.train.steps} "
                    "(raise train.steps to go on, or start over with --resume never --overwrite)")
                return {"unigram_entropy": entropy}
            loop = _Loop(cfg, zero, ckpts, train_split, data_id, wandb_id, out, evaluate=evaluate, sample=sample,
                         accounting=accounting, facts=facts)
            state, summary = loop.run(state, start)
            summary["unigram_entropy"] = entropy
        finally:
            ckpts.close()  # waits for a save in flight to be durable; an interrupted one is never listed
    finally:
        for held in (log_lock, lock):
            if held is not None:
                held.release()

    val = f", val loss {summary['val_loss']:.4f}" if "val_loss" in summary else ""
    say(f"done: train loss {summary['loss']:.4f}{val} (unigram entropy {entropy:.4f}); metrics in "
        f"{cfg.log_dir / 'metrics.jsonl'}, checkpoints in {cfg.checkpoint_dir}")
    if sample is not None:
        say("sample: " + sample(state.params))
    return summary


def build_step(cfg: Config, mesh) -> tuple[gpt_model.GPT, Zero1, functools.partial]:
    """The model, its ZeRO-1 step on `mesh` and its init function, as the config says (vocab resolved)."""
    model = gpt_model.GPT(cfg.model)
    init_fn = functools.partial(gpt_model.init_params, model)
    tx, schedule = make_optimizer(cfg.train)
    zero = Zero1(mesh, functools.partial(gpt_model.lm_loss, model), tx, jax.eval_shape(init_fn, jax.random.key(0)),
                 logical_axes=gpt_model.logical_axes(model), grad_reduce=cfg.zero.grad_reduce, lr_schedule=schedule)
    return model, zero, init_fn


def _sample_text(model: gpt_model.GPT, tokenizer: Tokenizer, cfg: Config, params) -> str:
    """The config's prompt and its continuation (every process runs it: the params span them all)."""
    sampling = Sampling(cfg.sample.temperature, cfg.sample.top_k, cfg.sample.top_p, seed=cfg.train.seed)
    prompt = tokenizer.encode(cfg.sample.prompt)[-(cfg.model.seq_len - 1):]
    return tokenizer.decode(generate(model, params, prompt, cfg.sample.tokens, sampling, tokenizer.eot_id))


def _startup_summary(cfg: Config, zero: Zero1, accounting: Accounting, n_params: int) -> list[str]:
    """What a run costs before it starts: sizes, per-device bytes, FLOPs and the compiled step's collectives."""
    params = with_shardings(zero.abstract_params, zero.param_shardings)
    opt = with_shardings(jax.eval_shape(zero.tx.init, abstract_views(zero.layouts, zero.abstract_params)),
                         zero.opt_shardings)
    accumulator = shard_bytes(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, np.float32, sharding=p.sharding),
                                           params))
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    lines = [f"zerolm: {cfg.name}: {n_params / 1e6:.2f}M params, {jax.device_count()} {accounting.device_kind} "
             f"device(s) in {jax.process_count()} process(es), mesh dp={cfg.dp} tp={cfg.mesh.tp}, "
             f"{cfg.accum_steps} accumulation step(s) of {cfg.train.micro_batch_size} sequence(s) per device, "
             f"{cfg.train.global_batch_size} sequences = {tokens:,} tokens per step, grad_reduce={cfg.zero.grad_reduce}",
             f"per device: params {mib(shard_bytes(params))}, gradient accumulator {mib(accumulator)}, optimizer state "
             f"{mib(shard_bytes(opt))} (1/{cfg.dp * cfg.mesh.tp} of it, plus padding); activations not counted",
             accounting.describe()]
    texts = comms.compiled_texts(zero, cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps)
    lines += ["collectives per step: " + line for line in comms.describe(comms.traffic(texts, dict(zero.mesh.shape)))]
    return lines


class _Loop:
    """Steps start + 1 .. train.steps of one run, with evaluation, samples, checkpoints and preemption."""

    def __init__(self, cfg: Config, zero: Zero1, ckpts: Checkpoints, train_split, data_id: dict, wandb_id: str,
                 out, *, evaluate, sample, accounting: Accounting, facts: dict):
        self.cfg, self.zero, self.ckpts, self.train_split = cfg, zero, ckpts, train_split
        self.data_id, self.wandb_id, self.out = data_id, wandb_id, out
        self.evaluate, self.sample, self.accounting, self.facts = evaluate, sample, accounting, facts
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len

    def checkpoint_meta(self, step: int, loss: float | None) -> dict:
        cfg = self.cfg
        return {"format": FORMAT, "step": step, "time": time.time(), "config": cfg.model_dump(), "dp": cfg.dp,
                "tp": cfg.mesh.tp, "accum_steps": cfg.accum_steps, "process_count": jax.process_count(),
                "dataset": self.data_id, "dataset_location": str(self.train_split.dataset.location),
                "tokens_seen": step * self.tokens_per_step, "loss": loss, "wandb_id": self.wandb_id,
                "zerolm_version": zerolm.__version__}

    def run(self, state: TrainState, start: int) -> tuple[TrainState, dict[str, float]]:
        cfg, zero = self.cfg, self.zero
        is_main = is_first_host(zero.mesh)
        loader = BatchLoader(self.train_split, zero.mesh, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                             cfg.train.seed)
        writer = MetricsWriter(cfg.log_dir, {**cfg.model_dump(), "run": self.facts}, cfg.name, cfg.logging.wandb,
                               cfg.logging.wandb_project, self.wandb_id, resume_step=start, enabled=is_main)
        bar = tqdm(total=cfg.train.steps, initial=start, desc=cfg.name, unit="step", disable=not is_main,
                   file=self.out, dynamic_ncols=True, mininterval=0.5)
        preemption = PreemptionWatch()
        summary: dict[str, float] = {}
        emitter = _Emitter(writer, bar, summary, self.tokens_per_step, self.accounting, cfg.logging.every,
                           cfg.train.max_consecutive_skips if cfg.train.skip_nonfinite else None)
        batches = loader.batches(start_step=start, prefetch=cfg.data.prefetch)
        profiler = _Profiler(cfg.logging.profile_steps, start, cfg.train.steps, cfg.log_dir / "profile", bar, self.out)
        try:
            for step in range(start + 1, cfg.train.steps + 1):
                batch, waited = next(batches)
                profiler.before(step)
                state, metrics = zero(state, batch)
                self.ckpts.check()  # a save that failed in the background stops the run now
                if cfg.data.skip_bad_samples:
                    metrics = {**metrics, "bad_samples": self.train_split.bad_samples}
                emitter.push(step, metrics, waited)  # emits the previous step's metrics: one step behind
                stop = preemption.reached(step)
                last = step == cfg.train.steps
                evaluate_now = self.evaluate is not None and (step % cfg.train.eval_every == 0 or last)
                sample_now = self.sample is not None and cfg.sample.every and step % cfg.sample.every == 0 and not last
                save_now = step % cfg.checkpoint.every == 0 or last or stop
                if evaluate_now or save_now or sample_now:
                    emitter.flush()  # a non-finite step raises here, before it could be saved
                if evaluate_now:
                    t0 = time.perf_counter()
                    loss = summary["val_loss"] = self.evaluate(state.params)
                    writer.write(step, {"val_loss": loss, "val_perplexity": perplexity(loss),
                                        "tokens_seen": step * self.tokens_per_step, "eval_s": time.perf_counter() - t0})
                    bar.write(f"step {step}: val loss {loss:.4f}, perplexity {perplexity(loss):.2f}", file=self.out)
                if sample_now:
                    text = self.sample(state.params)
                    writer.write_text(step, "sample", text)
                    if is_main:
                        bar.write(f"step {step}: sample: {text}", file=self.out)
                if save_now:
                    t0 = time.perf_counter()
                    self.ckpts.save(state, self.checkpoint_meta(step, summary.get("loss")), wait=stop)
                    writer.write(step, {"save_s": time.perf_counter() - t0})  # the step waits this long for it
                if evaluate_now or save_now or sample_now:
                    emitter.restart_clock()  # the next step's time is its own, not this host work's
                profiler.after(step, state)
                if stop:
                    raise Preempted(step, preemption.why)
            emitter.flush()
            self.ckpts.wait()
        except Exception as e:
            if is_peer_failure(e):  # before the cleanup below, which would wait on the dead peer
                exit_peer_lost(e)
            raise
        finally:
            profiler.close()
            batches.close()
            bar.close()
            writer.close()
            preemption.close()
        return state, summary


class _Profiler:
    """A jax.profiler trace of steps FIRST..LAST (logging.profile), written under the run's log dir."""

    def __init__(self, steps: tuple[int, int] | None, start: int, end: int, directory: Path, bar, out):
        """Steps `start`+1 .. `end` will run; a range reaching past them is cut to them, and said so."""
        self.directory, self.bar, self.out = directory, bar, out
        self.active = False
        self.steps = steps
        if steps is not None:
            first, last = max(steps[0], start + 1), min(steps[1], end)
            if first > last:
                bar.write(f"profile: steps {steps[0]}-{steps[1]} asked for, but this run trains steps {start + 1}-{end}: "
                          "nothing is traced", file=out)
                self.steps = None
            elif (first, last) != steps:
                bar.write(f"profile: tracing steps {first}-{last} (steps {steps[0]}-{steps[1]} asked for; this run "
                          f"trains steps {start + 1}-{end})", file=out)
                self.steps = (first, last)

    def before(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, state) -> None:
        if self.active and step == self.steps[1]:
            jax.block_until_ready(state)  # the trace holds these steps' device work, whole
            self.close()
            self.bar.write(f"profile of steps {self.steps[0]}-{self.steps[1]} in {self.directory}", file=self.out)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class _Emitter:
    """Turns a step's device metrics into logged numbers one step late, so dispatch never waits.

    `step_time_s` is the time from the end of the previous step (its metrics ready on the device) to the
    end of this one: the step itself, its wait for data included, but not the saves, evaluations and
    samples between steps (`save_s` and `eval_s` have those). tokens/s and MFU follow from it."""

    def __init__(self, writer, bar, summary, tokens_per_step, accounting: Accounting, every, max_skips: int | None):
        self.writer, self.bar, self.summary = writer, bar, summary
        self.tokens_per_step, self.accounting = tokens_per_step, accounting
        self.every, self.max_skips = every, max_skips
        self.pending = None
        self.last_time = time.perf_counter()

    def push(self, step, metrics, waited):
        self.flush()
        self.pending = (step, metrics, waited)

    def restart_clock(self):
        """After host work between steps (a save, an evaluation): the next step is timed from now."""
        self.last_time = time.perf_counter()

    def flush(self):
        if self.pending is None:
            return
        step, metrics, waited = self.pending
        self.pending = None
        values = {k: float(v) for k, v in metrics.items()}  # blocks until that step is done
        now = time.perf_counter()
        step_time = max(now - self.last_time, 1e-9)
        self.last_time = now
        values["perplexity"] = perplexity(values["loss"])
        values["tokens_seen"] = step * self.tokens_per_step
        values["step_time_s"] = step_time
        values["tokens_per_s"] = self.tokens_per_step / step_time
        values["data_wait_s"] = waited
        values["data_wait_share"] = min(waited / step_time, 1.0)
        values.update(self.accounting(values["tokens_per_s"]))
        memory = jax.local_devices()[0].memory_stats()  # None where the backend keeps no count (CPU)
        for key, name in (("bytes_in_use", "device_bytes_in_use"), ("peak_bytes_in_use", "device_peak_bytes")):
            if memory and key in memory:
                values[name] = memory[key]
        self.writer.write(step, values)
        finite = np.isfinite(values["loss"]) and np.isfinite(values["grad_norm"])
        if not finite and self.max_skips is None:
            raise NonFiniteError(f"step {step}: loss {values['loss']}, grad norm {values['grad_norm']} is not "
                                 "finite; stopping without saving it (the last good checkpoint stays the latest; "
                                 "train.skip_nonfinite: true skips such updates instead)")
        if self.max_skips is not None and values["skipped_in_a_row"] >= self.max_skips:
            raise NonFiniteError(f"step {step}: the last {int(values['skipped_in_a_row'])} updates were all skipped "
                                 f"(non-finite gradients; train.max_consecutive_skips is {self.max_skips}); stopping "
                                 "without saving: lower train.lr, or check the data")
        self.summary.update(values)
        self.bar.update(1)
        if step % self.every == 0:
            postfix = {"loss": f"{values['loss']:.3f}", "tok_s": f"{values['tokens_per_s']:,.0f}"}
            if "mfu" in values:
                postfix["mfu"] = f"{values['mfu']:.1%}"
            self.bar.set_postfix(postfix, refresh=False)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or OneLineParser(prog="zerolm train", description="Train a GPT model with ZeRO-1.")
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config file (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key; repeatable")
    parser.add_argument("--resume", choices=["auto", "strict", "never"], default="auto",
                        help="auto: continue from the newest intact checkpoint of the run if there is one (a damaged "
                             "newer one is moved aside); strict: the same, but a damaged latest checkpoint stops the "
                             "run; never: start fresh (refused over existing checkpoints without --overwrite) "
                             "(default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="with --resume never: move existing checkpoints aside and start over")
    parser.add_argument("--plot", action="store_true",
                        help="at the end, draw the run's curves into <logging.dir>/metrics.png (as `zerolm plot`)")
    parser.add_argument("--profile", metavar="FIRST-LAST", default=None,
                        help="capture a jax.profiler trace of these steps (the same as --set logging.profile=...)")
    dist = parser.add_argument_group("multi-process (omit on one host; on a TPU VM slice use --distributed)")
    dist.add_argument("--distributed", action="store_true", help="join a multi-process run (auto-detected cluster)")
    dist.add_argument("--coordinator", default=None, help="host:port of process 0, e.g. 127.0.0.1:12355")
    dist.add_argument("--num-processes", type=int, default=None)
    dist.add_argument("--process-id", type=int, default=None)
    dist.add_argument("--heartbeat-timeout", type=int, default=10, metavar="S",
                      help="a process silent this long is declared dead and the others stop with exit code 76 "
                           "(default: %(default)s)")
    dist.add_argument("--init-timeout", type=int, default=120, metavar="S",
                      help="how long to wait for the coordinator at start (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    finally:
        bound_shutdown()


def _main(args) -> int:
    try:
        if args.distributed or args.coordinator or args.num_processes is not None or args.process_id is not None:
            initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                   heartbeat_timeout_s=args.heartbeat_timeout, init_timeout_s=args.init_timeout)
        sets = args.set + ([f"logging.profile={args.profile}"] if args.profile else [])
        cfg = load_config(args.config, sets, device_count=jax.device_count())
        run(cfg, resume=args.resume, overwrite=args.overwrite)
        if args.plot and jax.process_index() == 0:
            print(f"plot: {plot.write([cfg.log_dir], cfg.log_dir / 'metrics.png')}", flush=True)
    except (ConfigError, DataError, LockHeld, DistributedError, plot.PlotError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SaveFailed as e:
        _exit_after_restore_error(f"error: {e}", EXIT_SAVE_FAILED)
    except CheckpointError as e:
        _exit_after_restore_error(f"error: {e}", 2)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Preempted as e:
        print(f"zerolm: {e}; exiting with code {EXIT_PREEMPTED}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print(f"zerolm: interrupted before the first step; nothing was saved; exiting with code {EXIT_INTERRUPTED}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if is_peer_failure(e):
            exit_peer_lost(e)
        raise
    return 0


def _exit_after_restore_error(message: str, code: int) -> None:
    """Report a checkpoint error as the last line and exit.

    After a failed restore, orbax has closed its event loop while TensorStore reads are still in
    flight, and their callbacks print 'Event loop is closed' tracebacks (not through sys.excepthook).
    They say nothing about the user's problem: let them drain into /dev/null, then report and leave.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    time.sleep(0.5)
    os.dup2(stderr, 2)
    print(message, file=sys.stderr, flush=True)
    os._exit(code)
