"""A training run opened: everything its loop needs, checked and compiled before the first step (`open_run`, one
`OpenedRun`): the places it reads and writes, its eval.tasks and data, the directories' locks, whatever refuses the
start without a compiled step, the step built and compiled for its shapes and checked to fit, the evaluator and the
sampler; the run's header said on the way."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from zerolm.checkpoint.resume import Resume, check_before_compiling
from zerolm.checkpoint.run_lock import LockHeld, RunLock
from zerolm.config.sampling import Sampling
from zerolm.config.tree import Config
from zerolm.core import storage
from zerolm.core.hardware import memory_limit
from zerolm.data.context import ContextPlan
from zerolm.data.dataset import dataset_identity
from zerolm.eval import downstream
from zerolm.eval.heldout import make_evaluator
from zerolm.model import losses
from zerolm.model.decoder import GPT
from zerolm.model.generate import generate
from zerolm.observe.mfu import Accounting
from zerolm.parallel.build import build_and_compile, check_fits
from zerolm.parallel.mesh import is_first_host, make_mesh, on_process_0
from zerolm.parallel.zero import Zero
from zerolm.train import compilation_cache
from zerolm.train.context_steps import ContextSteps
from zerolm.train.preflight import accounting_for, describe_step
from zerolm.train.run_data import RunData, describe_data, open_data

# Settings that name a place; logging.dir must be local (see check_storage).
LOCAL_LOGS = ("metrics.jsonl is appended every step and wandb keeps its files there, and a gs:// object cannot be "
              "appended to; keep it local (wandb, or copying the directory to the bucket, keeps the logs)")

Say = Callable[[str], None]


def check_storage(cfg: Config) -> str | None:
    """Before any device work: every place the run reads or writes can be used (StorageError, one line,
    otherwise). Returns the line that says which credentials gs:// is reached with, if that needs saying."""
    places = {"checkpoint.dir": cfg.checkpoint_dir, "data.dataset": cfg.data.dataset, "train.init_from":
              cfg.train.init_from or "", "train.branch_from": cfg.train.branch_from or "",
              "train.compilation_cache": compilation_cache.directory(cfg.train.compilation_cache) or "",
              "logging.tensorboard_dir": cfg.logging.tensorboard_dir or ""}
    storage.check(cfg.logging.dir or "", "logging.dir", local_only=LOCAL_LOGS)  # (cfg.log_dir is a local Path)
    for what, location in places.items():
        storage.check(location, what, read_only=what == "data.dataset")
    return storage.credentials_note() if any(map(storage.is_remote, places.values())) else None


@dataclasses.dataclass(frozen=True)
class OpenedRun:
    """One run, opened: everything the loop needs, checked and compiled before the first step."""

    cfg: Config  # as compiled: vocab and remat auto resolved
    mesh: Mesh
    data: RunData
    model: GPT  # resolved for the mesh's devices
    zero: Zero  # running the programs compiled for this run's shapes (at model.seq_len)
    contexts: ContextSteps  # the step of each context (train.context_stages: one per stage, then model.seq_len's)
    init_fn: Callable[[jax.Array], Any]
    accounting: Accounting
    data_id: dict[str, Any]  # the data's identity, which checkpoints record and a resume must match
    evaluate: Callable[[Any], float] | None  # params -> mean validation loss (None: no validation samples)
    sample: Callable[[Any], str] | None  # params -> the prompt and its continuation (None: sample.tokens is 0)
    tasks: downstream.DuringTraining | None  # (params, step) -> eval.tasks' metrics (None: no eval.tasks)
    lock: RunLock | None  # the checkpoint directory's (None on processes other than 0)
    say: Say  # prints on the first host only
    out: Any
    compile_s: float = 0.0  # building and compiling the step


@dataclasses.dataclass(frozen=True)
class AlreadyDone:
    """A run whose checkpoints are already at train.steps, found (and said) before anything is compiled."""

    step: int
    entropy: float  # the data's unigram entropy, which a run reports


def say_nothing_to_do(say: Say, cfg: Config, step: int) -> None:
    say(f"nothing to do: {cfg.checkpoint_dir} is at step {step} and train.steps is {cfg.train.steps} "
        "(raise train.steps to go on, or start over with --resume never --overwrite)")


