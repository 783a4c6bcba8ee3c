"""Training metrics: one JSON object per step in <logging.dir>/metrics.jsonl, mirrored to wandb and, with
`logging.tensorboard`, to TensorBoard scalars (zerolm.observe.tensorboard).

`step` is the number of optimizer steps taken, as in messages and checkpoint names: the line of
step s holds the loss of the s-th update, and the checkpoint of step s the state after it. A run
that resumes from the checkpoint of step s first drops the lines of later steps (rewriting the file
atomically), so each step is logged once even after a `kill -9`. One host writes: the one holding
the mesh's first device (process 0 by default).

wandb is imported only when a run asks for it (`offline` or `online`); the WANDB_MODE environment
variable, when set, wins over the config, as wandb documents. Everything wandb writes (the run, its
cache, config and staging areas) goes under `<logging.dir>/wandb/`, not into the home directory or
the working directory, unless the user's own WANDB_*_DIR variables say otherwise. An offline run is
uploaded later with `wandb sync <logging.dir>/wandb/offline-run-*`. `online` without wandb credentials
(WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or a `wandb login` entry in ~/.netrc) logs offline instead
and says so in one line: a run on a remote host has no one to answer wandb's login prompt.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zerolm.core.errors import ZerolmError
from zerolm.core.exitcodes import EXIT_NONFINITE
from zerolm.observe.mfu import Accounting
from zerolm.observe.tensorboard import TensorBoardWriter


class NonFiniteError(ZerolmError):
    """A non-finite loss or gradient norm (or too many skipped updates in a row): exit 3."""

    exit_code = EXIT_NONFINITE


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


@dataclasses.dataclass(frozen=True)
class WandbRun:
    """The wandb run a MetricsWriter mirrors to."""

    project: str  # logging.wandb_project
    name: str  # the run's name
    id: str  # stored in every checkpoint, so that a resumed run continues the same wandb run
    mode: str  # logging.wandb: disabled | offline | online (the WANDB_MODE variable wins)
    config: dict[str, Any]  # wandb's run config: the resolved config plus facts of the run


class MetricsWriter:
    def __init__(self, log_dir: Path, wandb_run: WandbRun, resume_step: int = 0, enabled: bool | None = None,
                 *, tensorboard: str | None = None, say=print):
        """`tensorboard`: the directory TensorBoard's scalars go to (logging.tensorboard), or None; `say` prints a
        notice (wandb logging offline for want of credentials)."""
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._wandb = None
        self._tensorboard: TensorBoardWriter | None = None
        if not self.enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        _drop_after(self.path, resume_step)
        self._file = self.path.open("a")
        if tensorboard is not None:
            self._tensorboard = TensorBoardWriter(tensorboard, first_step=resume_step + 1)
        self._wandb, self._env_before = start_wandb(log_dir, wandb_run, say)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        values = {k: float(v) for k, v in metrics.items()}
        record = {"step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(step, values)
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def flush(self) -> None:
        """Return once everything written so far is where it goes (metrics.jsonl is at each row; TensorBoard's
        events are written behind the loop): before a checkpoint, so that a resume from it finds its steps."""
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def write_text(self, step: int, key: str, text: str) -> None:
        """Text (a generated sample) to wandb, as preformatted HTML; metrics.jsonl holds numbers only."""
        if self.enabled and self._wandb is not None:
            import html

            import wandb
            self._wandb.log({key: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            finish_wandb(self._wandb, self._env_before)
            if self._tensorboard is not None:
                self._tensorboard.close()


def start_wandb(log_dir: Path, wandb_run: WandbRun, say=print) -> tuple[Any, dict[str, str | None]]:
    """The wandb run `wandb_run` names, started (or continued: resume="allow") with everything it writes under
    `<log_dir>/wandb`, and the environment it changed (for finish_wandb); (None, {}) where wandb is disabled."""
    mode: Any = os.environ.get("WANDB_MODE", wandb_run.mode)  # wandb checks the value
    if mode == "online" and not wandb_credentials():
        mode = "offline"
        say(f"wandb: no credentials on this host (WANDB_API_KEY, or `wandb login`): logging offline to "
            f"{log_dir / 'wandb'}; upload it later with `wandb sync {log_dir / 'wandb'}/offline-run-*`")
    if mode == "disabled":
        return None, {}
    home = (log_dir / "wandb").absolute()
    env_before = {v: os.environ.get(v) for v in _WANDB_DIRS}
    for variable, sub in _WANDB_DIRS.items():
        if env_before[variable] is None:
            os.environ[variable] = str(home / sub) if sub else str(log_dir.absolute())
    import wandb

    return wandb.init(project=wandb_run.project, name=wandb_run.name, config=wandb_run.config,
                      dir=str(log_dir.absolute()), mode=mode, id=wandb_run.id, resume="allow"), env_before


def finish_wandb(run: Any, env_before: dict[str, str | None]) -> None:
    """Finish a run start_wandb started, and put back the environment it changed."""
    if run is not None:
        run.finish()
        for variable, value in env_before.items():
            if value is None:
                os.environ.pop(variable, None)


def wandb_credentials() -> bool:
    """Whether wandb has credentials here without asking: its key or identity token in the environment,
    or a `wandb login` entry for its host in the netrc file."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return host is not None and netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# wandb's environment variables for where it writes -> the place under <logging.dir>/wandb ("": the
