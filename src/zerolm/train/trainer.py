"""One training run, top to bottom: open it (`open_run`: its data, the directories' locks, the step compiled for
its shapes, the evaluator and the sampler, as one `Run`), start it (`zerolm.checkpoint.resume`: fresh or from the newest
intact checkpoint), then loop over the steps with the work between them as hooks: evaluation, downstream
tasks, samples and checkpoints, each with its `every`. `zerolm.commands.train` is its command line.

Steps are counted from 1 everywhere: step s is the s-th optimizer update, its line in metrics.jsonl
holds that update's loss, and the checkpoint named s holds the state after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

import zerolm
from zerolm.checkpoint import branch
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.checkpoint.resume import Resume, Start, check_before_compiling, start_state
from zerolm.checkpoint.run_lock import LockHeld, RunLock
from zerolm.checkpoint.store import remove_unfinished
from zerolm.config.sampling import Sampling
from zerolm.config.tree import Config
from zerolm.core import storage
from zerolm.core.errors import first_line, is_out_of_memory
from zerolm.core.hardware import memory_limit
from zerolm.data.context import ContextPlan
from zerolm.data.dataset import dataset_identity
from zerolm.data.loader import BatchLoader
from zerolm.data.mixture import MixedOrder
from zerolm.eval import downstream
from zerolm.eval.heldout import make_evaluator
from zerolm.model import losses
from zerolm.model.decoder import GPT
from zerolm.model.generate import generate
from zerolm.observe import launches, library_log
from zerolm.observe.metrics import MetricsWriter, StepMetrics, StepTokens, WandbRun, perplexity
from zerolm.observe.mfu import Accounting
from zerolm.observe.profiling import Profiler
from zerolm.parallel.build import DoesNotFit, build_and_compile, check_fits
from zerolm.parallel.mesh import exit_peer_lost, is_first_host, is_peer_failure, make_mesh, on_process_0
from zerolm.parallel.zero import TrainState, Zero
from zerolm.train import compilation_cache
from zerolm.train.context_steps import ContextSteps
from zerolm.train.preemption import Preempted, PreemptionWatch
from zerolm.train.preflight import accounting_for, describe_step, run_facts
from zerolm.train.run_data import RunData, data_facts, describe_data, open_data

# Settings that name a place; logging.dir must be local (see check_storage).
LOCAL_LOGS = ("metrics.jsonl is appended every step and wandb keeps its files there, and a gs:// object cannot be "
              "appended to; keep it local (wandb, or copying the directory to the bucket, keeps the logs)")

Say = Callable[[str], None]


def check_storage(cfg: Config) -> str | None:
    """Before any device work: every place the run reads or writes can be used (StorageError, one line,
    otherwise). Returns the line that says which credentials gs:// is reached with, if that needs saying."""
    places = {"checkpoint.dir": cfg.checkpoint_dir, "data.dataset": cfg.data.dataset, "train.init_from":
              cfg.train.init_from or "", "train.branch_from": cfg.train.branch_from or "",
              "train.compilation_cache": compilation_cache.directory(cfg.train.compilation_cache) or ""}
    storage.check(cfg.logging.dir or "", "logging.dir", local_only=LOCAL_LOGS)  # (cfg.log_dir is a local Path)
    for what, location in places.items():
        storage.check(location, what, read_only=what == "data.dataset")
    return storage.credentials_note() if any(map(storage.is_remote, places.values())) else None