def open_run(cfg: Config, held: contextlib.ExitStack, out=sys.stdout, credentials: str | None = None,
             resume: Resume | None = None) -> OpenedRun | AlreadyDone:
    """Open `cfg`'s run: its eval.tasks and data (checked), the directories' locks (held by `held`), whatever
    refuses the start without a compiled step (zerolm.checkpoint.resume.check_before_compiling), then the step built and
    compiled for its shapes and checked to fit, the evaluators and the sampler; the header said on the way."""
    mesh = make_mesh(cfg.dp, cfg.mesh.tp, slices=cfg.mesh.slices)
    say: Say = (lambda line: print(line, file=out, flush=True)) if is_first_host(mesh) else (lambda line: None)
    if credentials:
        say(credentials)
    compilation_cache.use(cfg.train.compilation_cache)
    # An unknown task (or one whose data is not here) stops the run in seconds, not after compiling.
    manager = downstream.prepare(list(cfg.eval.tasks), cfg.eval.include_path, keys=downstream.TRAINING) \
        if cfg.eval.tasks else None
    cfg, data = open_data(cfg)
    # Before the step is built and compiled: a directory in use is refused in seconds, not minutes.
    lock = _lock_directories(cfg, held)
    data_id = dataset_identity(cfg, data.dataset)
    resumes = check_before_compiling(cfg, data_id, resume or Resume())
    if resumes is not None and resumes >= cfg.train.steps:
        say_nothing_to_do(say, cfg, resumes)
        return AlreadyDone(resumes, data.entropy)
    hits, t0 = compilation_cache.Hits.listen().hits, time.perf_counter()
    limit = memory_limit(jax.local_devices()[0])
    built = build_and_compile(cfg, mesh, limit)
    compile_s = time.perf_counter() - t0
    memory = check_fits(built, limit)
    zero = built.zero.using(built.compiled.programs)
    accounting = accounting_for(built.cfg, zero)
    contexts = ContextSteps(built, zero, ContextPlan.of(built.cfg.train, built.cfg.model.seq_len), limit)
    for line in describe_step(built, accounting, memory, limit):
        say(line)
    if contexts.plan.staged:
        for line in contexts.describe():
            say(line)
    if cache := compilation_cache.directory(cfg.train.compilation_cache):
        loaded = compilation_cache.Hits.hits - hits
        say(f"compiled the step in {compile_s:.1f} s; "
            + (f"{loaded} program(s) loaded from the compilation cache {cache}" if loaded else
               f"compilation cache: {cache}"))
    for line in describe_data(built.cfg, data):
        say(line)
    cfg, model = built.cfg, built.model
    tasks = None
    if manager is not None and data.tokenizer is not None:
        from zerolm.eval.harness import Loaded  # (lm-evaluation-harness: imported when eval.tasks asks for it)

        tasks = downstream.DuringTraining(list(cfg.eval.tasks), manager, Loaded(model, None, mesh, data.tokenizer),
                                          cfg.eval.limit)
    return OpenedRun(cfg, mesh, data, model, zero, contexts, built.init_fn, accounting, data_id,
               _evaluator(cfg, model, zero, data, say), _sampler(cfg, model, data), tasks, lock, say, out, compile_s)


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


def _evaluator(cfg: Config, model: GPT, zero: Zero, data: RunData, say: Say) -> Callable[[Any], float] | None:
    """The mean loss over train.eval_sequences validation samples (all of them if fewer), or None."""
    n_val = min(cfg.train.eval_sequences, len(data.val))
    if not n_val:
        say("note: " + ("train.eval_sequences is 0" if len(data.val) else f"{data.dataset.location} has no "
                        "validation samples") + ": training without evaluation")
        return None
    if n_val < cfg.train.eval_sequences:
        say(f"note: evaluating on all {n_val} validation samples (train.eval_sequences asks for "
            f"{cfg.train.eval_sequences})")
    return make_evaluator(functools.partial(losses.token_losses, model), zero.table.param_shardings,
                          zero.table.row_sharding, data.val.head(n_val), cfg.data_ranks * cfg.train.micro_batch_size)


def _sampler(cfg: Config, model: GPT, data: RunData) -> Callable[[Any], str] | None:
    """The config's prompt and its continuation (every process runs it: the params span them all), or None."""
    tokenizer = data.tokenizer
    if tokenizer is None or not cfg.sample.tokens:  # (eval.tasks loads the tokenizer too)
        return None
    sampling = Sampling(**cfg.sample.model_dump(include=set(Sampling.model_fields)))
    sampling = sampling.model_copy(update={"seed": cfg.train.seed if sampling.seed is None else sampling.seed})
    prompt = tokenizer.encode(cfg.sample.prompt)[-(cfg.model.seq_len - 1):]
    return lambda params: tokenizer.decode(generate(model, params, prompt, cfg.sample.tokens, sampling,
                                                    tokenizer.eot_id))
