"""`zerolm average`: the mean of a run's checkpoints' weights (latest weight averaging, LAWA: Kaddour 2022, "Stop
Wasting My Time! Saving Days of ImageNet and BERT Training with Latest Weight Averaging": the last k checkpoints),
or the moving average training kept (`train.ema`), written as a checkpoint that `zerolm eval`, `sample`,
`export-hf` and `train.init_from` read like any other.

What is averaged is each checkpoint's float32 weights: a float32 run's parameters, a mixed-precision run's master
weights (in its optimizer state: zerolm.parallel.optim.MasterWeights), not their bfloat16 working copies; with
`ema`, the moving average its optimizer state keeps (zerolm.parallel.optim.with_ema). Each checkpoint is read in
the layout it was saved in (any mesh, tp and ZeRO stage), that part of it alone, on this host's first device;
the mean is summed in float64 and rounded to float32 once. The result is written as
zerolm.checkpoint.warm_start.save_start writes a start: step 0, the run's config laid out on one device, its
dataset identity (an import's tokenizer copied beside it), and in its metadata (`averaged`) the source directory,
the steps and what of them was averaged. The source directory is only read; a request that cannot be met is one
line (AverageError, or the CheckpointError of a checkpoint that cannot be read) before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from pydantic import ValidationError

from zerolm.checkpoint.compatible import parameter_differences
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.checkpoint.store import SKIP, Checkpoints, quiet_orbax
from zerolm.checkpoint.trained_model import TOKENIZER_BESIDE
from zerolm.checkpoint.warm_start import Origin, one_device_step, save_start
from zerolm.config.tree import Config
from zerolm.core import storage
from zerolm.core.errors import ZerolmError, first_line
from zerolm.parallel.optim import ema_of, only
from zerolm.parallel.sharding import from_views, with_shardings
from zerolm.parallel.zero import TrainState, Zero


class AverageError(ZerolmError):
    """An average that cannot be made (no such checkpoints, checkpoints of different models, no EMA); one line."""


@dataclasses.dataclass(frozen=True)
class Averaging:
    """What `zerolm average` asks: a run's checkpoint directory, which of its checkpoints, of what, and where to."""

    checkpoints: str  # a run's checkpoint directory (local or gs://)
    out: str
    last: int | None = None  # the newest `last` checkpoints
    steps: Sequence[int] | None = None  # these steps (neither: the newest alone, which `ema` takes)
    ema: bool = False  # average each checkpoint's moving average (train.ema) instead of its weights
    overwrite: bool = False  # an existing `out` is moved aside


@dataclasses.dataclass(frozen=True)
class Averaged:
    where: Any  # the step directory written
    source: Any  # the source checkpoint directory
    steps: tuple[int, ...]
    of: str  # what was averaged: "params", "master weights" or "ema"


def parse_steps(text: str) -> list[int]:
    """`--steps 800,900,1000`: checkpoint steps, comma-separated."""
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        raise AverageError(f"--steps: {text!r}: expected checkpoint steps separated by commas, e.g. 800,900,1000") \
            from None
    if twice := sorted({s for s in steps if steps.count(s) > 1}):
        raise AverageError(f"--steps: step {twice[0]} is named twice")
    return steps


def average(request: Averaging, say: Callable[[str], None] = lambda line: None) -> Averaged:
    """Read the checkpoints asked for, average their float32 weights (or EMAs), write the checkpoint of step 0."""
    source, out = storage.path(request.checkpoints), storage.path(request.out)
    _check_out(source, out, request)
    with quiet_orbax():
        ckpts = _opened(source, request.checkpoints)
        try:
            steps = _chosen(ckpts, request)
            metas = [_readable(ckpts, step) for step in steps]
            _check_alike(ckpts, steps, metas, request.ema)
            cfg, zero = _config(metas[-1], ckpts.directory / str(steps[-1]), request.out)
            part = "ema" if request.ema else "master" if zero.mixed else "params"
            total = None
            for step, meta in zip(steps, metas, strict=True):
                weights = _weights(ckpts, step, meta, zero, part)
                total = weights if total is None else jax.tree.map(np.add, total, weights)
            mean = jax.tree.map(lambda t: (t / len(steps)).astype(np.float32), total)
        finally:
            ckpts.close()
    meta = metas[-1]
    beside = ckpts.directory / TOKENIZER_BESIDE
    tokenizer = beside.read_bytes() if meta.dataset_location is None and beside.exists() else None
    of = {"params": "params", "master": "master weights", "ema": "ema"}[part]
    averaged = {"checkpoints": str(ckpts.directory), "steps": list(steps), "of": of}
    where = save_start(cfg, mean, out, Origin(meta.dataset, meta.dataset_location, None, tokenizer, averaged), say)
    return Averaged(where, ckpts.directory, tuple(steps), of)


