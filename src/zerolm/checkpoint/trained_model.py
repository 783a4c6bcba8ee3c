"""A trained model, read from a checkpoint: what `zerolm eval`, `zerolm sample` and `zerolm export-hf`
start from.

`--checkpoint DIR` is either a run's checkpoint directory (its newest intact step is taken) or one
step's directory inside it (`checkpoints/tiny/300`). Only the parameters are read, replicated onto
the devices given (the run's mesh and tensor parallelism do not matter), with the model config the
checkpoint recorded. The tokenizer is the one the run's dataset was prepared with, found through the
dataset location the checkpoint recorded, or a file given with `--tokenizer`; either way its sha256
must be the one the checkpoint recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerolm.checkpoint.errors import CheckpointError, DamagedCheckpoint
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.checkpoint.store import Checkpoints, quiet_orbax
from zerolm.config.model import ModelConfig
from zerolm.core.errors import first_line
from zerolm.data.dataset import recorded_dataset
from zerolm.data.shards import DataError
from zerolm.data.tokenizer import Tokenizer, TokenizerError, from_bytes, from_file
from zerolm.model import decoder as gpt_model
from zerolm.parallel import auto
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.sharding import with_shardings

# The tokenizer of a checkpoint whose model no dataset of zerolm's was prepared for (an import's, and a growth of
# one): a file beside its step directories.
TOKENIZER_BESIDE = "tokenizer.json"


@dataclasses.dataclass
class Restored:
    model: gpt_model.GPT
    params: Any  # replicated over `mesh`
    meta: CheckpointMeta  # the checkpoint's metadata (config, dataset identity, tokens seen, ...)
    step: int
    where: epath.Path  # the step directory
    mesh: jax.sharding.Mesh

    @property
    def config(self) -> dict:
        return self.meta.full_config

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta.tokenizer_sha256

    def tokenizer(self, path: str | None = None) -> Tokenizer:
        """The run's tokenizer (or the file at `path`, which must be the same tokenizer)."""
        if path is not None:
            try:
                tok = from_file(Path(path))
            except TokenizerError as e:
                raise CheckpointError(f"--tokenizer: {e}") from None
            source = f"--tokenizer: {path}"
        elif self.meta.dataset_location is None and (beside := self.where.parent / TOKENIZER_BESIDE).exists():
            tok = from_bytes(beside.name, beside.read_bytes(), where=str(beside))  # an import's (zerolm.hf.importer)
            source = str(beside)
        else:
            location = self.meta.dataset_location
            try:
                tok = recorded_dataset(self.config, location).tokenizer()
            except (DataError, OSError) as e:
                raise CheckpointError(f"{self.where}: unknown tokenizer: the run's dataset {location} cannot "
                                      f"give it ({first_line(e)}); pass the tokenizer file with --tokenizer") from None
            source = f"{self.where}: the tokenizer of the run's dataset {location}"
        if tok.sha256 != self.tokenizer_sha256:
            raise CheckpointError(f"{source} (sha256 {tok.sha256[:12]}) is not the tokenizer this model was trained "
                                  f"with (sha256 {self.tokenizer_sha256[:12]})")
        return tok

    def at_context(self, seq_len: int, flag: str) -> Restored:
        """The same parameters in a model of context `seq_len`: shorter for any model, longer for ALiBi and
        rotary positions, which have no parameter of the context's length (a learned position table has
        seq_len rows and ends there: CheckpointError naming `flag`)."""
        cfg = self.model.cfg
        if seq_len > cfg.seq_len and cfg.position == "learned":
            raise CheckpointError(f"{flag}: {seq_len} tokens is past the model's trained context of {cfg.seq_len} "
                                  f"(model.seq_len): its learned position table has {cfg.seq_len} rows and ends "
                                  "there; models with model.position alibi or rope have no table and run past it")
        if seq_len == cfg.seq_len:
            return self
        return dataclasses.replace(self, model=gpt_model.GPT(cfg.model_copy(update={"seq_len": seq_len})))


