"""Where a run starts: a fresh state, or the newest intact checkpoint of the run (and what changed since).

Refuses to start over existing checkpoints without --overwrite; moves a damaged checkpoint aside and
takes the one before it (`--resume auto`), or stops (`--resume strict`); moves an old run's checkpoints
and logs aside with `--resume never --overwrite`; refuses a resume whose data order cannot continue.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from zerolm.checkpoint import CheckpointError, Checkpoints, DamagedCheckpoint, move_aside, move_damaged
from zerolm.checkpoint_meta import CheckpointMeta
from zerolm.config import Config
from zerolm.mesh import on_process_0
from zerolm.runlock import LEASE_FILE, LOCK_FILE
from zerolm.zero import TrainState, Zero1


def start_state(cfg: Config, zero: Zero1, init_fn, data_id: dict, resume: str, overwrite: bool,
                say) -> tuple[Checkpoints, TrainState, str]:
    """The run's checkpoints, and a fresh sharded state or the newest intact checkpoint's.

    Refuses to start over existing checkpoints without --overwrite. A damaged checkpoint is moved
    aside and the one before it taken (`--resume auto`), or stops the run (`--resume strict`).
    Needs the directory's run lock. Closes the checkpoints if it raises."""
    directory = cfg.checkpoint_dir

    def open_checkpoints() -> Checkpoints:
        return Checkpoints(directory, keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every)

    def on_every_process(what: str, fn):
        result = on_process_0(fn, (CheckpointError, OSError))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"zerolm: {what}")
        return result

    ckpts = open_checkpoints()
    try:
        latest = ckpts.latest_step()
        if latest is not None and resume == "never":
            if not overwrite:
                raise CheckpointError(f"{directory}: already holds checkpoints (latest step {latest}); "
                                      "resume with --resume auto, or pass --overwrite to start over "
                                      "(the old checkpoints are moved aside, not deleted)")
            ckpts.close()
            aside = on_every_process("old checkpoints moved aside",
                                     lambda: move_aside(directory, keep=(LOCK_FILE, LEASE_FILE)))
            logs_aside = on_every_process("old logs moved aside", lambda: _move_logs_aside(cfg.log_dir))
            say(f"checkpoints: moved the old run aside to {aside}"
                + (f"; its metrics and logs ({', '.join(logs_aside[1])}) to {logs_aside[0]}" if logs_aside else ""))
            ckpts, latest = open_checkpoints(), None
        state = meta = None
        while latest is not None and resume != "never":
            try:
                ckpts.verify(latest)
                state, meta = ckpts.restore(latest, zero, cfg.model.model_dump())
                break
            except DamagedCheckpoint as e:
                if resume == "strict":
                    raise CheckpointError(f"{e} (--resume strict; --resume auto moves it aside and takes the "
                                          "newest intact checkpoint before it)") from None
                ckpts.close()
                target = on_every_process("damaged checkpoint moved aside",
                                          lambda step=latest: move_damaged(directory, step))
                ckpts = open_checkpoints()
                before = ckpts.latest_step()
                say(f"checkpoints: step {latest} is damaged ({e.reason}); moved it aside to {target}; "
                    + (f"resuming from step {before}" if before is not None else "no intact checkpoint is left, "
                       "starting from scratch"))
                latest = before
        if state is None or meta is None:
            return ckpts, zero.init(init_fn, jax.random.key(cfg.train.seed)), secrets.token_hex(4)
        _check_resumable(cfg, meta, data_id, ckpts.directory / str(latest))
    except BaseException:
        ckpts.close()
        raise
    saved_tp = meta.tp
    say(f"resumed from {ckpts.directory / str(latest)} (step {latest}, saved on dp={meta.dp} tp={saved_tp})")
    saved_train = meta.train
    saved_schedule = saved_train["schedule_steps"] or saved_train["steps"]
    if saved_schedule != cfg.train.schedule_length:
        say(f"  note: the lr schedule changed length: {saved_schedule} -> {cfg.train.schedule_length} steps "
            "(set train.schedule_steps to keep it)")
    if meta.accum_steps != cfg.accum_steps or meta.dp != cfg.dp:
        say(f"  device count changed: dp {meta.dp} -> {cfg.dp}; accumulation steps recomputed "
            f"{meta.accum_steps} -> {cfg.accum_steps} (same global batch of {cfg.train.global_batch_size})")
    if saved_tp != cfg.mesh.tp:
        say(f"  tensor parallelism changed: tp {saved_tp} -> {cfg.mesh.tp}; parameters and optimizer state resharded")
    return ckpts, state, meta.wandb_id


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
    """The data order can continue only on the same data and the same global batch."""
    if meta.dataset != data_id:
        diff = [f"{k}: checkpoint {meta.dataset.get(k)!r}, now {v!r}" for k, v in data_id.items()
                if meta.dataset.get(k) != v]
        raise CheckpointError(f"{where}: the data differs from the checkpoint's, so the "
                              f"data order cannot continue: {'; '.join(diff)}")
    saved_batch = meta.train["global_batch_size"]
    if saved_batch != cfg.train.global_batch_size:
        raise CheckpointError(f"{where}: train.global_batch_size was {saved_batch}; "
                              f"resuming with {cfg.train.global_batch_size} would change the data order")