def _check_out(source: Any, out: Any, request: Averaging) -> None:
    """--out must be neither the source, nor inside it, nor above it (an --overwrite would move the source aside);
    an existing one only with --overwrite."""
    def key(p: Any) -> str:
        return str(p) if storage.is_remote(p) else str(p.resolve())

    src, dst = key(source), key(out)
    if dst == src or dst.startswith(src.rstrip("/") + "/") or src.startswith(dst.rstrip("/") + "/"):
        where = "is" if dst == src else "is inside" if len(dst) > len(src) else "holds"
        raise AverageError(f"--out: {request.out} {where} the source {request.checkpoints}: the checkpoints averaged "
                           "are only read; write the average to a directory of its own")
    if out.exists() and not request.overwrite:
        raise AverageError(f"--out: {request.out} already exists (pass --overwrite to move it aside and write anew)")


def _opened(source: Any, given: str) -> Checkpoints:
    if not source.exists():
        raise AverageError(f"--checkpoints: {given}: no such checkpoint directory")
    ckpts = Checkpoints(source, read_only=True)
    if not ckpts.steps():
        is_step = source.name.isdigit() and (source / "meta").exists()
        hint = (f"; it is one step's directory: --checkpoints {source.parent} --steps {source.name}" if is_step else
                " (a run's checkpoint directory, e.g. checkpoints/tiny)")
        ckpts.close()
        raise AverageError(f"--checkpoints: {given}: no checkpoint here{hint}")
    return ckpts


def _chosen(ckpts: Checkpoints, request: Averaging) -> list[int]:
    """The steps asked for (--last K: the newest K; --steps; neither: the newest), each one the directory holds."""
    kept = ckpts.steps()
    listed = ", ".join(map(str, kept))
    if request.steps is not None:
        if missing := [s for s in request.steps if s not in kept]:
            raise AverageError(f"--steps: {ckpts.directory} holds no checkpoint of step {missing[0]} (its steps: "
                               f"{listed})")
        return sorted(request.steps)
    last = request.last or 1
    if last > len(kept):
        raise AverageError(f"--last {last}: {ckpts.directory} keeps {len(kept)} checkpoint(s) (steps {listed}); "
                           "a run keeps its last checkpoint.keep (and every checkpoint.keep_every-th)")
    return kept[-last:]


def _readable(ckpts: Checkpoints, step: int) -> CheckpointMeta:
    ckpts.verify(step)  # its files as saved (DamagedCheckpoint otherwise)
    return ckpts.readable_meta(step)


def _check_alike(ckpts: Checkpoints, steps: list[int], metas: list[CheckpointMeta], ema: bool) -> None:
    """One model and tokenizer in all of them; with `ema`, a moving average in each."""
    first, where = metas[-1], ckpts.directory / str(steps[-1])
    for step, meta in zip(steps, metas, strict=True):
        here = ckpts.directory / str(step)
        if differs := parameter_differences(meta.model, first.model):
            key, theirs, ours = differs[0]
            raise AverageError(f"{here}: model.{key} is {theirs!r} there and {ours!r} in {where}: an average is of "
                               "checkpoints of one model")
        if meta.tokenizer_sha256 != first.tokenizer_sha256:
            raise AverageError(f"{here}: trained with another tokenizer than {where} (sha256 "
                               f"{meta.tokenizer_sha256[:12]}, {first.tokenizer_sha256[:12]})")
        if ema and meta.ema is None:
            raise AverageError(f"--ema: {here} holds no moving average of its parameters (its run had train.ema "
                               "null); average its weights instead (without --ema)")


def _config(meta: CheckpointMeta, where: Any, out: str) -> tuple[Config, Zero]:
    """The run's config (checkpoint.dir: `out`), and its step on one device, which the checkpoints are read with."""
    try:
        cfg = Config.model_validate(meta.full_config).with_values({"checkpoint.dir": out})
    except ValidationError as e:
        raise AverageError(f"{where}: its run's config does not read as this zerolm's ({first_line(e)})") from None
    cfg, zero, _ = one_device_step(cfg)
    return cfg, zero


def _weights(ckpts: Checkpoints, step: int, meta: CheckpointMeta, zero: Zero, part: str) -> Any:
    """Checkpoint `step`'s float32 `part` (params, master weights or ema) as float64 host arrays of the
    parameters' shapes: that part alone read, in the layout (dp, tp, stage) it was saved in."""
    table = zero.table
    opt_target, _ = table.restore_target(meta.dp, meta.tp, meta.stage)
    skip = lambda tree: jax.tree.map(lambda _: SKIP, tree)  # noqa: E731
    if part == "params":
        target = TrainState(step=SKIP, params=with_shardings(zero.abstract_params, table.param_shardings),
                            opt_state=skip(opt_target))
        tree = ckpts.restore_part(step, target).params
    else:
        state = ckpts.restore_part(step, TrainState(step=SKIP, params=skip(zero.abstract_params),
                                                    opt_state=only(opt_target, "master" if part == "master" else "ema", SKIP)))
        views = state.opt_state.master if part == "master" else ema_of(state.opt_state)
        tree = from_views(table.plan(meta.dp, meta.tp, meta.stage), views)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float64), tree)
