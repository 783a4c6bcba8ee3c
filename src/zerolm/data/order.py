"""Stream position -> sample id: the order a run reads a split in (`Split.order`; a mixture has its own,
zerolm.data.mixture.MixedOrder).

Epoch e visits the shards in a seeded permutation of (seed, e), and each shard's samples in a seeded
permutation of (seed, e, shard). No shuffle buffer holds state, so the sample at stream position p is a
pure function of (seed, p), and resuming at step s needs only s (zerolm.data.loader).
"""

from __future__ import annotations

import functools

import numpy as np


class SampleOrder:
    """Stream position -> sample id, for one split and seed."""

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

