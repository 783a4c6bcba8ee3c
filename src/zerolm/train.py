"""The training loop of one run: its dataset, start (fresh or resumed), the ZeRO-1 step, evaluation,
checkpoints, metrics, samples and preemption. `zerolm.commands.train` is its command line.

Steps are counted from 1 everywhere: step s is the s-th optimizer update, its line in metrics.jsonl
holds that update's loss, and the checkpoint named s holds the state after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

import zerolm
from zerolm import comms, compilation_cache, device_policy, library_log, losses, storage
from zerolm import model as gpt_model
from zerolm.checkpoint import Checkpoints, remove_unfinished
from zerolm.checkpoint_meta import CheckpointMeta
from zerolm.config import Config
from zerolm.data.dataset import PreparedDataset, dataset_identity, open_dataset, resolve_vocab
from zerolm.data.loader import BatchLoader
from zerolm.data.mixture import BLOCK as MIXTURE_BLOCK
from zerolm.data.mixture import MixedOrder, MixedSplit, Mixture
from zerolm.data.shards import Split
from zerolm.data.tokenizer import Tokenizer
from zerolm.evaluate import make_evaluator
from zerolm.hardware import memory_limit
from zerolm.mesh import exit_peer_lost, is_first_host, is_peer_failure, make_mesh, on_process_0
from zerolm.metrics import MetricsWriter, StepMetrics, perplexity
from zerolm.mfu import Accounting, flops_per_token
from zerolm.preemption import Preempted, PreemptionWatch
from zerolm.profiling import Profiler
from zerolm.resume import start_state
from zerolm.runlock import LockHeld, RunLock
from zerolm.sample import Sampling, generate
from zerolm.sharding import abstract_views, shard_bytes, with_shardings
from zerolm.step import CompiledStep, DoesNotFit, build_and_compile, describe_remat_choice, is_out_of_memory
from zerolm.zero import TrainState, Zero1

# Settings that name a place; logging.dir must be local (see check_storage).
LOCAL_LOGS = ("metrics.jsonl is appended every step and wandb keeps its files there, and a gs:// object cannot be "
              "appended to; keep it local (wandb, or copying the directory to the bucket, keeps the logs)")


def check_storage(cfg: Config) -> str | None:
    """Before any device work: every place the run reads or writes can be used (StorageError, one line,
    otherwise). Returns the line that says which credentials gs:// is reached with, if that needs saying."""
    places = {"checkpoint.dir": cfg.checkpoint_dir, "data.dataset": cfg.data.dataset,
              "train.compilation_cache": compilation_cache.directory(cfg.train.compilation_cache) or ""}
    storage.check(cfg.logging.dir or "", "logging.dir", local_only=LOCAL_LOGS)  # (cfg.log_dir is a local Path)
    for what, location in places.items():
        storage.check(location, what, read_only=what == "data.dataset")
    return storage.credentials_note() if any(map(storage.is_remote, places.values())) else None


def run(cfg: Config, out=sys.stdout, *, resume: str = "auto", overwrite: bool = False) -> dict[str, float]:
    """Train `cfg` (resuming per `resume`); returns the last train loss, val loss and unigram entropy."""
    credentials = check_storage(cfg)
    with library_log.capture(cfg.log_dir / library_log.NAME.format(process=jax.process_index())):
        return _train(cfg, out, resume, overwrite, credentials)


def _train(cfg: Config, out, resume: str, overwrite: bool, credentials: str | None) -> dict[str, float]:
    mesh = make_mesh(cfg.dp, cfg.mesh.tp)
    is_main = is_first_host(mesh)
    say = (lambda *a: print(*a, file=out, flush=True)) if is_main else (lambda *a: None)
    if credentials:
        say(credentials)
    compilation_cache.use(cfg.train.compilation_cache)
    cfg, data = _open_data(cfg)
    with contextlib.ExitStack() as held:
        # Before the step is built and compiled: a directory in use is refused in seconds, not minutes.
        lock = _lock_directories(cfg, held)
        return _train_locked(cfg, mesh, data, out, say, lock, resume, overwrite)


