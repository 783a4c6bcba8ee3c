"""A run's steps, start + 1 .. train.steps, with the work between them as hooks (`Hook`: the run's evaluation,
downstream tasks, samples and checkpoints, and the user's own), a step's metrics one step late, and preemption.
Steps are counted from 1: step s is the s-th optimizer update, its line in metrics.jsonl holds that update's loss,
and the checkpoint named s holds the state after it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from tqdm import tqdm

import zerolm
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.checkpoint.resume import Start
from zerolm.data.loader import BatchLoader
from zerolm.data.mixture import MixedOrder
from zerolm.observe.metrics import MetricsWriter, StepMetrics, StepTokens, WandbRun, perplexity
from zerolm.observe.profiling import Profiler
from zerolm.parallel.mesh import exit_if_a_peer_fails, is_first_host
from zerolm.parallel.zero import TrainState
from zerolm.train.opening import OpenedRun
from zerolm.train.preemption import Preempted, PreemptionWatch
from zerolm.train.preflight import run_facts


def _validation(loss: float) -> dict[str, float]:
    return {"val_loss": loss, "val_perplexity": perplexity(loss)}


@dataclasses.dataclass(frozen=True)
class Hook:
    """Work between two steps, and what it logs: `fn(step, state, stopping)` runs after step `step`'s update (`state`
    the run's TrainState after it: its `params`, in the run's shardings; `stopping`: a preemption stops the run at
    this step) every `every` steps (0: never), at the run's last step too (`at_last`; False: never there), and at the
    step a preemption stops at if `at_stop`. The numbers it returns are written at that step (metrics.jsonl and
    wandb) and join the run's summary. The run's own evaluation, tasks, samples and checkpoints are hooks; yours
    (`zerolm.train.trainer.train(cfg, hooks=[...])`) run after the samples, before the checkpoint of their step.
    Every process of a multi-process run runs it (the params span them all); metrics are written by the first."""

    every: int
    fn: Callable[[int, TrainState, bool], dict[str, float] | None]
    at_last: bool = True
    at_stop: bool = False

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        if last:
            return self.at_last
        return (self.every > 0 and step % self.every == 0) or (stopping and self.at_stop)


class StepLoop:
    """Steps start + 1 .. train.steps of an opened run, the hooks between them, and preemption."""

    def __init__(self, opened: OpenedRun, start: Start, hooks: Sequence[Hook] = ()):
        self.opened, self.start, self.user_hooks = opened, start, tuple(hooks)
        self.plan = opened.contexts.plan
        self.is_main = is_first_host(opened.mesh)
        self.shares: Callable[[int], dict[str, float]] | None = None  # a mixture's realised shares

    def tokens_seen(self, step: int) -> int:
        """Tokens trained on in steps 1 .. `step`, each at its context (zerolm.data.context)."""
        return self.plan.tokens_seen(step, self.opened.cfg.train.global_batch_size)

    def step_tokens(self, step: int) -> StepTokens:
        """What step `step` trains: its tokens, the tokens seen after it, and its context's FLOP accounting."""
        context = self.plan.at(step)
        accounting = self.opened.accounting if context is self.plan.contexts[-1] else \
            self.opened.contexts.accounting(context)
        return StepTokens(self.opened.cfg.train.global_batch_size * context.tokens_per_sample, self.tokens_seen(step),
                          accounting)

    def hooks(self, writer: MetricsWriter, bar, emitter: StepMetrics) -> list[Hook]:
        """Evaluation, downstream tasks, samples, the user's hooks and checkpoints, in the order they run between two
        steps. Everything runs before the save of its step: a row lost to a kill was of a step no checkpoint holds,
        which the resumed run trains and evaluates again (metrics.jsonl keeps the rows up to the step resumed)."""
        cfg, opened = self.opened.cfg, self.opened
        hooks = []
        if opened.evaluate is not None:
            hooks.append(Hook(cfg.train.eval_every, functools.partial(self.evaluate, bar)))
        if opened.tasks is not None:
            hooks.append(Hook(cfg.eval.every or cfg.train.eval_every, functools.partial(self.evaluate_tasks, bar)))
        if opened.sample is not None and cfg.sample.every:
            # at_last=False: the run's last sample is its closing line
            hooks.append(Hook(cfg.sample.every, functools.partial(self.sample, writer, bar), at_last=False))
        hooks.extend(self.user_hooks)
        hooks.append(Hook(cfg.checkpoint.every, functools.partial(self.save, writer, emitter), at_stop=True))
        return hooks

    def evaluate(self, bar, step: int, state: TrainState, stopping: bool) -> dict[str, float]:
        """The validation loss of the parameters, and with train.ema of their moving average beside it."""
        assert self.opened.evaluate is not None
        t0 = time.perf_counter()
        numbers = _validation(self.opened.evaluate(state.params))
        ema = self.opened.zero.ema_params(state)  # (a gathered copy, dropped once evaluated)
        if ema is not None:
            numbers.update({f"{key}_ema": value for key, value in _validation(self.opened.evaluate(ema)).items()})
            del ema
        line = f"step {step}: val loss {numbers['val_loss']:.4f}, perplexity {numbers['val_perplexity']:.2f}"
        if "val_loss_ema" in numbers:
            line += f"; EMA: val loss {numbers['val_loss_ema']:.4f}, perplexity {numbers['val_perplexity_ema']:.2f}"
        bar.write(line, file=self.opened.out)
        return {**numbers, "tokens_seen": self.tokens_seen(step), "eval_s": time.perf_counter() - t0}

    def evaluate_tasks(self, bar, step: int, state: TrainState, stopping: bool) -> dict[str, float]:
        assert self.opened.tasks is not None
        t0 = time.perf_counter()
        numbers = self.opened.tasks(state.params, step)
        if self.is_main:
            bar.write(f"step {step}: " + ", ".join(f"{key.removeprefix('tasks/')} {value:.4f}"
                                                   for key, value in numbers.items()), file=self.opened.out)
        return {**numbers, "tokens_seen": self.tokens_seen(step), "tasks_s": time.perf_counter() - t0}

    def sample(self, writer: MetricsWriter, bar, step: int, state: TrainState, stopping: bool) -> dict[str, float]:
        assert self.opened.sample is not None
        text = self.opened.sample(state.params)
        writer.write_text(step, "sample", text)
        if self.is_main:
            bar.write(f"step {step}: sample: {text}", file=self.opened.out)
        return {}

    def save(self, writer: MetricsWriter, emitter: StepMetrics, step: int, state: TrainState,
             stopping: bool) -> dict[str, float]:
        writer.flush()  # every row up to this step is logged everywhere before the checkpoint can be resumed from
        t0 = time.perf_counter()
        self.start.checkpoints.save(state, self.checkpoint_meta(step, emitter.summary().get("loss")), wait=stopping)
        return {"save_s": time.perf_counter() - t0}  # the step waits this long for it

    def checkpoint_meta(self, step: int, loss: float | None) -> CheckpointMeta:
        cfg = self.opened.cfg
        return CheckpointMeta(step=step, time=time.time(), config=cfg.model_dump(), dp=cfg.dp, tp=cfg.mesh.tp,
                              accum_steps=cfg.accum_steps, process_count=jax.process_count(),
                              dataset={**self.opened.data_id, "order": self.start.order},
                              dataset_location=str(self.opened.data.train.dataset.location),
                              tokens_seen=self.tokens_seen(step), loss=loss, wandb_id=self.start.wandb_id,
                              zerolm_version=zerolm.__version__, branched_from=self.start.branched_from)

    def train(self) -> tuple[TrainState, dict[str, float]]:
        """The steps, and the run's summary: the last step's metrics and what the hooks logged last."""
        with contextlib.ExitStack() as held:
            writer, bar, emitter, batches = self.open(held)
            with exit_if_a_peer_fails():  # before `held` cleans up, which would wait on the dead peer
                return self.steps(writer, bar, emitter, batches, held)

    def open(self, held: contextlib.ExitStack):
        """The metrics writer, the progress bar, the step metrics and the batches, closed by `held`."""
        opened, cfg, start = self.opened, self.opened.cfg, self.start.step
        loader = BatchLoader(opened.data.train, opened.mesh, cfg.train.global_batch_size,
                             cfg.train.micro_batch_size, cfg.train.seed, order=self.start.order)
        wandb_run = WandbRun(cfg.logging.wandb_project, cfg.name, self.start.wandb_id, cfg.logging.wandb,
                             {**cfg.model_dump(), "run": run_facts(cfg, opened.zero, opened.accounting)})
        writer = MetricsWriter(cfg.log_dir, wandb_run, resume_step=start, enabled=self.is_main,
                               tensorboard=cfg.tensorboard_dir, say=lambda line: print(line, file=opened.out, flush=True))
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
        opened, cfg, state = self.opened, self.opened.cfg, self.start.state
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
                    if numbers := hook.fn(step, state, stopping):
                        writer.write(step, numbers)
                        summary.update(numbers)
                writer.flush()  # (the save's own row too, written after the save began)
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
        if self.opened.lock is not None:
            self.opened.lock.check()  # so does a gs:// lease that could not be renewed

    def with_data_metrics(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """The step's metrics, with the bad samples skipped so far and each mixture dataset's share of the
        samples so far (the mixture as realised)."""
        if self.opened.cfg.data.skip_bad_samples:
            metrics = {**metrics, "bad_samples": self.opened.data.train.bad_samples}
        if self.shares is not None:
            shares = self.shares(step * self.opened.cfg.train.global_batch_size)
            metrics = {**metrics, **{f"mixture_share/{name}": share for name, share in shares.items()}}
        return metrics