def run(cfg: Config, out=sys.stdout, *, resume: str = "auto", overwrite: bool = False) -> dict[str, float]:
    """Train `cfg` (resuming per `resume`); returns the last train loss, val loss and unigram entropy."""
    credentials = check_storage(cfg)
    branch.check_logs_apart(cfg)  # before anything is written in logging.dir
    with library_log.capture(cfg.log_dir / library_log.NAME.format(process=jax.process_index())), \
            contextlib.ExitStack() as held:
        asked = Resume(resume, overwrite)
        try:
            opened = open_run(cfg, held, out, credentials, asked)
        except _NothingToDo as done:
            return {"unigram_entropy": done.entropy}
        t0 = time.perf_counter()
        start = _start(opened, asked, held)
        cfg = opened.cfg
        if start.step < cfg.train.steps and is_first_host(opened.mesh):
            _record_launch(opened, start, time.perf_counter() - t0)
        if start.step >= cfg.train.steps:
            _say_nothing_to_do(opened.say, cfg, start.step)
            return {"unigram_entropy": opened.data.entropy}
        with _out_of_memory_as(cfg):
            state, summary = _Loop(opened, start).run()
        start.checkpoints.close()  # waits for a save in flight to be durable; an interrupted one is never listed
        _say_done(opened, summary, state)
        return {**summary, "unigram_entropy": opened.data.entropy}


@dataclasses.dataclass(frozen=True)
class Run:
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


class _NothingToDo(Exception):
    """The run's checkpoints are already at train.steps: said before anything is compiled."""

    def __init__(self, entropy: float):
        super().__init__()
        self.entropy = entropy


def _say_nothing_to_do(say: Say, cfg: Config, step: int) -> None:
    say(f"nothing to do: {cfg.checkpoint_dir} is at step {step} and train.steps is {cfg.train.steps} "
        "(raise train.steps to go on, or start over with --resume never --overwrite)")


def open_run(cfg: Config, held: contextlib.ExitStack, out=sys.stdout, credentials: str | None = None,
             resume: Resume | None = None) -> Run:
    """Open `cfg`'s run: its eval.tasks and data (checked), the directories' locks (held by `held`), whatever
    refuses the start without a compiled step (zerolm.checkpoint.resume.check_before_compiling), then the step built and
    compiled for its shapes and checked to fit, the evaluators and the sampler; the header said on the way."""
    mesh = make_mesh(cfg.dp, cfg.mesh.tp)
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
        _say_nothing_to_do(say, cfg, resumes)
        raise _NothingToDo(data.entropy)
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
    return Run(cfg, mesh, data, model, zero, contexts, built.init_fn, accounting, data_id,
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
                          zero.table.row_sharding, data.val.head(n_val), cfg.dp * cfg.train.micro_batch_size)


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


def _start(opened: Run, resume: Resume, held: contextlib.ExitStack) -> Start:
    """Unfinished saves of an earlier run removed, then where the run starts (zerolm.checkpoint.resume); its checkpoints
    closed by `held` if the run stops before its loop ends."""
    cfg = opened.cfg
    with storage.faults(cfg.checkpoint_dir, "removing unfinished saves"):
        removed = on_process_0(lambda: remove_unfinished(cfg.checkpoint_dir), (OSError,))
    if removed:
        opened.say(f"checkpoints: removed {len(removed)} unfinished save(s) of an earlier run that died while "
                   "saving: " + ", ".join(removed))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("zerolm: unfinished saves removed")
    with _out_of_memory_as(cfg):
        start = start_state(cfg, opened.zero, opened.init_fn, opened.data_id, resume, opened.say)
    held.callback(start.checkpoints.close)
    if opened.lock is not None:
        start.checkpoints.health = opened.lock.check
    return start


def _record_launch(opened: Run, start: Start, start_s: float) -> None:
    """This launch's line in launches.jsonl (zerolm.observe.launches), before metrics.jsonl drops the steps it retrains."""
    cfg, peak = opened.cfg, opened.accounting.peak
    facts = {**run_facts(cfg, opened.zero, opened.accounting), "peak_flops": peak.flops if peak else None}
    where = cfg.checkpoint_dir if storage.is_remote(cfg.checkpoint_dir) else str(Path(cfg.checkpoint_dir).absolute())
    last_logged, lost_s = launches.logged_after(cfg.log_dir, start.step)
    launches.append(cfg.log_dir, launches.Launch(
        time=time.time(), start_step=start.step, last_logged_step=last_logged, compile_s=opened.compile_s,
        start_s=start_s, checkpoint_dir=where, wandb_id=start.wandb_id, config=cfg.model_dump(), facts=facts,
        data=data_facts(opened.data), lost_s=lost_s, branched_from=start.branched_from))


