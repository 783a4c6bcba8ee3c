"""One training run, top to bottom (`train`): open it (zerolm.train.opening: its data, the directories' locks, the step
compiled for its shapes, the evaluator and the sampler), start it (zerolm.checkpoint.resume: fresh or from the newest
intact checkpoint), then loop over the steps (zerolm.train.loop) with the work between them as hooks: evaluation,
downstream tasks, samples, yours, and checkpoints, each with its `every`. `zerolm.commands.train` is its command line.

Steps are counted from 1 everywhere: step s is the s-th optimizer update, its line in metrics.jsonl
holds that update's loss, and the checkpoint named s holds the state after it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from zerolm.checkpoint import branch
from zerolm.checkpoint.resume import Resume, Start, start_state
from zerolm.checkpoint.store import remove_unfinished
from zerolm.config.tree import Config
from zerolm.core import storage
from zerolm.core.errors import first_line, is_out_of_memory
from zerolm.observe import launches, library_log
from zerolm.parallel.build import DoesNotFit
from zerolm.parallel.mesh import exit_if_a_peer_fails, is_first_host, on_process_0
from zerolm.parallel.zero import TrainState
from zerolm.train.loop import Hook, StepLoop
from zerolm.train.opening import AlreadyDone, OpenedRun, check_storage, open_run, say_nothing_to_do
from zerolm.train.preflight import run_facts
from zerolm.train.run_data import data_facts


def train(cfg: Config, out=sys.stdout, *, resume: str = "auto", overwrite: bool = False,
          hooks: Sequence[Hook] = ()) -> dict[str, float]:
    """Train `cfg` (resuming per `resume`), with your own `hooks` between steps beside the run's
    (zerolm.train.loop.Hook); returns the run's summary: its last step's metrics, what its hooks logged last (the
    last val loss, ...), and the data's unigram entropy."""
    credentials = check_storage(cfg)
    branch.check_logs_apart(cfg)  # before anything is written in logging.dir
    with library_log.capture(cfg.log_dir / library_log.NAME.format(process=jax.process_index())), \
            contextlib.ExitStack() as held, exit_if_a_peer_fails():  # (before `held` waits on a dead peer)
        asked = Resume(resume, overwrite)
        opened = open_run(cfg, held, out, credentials, asked)
        if isinstance(opened, AlreadyDone):
            return {"unigram_entropy": opened.entropy}
        t0 = time.perf_counter()
        start = _start(opened, asked, held)
        cfg = opened.cfg
        if start.step < cfg.train.steps and is_first_host(opened.mesh):
            _record_launch(opened, start, time.perf_counter() - t0)
        if start.step >= cfg.train.steps:
            say_nothing_to_do(opened.say, cfg, start.step)
            return {"unigram_entropy": opened.data.entropy}
        with _out_of_memory_as(cfg):
            state, summary = StepLoop(opened, start, hooks).train()
        start.checkpoints.close()  # waits for a save in flight to be durable; an interrupted one is never listed
        _say_done(opened, summary, state)
        return {**summary, "unigram_entropy": opened.data.entropy}


def _start(opened: OpenedRun, resume: Resume, held: contextlib.ExitStack) -> Start:
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


def _record_launch(opened: OpenedRun, start: Start, start_s: float) -> None:
    """This launch's line in launches.jsonl (zerolm.observe.launches), before metrics.jsonl drops the steps it retrains."""
    cfg, peak = opened.cfg, opened.accounting.peak
    facts = {**run_facts(cfg, opened.zero, opened.accounting), "peak_flops": peak.flops if peak else None}
    where = cfg.checkpoint_dir if storage.is_remote(cfg.checkpoint_dir) else str(Path(cfg.checkpoint_dir).absolute())
    last_logged, lost_s = launches.logged_after(cfg.log_dir, start.step)
    launches.append(cfg.log_dir, launches.Launch(
        time=time.time(), start_step=start.step, last_logged_step=last_logged, compile_s=opened.compile_s,
        start_s=start_s, checkpoint_dir=where, wandb_id=start.wandb_id, config=cfg.model_dump(), facts=facts,
        data=data_facts(opened.data), lost_s=lost_s, branched_from=start.branched_from))


def _say_done(opened: OpenedRun, summary: dict[str, float], state: TrainState) -> None:
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