@dataclasses.dataclass(frozen=True)
class _Data:
    """The run's data, opened and checked before anything is written."""

    dataset: PreparedDataset | Mixture
    train: Split | MixedSplit
    val: Split | MixedSplit
    entropy: float  # the train split's unigram entropy, nats per token
    tokenizer: Tokenizer | None  # for samples (None: sample.tokens is 0)


def _open_data(cfg: Config) -> tuple[Config, _Data]:
    """The dataset (or mixture) and its splits, checked; the config with the vocabulary resolved from it."""
    dataset = open_dataset(cfg)
    cfg = resolve_vocab(cfg, dataset)
    train_split = dataset.split("train", cfg.data.skip_bad_samples)
    val_split = dataset.split("val", cfg.data.skip_bad_samples)
    train_split.verify()  # a missing or truncated shard stops the run now, not when first read
    val_split.verify()
    entropy = dataset.manifest.splits["train"].unigram_entropy or 0.0  # None only for an empty split
    tokenizer = dataset.tokenizer() if cfg.sample.tokens else None  # fail now, not after training
    return cfg, _Data(dataset, train_split, val_split, entropy, tokenizer)


def _lock_directories(cfg: Config, held: contextlib.ExitStack) -> RunLock | None:
    """Take the checkpoint directory's run lock and, when it is another directory, the logging directory's
    (two runs writing one logging.dir would each rewrite the other's metrics.jsonl); `held` releases them.
    Returns the checkpoint directory's lock (None on processes other than 0)."""
    lock = on_process_0(lambda: RunLock.acquire(cfg.checkpoint_dir), (LockHeld, storage.StorageFault))
    if lock is not None:
        held.callback(lock.release)
    if str(cfg.log_dir) != str(cfg.checkpoint_dir):
        log_lock = on_process_0(lambda: RunLock.acquire(str(cfg.log_dir), what="logging directory"), (LockHeld,))
        if log_lock is not None:
            held.callback(log_lock.release)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("zerolm: checkpoint directory locked")
    return lock


