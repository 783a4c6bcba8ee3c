"""Weighted mixtures of prepared datasets (`data.mixture`): one stream of samples, deterministic, the same
on every host, and exactly resumable from the step alone.

The stream is cut into blocks of BLOCK positions. Every block holds the same number of samples of each
dataset, n_i (BLOCK × weight_i, rounded by largest remainder so that they add up to BLOCK: the realised
share n_i / BLOCK is within 1/BLOCK of the weight), in an order drawn from (seed, block). So position p
of the stream is dataset i's sample number b·n_i + (its rank among dataset i's positions of its block):
a pure function of p, with no state to save. Each dataset's own stream is then its epochs in its own
shuffled order (zerolm.data.order, seeded by the run's seed and the dataset's index), so
a small dataset repeats sooner than a large one, at the rate its weight asks for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from zerolm.config.section import ConfigError
from zerolm.data.order import VERSION as ORDER_VERSION
from zerolm.data.order import sample_order

BLOCK = 8192


def apportion(weights: Sequence[float] | np.ndarray, total: int) -> np.ndarray:
    """`total` seats in proportion to `weights`, by largest remainder (ties to the earlier dataset)."""
    w = np.asarray(weights, np.float64)
    exact = w / w.sum() * total
    seats = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - seats), kind="stable")
    seats[order[: total - int(seats.sum())]] += 1
    return seats


def check_weights(weights: Sequence[float], names: Sequence[str]) -> None:
    """Every dataset of a mixture has samples in each block (ConfigError naming the weight that gives none)."""
    for i, (weight, name, seats) in enumerate(zip(weights, names, apportion(weights, BLOCK), strict=True)):
        if seats == 0:
            raise ConfigError(f"data.mixture.{i}.weight: {weight:g} gives {name} none of every {BLOCK} samples "
                              "(weights are shares of their sum); raise it or leave the dataset out")


class MixtureOrder:
    """Stream position -> (dataset, position in that dataset's own stream)."""

    def __init__(self, weights: Sequence[float], seed: int, block: int = BLOCK):
        self.per_block = apportion(weights, block)
        self.block, self.seed = block, seed
        self.pattern = np.repeat(np.arange(len(self.per_block)), self.per_block)
        self._block = functools.lru_cache(maxsize=8)(self._block_order)

    def _block_order(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's dataset per offset, and each offset's rank among its dataset's offsets in the block."""
        datasets = self.pattern[np.random.default_rng([self.seed, 1 << 20, b]).permutation(self.block)]
        rank = np.empty(self.block, np.int64)
        for i in range(len(self.per_block)):
            at = datasets == i
            rank[at] = np.arange(int(at.sum()))
        return datasets, rank

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, position in its stream) of each stream position."""
        positions = np.asarray(positions, np.int64)
        dataset, local = np.empty(len(positions), np.int64), np.empty(len(positions), np.int64)
        blocks = positions // self.block
        for b in np.unique(blocks):
            at = blocks == b
            d, rank = self._block(int(b))
            offsets = positions[at] % self.block
            dataset[at] = d[offsets]
            local[at] = int(b) * self.per_block[d[offsets]] + rank[offsets]
        return dataset, local

    def counts(self, n: int) -> np.ndarray:
        """Samples of each dataset among the stream's first `n` positions."""
        b, rest = divmod(n, self.block)
        head = np.bincount(self._block(b)[0][:rest], minlength=len(self.per_block)) if rest else 0
        return b * self.per_block + head


class Mixture:
    """Prepared datasets of one tokenizer and sequence length, read as one by weight (what a run's data is
    when `data.mixture` is set; it answers what train asks of a PreparedDataset)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], names: Sequence[str]):
        self.datasets, self.weights, self.names = list(datasets), [float(w) for w in weights], list(names)
        self.seq_len = self.datasets[0].seq_len
        self.location = "mixture of " + ", ".join(f"{n} ({w:g})" for n, w in zip(self.names, self.weights, strict=True))
        self.per_block = apportion(self.weights, BLOCK)

    @functools.cached_property
    def manifest(self):
        """The first dataset's manifest (the tokenizer and sequence length they all share), its training
        split's unigram entropy the datasets' weighted mean (the mixture's own is at least that)."""
        first = self.datasets[0].manifest
        mean = sum(w * (d.manifest.splits["train"].unigram_entropy or 0.0) for w, d in
                   zip(self.per_block / BLOCK, self.datasets, strict=True))
        return dataclasses.replace(first, splits={**first.splits, "train": dataclasses.replace(
            first.splits["train"], unigram_entropy=mean)})

    def split(self, name: str, skip_bad: bool = False) -> MixedSplit:
        return MixedSplit(self, [d.split(name, skip_bad) for d in self.datasets])

    def tokenizer(self):
        return self.datasets[0].tokenizer()


class MixedSplit:
    """One split (train or val) of every dataset of a mixture, read as one: sample ids are the datasets'
    own, offset by the samples of the datasets before (what `read` takes); `order(seed)` is the mixture's
    stream (what zerolm.data.loader reads it in)."""

    def __init__(self, mixture: Mixture, splits: Sequence):
        self.dataset, self.splits = mixture, list(splits)
        self.weights, self.names = mixture.weights, mixture.names
        self.name = self.splits[0].name
        self.T1 = self.splits[0].T1
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in self.splits])])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def bad_samples(self) -> int:
        return sum(s.bad_samples for s in self.splits)

    @property
    def rows_read(self) -> int:
        return sum(s.rows_read for s in self.splits)

    def verify(self) -> None:
        for s in self.splits:
            s.verify()

    def read(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        which = np.searchsorted(self.offsets, ids, side="right") - 1
        rows = np.empty((len(ids), self.T1), np.int32)
        for i in np.unique(which):
            at = which == i
            rows[at] = self.splits[i].read(ids[at] - self.offsets[i])
        return rows

    def order(self, seed: int, version: int = ORDER_VERSION) -> MixedOrder:
        return MixedOrder(self, seed, version)

    def head(self, n: int) -> np.ndarray:
        """The first `n` samples of the mixture (all of them if it has fewer), unshuffled: each dataset's
        first ones, as many as its weight gives it (for evaluation). A dataset with fewer gives all it has,
        and the others share what it lacks by their weights, so that `n` samples come back."""
        sizes = np.array([len(s) for s in self.splits], np.int64)
        weights = np.asarray(self.weights, np.float64)
        take = np.zeros_like(sizes)
        while (short := min(n, int(sizes.sum())) - int(take.sum())) > 0:  # each round fills one dataset at least
            room = take < sizes
            take[room] = np.minimum(take[room] + apportion(weights[room], short), sizes[room])
        return np.concatenate([s.read(np.arange(k)) for s, k in zip(self.splits, take, strict=True) if k])


class MixedOrder:
    """Stream position -> sample id of a MixedSplit: MixtureOrder's dataset and position in its stream,
    then that dataset's own order (zerolm.data.order, seeded by the seed and the dataset's index)."""

    def __init__(self, split: MixedSplit, seed: int, version: int = ORDER_VERSION):
        self.split, self.mixture = split, MixtureOrder(split.weights, seed)
        self.orders = [sample_order(s.sizes, seed + 1000003 * i, version) for i, s in enumerate(split.splits)]

    def ids(self, positions: np.ndarray) -> np.ndarray:
        dataset, local = self.mixture.locate(positions)
        out = np.empty(len(dataset), np.int64)
        for i in np.unique(dataset):
            at = dataset == i
            out[at] = self.split.offsets[i] + self.orders[i].ids(local[at])
        return out

    def shares(self, n: int) -> dict[str, float]:
        """Each dataset's share of the stream's first `n` samples."""
        counts = self.mixture.counts(n)
        return {name: float(c) / max(n, 1) for name, c in zip(self.split.names, counts, strict=True)}
