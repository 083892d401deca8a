"""The deterministic batch plan: which samples batch `seq` holds, as a pure function of the inputs.

Per epoch: this node's shard is shuffled from (seed, shard, epoch); the shuffled order is cut into windows
of about `length_group_window` batches' worth of tokens; each window is sorted by length and packed
greedily under the token budget (uniform lengths inside a batch, no padding), and the window's batches are
shuffled so lengths do not trend through the epoch. `seq` counts batches across epochs. The plan needs only
the per-sample token lengths, so resuming at `seq` k skips the first k batches without reading, tokenizing
or forwarding them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

SHARD_STREAM = 0x5EED  # separates the shard permutation's random stream from the epochs'


@dataclass(frozen=True)
class PlannedBatch:
    seq: int
    epoch: int
    sample_ids: tuple[int, ...]
    num_tokens: int


def shard_sample_ids(
    num_samples: int, seed: int, shard_index: int, shard_count: int, exclude: Sequence[int] = ()
) -> np.ndarray:
    """This node's sample ids: a seeded permutation dealt round-robin, so shards are disjoint and cover all
    but `exclude` (the held-out records, producer/validation.py; none: the plan of a job without them)."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} is not in 0..{shard_count - 1}")
    if len(exclude) == 0:
        perm = np.random.default_rng([seed, SHARD_STREAM]).permutation(num_samples)
        return np.sort(perm[shard_index::shard_count])
    pool = np.setdiff1d(np.arange(num_samples), np.asarray(exclude, dtype=np.int64))
    perm = np.random.default_rng([seed, SHARD_STREAM]).permutation(len(pool))
    return np.sort(pool[perm[shard_index::shard_count]])


class BatchPlan:
    """Batches of sample ids packed under `tokens_per_batch`, for `epochs` epochs of one shard."""

    def __init__(
        self,
        lengths: Sequence[int],
        seed: int,
        epochs: int,
        tokens_per_batch: int,
        length_group_window: int,
        shard_index: int = 0,
        shard_count: int = 1,
        exclude: Sequence[int] = (),
    ):
        """`exclude`: sample ids never planned (the held-out records of data.validation)."""
        self.lengths = np.asarray(lengths, dtype=np.int64)
        too_long = np.flatnonzero(self.lengths > tokens_per_batch)
        if too_long.size:
            raise ValueError(
                f"sample {int(too_long[0])} has {int(self.lengths[too_long[0]])} tokens, over tokens_per_batch"
                f" {tokens_per_batch}; truncate samples to max_length <= tokens_per_batch first"
            )
        if (self.lengths <= 0).any():
            raise ValueError("every sample needs at least one token")
        self.seed = seed
        self.epochs = epochs
        self.tokens_per_batch = tokens_per_batch
        self.window_tokens = length_group_window * tokens_per_batch
        self.shard_index = shard_index
        self.sample_ids = shard_sample_ids(len(self.lengths), seed, shard_index, shard_count, exclude)
        self._cached: tuple[int, list[tuple[int, ...]]] | None = None

    def epoch_batches(self, epoch: int) -> list[tuple[int, ...]]:
        """The sample ids of every batch of `epoch`, in order."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, self.shard_index, epoch])
        order = rng.permutation(self.sample_ids)
        cum = np.cumsum(self.lengths[order])  # tokens up to and including each position
        batches: list[tuple[int, ...]] = []
        start = 0
        while start < len(order):
            before = int(cum[start - 1]) if start else 0
            stop = int(np.searchsorted(cum, before + self.window_tokens, side="left")) + 1
            window = order[start:stop]
            window = window[np.argsort(-self.lengths[window], kind="stable")]  # longest first
            packed = self._pack(window)
            batches += [packed[i] for i in rng.permutation(len(packed))]
            start = stop
        self._cached = (epoch, batches)
        return batches

    def _pack(self, window: np.ndarray) -> list[tuple[int, ...]]:
        packed: list[tuple[int, ...]] = []
        current: list[int] = []
        used = 0
        for sample in window.tolist():
            n = int(self.lengths[sample])
            if used + n > self.tokens_per_batch:
                packed.append(tuple(current))
                current, used = [], 0
            current.append(sample)
            used += n
        if current:
            packed.append(tuple(current))
        return packed

    def batches_per_epoch(self, epoch: int) -> int:
        return len(self.epoch_batches(epoch))

    def __len__(self) -> int:
        """Batches across all epochs (plans every epoch: cheap, integer work only)."""
        return sum(len(self.epoch_batches(e)) for e in range(self.epochs))

    def batches_from(self, seq: int = 0) -> Iterator[PlannedBatch]:
        """Every batch from global sequence number `seq` on; earlier ones are skipped by counting only."""
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        first = 0  # global seq of the current epoch's first batch
        for epoch in range(self.epochs):
            batches = self.epoch_batches(epoch)
            for k in range(max(0, seq - first), len(batches)):
                ids = batches[k]
                yield PlannedBatch(first + k, epoch, ids, int(self.lengths[list(ids)].sum()))
            first += len(batches)