def _train_locked(cfg: Config, mesh: Mesh, data: _Data, out, say, lock: RunLock | None, resume: str,
                  overwrite: bool) -> dict[str, float]:
    dataset, train_split, val_split, entropy, tokenizer = (data.dataset, data.train, data.val, data.entropy,
                                                          data.tokenizer)

    # Compiled once, here: the step runs these executables, and the summary reads their collectives.
    hits, t0 = compilation_cache.Hits.listen().hits, time.perf_counter()
    limit = memory_limit(jax.local_devices()[0])
    built = build_and_compile(cfg, mesh, limit)
    cfg, model, zero, init_fn, compiled = built.cfg, built.model, built.zero, built.init_fn, built.compiled
    abstract_params = zero.abstract_params
    n_params = gpt_model.count_params(abstract_params)
    accounting = Accounting(flops_per_token(gpt_model.count_params(abstract_params, exclude_positions=True),
                                            cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len),
                            jax.device_count(), jax.devices()[0].device_kind)
    facts = {"params": n_params, "devices": jax.device_count(), "device_kind": accounting.device_kind,
             "processes": jax.process_count(), "mesh": {"dp": cfg.dp, "tp": cfg.mesh.tp},
             "accum_steps": cfg.accum_steps, "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_len,
             "flops_per_token": accounting.flops_per_token, "zerolm_version": zerolm.__version__}
    memory = _check_fits(cfg, zero, compiled, limit)
    zero = zero.using(compiled.programs)
    texts = compiled.texts
    for line in _startup_summary(cfg, zero, accounting, n_params, texts):
        say(line)
    if memory:
        say(memory)
    if remat := describe_remat_choice(built, limit):
        say(remat)
    if cache := compilation_cache.directory(cfg.train.compilation_cache):
        loaded = compilation_cache.Hits.hits - hits
        say(f"compiled the step in {time.perf_counter() - t0:.1f} s; "
            + (f"{loaded} program(s) loaded from the compilation cache {cache}" if loaded else
               f"compilation cache: {cache}"))
    if isinstance(dataset, Mixture):
        say("data: mixture: " + ", ".join(f"{name} {n / MIXTURE_BLOCK:.4f} ({n} of every {MIXTURE_BLOCK} samples; weight "
                                          f"{w:g})" for name, n, w in zip(dataset.names, dataset.per_block,
                                                                           dataset.weights, strict=True)))
    say(f"data: {dataset.location}: {len(train_split)} train / {len(val_split)} val samples of "
        f"{cfg.model.seq_len + 1} tokens, tokenizer {dataset.manifest.tokenizer.name} "
        f"({dataset.manifest.tokenizer.vocab_size} tokens), unigram entropy {entropy:.3f} nats/token")
    evaluate = None
    n_val = min(cfg.train.eval_sequences, len(val_split))
    if n_val:
        evaluate = make_evaluator(functools.partial(losses.token_losses, model), zero.table.param_shardings,
                                  zero.table.row_sharding, val_split.head(n_val),
                                  cfg.dp * cfg.train.micro_batch_size)
        if n_val < cfg.train.eval_sequences:
            say(f"note: evaluating on all {n_val} validation samples (train.eval_sequences asks for "
                f"{cfg.train.eval_sequences})")
    else:
        say("note: " + ("train.eval_sequences is 0" if len(val_split) else f"{dataset.location} has no validation "
                        "samples") + ": training without evaluation")
    sample = functools.partial(_sample_text, model, tokenizer, cfg) if tokenizer is not None else None

    data_id = dataset_identity(cfg, dataset)
    with storage.faults(cfg.checkpoint_dir, "removing unfinished saves"):
        removed = on_process_0(lambda: remove_unfinished(cfg.checkpoint_dir), (OSError,))
    if removed:
        say(f"checkpoints: removed {len(removed)} unfinished save(s) of an earlier run that died while saving: "
            + ", ".join(removed))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("zerolm: unfinished saves removed")
    with _out_of_memory_as(cfg):
        ckpts, state, wandb_id = start_state(cfg, zero, init_fn, data_id, resume, overwrite, say)
    if lock is not None:
        ckpts.health = lock.check
    try:
        start = int(state.step)
        if start >= cfg.train.steps:
            say(f"nothing to do: {cfg.checkpoint_dir} is at step {start} and train.steps is {cfg.train.steps} "
                "(raise train.steps to go on, or start over with --resume never --overwrite)")
            return {"unigram_entropy": entropy}
        loop = _Loop(cfg, zero, ckpts, train_split, data_id, wandb_id, out, evaluate=evaluate, sample=sample,
                     accounting=accounting, facts=facts, lock=lock)
        with _out_of_memory_as(cfg):
            state, summary = loop.run(state, start)
        summary["unigram_entropy"] = entropy
    finally:
        ckpts.close()  # waits for a save in flight to be durable; an interrupted one is never listed

    val = f", val loss {summary['val_loss']:.4f}" if "val_loss" in summary else ""
    say(f"done: train loss {summary['loss']:.4f}{val} (unigram entropy {entropy:.4f}); metrics in "
        f"{cfg.log_dir / 'metrics.jsonl'}, checkpoints in {cfg.checkpoint_dir}")
    if sample is not None:
        say("sample: " + sample(state.params))
    return summary


