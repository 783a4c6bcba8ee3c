"""A run's data, opened and checked before anything is written: the dataset (or mixture), its train and
validation splits, the unigram entropy training is measured against, and the tokenizer samples need; and
the lines the run's header says of it."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerolm.config.tree import Config
from zerolm.data.dataset import PreparedDataset, open_dataset, resolve_vocab
from zerolm.data.mixture import BLOCK as MIXTURE_BLOCK
from zerolm.data.mixture import MixedSplit, Mixture
from zerolm.data.shards import Split
from zerolm.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class RunData:
    """The run's data, opened and checked before anything is written."""

    dataset: PreparedDataset | Mixture
    train: Split | MixedSplit
    val: Split | MixedSplit
    entropy: float  # the train split's unigram entropy, nats per token
    tokenizer: Tokenizer | None  # for samples and eval.tasks (None: sample.tokens is 0 and no eval.tasks)


def open_data(cfg: Config) -> tuple[Config, RunData]:
    """The dataset (or mixture) and its splits, checked; the config with the vocabulary resolved from it."""
    dataset = open_dataset(cfg)
    cfg = resolve_vocab(cfg, dataset)
    train_split = dataset.split("train", cfg.data.skip_bad_samples)
    val_split = dataset.split("val", cfg.data.skip_bad_samples)
    train_split.verify()  # a missing or truncated shard stops the run now, not when first read
    val_split.verify()
    entropy = dataset.manifest.splits["train"].unigram_entropy or 0.0  # None only for an empty split
    tokenizer = dataset.tokenizer() if cfg.sample.tokens or cfg.eval.tasks else None  # fail now, not after training
    return cfg, RunData(dataset, train_split, val_split, entropy, tokenizer)


def describe_data(cfg: Config, data: RunData) -> list[str]:
    """The header's lines about the data: the mixture's shares, the splits, the tokenizer, the entropy."""
    dataset, lines = data.dataset, []
    if isinstance(dataset, Mixture):
        lines.append("data: mixture: " + ", ".join(
            f"{name} {n / MIXTURE_BLOCK:.4f} ({n} of every {MIXTURE_BLOCK} samples; weight {w:g})"
            for name, n, w in zip(dataset.names, dataset.per_block, dataset.weights, strict=True)))
    tokenizer = dataset.manifest.tokenizer
    lines.append(f"data: {dataset.location}: {len(data.train)} train / {len(data.val)} val samples of "
                 f"{cfg.model.seq_len + 1} tokens, tokenizer {tokenizer.name} ({tokenizer.vocab_size} tokens), "
                 f"unigram entropy {data.entropy:.3f} nats/token")
    return lines


def data_facts(data: RunData) -> list[dict[str, Any]]:
    """Each training dataset's name, location, weight in the mixture (1 alone), and its train split's samples
    and tokens (the unique tokens an epoch reads): what zerolm.observe.launches records."""
    dataset = data.dataset
    parts = (zip(dataset.names, dataset.weights, dataset.datasets, strict=True) if isinstance(dataset, Mixture)
             else [("data", 1.0, dataset)])
    return [{"name": name, "location": str(d.location), "weight": weight, "samples": d.manifest.splits["train"].samples,
             "tokens": d.manifest.splits["train"].tokens} for name, weight, d in parts]