def _say_done(opened: Run, summary: dict[str, float], state: TrainState) -> None:
    cfg, entropy = opened.cfg, opened.data.entropy
    val = f", val loss {summary['val_loss']:.4f}" if "val_loss" in summary else ""
    val += f" (its EMA's {summary['val_loss_ema']:.4f})" if "val_loss_ema" in summary else ""
    opened.say(f"done: train loss {summary['loss']:.4f}{val} (unigram entropy {entropy:.4f}); metrics in "
               f"{cfg.log_dir / 'metrics.jsonl'}, checkpoints in {cfg.checkpoint_dir}")
    if opened.sample is not None:
        opened.say("sample: " + opened.sample(state.params))


@contextlib.contextmanager
def _out_of_memory_as(cfg: Config):
    """A device that runs out at run time (the compiled peak fit, the allocator did not: fragmentation, or
    the evaluation's own program) stops the run with DoesNotFit; checkpoints already saved stay as they are."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        xla = str(e).split("RESOURCE_EXHAUSTED:", 1)[-1].split(" with allocator")[0]
        raise DoesNotFit(cfg, f"the device ran out: {first_line(xla, 200)}") from None


def _validation(loss: float) -> dict[str, float]:
    return {"val_loss": loss, "val_perplexity": perplexity(loss)}


@dataclasses.dataclass(frozen=True)
class Hook:
    """Host work between two steps: at every `every`-th step (0: never); at the last step too (`at_last`
    True), or never there (False: the run's end does it); at the step a preemption stops at if `at_stop`.
    `run(step, state, stopping)` returns what it adds to the run's summary."""

    every: int
    run: Callable[[int, TrainState, bool], dict[str, float]]
    at_last: bool = True
    at_stop: bool = False

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        if last:
            return self.at_last
        return (self.every > 0 and step % self.every == 0) or (stopping and self.at_stop)


class _Loop:
    """Steps start + 1 .. train.steps of an opened run, the hooks between them, and preemption."""

    def __init__(self, opened: Run, start: Start):
        self.run_, self.start = opened, start
        self.plan = opened.contexts.plan
        self.is_main = is_first_host(opened.mesh)
        self.shares: Callable[[int], dict[str, float]] | None = None  # a mixture's realised shares

    def tokens_seen(self, step: int) -> int:
        """Tokens trained on in steps 1 .. `step`, each at its context (zerolm.data.context)."""
        return self.plan.tokens_seen(step, self.run_.cfg.train.global_batch_size)

    def step_tokens(self, step: int) -> StepTokens:
        """What step `step` trains: its tokens, the tokens seen after it, and its context's FLOP accounting."""
        context = self.plan.at(step)
        accounting = self.run_.accounting if context is self.plan.contexts[-1] else \
            self.run_.contexts.accounting(context)
        return StepTokens(self.run_.cfg.train.global_batch_size * context.tokens_per_sample, self.tokens_seen(step),
                          accounting)

    def hooks(self, writer: MetricsWriter, bar, emitter: StepMetrics) -> list[Hook]:
        """Evaluation, downstream tasks, samples and checkpoints, in the order they run between two steps. The
        tasks run before the save of their step: a row lost to a kill was of a step no checkpoint holds, which
        the resumed run trains and evaluates again (metrics.jsonl keeps the rows up to the step resumed)."""
        cfg, opened = self.run_.cfg, self.run_
        hooks = []
        if opened.evaluate is not None:
            hooks.append(Hook(cfg.train.eval_every, functools.partial(self.evaluate, writer, bar)))
        if opened.tasks is not None:
            hooks.append(Hook(cfg.eval.every or cfg.train.eval_every, functools.partial(self.evaluate_tasks, writer,
                                                                                          bar)))
        if opened.sample is not None and cfg.sample.every:
            # at_last=False: the run's last sample is its closing line
            hooks.append(Hook(cfg.sample.every, functools.partial(self.sample, writer, bar), at_last=False))
        hooks.append(Hook(cfg.checkpoint.every, functools.partial(self.save, writer, emitter), at_stop=True))
        return hooks

    def evaluate(self, writer: MetricsWriter, bar, step: int, state: TrainState, stopping: bool) -> dict[str, float]:
        """The validation loss of the parameters, and with train.ema of their moving average beside it."""
        assert self.run_.evaluate is not None
        t0 = time.perf_counter()
        numbers = _validation(self.run_.evaluate(state.params))
        ema = self.run_.zero.ema_params(state)  # (a gathered copy, dropped once evaluated)
        if ema is not None:
            numbers.update({f"{key}_ema": value for key, value in _validation(self.run_.evaluate(ema)).items()})
            del ema
        writer.write(step, {**numbers, "tokens_seen": self.tokens_seen(step), "eval_s": time.perf_counter() - t0})
        line = f"step {step}: val loss {numbers['val_loss']:.4f}, perplexity {numbers['val_perplexity']:.2f}"
        if "val_loss_ema" in numbers:
            line += f"; EMA: val loss {numbers['val_loss_ema']:.4f}, perplexity {numbers['val_perplexity_ema']:.2f}"
        bar.write(line, file=self.run_.out)
        return {key: numbers[key] for key in ("val_loss", "val_loss_ema") if key in numbers}

    def evaluate_tasks(self, writer: MetricsWriter, bar, step: int, state: TrainState,
                       stopping: bool) -> dict[str, float]:
        assert self.run_.tasks is not None
        t0 = time.perf_counter()
        numbers = self.run_.tasks(state.params, step)
        writer.write(step, {**numbers, "tokens_seen": self.tokens_seen(step), "tasks_s": time.perf_counter() - t0})
        if self.is_main:
            bar.write(f"step {step}: " + ", ".join(f"{key.removeprefix('tasks/')} {value:.4f}"
                                                   for key, value in numbers.items()), file=self.run_.out)
        return numbers

    def sample(self, writer: MetricsWriter, bar, step: int, state: TrainState, stopping: bool) -> dict[str, float]:
        assert self.run_.sample is not None
        text = self.run_.sample(state.params)
        writer.write_text(step, "sample", text)
        if self.is_main:
            bar.write(f"step {step}: sample: {text}", file=self.run_.out)
        return {}

    def save(self, writer: MetricsWriter, emitter: StepMetrics, step: int, state: TrainState,
             stopping: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        self.start.checkpoints.save(state, self.checkpoint_meta(step, emitter.summary().get("loss")), wait=stopping)
        writer.write(step, {"save_s": time.perf_counter() - t0})  # the step waits this long for it
        return {}

    def checkpoint_meta(self, step: int, loss: float | None) -> CheckpointMeta:
        cfg = self.run_.cfg
        return CheckpointMeta(step=step, time=time.time(), config=cfg.model_dump(), dp=cfg.dp, tp=cfg.mesh.tp,
                              accum_steps=cfg.accum_steps, process_count=jax.process_count(),
                              dataset={**self.run_.data_id, "order": self.start.order},
                              dataset_location=str(self.run_.data.train.dataset.location),
                              tokens_seen=self.tokens_seen(step), loss=loss, wandb_id=self.start.wandb_id,
                              zerolm_version=zerolm.__version__, branched_from=self.start.branched_from)

    def run(self) -> tuple[TrainState, dict[str, float]]:
        with contextlib.ExitStack() as held:
            writer, bar, emitter, batches = self.open(held)
            try:
                return self.steps(writer, bar, emitter, batches, held)
            except Exception as e:
                if is_peer_failure(e):  # before the cleanup, which would wait on the dead peer
                    exit_peer_lost(e)
                raise

    def open(self, held: contextlib.ExitStack):
        """The metrics writer, the progress bar, the step metrics and the batches, closed by `held`."""
        opened, cfg, start = self.run_, self.run_.cfg, self.start.step
        loader = BatchLoader(opened.data.train, opened.mesh, cfg.train.global_batch_size,
                             cfg.train.micro_batch_size, cfg.train.seed, order=self.start.order)
        wandb_run = WandbRun(cfg.logging.wandb_project, cfg.name, self.start.wandb_id, cfg.logging.wandb,
                             {**cfg.model_dump(), "run": run_facts(cfg, opened.zero, opened.accounting)})
        writer = MetricsWriter(cfg.log_dir, wandb_run, resume_step=start, enabled=self.is_main,
                               say=lambda line: print(line, file=opened.out, flush=True))
        held.callback(writer.close)
        bar = tqdm(total=cfg.train.steps, initial=start, desc=cfg.name, unit="step", disable=not self.is_main,
                   file=opened.out, dynamic_ncols=True, mininterval=0.5)
        held.callback(bar.close)
        emitter = StepMetrics(writer, bar, self.step_tokens, cfg.logging.every,
                              cfg.train.max_consecutive_skips if cfg.train.skip_nonfinite else None)
        held.callback(emitter.close)
        batches = loader.batches(start_step=start, prefetch=cfg.data.prefetch,
                                 plan=self.plan if self.plan.staged else None)
        held.callback(batches.close)
        self.shares = loader.order.shares if isinstance(loader.order, MixedOrder) else None
        return writer, bar, emitter, batches

    def steps(self, writer, bar, emitter: StepMetrics, batches, held: contextlib.ExitStack):
        opened, cfg, state = self.run_, self.run_.cfg, self.start.state
        preemption = held.enter_context(contextlib.closing(PreemptionWatch()))
        profiler = held.enter_context(contextlib.closing(
            Profiler(cfg.logging.profile_steps, self.start.step, cfg.train.steps, cfg.log_dir / "profile", bar,
                     opened.out)))
        hooks, summary = self.hooks(writer, bar, emitter), {}
        for step in range(self.start.step + 1, cfg.train.steps + 1):
            preemption.dispatching(step)
            batch, waited = next(batches)
            profiler.before(step)
            state, metrics = opened.contexts.at(step)(state, batch)
            self.check_health()
            emitter.push(step, self.with_data_metrics(step, metrics), waited)  # emits the previous step's
            stopping = preemption.reached(step)
            if step == cfg.train.steps:
                preemption.finishing(step)  # a stop during the last step's work saves this step, not one after
            due = [h for h in hooks if h.due(step, step == cfg.train.steps, stopping)]
            if due:
                emitter.flush()  # a non-finite step raises here, before it could be saved
                for hook in due:
                    summary.update(hook.run(step, state, stopping))
                emitter.restart_clock()  # the next step's time is its own, not this host work's
            profiler.after(step, state)
            if stopping or (step == cfg.train.steps and preemption.stopped()):
                self.start.checkpoints.wait()  # (a stop during the last step's work came after its save began)
                raise Preempted(step, preemption.why)
        emitter.flush()
        self.start.checkpoints.wait()
        return state, {**emitter.summary(), **summary}

    def check_health(self) -> None:
        self.start.checkpoints.check()  # a save that failed in the background stops the run now
        if self.run_.lock is not None:
            self.run_.lock.check()  # so does a gs:// lease that could not be renewed

    def with_data_metrics(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """The step's metrics, with the bad samples skipped so far and each mixture dataset's share of the
        samples so far (the mixture as realised)."""
        if self.run_.cfg.data.skip_bad_samples:
            metrics = {**metrics, "bad_samples": self.run_.data.train.bad_samples}
        if self.shares is not None:
            shares = self.shares(step * self.run_.cfg.train.global_batch_size)
            metrics = {**metrics, **{f"mixture_share/{name}": share for name, share in shares.items()}}
        return metrics