def _check_fits(cfg: Config, zero: Zero1, compiled: CompiledStep, limit: int | None) -> str | None:
    """Stop before anything is written when the step cannot fit this device (DoesNotFit): the compiler
    refused a program (a TPU's does), or the compiled peak (`CompiledStep.memory`, `zerolm compile`'s rule)
    is over the allocator's limit (a GPU's: its compiler accepts any size). The header line, or None where
    the backend states no limit (CPU)."""
    if compiled.refused:
        name, refusal = next(iter(compiled.refused.items()))
        raise DoesNotFit(cfg, f"the compiler refused its {name} program: {refusal.strip().splitlines()[0][:300]}")
    if not limit:
        return None
    memory = compiled.memory(zero, cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps)
    name = max(memory, key=lambda n: memory[n]["peak_bytes"])
    peak = memory[name]["peak_bytes"]
    where = f"{peak / 2**30:.2f} GiB per device at its peak ({name}) of the {limit / 2**30:.2f} GiB"
    if peak > limit:
        gpu = jax.local_devices()[0].platform in ("gpu", "cuda", "rocm")
        raise DoesNotFit(cfg, f"the compiled step needs {where} the device may allocate"
                         + (", XLA_PYTHON_CLIENT_MEM_FRACTION of its memory (0.75 unless set)" if gpu else ""))
    return f"device memory: the compiled step needs {where} the device may allocate"


@contextlib.contextmanager
def _out_of_memory_as(cfg: Config):
    """A device that runs out at run time (the compiled peak fit, the allocator did not: fragmentation, or
    the evaluation's own program) stops the run with DoesNotFit; checkpoints already saved stay as they are."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        xla = str(e).split("RESOURCE_EXHAUSTED:", 1)[-1].strip().split(" with allocator")[0].splitlines()[0]
        raise DoesNotFit(cfg, f"the device ran out: {xla[:200]}") from None


def _sample_text(model: gpt_model.GPT, tokenizer: Tokenizer, cfg: Config, params) -> str:
    """The config's prompt and its continuation (every process runs it: the params span them all)."""
    sampling = Sampling(cfg.sample.temperature, cfg.sample.top_k, cfg.sample.top_p, seed=cfg.train.seed)
    prompt = tokenizer.encode(cfg.sample.prompt)[-(cfg.model.seq_len - 1):]
    return tokenizer.decode(generate(model, params, prompt, cfg.sample.tokens, sampling, tokenizer.eot_id))


def _startup_summary(cfg: Config, zero: Zero1, accounting: Accounting, n_params: int,
                     texts: dict[str, str]) -> list[str]:
    """What a run costs before it starts: sizes, per-device bytes, FLOPs and the compiled step's collectives."""
    params = with_shardings(zero.working_params, zero.table.param_shardings)
    opt = with_shardings(jax.eval_shape(zero.tx.init, abstract_views(zero.table.layouts, zero.abstract_params)),
                         zero.table.opt_shardings)
    accumulator = shard_bytes(jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, cfg.zero.accumulate_dtype, sharding=p.sharding), params))
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    lines = [f"zerolm: {cfg.name}: {n_params / 1e6:.2f}M params, {jax.device_count()} {accounting.device_kind} "
             f"device(s) in {jax.process_count()} process(es), mesh dp={cfg.dp} tp={cfg.mesh.tp}, "
             f"{cfg.accum_steps} accumulation step(s) of {cfg.train.micro_batch_size} sequence(s) per device, "
             f"{cfg.train.global_batch_size} sequences = {tokens:,} tokens per step, grad_reduce={cfg.zero.grad_reduce}"
             + (f" ({zero.scatter})" if cfg.zero.grad_reduce == "reduce_scatter" and zero.scatter != "collective" else "")
             + f", precision={cfg.zero.precision}, attention "
             f"{device_policy.for_device(cfg.model, zero.mesh.devices.flat[0]).attention}",
             f"per device: params {mib(shard_bytes(params))}, gradient accumulator {mib(accumulator)}, optimizer state "
             f"{mib(shard_bytes(opt))} (1/{cfg.dp * cfg.mesh.tp} of it, plus padding"
             + (", master weights included" if zero.mixed else "") + "); activations not counted",
             accounting.describe()]
    if cfg.model.document_mask:
        lines.append(f"documents: attention stays inside each document of a sample (end-of-text {cfg.model.eot}), "
                     f"positions {'restart per document' if cfg.model.document_positions == 'restart' else 'continue'}")
    try:
        traffic = comms.traffic(texts, dict(zero.mesh.shape))
    except ValueError as e:  # HLO this zerolm cannot read: the summary says so, the run goes on
        return [*lines, f"collectives per step: not read ({e})"]
    return [*lines, *("collectives per step: " + line for line in comms.describe(traffic, list(texts)))]


