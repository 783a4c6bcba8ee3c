"""The training loop: data, init, the ZeRO-1 step, evaluation, metrics, and a sample at the end."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass

import jax
import numpy as np
from tqdm import tqdm

from zerolm import model as gpt_model
from zerolm.config import Config, ConfigError, load_config
from zerolm.data.corpus import default_documents, split_documents
from zerolm.data.loader import BatchLoader, pack, unigram_entropy
from zerolm.data.tokenizer import Tokenizer, load_tokenizer
from zerolm.mesh import make_mesh
from zerolm.metrics import MetricsWriter
from zerolm.sample import generate
from zerolm.zero import TrainState, Zero1, make_optimizer


@dataclass
class Dataset:
    tokenizer: Tokenizer
    train: np.ndarray  # (n, seq_len + 1) packed samples
    val: np.ndarray


def load_data(cfg: Config) -> Dataset:
    documents = default_documents()
    train_docs, val_docs = split_documents(documents, cfg.data.val_every)
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_vocab_size, train_docs)
    T = cfg.model.seq_len
    return Dataset(tok, pack(tok.encode_batch(train_docs), tok.eot_id, T),
                   pack(tok.encode_batch(val_docs), tok.eot_id, T))


def resolve_vocab(cfg: Config, tok: Tokenizer) -> Config:
    if cfg.model.vocab_size == "auto":
        return cfg.resolve(model__vocab_size=tok.vocab_size)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{tok.vocab_size} tokens ({tok.name})")
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
    data = load_data(cfg)
    cfg = resolve_vocab(cfg, data.tokenizer)
    entropy = unigram_entropy(data.train)
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
    say(f"data: {len(data.train)} train / {len(data.val)} val samples of {cfg.model.seq_len + 1} tokens, "
        f"tokenizer {data.tokenizer.name} ({data.tokenizer.vocab_size} tokens), "
        f"unigram entropy {entropy:.3f} nats/token")

    loader = BatchLoader(data.train, mesh, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                         cfg.train.seed)
    val_loader = BatchLoader(data.val, mesh, cfg.dp * cfg.train.micro_batch_size, cfg.train.micro_batch_size, 0)
    val_batches = [val_loader.global_batch(i) for i in range(cfg.train.eval_batches)]
    evaluate = make_evaluator(zero, loss_fn)

    writer = MetricsWriter(cfg.log_dir, cfg.model_dump(), cfg.name, cfg.logging.wandb, cfg.logging.wandb_project)
    bar = tqdm(total=cfg.train.steps, desc=cfg.name, unit="step", disable=not is_main, file=out,
               dynamic_ncols=True, mininterval=0.5)
    summary: dict[str, float] = {"unigram_entropy": entropy}
    pending = None  # metrics are read one step behind, so the host never waits on the step in flight
    last_time = time.perf_counter()
    batches = loader.batches(start_step=0)
    try:
        for step in range(cfg.train.steps):
            batch, waited = next(batches)
            state, metrics = zero(state, batch)
            if pending is not None:
                last_time = _emit(pending, last_time, tokens_per_step, writer, bar, summary, cfg.logging.every)
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
    if cfg.sample.tokens and is_main:
        ids = generate(model, state.params, data.tokenizer.encode(cfg.sample.prompt), cfg.sample.tokens,
                       cfg.sample.temperature, seed=cfg.train.seed)
        say("sample: " + data.tokenizer.decode(ids))
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set, device_count=jax.device_count())
        run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
