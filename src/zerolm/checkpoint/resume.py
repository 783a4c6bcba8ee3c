"""Where a run starts: a fresh state, the newest intact checkpoint of the run (and what changed since), or, for a
decay branch without checkpoints of its own, the checkpoint train.branch_from names (zerolm.checkpoint.branch).

Refuses to start over existing checkpoints without --overwrite; moves a damaged checkpoint aside and
takes the one before it (`--resume auto`), or stops (`--resume strict`); moves an old run's checkpoints
and logs aside with `--resume never --overwrite`; refuses a resume (or a branch) whose data order cannot
continue.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from zerolm.checkpoint import branch, warm_start
from zerolm.checkpoint.compatible import check_compatible
from zerolm.checkpoint.errors import CheckpointError, DamagedCheckpoint
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.checkpoint.run_lock import LEASE_FILE, LOCK_FILE
from zerolm.checkpoint.set_aside import move_aside, move_damaged
from zerolm.checkpoint.store import Checkpoints, quiet_orbax
from zerolm.config.tree import Config
from zerolm.core import storage
from zerolm.data.order import VERSION as ORDER_VERSION
from zerolm.parallel.mesh import on_process_0
from zerolm.parallel.zero import TrainState, Zero


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts: its checkpoints (open; the caller closes them), the state and its step, the
    wandb run it continues, and the data order it reads in (zerolm.data.order: a checkpoint continues in
    the version it was saved with)."""

    checkpoints: Checkpoints
    state: TrainState
    wandb_id: str
    order: int = ORDER_VERSION
    branched_from: dict | None = None  # a decay branch's source (zerolm.checkpoint.branch.Source.record)

    @property
    def step(self) -> int:
        return int(self.state.step)


@dataclasses.dataclass(frozen=True)
class Resume:
    """How a run starts, as asked (`zerolm train --resume`, `--overwrite`)."""

    mode: str = "auto"  # auto | strict | never
    overwrite: bool = False


def start_state(cfg: Config, zero: Zero, init_fn, data_id: dict, asked: Resume, say) -> Start:
    """The run's checkpoints, and a fresh sharded state or the newest intact checkpoint's.

    Refuses to start over existing checkpoints without --overwrite. A damaged checkpoint is moved
    aside and the one before it taken (`--resume auto`), or stops the run (`--resume strict`).
    Needs the directory's run lock. Closes the checkpoints if it raises."""
    places = _Places(cfg)
    ckpts = places.open()
    try:
        latest = ckpts.latest_step()
        if latest is not None and asked.mode == "never":
            ckpts, latest = _start_over(places, ckpts, latest, asked.overwrite, say), None
        restored = None
        while latest is not None and asked.mode != "never" and restored is None:
            ckpts, latest, restored = _restore_or_move_aside(places, ckpts, latest, zero, asked.mode, say)
        if restored is None and cfg.train.branch_from is not None:  # a branch: its source's whole state
            return _branched(cfg, zero, data_id, ckpts, say)
        if restored is None:  # fresh: drawn from train.seed, or train.init_from's parameters
            state = warm_start.initial_state(cfg, zero, init_fn, data_id, say)
            return Start(ckpts, state, secrets.token_hex(4), ORDER_VERSION)
        state, meta = restored
        _check_resumable(cfg, meta, data_id, ckpts.directory / str(latest))
    except BaseException:
        ckpts.close()
        raise
    _say_resumed(cfg, meta, ckpts.directory / str(latest), say)
    return Start(ckpts, state, meta.wandb_id, meta.dataset.get("order", 1), meta.branched_from)


def _branched(cfg: Config, zero: Zero, data_id: dict, ckpts: Checkpoints, say) -> Start:
    """A branch's start: the state of the checkpoint train.branch_from names, restored onto this run's mesh as a
    resume restores it (the source read only), a wandb run of its own, the source's data order."""
    with branch.opened(cfg) as source:
        _check_branchable(cfg, source, data_id)
        try:
            state, meta = source.checkpoints.restore(source.step, zero, cfg.model.model_dump())
        except CheckpointError as e:
            raise CheckpointError(f"{branch.KEY}: {e}") from None
        record = source.record()
    _say_resumed(cfg, meta, source.where, say, branched=True)
    return Start(ckpts, state, secrets.token_hex(4), meta.dataset.get("order", 1), record)


def _check_branchable(cfg: Config, source: branch.Source, data_id: dict) -> None:
    """What a resume checks (the model, the precision, the data and the global batch), naming train.branch_from."""
    try:
        check_compatible(source.meta, source.where, cfg.model.model_dump(), cfg.zero.precision, cfg.train.ema)
        _check_resumable(cfg, source.meta, data_id, source.where)
    except CheckpointError as e:
        raise CheckpointError(f"{branch.KEY}: {e}") from None