def locate(path: str) -> tuple[Checkpoints, int]:
    """The checkpoints and the step that `path` names (a run directory: its newest intact step)."""
    p = epath.Path(path if "://" in path else epath.Path(path).absolute())
    if not p.exists() and p.name.isdigit() and p.parent.exists():
        with quiet_orbax():
            steps = Checkpoints(p.parent, read_only=True).steps()
        if steps:
            raise CheckpointError(f"{path}: no step {p.name} in {p.parent} (its steps: {', '.join(map(str, steps))})")
    if not p.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not p.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    is_step = p.name.isdigit() and (p / "meta").exists()
    with quiet_orbax():
        ckpts = Checkpoints(p.parent if is_step else p, read_only=True)
    steps = ckpts.steps()
    if is_step:
        step = int(p.name)
        if step not in steps:
            raise CheckpointError(f"{path}: not a complete checkpoint (the run's steps: "
                                  f"{', '.join(map(str, steps)) or 'none'})")
        ckpts.verify(step)
        return ckpts, step
    if not steps:
        numbered = sorted(int(c.name) for c in p.iterdir() if c.name.isdigit())
        hint = f"; its step directories: {', '.join(map(str, numbered))}" if numbered else ""
        raise CheckpointError(f"{path}: no checkpoint here (a run's checkpoint directory, e.g. checkpoints/tiny, "
                              f"or one of its step directories){hint}")
    for step in reversed(steps):
        try:
            ckpts.verify(step)
            return ckpts, step
        except DamagedCheckpoint:
            continue
    raise CheckpointError(f"{path}: every checkpoint is damaged (see zerolm checkpoints {path})")


@dataclasses.dataclass(frozen=True)
class Opened:
    """A checkpoint opened read only (`opened_for`): its run's checkpoints, its step and its record."""

    checkpoints: Checkpoints
    step: int
    meta: CheckpointMeta

    @property
    def where(self) -> epath.Path:
        """The step's directory."""
        return self.checkpoints.directory / str(self.step)


@contextlib.contextmanager
def opened_for(path: str, key: str) -> Iterator[Opened]:
    """The checkpoint a config key names (train.init_from, train.branch_from) and its metadata, opened read only
    and closed after; a problem is a CheckpointError naming `key`."""
    try:
        ckpts, step = locate(path)
    except CheckpointError as e:
        raise CheckpointError(f"{key}: {e}") from None
    try:
        with quiet_orbax():
            try:
                meta = ckpts.readable_meta(step)
            except CheckpointError as e:
                raise CheckpointError(f"{key}: {e}") from None
        yield Opened(ckpts, step, meta)
    finally:
        ckpts.close()


def load(path: str, devices: list[jax.Device] | None = None) -> Restored:
    """The parameters and metadata of the checkpoint `path` names, replicated over `devices` (default:
    this process's devices)."""
    ckpts, step = locate(path)
    with quiet_orbax():
        try:
            meta = ckpts.readable_meta(step)
            cfg = ModelConfig.model_validate(meta.model)
            devices = devices or jax.local_devices()
            # A model trained with a kernel this machine lacks computes with another (its parameters are the same).
            if auto.unrunnable_attention(cfg, auto.Where.of(devices[0])):
                cfg = cfg.model_copy(update={"attention": "auto"})  # compute only: the parameters are the same
            model = gpt_model.GPT(auto.for_device(cfg, devices[0]))
            mesh = make_mesh(len(devices), 1, devices)
            abstract = jax.eval_shape(functools.partial(gpt_model.init_params, model), jax.random.key(0))
            replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
            params = ckpts.restore_params(step, with_shardings(abstract, replicated))
        finally:
            ckpts.close()
    return Restored(model=model, params=params, meta=meta, step=step, where=ckpts.directory / str(step), mesh=mesh)
