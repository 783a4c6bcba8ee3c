"""The training loop: data, init or resume, the ZeRO-1 step, evaluation, checkpoints, metrics, a sample.

Exit codes of `zerolm train`: 0 done; 2 bad config, data or checkpoint; 3 a non-finite loss or
gradient norm; 75 preempted (SIGTERM): a checkpoint of the step reached was saved, run again to resume.
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
from zerolm import model as gpt_model
from zerolm.checkpoint import CheckpointError, Checkpoints, move_aside
from zerolm.config import Config, ConfigError, load_config
from zerolm.data.loader import BatchLoader
from zerolm.data.prepare import MANIFEST, prepare
from zerolm.data.shards import DataError, PreparedDataset
from zerolm.data.tokenizer import cache_dir, from_file
from zerolm.mesh import initialize_distributed, make_mesh
from zerolm.metrics import MetricsWriter
from zerolm.sample import generate
from zerolm.zero import TrainState, Zero1, make_optimizer

EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later; `--resume auto` continues from the saved step


class NonFiniteError(RuntimeError):
    pass


class Preempted(Exception):
    def __init__(self, step: int):
        super().__init__(f"preempted: checkpoint saved at step {step}")
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
                prepare("default", location, vocab_size=cfg.data.default_vocab_size, seq_len=cfg.model.seq_len,
                        progress=False)
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


def make_evaluator(zero: Zero1, loss_fn):
    """Mean loss over fixed validation batches; the batch's rows stay sharded on dp."""
    loss = jax.jit(lambda params, batch: loss_fn(params, batch.reshape(-1, batch.shape[-1])),
                   in_shardings=(zero.param_shardings, zero.batch_sharding))

    def evaluate(params, batches) -> float:
        return float(np.mean([loss(params, b) for b in batches]))

    return evaluate


class PreemptionWatch:
    """Has a SIGTERM arrived? All processes agree on the step at which they stop."""

    def __init__(self):
        self.flag = False
        self.multi = jax.process_count() > 1
        if not self.multi:  # jax.distributed's preemption notifier handles SIGTERM across processes
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.flag = True

    def reached(self, step: int) -> bool:
        return multihost_utils.reached_preemption_sync_point(step) if self.multi else self.flag

    def close(self):
        if not self.multi:
            signal.signal(signal.SIGTERM, self._previous)


