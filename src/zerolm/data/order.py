"""Stream position -> sample id: the order a run reads a split in (`Split.order`; a mixture has its own,
zerolm.data.mixture.MixedOrder, which takes each dataset's from here).

Version 2 (`GlobalOrder`, every run since it was introduced): epoch e is a keyed pseudo-random
permutation of all N sample ids of the split, whatever shards hold them: a Feistel network on the
smallest power of four that holds N, with cycle-walking back into [0, N) (the construction of Grain's
index shuffle and Levanter's permutation). Its round keys come from (seed, e), so the sample at stream
position p is a pure function of (seed, p), and resuming at step s needs only s (zerolm.data.loader).
What that guarantees: each epoch visits every sample exactly once, and the samples of one global batch
are G draws spread over the whole split, independent of how `zerolm prepare` cut it into shards (1 or
100,000 samples per shard give the same ids in the same order), so a batch is as mixed as under a
global shuffle: on average S·(1 − (1 − 1/S)^G) distinct shards of S equal ones, nearly G when S ≫ G,
and all S when S ≤ G/4 or so (tests/test_data.py checks the spread for shard sizes from 1 to 10^5).

Version 1 (`ShardOrder`, checkpoints saved before version 2): epoch e visits the shards in a seeded
permutation and each shard's samples in a seeded permutation within it, so a global batch came from
one shard, a contiguous stretch of the source, for samples_per_shard / G steps in a row. A checkpoint
records the version it was saved with (`dataset["order"]`; none recorded means 1), and resumes in it.
"""

from __future__ import annotations

import functools

import numpy as np

VERSION = 2  # what a new run uses
_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def sample_order(sizes: np.ndarray, seed: int, version: int = VERSION) -> GlobalOrder | ShardOrder:
    """The order of a split whose shards hold `sizes` samples, as run `version` defines it."""
    if version == 1:
        return ShardOrder(sizes, seed)
    if version == 2:
        return GlobalOrder(int(np.sum(sizes)), seed)
    raise ValueError(f"data order version {version}: this zerolm knows versions 1 and 2")


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective 64-bit hash (wrapping uint64 arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class GlobalOrder:
    """Version 2: each epoch a keyed bijection of [0, n) (module docstring)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        bits = max(2, int(n - 1).bit_length())
        self.half = (bits + 1) // 2  # the permutation acts on [0, 4^half), the smallest power of 4 >= n
        self.mask = np.uint64((1 << self.half) - 1)
        self._keys = functools.lru_cache(maxsize=4)(self._epoch_keys)

    def _epoch_keys(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, 2]).integers(0, 2**63, _ROUNDS, dtype=np.uint64)

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << half) | right

    def permute(self, x: np.ndarray, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of ids `x` (each in [0, n))."""
        keys = self._keys(epoch)
        y = self._feistel(np.asarray(x, np.uint64), keys)
        outside = y >= self.n
        while outside.any():  # cycle-walking: at most a few rounds, as 4^half < 4n
            y[outside] = self._feistel(y[outside], keys)
            outside = y >= self.n
        return y.astype(np.int64)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        out = np.empty(len(positions), np.int64)
        epochs = positions // self.n
        for epoch in np.unique(epochs):
            at = epochs == epoch
            out[at] = self.permute(positions[at] % self.n, int(epoch))
        return out


class ShardOrder:
    """Version 1: shards in a seeded order per epoch, samples shuffled within each (module docstring)."""

    def __init__(self, sizes: np.ndarray, seed: int):
        self.sizes, self.seed = np.asarray(sizes, np.int64), seed
        self.n = int(self.sizes.sum())
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self._epoch = functools.lru_cache(maxsize=4)(self._epoch_order)
        self._within = functools.lru_cache(maxsize=16)(self._within_order)

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        shard_order = np.random.default_rng([self.seed, epoch]).permutation(len(self.sizes))
        return shard_order, np.concatenate([[0], np.cumsum(self.sizes[shard_order])])

    def _within_order(self, epoch: int, shard: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, shard]).permutation(int(self.sizes[shard]))

    def ids(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        out = np.empty(len(positions), np.int64)
        for epoch in np.unique(positions // self.n):
            sel = positions // self.n == epoch
            shard_order, bounds = self._epoch(int(epoch))
            p = positions[sel] % self.n
            slot = np.searchsorted(bounds, p, side="right") - 1
            ids = np.empty(len(p), np.int64)
            for s in np.unique(slot):
                k = int(shard_order[s])
                at = slot == s
                ids[at] = self.starts[k] + self._within(int(epoch), k)[p[at] - bounds[s]]
            out[sel] = ids
        return out
