"""A run's dataset from its config: opened, checked against the model, and the default corpus prepared
on first use (by process 0 first, then by any host whose disk still lacks it)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from zerolm.config import Config, ConfigError, load_config
from zerolm.data.manifest import MANIFEST
from zerolm.data.prepare import PrepareError, prepare
from zerolm.data.shards import DataError, PreparedDataset
from zerolm.data.tokenizer import TokenizerError, cache_dir, from_file


def default_dataset_dir(cfg: Config) -> Path:
    return cache_dir() / "datasets" / f"kjv-bpe{cfg.data.default_vocab_size}-seq{cfg.model.seq_len}"


def open_dataset(cfg: Config) -> PreparedDataset:
    """The run's prepared dataset; the default corpus is prepared on first use (by process 0)."""
    location: str | Path = cfg.data.dataset
    if location == "default":
        location = default_dataset_dir(cfg)
        # Process 0 first; then any host whose disk still lacks it (hosts of a slice have their own disks).
        for turn in ("first", "rest"):
            if (turn == "first") == (jax.process_index() == 0) and not (Path(location) / MANIFEST).exists():
                try:
                    prepare("default", location, vocab_size=cfg.data.default_vocab_size, seq_len=cfg.model.seq_len,
                            progress=False, catch_sigterm=jax.process_count() == 1)
                except PrepareError as e:
                    raise ConfigError(f"model.seq_len: {cfg.model.seq_len}: the default dataset cannot be prepared "
                                      f"for it: {e}") from None
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"zerolm: default dataset prepared ({turn})")
    try:
        dataset = PreparedDataset(location)
    except DataError as e:
        raise ConfigError(f"data.dataset: {e}") from None
    if dataset.seq_len != cfg.model.seq_len:
        raise ConfigError(f"data.dataset: {location} was prepared with seq_len {dataset.seq_len}, "
                          f"but model.seq_len is {cfg.model.seq_len}")
    if cfg.data.tokenizer is not None:
        try:
            wanted = from_file(Path(cfg.data.tokenizer))
        except TokenizerError as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
        have = dataset.manifest.tokenizer
        if wanted.sha256 != have.sha256:
            raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer} (sha256 {wanted.sha256[:12]}) is not the "
                              f"tokenizer {location} was prepared with ({have.name}, sha256 {have.sha256[:12]})")
    return dataset


def resolve_vocab(cfg: Config, dataset: PreparedDataset) -> Config:
    vocab = dataset.manifest.tokenizer.vocab_size
    if cfg.model.vocab_size == "auto":
        return cfg.resolve(model__vocab_size=vocab)
    if cfg.model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the dataset's tokenizer "
                          f"({dataset.manifest.tokenizer.name}, {vocab} tokens)")
    return cfg


def dataset_identity(cfg: Config, dataset: PreparedDataset) -> dict:
    """What must not change across a resume for the data order to continue exactly: the tokens (by
    tokenizer and shard layout, not by where the dataset lives, so a copied dataset still resumes),
    the sequence length and the seed."""
    train = dataset.manifest.splits["train"]
    # By a shard's own name, not its directory: a dataset prepared again into gs:// has the same identity.
    shards = [(s.name.rsplit("/", 1)[-1], s.samples) for s in train.shards]
    return {"tokenizer_sha256": dataset.manifest.tokenizer.sha256,
            "train_shards_sha256": hashlib.sha256(json.dumps(shards).encode()).hexdigest(),
            "train_samples": int(train.samples),
            "seq_len": dataset.seq_len, "seed": cfg.train.seed}


def planned_vocab(cfg) -> int:
    """model.vocab_size, with `auto` resolved as training would, without preparing anything."""
    if cfg.model.vocab_size != "auto":
        return cfg.model.vocab_size
    if cfg.data.dataset == "default":
        return cfg.data.default_vocab_size
    try:
        return int(PreparedDataset(cfg.data.dataset).manifest.tokenizer.vocab_size)
    except DataError as e:
        raise ConfigError(f"model.vocab_size: auto needs the dataset's tokenizer ({e}); set model.vocab_size") from None


def load_planned(path: str | Path, overrides: Sequence[str] = (), device_count: int | None = None) -> Config:
    """A config as `zerolm plan`, `comms` and `compile` take it: loaded and validated, its vocabulary
    resolved as training would resolve it, without preparing anything (`planned_vocab`)."""
    cfg = load_config(path, overrides, device_count=device_count)
    return cfg.resolve(model__vocab_size=planned_vocab(cfg))