def check_before_compiling(cfg: Config, data_id: dict, asked: Resume) -> int | None:
    """What refuses this start without a compiled step, refused before the step is built and compiled (on a
    real model, minutes): --resume never over checkpoints without --overwrite, and a resume whose newest
    checkpoint cannot continue (another model, precision, data or global batch). Returns the step of the
    checkpoint the run would continue (None: it starts fresh, or the newest checkpoint is damaged and
    start_state decides); a fresh start's train.init_from (zerolm.checkpoint.warm_start.check) or train.branch_from
    (the same checks as a resume's, and zerolm.checkpoint.branch.opened's). Reads only; every process reads the same
    and raises the same."""
    with storage.faults(cfg.checkpoint_dir, "listing the checkpoints"), quiet_orbax():
        if not storage.path(cfg.checkpoint_dir).exists():
            return _fresh(cfg, data_id)
        ckpts = Checkpoints(cfg.checkpoint_dir, read_only=True)
    try:
        with storage.faults(cfg.checkpoint_dir, "listing the checkpoints"):
            latest = ckpts.latest_step()
        if latest is None:
            return _fresh(cfg, data_id)
        if asked.mode == "never":
            if not asked.overwrite:
                raise _refused_start_over(cfg.checkpoint_dir, latest)
            return _fresh(cfg, data_id)
        try:
            ckpts.verify(latest)  # its files as recorded (one listing): a damaged one is start_state's to handle
            meta = ckpts.readable_meta(latest)
        except DamagedCheckpoint:
            return None
        where = ckpts.directory / str(latest)
        check_compatible(meta, where, cfg.model.model_dump(), cfg.zero.precision, cfg.train.ema)
        _check_resumable(cfg, meta, data_id, where)
        return latest
    finally:
        ckpts.close()


def _fresh(cfg: Config, data_id: dict) -> int | None:
    """check_before_compiling's answer for a start without checkpoints of the run's own: None, its train.init_from
    checked first; or the step train.branch_from continues, checked."""
    warm_start.check(cfg, data_id)
    if cfg.train.branch_from is None:
        return None
    with branch.opened(cfg) as source:
        _check_branchable(cfg, source, data_id)
        return source.step


def _refused_start_over(directory, latest: int) -> CheckpointError:
    return CheckpointError(f"{directory}: already holds checkpoints (latest step {latest}); "
                           "resume with --resume auto, or pass --overwrite to start over "
                           "(the old checkpoints are moved aside, not deleted)")


@dataclasses.dataclass(frozen=True)
class _Places:
    """The run's checkpoint and logging directories, and the work on them every process waits for."""

    cfg: Config

    def open(self) -> Checkpoints:
        return Checkpoints(self.cfg.checkpoint_dir, keep=self.cfg.checkpoint.keep,
                           keep_every=self.cfg.checkpoint.keep_every)

    def on_every_process(self, what: str, fn):
        """`fn` on process 0 (its errors raised on every process), then every process waits for it."""
        result = on_process_0(fn, (CheckpointError, OSError))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"zerolm: {what}")
        return result


def _start_over(places: _Places, ckpts: Checkpoints, latest: int, overwrite: bool, say) -> Checkpoints:
    """--resume never: refused without --overwrite; with it, the old run's checkpoints and logs moved aside."""
    directory = places.cfg.checkpoint_dir
    if not overwrite:
        raise _refused_start_over(directory, latest)
    ckpts.close()
    aside = places.on_every_process("old checkpoints moved aside",
                                    lambda: move_aside(directory, keep=(LOCK_FILE, LEASE_FILE)))
    logs_aside = places.on_every_process("old logs moved aside", lambda: _move_logs_aside(places.cfg.log_dir))
    say(f"checkpoints: moved the old run aside to {aside}"
        + (f"; its metrics and logs ({', '.join(logs_aside[1])}) to {logs_aside[0]}" if logs_aside else ""))
    return places.open()


def _restore_or_move_aside(places: _Places, ckpts: Checkpoints, latest: int, zero: Zero, resume: str, say):
    """(checkpoints, step, (state, meta)) of checkpoint `latest` restored; if it is damaged, it is moved aside
    (--resume auto) and the step before it returned with None, or the run stops (--resume strict). A restore that
    fails without damage (out of memory, permission, storage, a bug: zerolm.checkpoint.errors) raises as it is."""
    try:
        ckpts.verify(latest)
        return ckpts, latest, ckpts.restore(latest, zero, places.cfg.model.model_dump(), places.cfg.train.ema)
    except DamagedCheckpoint as e:
        if resume == "strict":
            raise CheckpointError(f"{e} (--resume strict; --resume auto moves it aside and takes the "
                                  "newest intact checkpoint before it)") from None
        ckpts.close()
        target = places.on_every_process("damaged checkpoint moved aside",
                                         lambda: move_damaged(places.cfg.checkpoint_dir, latest))
        ckpts = places.open()
        before = ckpts.latest_step()
        say(f"checkpoints: step {latest} is damaged ({e.reason}); moved it aside to {target}; "
            + (f"resuming from step {before}" if before is not None else "no intact checkpoint is left, "
               "starting from scratch"))
        return ckpts, before, None


