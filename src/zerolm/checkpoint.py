"""Checkpoints with orbax: asynchronous, sharded, atomic, and restorable on another device count.

A checkpoint is a step directory written by an orbax CheckpointManager, holding two items:
  state  params, the dp-sharded optimizer state (each process writes its own shards) and the step
  meta   JSON: the resolved config, the dp it was saved on, the dataset/tokenizer identity, tokens
         seen, the last loss, the wandb run id, the time
Orbax writes into a temporary directory and renames it when complete. A save cut short by a crash
is never listed, so `latest_step` is always a checkpoint that restores.

The data loader's position is not stored separately: the batch of step s is a pure function of
(seed, s) (see data/loader.py), so the step is the position.

Elastic restore: the optimizer state is saved in the ZeRO layout of the dp it was trained on (see
zero.Layout). Leaves split along an axis have the parameter's shape whatever dp is, and restore
straight into the new sharding. Leaves packed into dp padded blocks change shape with dp: they are
restored whole and repacked for the new dp.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath

from zerolm.zero import TrainState, Zero1, abstract_views, is_layout, plan, with_shardings


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; one line naming the directory and what is wrong."""


class Checkpoints:
    """The checkpoints of one run directory (local path or gs://)."""

    def __init__(self, directory: str | Path, *, keep: int = 3, keep_every: int | None = None,
                 read_only: bool = False):
        directory = str(directory)
        # orbax needs absolute paths; a relative local one is taken from the working directory.
        self.directory = epath.Path(directory if "://" in directory else Path(directory).absolute())
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, keep_period=keep_every, create=not read_only, read_only=read_only,
            enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, meta: dict[str, Any], *, wait: bool = False) -> None:
        """Start an asynchronous save; the step continues while it is written."""
        step = int(meta["step"])
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        if wait:
            self.manager.wait_until_finished()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def meta(self, step: int) -> dict[str, Any]:
        try:
            return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        except Exception as e:  # orbax raises many types for a damaged directory
            raise CheckpointError(f"{self.directory / str(step)}: cannot read checkpoint metadata "
                                  f"({type(e).__name__}: {_first_line(e)})") from None

    def restore(self, step: int, zero: Zero1, model_config: dict) -> tuple[TrainState, dict[str, Any]]:
        """Restore `step` into `zero`'s mesh and shardings. Checks the model first; writes nothing."""
        meta = self.meta(step)
        where = self.directory / str(step)
        saved_model = meta["config"]["model"]
        differs = [f"model.{k}: checkpoint {saved_model.get(k)!r}, config {v!r}"
                   for k, v in model_config.items() if saved_model.get(k) != v and k not in _COMPUTE_ONLY]
        if differs:
            raise CheckpointError(f"{where}: the checkpoint's model differs from the config: " + "; ".join(differs))

        saved_layouts = plan(zero.abstract_params, meta["dp"])
        saved_views = abstract_views(saved_layouts, zero.abstract_params)
        saved_opt = jax.eval_shape(zero.tx.init, saved_views)
        # Same shape as now: restore straight into the new sharding; else whole, then repacked below.
        same = jax.tree.map(lambda old, new: old.view_shape == new.view_shape, saved_layouts, zero.layouts,
                            is_leaf=is_layout)
        view_restore = jax.tree.map(lambda s, sh: sh if s else zero.replicated, same, zero.view_shardings)
        opt_restore = optax.tree_map_params(zero.tx, lambda _, sh: sh, saved_opt, view_restore,
                                            transform_non_params=lambda _: zero.replicated)
        target = TrainState(step=jax.ShapeDtypeStruct((), np.int32, sharding=zero.replicated),
                            params=with_shardings(zero.abstract_params, zero.param_shardings),
                            opt_state=with_shardings(saved_opt, opt_restore))
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except Exception as e:
            raise CheckpointError(f"{where}: cannot restore, the checkpoint is damaged or incomplete "
                                  f"({type(e).__name__}: {_first_line(e)})") from None
        state = restored["state"]
        if meta["dp"] != zero.dp:
            repack = jax.jit(lambda opt: optax.tree_map_params(
                zero.tx, lambda v, old, new: new.to_view(old.from_view(v)), opt, saved_layouts, zero.layouts,
                transform_non_params=lambda x: x, is_leaf=is_layout), out_shardings=zero.opt_shardings)
            state = state.replace(opt_state=repack(state.opt_state))
        return state, meta


def _first_line(error: Exception) -> str:
    """The useful head of a library error (TensorStore appends pages of spec)."""
    return str(error).splitlines()[0].split(" See full")[0][:300]


# Keys that change how the model computes, not what its parameters are.
_COMPUTE_ONLY = {"dtype", "attention", "remat"}


def directory_size(path: epath.Path) -> int:
    """Bytes under a directory (walked level by level: epath refuses `**` globs on GCS)."""
    return sum(directory_size(p) if p.is_dir() else p.stat().length for p in path.iterdir())


def move_aside(directory: Path) -> Path:
    """Rename a run's checkpoint directory out of the way (never delete someone's checkpoints)."""
    aside = directory.with_name(f"{directory.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.move(str(directory), str(aside))
    return aside


def describe(directory: str | Path) -> str:
    """The table `zerolm checkpoints DIR` prints."""
    ckpts = Checkpoints(directory, read_only=True)
    steps = ckpts.steps()
    if not steps:
        return f"{directory}: no complete checkpoint; `--resume auto` would start from scratch"
    rows = ["step  saved (UTC)           size      tokens seen      loss    dp"]
    for step in steps:
        meta = ckpts.meta(step)
        size = directory_size(ckpts.directory / str(step))
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(meta["time"]))
        loss = f"{meta['loss']:.4f}" if meta.get("loss") is not None else "-"
        rows.append(f"{step:<5} {saved}  {size / 2**20:7.1f} MiB  {meta['tokens_seen']:>13,}  {loss:>8}  {meta['dp']:>4}")
    rows.append(f"`--resume auto` would take step {ckpts.latest_step()}")
    return "\n".join(rows)
