"""`train.init_from`: a fresh run's parameters read from a zerolm checkpoint instead of drawn at random.

The checkpoint may be a run's checkpoint directory (its newest intact step) or one step's directory, local
or gs://, saved on any mesh, tp and ZeRO stage (zerolm.checkpoint.trained_model.locate finds it). Its parameters are
restored straight into this run's own parameter shardings, as a resume restores them (each device reads
its own part), and the run starts from them with a fresh optimizer state at step 0, its own lr schedule
and its own data order. Only a fresh start reads it: a run with a checkpoint of its own resumes from that
(zerolm.checkpoint.resume), init_from or not. The checkpoint's model must have the config's parameter shapes (the
settings that only change how the model computes may differ, and so may model.seq_len where no parameter has
its length, ALiBi's and rotary positions: zerolm.checkpoint.compatible.parameter_differences)
and its tokenizer the run's data's; otherwise one line naming `train.init_from`, before the step is
compiled (`check`). A checkpoint trained in mixed precision gives its bfloat16 working parameters.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

import zerolm
from zerolm.checkpoint.compatible import parameter_differences
from zerolm.checkpoint.errors import CheckpointError
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.checkpoint.set_aside import move_aside
from zerolm.checkpoint.store import Checkpoints, quiet_orbax
from zerolm.checkpoint.trained_model import TOKENIZER_BESIDE, Opened, opened_for
from zerolm.config.tree import Config
from zerolm.parallel import auto
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.sharding import with_shardings
from zerolm.parallel.zero import TrainState, Zero

KEY = "train.init_from"


@contextlib.contextmanager
def _opened(cfg: Config, data_id: dict) -> Iterator[Opened]:
    """The checkpoint init_from names, checked against the run (CheckpointError naming train.init_from)."""
    path = cfg.train.init_from
    assert path is not None
    with opened_for(path, KEY) as source:
        _check(cfg, source, data_id)
        yield source


def _check(cfg: Config, source: Opened, data_id: dict) -> None:
    differs = parameter_differences(source.meta.model, cfg.model.model_dump())
    if differs:
        key, saved, wanted = differs[0]
        hint = {"n_layer": "; `zerolm grow` makes a deeper model from it",
                "seq_len": ": its learned position table has model.seq_len rows; ALiBi and rotary positions "
                           "have no such table and take any seq_len"}.get(key, "")
        raise CheckpointError(f"{KEY}: {source.where}: model.{key} is {saved!r} there and {wanted!r} in the config "
                              f"(a run starts from parameters of the same shapes{hint})")
    saved_tok, tok = source.meta.tokenizer_sha256, data_id["tokenizer_sha256"]
    if saved_tok != tok:
        raise CheckpointError(f"{KEY}: {source.where}: its model was trained with another tokenizer (sha256 "
                              f"{saved_tok[:12]}) than this run's data was prepared with ({tok[:12]}): its embeddings "
                              "would stand for other tokens")


def check(cfg: Config, data_id: dict) -> None:
    """Before the step is compiled, for a run that starts fresh: the checkpoint train.init_from names (if any)
    exists, reads, and fits the config (CheckpointError, one line, otherwise). Reads only."""
    if cfg.train.init_from is not None:
        with _opened(cfg, data_id):
            pass


def initial_state(cfg: Config, zero: Zero, init_fn: Callable[[jax.Array], Any], data_id: dict,
                  say: Callable[[str], None]) -> TrainState:
    """A fresh run's state: its parameters drawn from train.seed, or read from train.init_from into `zero`'s
    parameter shardings; a fresh optimizer state either way, at step 0."""
    if cfg.train.init_from is None:
        return zero.init(init_fn, jax.random.key(cfg.train.seed))
    with _opened(cfg, data_id) as source:
        target = with_shardings(zero.abstract_params, zero.table.param_shardings)  # float32: the master weights
        with quiet_orbax():
            params = source.checkpoints.restore_params(source.step, target)
        meta = source.meta
        say(f"parameters from {source.where} ({KEY}: step {meta.step} of a run on dp={meta.dp} tp={meta.tp} "
            f"ZeRO-{meta.stage}); a fresh optimizer state, from step 0")
    return zero.init_from_params(params)


class Origin(NamedTuple):
    """What a written start records of where its parameters came from."""

    dataset: dict  # the data's identity (its tokenizer's sha256 above all: zerolm.data.dataset.dataset_identity)
    dataset_location: str | None  # where that data is (or None: nowhere; an import's tokenizer is beside it)
    data: dict | None = None  # the config's data section to record instead of the config's own (a source run's)
    tokenizer: bytes | None = None  # the tokenizer file to write beside the checkpoint (where there is no dataset)
    averaged: dict | None = None  # what `zerolm average` averaged (CheckpointMeta.averaged)


def one_device_step(cfg: Config) -> tuple[Config, Zero, Callable[[jax.Array], Any]]:
    """`cfg` laid out on one device (the layout of a written start), and its step and init function built on this
    host's first device, to lay out or read states on (nothing is compiled)."""
    device = jax.local_devices()[:1]
    cfg = cfg.with_values({"mesh.dp": 1, "mesh.tp": 1})
    # (An attention this machine lacks is only how the model computes: the step built here runs nothing.)
    unrunnable = auto.unrunnable_attention(cfg.model, auto.Where.of(device[0])) is not None
    from zerolm.parallel.build import build_step

    _, zero, init_fn = build_step(cfg.with_values({"model.attention": "auto"}) if unrunnable else cfg, make_mesh(1, 1, device))
    return cfg, zero, init_fn


def save_start(cfg: Config, params: Any, out: Any, origin: Origin, say: Callable[[str], None] = lambda line: None) -> Any:
    """Write `params` (host arrays of `cfg`'s model) as the checkpoint of step 0 at `out` (an epath) that
    train.init_from starts from (`zerolm grow`'s and `zerolm import-hf`'s output): a fresh optimizer state laid
    out for one device (a run on any mesh restores it), `cfg` as the run's config, and `origin` (its tokenizer,
    if any, beside the step directory, where zerolm.checkpoint.trained_model finds it). What `out` held is moved aside first. The
    step directory written."""
    cfg, zero, init_fn = one_device_step(cfg)
    expected = jax.tree.map(lambda a: a.shape, jax.eval_shape(init_fn, jax.random.key(0)))
    assert jax.tree.map(np.shape, params) == expected, "the parameters are not the config's model's"
    state = zero.init_from_params(jax.device_put(params, zero.table.param_shardings))
    config = {**cfg.model_dump(), **({"data": origin.data} if origin.data else {})}
    meta = CheckpointMeta(step=0, time=time.time(), config=config, dp=1, tp=1, accum_steps=cfg.accum_steps,
                          dataset=origin.dataset, tokens_seen=0, loss=None, wandb_id=secrets.token_hex(4),
                          dataset_location=origin.dataset_location, zerolm_version=zerolm.__version__,
                          averaged=origin.averaged)
    if out.exists():
        say(f"--overwrite: moved what {out} held aside to {move_aside(out)}")
    with quiet_orbax():
        ckpts = Checkpoints(out)
        try:
            ckpts.save(state, meta, wait=True)
        finally:
            ckpts.close()
    if origin.tokenizer is not None:
        (ckpts.directory / TOKENIZER_BESIDE).write_bytes(origin.tokenizer)
    return ckpts.directory / "0"
