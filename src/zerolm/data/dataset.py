"""A run's dataset from its config: opened, checked against the model, and the default corpus prepared
on first use (by process 0 first, then by any host whose disk still lacks it)."""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.config.tree import Config
from zerolm.core.errors import first_line
from zerolm.core.storage import cache_dir
from zerolm.data.manifest import MANIFEST
from zerolm.data.mixture import Mixture, check_weights
from zerolm.data.order import VERSION as ORDER_VERSION
from zerolm.data.prepare import PrepareError, prepare
from zerolm.data.shards import DataError, PreparedDataset
from zerolm.data.tokenizer import TokenizerError, from_file
from zerolm.parallel import auto


def default_dataset_dir(cfg: Config) -> Path:
    return cache_dir() / "datasets" / f"kjv-bpe{cfg.data.default_vocab_size}-seq{cfg.model.seq_len}"


def open_dataset(cfg: Config) -> PreparedDataset | Mixture:
    """The run's prepared dataset, or its mixture of them (`data.mixture`: one tokenizer and seq_len); the
    default corpus is prepared on first use (by process 0)."""
    if cfg.data.mixture is None:
        return _open(cfg, cfg.data.dataset, "data.dataset")
    check_weights([e.weight for e in cfg.data.mixture], [str(e.dataset) for e in cfg.data.mixture])
    datasets, names = [], []
    for i, entry in enumerate(cfg.data.mixture):
        key = f"data.mixture.{i}.dataset"
        datasets.append(_open(cfg, entry.dataset, key))
        names.append(entry.name or str(entry.dataset).rstrip("/").rsplit("/", 1)[-1])
        first, this = datasets[0].manifest.tokenizer, datasets[-1].manifest.tokenizer
        if this.sha256 != first.sha256:
            raise ConfigError(f"{key}: {entry.dataset} was prepared with tokenizer {this.name} (sha256 "
                              f"{this.sha256[:12]}), data.mixture.0.dataset with {first.name} (sha256 "
                              f"{first.sha256[:12]}): a mixture's datasets share one tokenizer")
    if len(set(names)) < len(names):
        raise ConfigError(f"data.mixture: two datasets are named {sorted(n for n in names if names.count(n) > 1)[0]!r}; "
                          "give each a name")
    return Mixture(datasets, [e.weight for e in cfg.data.mixture], names)


def _prepare_default(cfg: Config, location: Path) -> None:
    """The default corpus prepared into the cache, once whatever the processes of this machine that ask at the same
    time (two runs started together; the test suite's workers): the first to take the lock prepares it, the
    others find it prepared. (Each would otherwise publish its own copy over the other's, under a run reading it.)"""
    location.parent.mkdir(parents=True, exist_ok=True)
    with open(location.parent / f".{location.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (location / MANIFEST).exists():
            return
        try:
            prepare("default", location, vocab_size=cfg.data.default_vocab_size, seq_len=cfg.model.seq_len,
                    progress=False, catch_sigterm=jax.process_count() == 1)
        except PrepareError as e:
            raise ConfigError(f"model.seq_len: {cfg.model.seq_len}: the default dataset cannot be prepared for it: "
                              f"{e}") from None


def recorded_dataset(config: dict, location: str | None) -> PreparedDataset | Mixture:
    """The data a run trained on, as its checkpoint records it: the dataset at `location` (where the run read
    it), or the run's mixture, opened again from its config's data.mixture (DataError if it cannot be)."""
    if config.get("data", {}).get("mixture"):
        try:
            return open_dataset(Config.model_validate(config))
        except (ConfigError, ValueError) as e:
            raise DataError(f"the run's mixture cannot be opened: {first_line(e)}") from None
    if location is None:
        raise DataError("the checkpoint does not record where its dataset was")
    return PreparedDataset(location)


def _open(cfg: Config, location: str | Path, key: str) -> PreparedDataset:
    if location == "default":
        location = default_dataset_dir(cfg)
        # Process 0 first; then any host whose disk still lacks it (hosts of a slice have their own disks).
        for turn in ("first", "rest"):
            if (turn == "first") == (jax.process_index() == 0) and not (Path(location) / MANIFEST).exists():
                _prepare_default(cfg, Path(location))
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"zerolm: default dataset prepared ({turn})")
    try:
        dataset = PreparedDataset(location)
    except DataError as e:
        raise ConfigError(f"{key}: {e}") from None
    if dataset.seq_len != cfg.model.seq_len:
        raise ConfigError(f"{key}: {location} was prepared with seq_len {dataset.seq_len}, "
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


def resolve_vocab(cfg: Config, dataset: PreparedDataset | Mixture) -> Config:
    """model.vocab_size and model.eot_id from the dataset's tokenizer (`auto`), or checked against it
    (zerolm.parallel.auto.vocabulary)."""
    tok = dataset.manifest.tokenizer
    return cfg.model_copy(update={"model": auto.vocabulary(cfg.model, tok.vocab_size, tok.eot_id, tok.name)})


def dataset_identity(cfg: Config, dataset: PreparedDataset | Mixture) -> dict:
    """What must not change across a resume for the data order to continue exactly: the tokens (by
    tokenizer and shard layout, not by where the dataset lives, so a copied dataset still resumes),
    the sequence length and the seed; for a mixture, each dataset's and the samples per block of each. Its
    "order" is the version a new run reads in (a resumed run records the version it continues)."""
    if isinstance(dataset, Mixture):
        parts = [dataset_identity(cfg, d) for d in dataset.datasets]
        return {**parts[0], "train_shards_sha256": [p["train_shards_sha256"] for p in parts],
                "train_samples": [p["train_samples"] for p in parts], "mixture_per_block": dataset.per_block.tolist()}
    train = dataset.manifest.splits["train"]
    # By a shard's own name, not its directory: a dataset prepared again into gs:// has the same identity.
    shards = [(s.name.rsplit("/", 1)[-1], s.samples) for s in train.shards]
    return {"order": ORDER_VERSION, "tokenizer_sha256": dataset.manifest.tokenizer.sha256,
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
    # The end-of-text id changes no shape of the step: a plan or a compile takes any (0) when it is auto.
    eot = 0 if cfg.model.eot_id == "auto" else cfg.model.eot_id
    return cfg.model_copy(update={"model": auto.vocabulary(cfg.model, planned_vocab(cfg), eot, "planned")})