def _say_resumed(cfg: Config, meta: CheckpointMeta, where, say, branched: bool = False) -> None:
    """Where the run resumed (or branched) from, and what changed since the checkpoint was saved."""
    if branched:
        say(f"branched from {where} ({branch.KEY}: step {meta.step} of the run {meta.config['name']}, saved on "
            f"dp={meta.dp} tp={meta.tp}): its parameters, optimizer state and data position; checkpoints to "
            f"{cfg.checkpoint_dir}, logs to {cfg.log_dir}")
    else:
        say(f"resumed from {where} (step {meta.step}, saved on dp={meta.dp} tp={meta.tp})")
    saved_train, train = meta.full_config["train"], cfg.train.model_dump()
    saved_schedule, schedule = _schedule(saved_train), _schedule(train)
    if saved_schedule != schedule:
        kept = "" if branched or _length(saved_train) == _length(train) else \
            " (train.schedule_steps keeps a schedule's length when train.steps changes)"
        say(f"  lr schedule: {saved_schedule} -> {schedule}{kept}")
    if saved_train["lr"] != train["lr"]:
        say(f"  train.lr: {saved_train['lr']:g} -> {train['lr']:g}")
    if meta.slices != cfg.mesh.slices:
        say(f"  slices changed: {meta.slices} -> {cfg.mesh.slices}; the optimizer state laid out again on each slice")
    if meta.accum_steps != cfg.accum_steps or meta.dp != cfg.dp:
        say(f"  device count changed: dp {meta.dp} -> {cfg.dp}; accumulation steps recomputed "
            f"{meta.accum_steps} -> {cfg.accum_steps} (same global batch of {cfg.train.global_batch_size})")
    if meta.tp != cfg.mesh.tp:
        say(f"  tensor parallelism changed: tp {meta.tp} -> {cfg.mesh.tp}; parameters and optimizer state resharded")
    if meta.stage != cfg.zero.stage:
        say(f"  ZeRO stage changed: {meta.stage} -> {cfg.zero.stage}; parameters and optimizer state resharded")


def _length(train: dict) -> int:
    return train["schedule_steps"] or train["steps"]


def _schedule(train: dict) -> str:
    """An lr schedule in a few words (its train section as recorded): what a resume or a branch says it changed."""
    if train["schedule"] == "constant":
        return "constant"
    length = _length(train)
    if train["schedule"] == "wsd":
        return f"wsd, its decay over steps {length - train['decay_steps'] + 1}..{length}"
    return f"{train['schedule']} over {length} steps"


def _move_logs_aside(log_dir: Path) -> tuple[Path, list[str]] | None:
    """With the old checkpoints, the old run's logs (metrics.jsonl, wandb/, the profile, the plot) go
    to `<logging.dir>.replaced-<time>/`. The lock and this launch's process and library logs stay."""
    if not log_dir.is_dir():
        return None
    keep = (LOCK_FILE, LEASE_FILE, *(p.name for p in log_dir.glob("process-*.log")),
            *(p.name for p in log_dir.glob("library-*.log")))
    names = sorted(p.name for p in log_dir.iterdir() if p.name not in keep)
    if not names:
        return None
    return Path(move_aside(log_dir, keep=keep)), names


def _check_resumable(cfg: Config, meta: CheckpointMeta, data_id: dict, where) -> None:
    """The data order can continue only on the same data and the same global batch (in the order's version
    the checkpoint was saved with, whatever a new run would take)."""
    saved = {k: v for k, v in meta.dataset.items() if k != "order"}
    if saved != {k: v for k, v in data_id.items() if k != "order"}:
        diff = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in data_id.items()
                if k != "order" and saved.get(k) != v]
        raise CheckpointError(f"{where}: the data differs from the checkpoint's, so the "
                              f"data order cannot continue: {'; '.join(diff)}")
    saved_batch = meta.train["global_batch_size"]
    if saved_batch != cfg.train.global_batch_size:
        raise CheckpointError(f"{where}: train.global_batch_size was {saved_batch}; "
                              f"resuming with {cfg.train.global_batch_size} would change the data order")
