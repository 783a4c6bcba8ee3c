"""The training loop: data, init, the ZeRO-1 step, evaluation, metrics, and a sample at the end."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from zerolm import model as gpt_model
from zerolm.config import Config, ConfigError, load_config
from zerolm.data.loader import BatchLoader
from zerolm.data.prepare import MANIFEST, prepare
from zerolm.data.shards import DataError, PreparedDataset
from zerolm.data.tokenizer import cache_dir, from_file
from zerolm.mesh import initialize_distributed, make_mesh
from zerolm.metrics import MetricsWriter
from zerolm.sample import generate
from zerolm.zero import TrainState, Zero1, make_optimizer


def default_dataset_dir(cfg: Config) -> Path:
    return cache_dir() / "datasets" / f"kjv-bpe{cfg.data.default_vocab_size}-seq{cfg.model.seq_len}"


def open_dataset(cfg: Config) -> PreparedDataset:
    """The run's prepared dataset; the default corpus is prepared on first use (by process 0)."""
    location = cfg.data.dataset
    if location == "default":
        location = default_dataset_dir(cfg)
        if jax.process_index() == 0 and not (location / MANIFEST).exists():
            prepare("default", location, vocab_size=cfg.data.default_vocab_size, seq_len=cfg.model.seq_len,
                    progress=False)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("zerolm: default dataset prepared")
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


def make_evaluator(zero: Zero1, loss_fn):
    """Mean loss over fixed validation batches; the batch's rows stay sharded on dp."""
    loss = jax.jit(lambda params, batch: loss_fn(params, batch.reshape(-1, batch.shape[-1])),
                   in_shardings=(zero.param_shardings, zero.batch_sharding))

    def evaluate(params, batches) -> float:
        return float(np.mean([loss(params, b) for b in batches]))

    return evaluate


def run(cfg: Config, out=sys.stdout) -> dict[str, float]:
    """Train `cfg` from scratch; returns the final train loss, val loss and unigram entropy."""
    dataset = open_dataset(cfg)
    cfg = resolve_vocab(cfg, dataset)
    train_split = dataset.split("train", cfg.data.skip_bad_samples)
    val_split = dataset.split("val", cfg.data.skip_bad_samples)
    entropy = dataset.manifest["splits"]["train"]["unigram_entropy"]
    tok = dataset.tokenizer() if cfg.sample.tokens else None
    is_main = jax.process_index() == 0
    say = (lambda *a: print(*a, file=out, flush=True)) if is_main else (lambda *a: None)

    mesh = make_mesh(cfg.dp, cfg.mesh.tp)
    model = gpt_model.GPT(cfg.model)
    init_fn = functools.partial(gpt_model.init_params, model)
    loss_fn = functools.partial(gpt_model.lm_loss, model)
    abstract_params = jax.eval_shape(init_fn, jax.random.key(0))
    tx, schedule = make_optimizer(cfg.train)
    zero = Zero1(mesh, loss_fn, tx, abstract_params, grad_reduce=cfg.zero.grad_reduce, lr_schedule=schedule)
    state: TrainState = zero.init(init_fn, jax.random.key(cfg.train.seed))

    n_params = gpt_model.count_params(abstract_params)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    say(f"zerolm: {cfg.name}: {n_params / 1e6:.2f}M params, {jax.device_count()} {jax.default_backend()} "
        f"device(s), mesh dp={cfg.dp} tp={cfg.mesh.tp}, {cfg.accum_steps} accumulation step(s) of "
        f"{cfg.train.micro_batch_size} per device, grad_reduce={cfg.zero.grad_reduce}")
    say(f"data: {dataset.location}: {len(train_split)} train / {len(val_split)} val samples of "
        f"{cfg.model.seq_len + 1} tokens, tokenizer {dataset.manifest['tokenizer']['name']} "
        f"({dataset.manifest['tokenizer']['vocab_size']} tokens), unigram entropy {entropy:.3f} nats/token")

    loader = BatchLoader(train_split, mesh, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                         cfg.train.seed)
    val_loader = BatchLoader(val_split, mesh, cfg.dp * cfg.train.micro_batch_size, cfg.train.micro_batch_size,
                             seed=0, allow_repeats=True)
    val_batches = [val_loader.global_batch(i) for i in range(cfg.train.eval_batches)]
    evaluate = make_evaluator(zero, loss_fn)

    writer = MetricsWriter(cfg.log_dir, cfg.model_dump(), cfg.name, cfg.logging.wandb, cfg.logging.wandb_project)
    bar = tqdm(total=cfg.train.steps, desc=cfg.name, unit="step", disable=not is_main, file=out,
               dynamic_ncols=True, mininterval=0.5)
    summary: dict[str, float] = {"unigram_entropy": entropy}
    pending = None  # metrics are read one step behind, so the host never waits on the step in flight
    last_time = time.perf_counter()
    batches = loader.batches(start_step=0, prefetch=cfg.data.prefetch)
    try:
        for step in range(cfg.train.steps):
            batch, waited = next(batches)
            state, metrics = zero(state, batch)
            if pending is not None:
                last_time = _emit(pending, last_time, tokens_per_step, writer, bar, summary, cfg.logging.every)
            if cfg.data.skip_bad_samples:
                metrics = {**metrics, "bad_samples": train_split.bad_samples}
            pending = (step, metrics, waited)
            if (step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps:
                last_time = _emit(pending, last_time, tokens_per_step, writer, bar, summary, cfg.logging.every)
                pending = None
                summary["val_loss"] = evaluate(state.params, val_batches)
                writer.write(step, {"val_loss": summary["val_loss"]})
                bar.write(f"step {step + 1}: val loss {summary['val_loss']:.4f}", file=out)
    finally:
        bar.close()
        writer.close()

    say(f"done: train loss {summary['loss']:.4f}, val loss {summary['val_loss']:.4f} "
        f"(unigram entropy {entropy:.4f}); metrics in {cfg.log_dir / 'metrics.jsonl'}")
    if tok is not None and is_main:
        ids = generate(model, state.params, tok.encode(cfg.sample.prompt), cfg.sample.tokens,
                       cfg.sample.temperature, seed=cfg.train.seed)
        say("sample: " + tok.decode(ids))
    return summary


def _emit(pending, last_time, tokens_per_step, writer, bar, summary, every) -> float:
    step, metrics, waited = pending
    values = {k: float(v) for k, v in metrics.items()}  # blocks until that step is done
    now = time.perf_counter()
    values["tokens_per_s"] = tokens_per_step / max(now - last_time, 1e-9)
    values["data_wait_s"] = waited
    writer.write(step, values)
    summary.update(values)
    bar.update(1)
    if step % every == 0:
        bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{values['tokens_per_s']:,.0f}", refresh=False)
    return now


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="zerolm train", description="Train a GPT model with ZeRO-1.")
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config file (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key; repeatable")
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
        run(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
