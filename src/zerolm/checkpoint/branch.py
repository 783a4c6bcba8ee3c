"""`train.branch_from`: a run that starts where another run's checkpoint left off, in directories of its own.

The checkpoint may be a run's checkpoint directory (its newest intact step) or one step's directory, local or
gs://, saved on any mesh, tp and ZeRO stage (zerolm.checkpoint.trained_model.locate finds it). A run without
checkpoints of its own takes from it what a resume would: the parameters, the optimizer state, the step, and
so the data position (the order is a function of the step, in the order version the checkpoint recorded), after
the same checks (zerolm.checkpoint.resume: the model, the precision, the data and the global batch). It then
trains steps step + 1 .. train.steps, saving into its own checkpoint.dir and logging into its own logging.dir:
with train.schedule wsd and train.decay_steps, that is a decay branch. The source is opened read only and never
written; it may still be training. Once the branch has checkpoints of its own it resumes from them like any run,
whether the source is still there or not. A branch's checkpoint is a checkpoint: it may be branched from again,
and each branch records its source's record within its own (`Source.record`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerolm.checkpoint.errors import CheckpointError
from zerolm.checkpoint.trained_model import Opened, opened_for
from zerolm.config.tree import Config, place

KEY = "train.branch_from"


class SharedLogs(CheckpointError):
    """The branch's logging.dir is its source's."""


@dataclasses.dataclass(frozen=True)
class Source(Opened):
    """The checkpoint a branch starts from (read only), and where its run logs."""

    @property
    def log_dir(self) -> Path:
        """The source run's logging.dir as its config names it, from this working directory."""
        logging, name = self.meta.config.get("logging", {}), self.meta.config["name"]
        return Path(os.path.abspath(logging.get("dir") or Path("runs") / name))

    @property
    def tensorboard_dir(self) -> str:
        """Where the source run's TensorBoard events go, or would go with logging.tensorboard (before the key
        existed: nowhere, but <logging.dir>/tensorboard is still the source's)."""
        return self.meta.config.get("logging", {}).get("tensorboard_dir") or str(self.log_dir / "tensorboard")

    def record(self) -> dict[str, Any]:
        """What the branch's checkpoints and launches record of where it started (CheckpointMeta.branched_from):
        the step directory, its step, the source's name, wandb run and logging directory (None where it holds no
        metrics.jsonl here), and the source's own record if it was a branch too."""
        logs = self.log_dir if (self.log_dir / "metrics.jsonl").exists() else None
        return {"checkpoint": str(self.where), "step": self.step, "name": self.meta.config["name"],
                "wandb_id": self.meta.wandb_id, "log_dir": str(logs) if logs else None,
                "from": self.meta.branched_from}


@contextlib.contextmanager
def opened(cfg: Config) -> Iterator[Source]:
    """The checkpoint train.branch_from names, opened read only; refused (CheckpointError naming the key) where it
    cannot be read, where it is at or past train.steps, or where the source's logging.dir is this run's."""
    path = cfg.train.branch_from
    assert path is not None
    with opened_for(path, KEY) as found:
        source, step = Source(found.checkpoints, found.step, found.meta), found.step
        if step >= cfg.train.steps:
            raise CheckpointError(f"{KEY}: {source.where}: step {step} is not before train.steps {cfg.train.steps}: "
                                  f"a branch trains the steps after its source's ({step + 1}..train.steps)")
        if Path(os.path.abspath(cfg.log_dir)) == source.log_dir:
            raise SharedLogs(f"{KEY}: {source.where}: logging.dir {cfg.log_dir} is the source run's: a branch "
                             "writes its own logs; give it its own (set name, or logging.dir)")
        if cfg.tensorboard_dir is not None and place(cfg.tensorboard_dir) == place(source.tensorboard_dir):
            raise SharedLogs(f"{KEY}: {source.where}: logging.tensorboard_dir {cfg.tensorboard_dir} is the source "
                             "run's: a branch writes its own logs (and would hide the source's steps after its own "
                             "first there); give it its own, or null for <logging.dir>/tensorboard")
        yield source


def check_logs_apart(cfg: Config) -> None:
    """Before the run locks its logging directory (and writes its library log there): SharedLogs where it is the
    source run's. Any other problem with the source is left to the run's start, which reads the source only where
    the run has no checkpoints of its own (zerolm.checkpoint.resume.check_before_compiling)."""
    if cfg.train.branch_from is None:
        return
    try:
        with opened(cfg):
            pass
    except SharedLogs:
        raise
    except CheckpointError:
        return