# run directory itself, under which wandb makes its own `wandb/`).
_WANDB_DIRS = {"WANDB_DIR": "", "WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config", "WANDB_DATA_DIR": "data",
               "WANDB_ARTIFACT_DIR": "artifacts"}


def _drop_after(path: Path, step: int) -> None:
    """Keep the lines of steps <= `step` (and drop a line cut short by a kill); atomic rewrite."""
    if not path.exists():
        return
    kept, changed = [], False
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        kept.append(line) if keep else None
        changed |= not keep
    if changed:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


class CompletionClock:
    """When each step finished on the device, noted by a thread that waits on the steps' outputs in turn.

    The loop reads a step's metrics one step late, after dispatching the next step. Dispatch may block
    (on a full queue of device work, or while the runtime runs a program inline), so the moment the loop
    reads a step's values can be long after the step ended: timing steps by those reads gives one step
    twice its time and the next nearly none. This thread blocks on each step's outputs as soon as the
    step is dispatched and notes the time they become ready, so a step's end is its own whatever the loop
    was doing then; the loop never waits on it beyond the read it already makes."""

    def __init__(self):
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._done: dict[int, float] = {}
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="zerolm-step-clock", daemon=True)
        self._thread.start()

    def watch(self, step: int, outputs: Any) -> None:
        """Note when `outputs` (the step's device arrays) are ready."""
        self._pending.put((step, outputs))

    def done_at(self, step: int) -> float:
        """The `time.perf_counter()` at which step `step`'s outputs were ready (waits for the thread)."""
        with self._ready:
            self._ready.wait_for(lambda: step in self._done)
            return self._done.pop(step)

    def close(self) -> None:
        """Let the thread end once it has seen the steps before (not waited for: a failed device may never
        answer, and the thread is a daemon)."""
        self._pending.put(None)

    def _watch(self) -> None:
        while (item := self._pending.get()) is not None:
            step, outputs = item
            try:
                jax.block_until_ready(outputs)
            except Exception:  # noqa: BLE001  (the loop's own read of these outputs raises it)
                pass
            ready = time.perf_counter()
            with self._ready:
                self._done[step] = ready
                self._ready.notify_all()


@dataclasses.dataclass(frozen=True)
class StepTokens:
    """What one step trains, for its metrics: its tokens, the tokens seen after it, and its FLOP accounting (a
    staged-context run's steps differ: zerolm.data.context)."""

    tokens: int
    seen: int
    accounting: Accounting


class StepMetrics:
    """Turns a step's device metrics into logged numbers one step late, so dispatch never waits.

    `step_time_s` is the time from the end of the previous step on the device (or from the end of the host
    work between steps: saves, evaluations, samples, which `save_s`, `eval_s` and `tasks_s` time) to the end
    of this one (`CompletionClock`): the step itself, its wait for data included. tokens/s and MFU follow
    from it and from what the step trains (`step_tokens(step)`)."""

    def __init__(self, writer, bar, step_tokens: Callable[[int], StepTokens], every, max_skips: int | None,
                 clock: CompletionClock | None = None):
        """`clock`: when each step ended (default: a CompletionClock of this run's steps)."""
        self.writer, self.bar = writer, bar
        self._last: dict[str, float] = {}  # the last emitted step's values
        self.step_tokens = step_tokens
        self.every, self.max_skips = every, max_skips
        self.pending: tuple[int, dict[str, Any], float] | None = None
        self.clock = clock or CompletionClock()
        self.last_time = time.perf_counter()

    def push(self, step, metrics, waited):
        self.clock.watch(step, metrics)
        self.flush()
        self.pending = (step, metrics, waited)

    def summary(self) -> dict[str, float]:
        """The last emitted step's values (loss, tokens_per_s, ...): what a finished run reports."""
        return dict(self._last)

    def restart_clock(self):
        """After host work between steps (a save, an evaluation): the next step is timed from now."""
        self.last_time = time.perf_counter()

    def close(self) -> None:
        """Stop the completion clock's thread."""
        self.clock.close()

    def flush(self):
        if self.pending is None:
            return
        step, metrics, waited = self.pending
        self.pending = None
        # One transfer for all of them (blocks until that step is done; it is, or nearly: the next one is dispatched).
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        done = self.clock.done_at(step)
        step_time = max(done - self.last_time, 1e-9)
        self.last_time = max(done, self.last_time)
        trained = self.step_tokens(step)
        values["perplexity"] = perplexity(values["loss"])
        values["tokens_seen"] = trained.seen
        values["step_time_s"] = step_time
        values["tokens_per_s"] = trained.tokens / step_time
        values["data_wait_s"] = waited
        values["data_wait_share"] = min(waited / step_time, 1.0)
        values.update(trained.accounting(values["tokens_per_s"]))
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
        self._last = values
        self.bar.update(1)
        if step % self.every == 0:
            postfix = {"loss": f"{values['loss']:.3f}", "tok_s": f"{values['tokens_per_s']:,.0f}"}
            if "mfu" in values:
                postfix["mfu"] = f"{values['mfu']:.1%}"
            self.bar.set_postfix(postfix, refresh=False)