def start_state(cfg: Config, zero: Zero1, init_fn, ckpts: Checkpoints, data_id: dict, resume: str,
                overwrite: bool, say) -> tuple[TrainState, str, Checkpoints]:
    """A fresh sharded state, or the latest checkpoint's; refuses to start over existing checkpoints."""
    latest = ckpts.latest_step()
    if latest is not None and resume == "never":
        if not overwrite:
            raise CheckpointError(f"{ckpts.directory}: already holds checkpoints (latest step {latest}); "
                                  "resume with --resume auto, or pass --overwrite to start over "
                                  "(the old checkpoints are moved aside, not deleted)")
        ckpts.close()
        if jax.process_index() == 0:
            say(f"checkpoints: moved the old run aside to {move_aside(Path(str(ckpts.directory)))}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("zerolm: old checkpoints moved aside")
        ckpts = Checkpoints(ckpts.directory, keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every)
        latest = None
    if latest is None or resume == "never":
        return zero.init(init_fn, jax.random.key(cfg.train.seed)), secrets.token_hex(4), ckpts

    state, meta = ckpts.restore(latest, zero, cfg.model.model_dump())
    if meta["dataset"] != data_id:
        diff = [f"{k}: checkpoint {meta['dataset'].get(k)!r}, now {v!r}" for k, v in data_id.items()
                if meta["dataset"].get(k) != v]
        raise CheckpointError(f"{ckpts.directory / str(latest)}: the data differs from the checkpoint's, so the "
                              f"data order cannot continue: {'; '.join(diff)}")
    saved_batch = meta["config"]["train"]["global_batch_size"]
    if saved_batch != cfg.train.global_batch_size:
        raise CheckpointError(f"{ckpts.directory / str(latest)}: train.global_batch_size was {saved_batch}; "
                              f"resuming with {cfg.train.global_batch_size} would change the data order")
    say(f"resumed from {ckpts.directory / str(latest)} (step {latest}, saved on dp={meta['dp']})")
    saved_train = meta["config"]["train"]
    saved_schedule = saved_train["schedule_steps"] or saved_train["steps"]
    if saved_schedule != cfg.train.schedule_length:
        say(f"  note: the lr schedule changed length: {saved_schedule} -> {cfg.train.schedule_length} steps "
            "(set train.schedule_steps to keep it)")
    if meta["accum_steps"] != cfg.accum_steps or meta["dp"] != cfg.dp:
        say(f"  device count changed: dp {meta['dp']} -> {cfg.dp}; accumulation steps recomputed "
            f"{meta['accum_steps']} -> {cfg.accum_steps} (same global batch of {cfg.train.global_batch_size})")
    return state, meta["wandb_id"], ckpts


def run(cfg: Config, out=sys.stdout, *, resume: str = "auto", overwrite: bool = False) -> dict[str, float]:
    """Train `cfg` (resuming per `resume`); returns the last train loss, val loss and unigram entropy."""
    is_main = jax.process_index() == 0
    say = (lambda *a: print(*a, file=out, flush=True)) if is_main else (lambda *a: None)
    dataset = open_dataset(cfg)
    cfg = resolve_vocab(cfg, dataset)
    train_split = dataset.split("train", cfg.data.skip_bad_samples)
    val_split = dataset.split("val", cfg.data.skip_bad_samples)
    entropy = dataset.manifest["splits"]["train"]["unigram_entropy"]
    tokenizer = dataset.tokenizer() if cfg.sample.tokens and is_main else None  # fail now, not after training

    mesh = make_mesh(cfg.dp, cfg.mesh.tp)
    model = gpt_model.GPT(cfg.model)
    init_fn = functools.partial(gpt_model.init_params, model)
    loss_fn = functools.partial(gpt_model.lm_loss, model)
    abstract_params = jax.eval_shape(init_fn, jax.random.key(0))
    tx, schedule = make_optimizer(cfg.train)
    zero = Zero1(mesh, loss_fn, tx, abstract_params, grad_reduce=cfg.zero.grad_reduce, lr_schedule=schedule)

    say(f"zerolm: {cfg.name}: {gpt_model.count_params(abstract_params) / 1e6:.2f}M params, {jax.device_count()} "
        f"{jax.default_backend()} device(s) in {jax.process_count()} process(es), mesh dp={cfg.dp} tp={cfg.mesh.tp}, "
        f"{cfg.accum_steps} accumulation step(s) of {cfg.train.micro_batch_size} per device, "
        f"grad_reduce={cfg.zero.grad_reduce}")
    say(f"data: {dataset.location}: {len(train_split)} train / {len(val_split)} val samples of "
        f"{cfg.model.seq_len + 1} tokens, tokenizer {dataset.manifest['tokenizer']['name']} "
        f"({dataset.manifest['tokenizer']['vocab_size']} tokens), unigram entropy {entropy:.3f} nats/token")

    data_id = dataset_identity(cfg, dataset)
    ckpts = Checkpoints(cfg.checkpoint_dir, keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every)
    try:
        state, wandb_id, ckpts = start_state(cfg, zero, init_fn, ckpts, data_id, resume, overwrite, say)
        start = int(state.step)
        if start >= cfg.train.steps:
            say(f"nothing to do: {cfg.checkpoint_dir} is at step {start} and train.steps is {cfg.train.steps} "
                "(raise train.steps to go on, or start over with --resume never --overwrite)")
            return {"unigram_entropy": entropy}
        state, summary = _train_loop(cfg, zero, loss_fn, state, start, ckpts, train_split, val_split, data_id,
                                     wandb_id, entropy, out)
    finally:
        ckpts.close()  # waits for a save in flight to be durable; an interrupted one is never listed

    say(f"done: train loss {summary['loss']:.4f}, val loss {summary['val_loss']:.4f} "
        f"(unigram entropy {entropy:.4f}); metrics in {cfg.log_dir / 'metrics.jsonl'}, "
        f"checkpoints in {cfg.checkpoint_dir}")
    if tokenizer is not None:
        ids = generate(model, state.params, tokenizer.encode(cfg.sample.prompt), cfg.sample.tokens,
                       cfg.sample.temperature, seed=cfg.train.seed)
        say("sample: " + tokenizer.decode(ids))
    return summary


def _train_loop(cfg: Config, zero: Zero1, loss_fn, state: TrainState, start: int, ckpts: Checkpoints,
                train_split, val_split, data_id: dict, wandb_id: str, entropy: float, out):
    """Steps `start` .. train.steps, with evaluation, checkpoints and preemption."""
    mesh, is_main = zero.mesh, jax.process_index() == 0
    loader = BatchLoader(train_split, mesh, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                         cfg.train.seed)
    val_loader = BatchLoader(val_split, mesh, cfg.dp * cfg.train.micro_batch_size, cfg.train.micro_batch_size,
                             seed=0, allow_repeats=True)
    val_batches = [val_loader.global_batch(i) for i in range(cfg.train.eval_batches)]
    evaluate = make_evaluator(zero, loss_fn)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len

    def checkpoint_meta(done: int, loss: float | None) -> dict:
        return {"step": done, "time": time.time(), "config": cfg.model_dump(), "dp": cfg.dp,
                "accum_steps": cfg.accum_steps, "process_count": jax.process_count(), "dataset": data_id,
                "dataset_location": str(train_split.dataset.location),
                "tokens_seen": done * tokens_per_step, "loss": loss, "wandb_id": wandb_id,
                "zerolm_version": zerolm.__version__}

    writer = MetricsWriter(cfg.log_dir, cfg.model_dump(), cfg.name, cfg.logging.wandb, cfg.logging.wandb_project,
                           wandb_id)
    bar = tqdm(total=cfg.train.steps, initial=start, desc=cfg.name, unit="step", disable=not is_main, file=out,
               dynamic_ncols=True, mininterval=0.5)
    preemption = PreemptionWatch()
    summary: dict[str, float] = {"unigram_entropy": entropy}
    emitter = _Emitter(writer, bar, summary, tokens_per_step, cfg.logging.every, cfg.train.skip_nonfinite)
    batches = loader.batches(start_step=start, prefetch=cfg.data.prefetch)
    try:
        for step in range(start, cfg.train.steps):
            batch, waited = next(batches)
            state, metrics = zero(state, batch)
            if cfg.data.skip_bad_samples:
                metrics = {**metrics, "bad_samples": train_split.bad_samples}
            emitter.push(step, metrics, waited)  # emits the previous step's metrics: one step behind
            done = step + 1
            stop = preemption.reached(done)
            evaluate_now = done % cfg.train.eval_every == 0 or done == cfg.train.steps
            save_now = done % cfg.checkpoint.every == 0 or done == cfg.train.steps or stop
            if evaluate_now or save_now:
                emitter.flush()  # a non-finite step raises here, before it could be saved
            if evaluate_now:
                summary["val_loss"] = evaluate(state.params, val_batches)
                writer.write(step, {"val_loss": summary["val_loss"]})
                bar.write(f"step {done}: val loss {summary['val_loss']:.4f}", file=out)
            if save_now:
                ckpts.save(state, checkpoint_meta(done, summary.get("loss")), wait=stop)
            if stop:
                raise Preempted(done)
        ckpts.wait()
    finally:
        batches.close()
        bar.close()
        writer.close()
        preemption.close()
    return state, summary


class _Emitter:
    """Turns a step's device metrics into logged numbers one step late, so dispatch never waits."""

    def __init__(self, writer, bar, summary, tokens_per_step, every, skip_nonfinite):
        self.writer, self.bar, self.summary = writer, bar, summary
        self.tokens_per_step, self.every, self.skip_nonfinite = tokens_per_step, every, skip_nonfinite
        self.pending = None
        self.last_time = time.perf_counter()

    def push(self, step, metrics, waited):
        self.flush()
        self.pending = (step, metrics, waited)

    def flush(self):
        if self.pending is None:
            return
        step, metrics, waited = self.pending
        self.pending = None
        values = {k: float(v) for k, v in metrics.items()}  # blocks until that step is done
        now = time.perf_counter()
        values["tokens_per_s"] = self.tokens_per_step / max(now - self.last_time, 1e-9)
        values["data_wait_s"] = waited
        self.last_time = now
        self.writer.write(step, values)
        if not (np.isfinite(values["loss"]) and np.isfinite(values["grad_norm"])) and not self.skip_nonfinite:
            raise NonFiniteError(f"step {step + 1}: loss {values['loss']}, grad norm {values['grad_norm']} is not "
                                 "finite; stopping without saving it (the last good checkpoint stays the latest; "
                                 "train.skip_nonfinite: true skips such updates instead)")
        self.summary.update(values)
        self.bar.update(1)
        if step % self.every == 0:
            self.bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{values['tokens_per_s']:,.0f}", refresh=False)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="zerolm train", description="Train a GPT model with ZeRO-1.")
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config file (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key; repeatable")
    parser.add_argument("--resume", choices=["auto", "never"], default="auto",
                        help="auto: continue from the latest checkpoint of the run if there is one; never: "
                             "start fresh (refused over existing checkpoints without --overwrite) (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="with --resume never: move existing checkpoints aside and start over")
    dist = parser.add_argument_group("multi-process (omit on one host; on a TPU VM slice use --distributed)")
    dist.add_argument("--distributed", action="store_true", help="join a multi-process run (auto-detected cluster)")
    dist.add_argument("--coordinator", default=None, help="host:port of process 0, e.g. 127.0.0.1:12355")
    dist.add_argument("--num-processes", type=int, default=None)
    dist.add_argument("--process-id", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.distributed or args.coordinator:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    try:
        cfg = load_config(args.config, args.set, device_count=jax.device_count())
        run(cfg, resume=args.resume, overwrite=args.overwrite)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        _exit_after_restore_error(f"error: {e}", 2)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Preempted as e:
        print(f"zerolm: {e}; exiting with code {EXIT_PREEMPTED}", file=sys.stderr)
        return EXIT_PREEMPTED
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