class _Loop:
    """Steps start + 1 .. train.steps of one run, with evaluation, samples, checkpoints and preemption."""

    def __init__(self, cfg: Config, zero: Zero1, ckpts: Checkpoints, train_split, data_id: dict, wandb_id: str,
                 out, *, evaluate, sample, accounting: Accounting, facts: dict, lock: RunLock | None):
        self.cfg, self.zero, self.ckpts, self.train_split, self.lock = cfg, zero, ckpts, train_split, lock
        self.data_id, self.wandb_id, self.out = data_id, wandb_id, out
        self.evaluate, self.sample, self.accounting, self.facts = evaluate, sample, accounting, facts
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len

    def checkpoint_meta(self, step: int, loss: float | None) -> CheckpointMeta:
        cfg = self.cfg
        return CheckpointMeta(step=step, time=time.time(), config=cfg.model_dump(), dp=cfg.dp, tp=cfg.mesh.tp,
                              accum_steps=cfg.accum_steps, process_count=jax.process_count(), dataset=self.data_id,
                              dataset_location=str(self.train_split.dataset.location),
                              tokens_seen=step * self.tokens_per_step, loss=loss, wandb_id=self.wandb_id,
                              zerolm_version=zerolm.__version__)

    def run(self, state: TrainState, start: int) -> tuple[TrainState, dict[str, float]]:
        cfg, zero = self.cfg, self.zero
        is_main = is_first_host(zero.mesh)
        loader = BatchLoader(self.train_split, zero.mesh, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                             cfg.train.seed)
        writer = MetricsWriter(cfg.log_dir, {**cfg.model_dump(), "run": self.facts}, cfg.name, cfg.logging.wandb,
                               cfg.logging.wandb_project, self.wandb_id, resume_step=start, enabled=is_main,
                               say=lambda line: print(line, file=self.out, flush=True))
        bar = tqdm(total=cfg.train.steps, initial=start, desc=cfg.name, unit="step", disable=not is_main,
                   file=self.out, dynamic_ncols=True, mininterval=0.5)
        preemption = PreemptionWatch()
        summary: dict[str, float] = {}
        emitter = StepMetrics(writer, bar, summary, self.tokens_per_step, self.accounting, cfg.logging.every,
                           cfg.train.max_consecutive_skips if cfg.train.skip_nonfinite else None)
        batches = loader.batches(start_step=start, prefetch=cfg.data.prefetch)
        shares = loader.order.shares if isinstance(loader.order, MixedOrder) else None
        profiler = Profiler(cfg.logging.profile_steps, start, cfg.train.steps, cfg.log_dir / "profile", bar, self.out)
        try:
            for step in range(start + 1, cfg.train.steps + 1):
                batch, waited = next(batches)
                profiler.before(step)
                state, metrics = zero(state, batch)
                self.ckpts.check()  # a save that failed in the background stops the run now
                if self.lock is not None:
                    self.lock.check()  # so does a gs:// lease that could not be renewed
                if cfg.data.skip_bad_samples:
                    metrics = {**metrics, "bad_samples": self.train_split.bad_samples}
                if shares is not None:  # the mixture as realised: each dataset's share of the samples so far
                    realised: dict[str, Any] = {f"mixture_share/{name}": share for name, share in
                                                shares(step * cfg.train.global_batch_size).items()}
                    metrics = {**metrics, **realised}
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
