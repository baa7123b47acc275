"""Length-grouped batching without buckets: each batch pads only to its own longest row.

Every epoch: shuffle all examples with ``numpy.random.default_rng([seed, epoch])``,
cut the order into windows of ``window_batches * batch_size`` examples, sort each
window by length, cut it into batches, and shuffle the order of the batches. Rows of
one batch then have similar lengths, and the sequence of batches still mixes short
and long. The last ``len % batch_size`` examples of each epoch's shuffled order are
left out of that epoch (every batch is full, so the batch dim stays fixed).

Padding goes to the longest row of the batch, optionally rounded up to a multiple
of ``pad_multiple`` (default 1 = off: exact shapes, as jaxmem wants them; 8 trades
~1-2 % more padding for up to 8x fewer distinct shapes, i.e. fewer XLA compiles).

The plan is a pure function of ``(lengths, batch_size, seed, window_batches)``, so
``batch_indices(step)`` is the same in a resumed run as in an uninterrupted one.

The other plan is packing (``--packing``, :mod:`train.packing`): several examples per
row of a fixed length, one batch shape; :func:`pad_stats` accounts for either.

Example:
    >>> batcher = LengthGroupedBatcher(np.arange(1, 101), batch_size=4, seed=0)
    >>> batcher.batches_per_epoch, len(batcher.batch_indices(7))
    (25, 4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from train.data import Example
from train.packing import PackedBatcher


def round_up(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple``.

    Example:
        >>> round_up(13, 8), round_up(16, 8), round_up(13, 1)
        (16, 16, 13)
    """
    return -(-n // multiple) * multiple


class BatchPlan:
    """What every batch plan shares: its epochs (one cached), steps and padded shapes.

    A subclass sets ``lengths``, ``pad_multiple`` and ``bucket_cap`` and provides
    ``batches_per_epoch`` and ``_plan(epoch)``, the example indices of every batch of
    one epoch in run order.
    """

    lengths: np.ndarray
    pad_multiple: int
    bucket_cap: int | None
    _epochs: dict[int, tuple[np.ndarray, ...]]

    @property
    def batches_per_epoch(self) -> int:
        raise NotImplementedError

    def _plan(self, epoch: int) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def epoch(self, epoch: int) -> tuple[np.ndarray, ...]:
        """Example indices of every batch of ``epoch``, in the order they are run."""
        if epoch not in self._epochs:
            self._epochs = {epoch: self._plan(epoch)}  # keep only the current epoch
        return self._epochs[epoch]

    def batch_indices(self, step: int) -> np.ndarray:
        """Example indices of the batch run at 0-based ``step``."""
        epoch, i = divmod(step, self.batches_per_epoch)
        return self.epoch(epoch)[i]

    def pad_length(self, length: int) -> int:
        """``length`` rounded up to the pad multiple, then to its bucket (if any)."""
        length = round_up(length, self.pad_multiple)
        return length if self.bucket_cap is None else bucket_length(length, self.bucket_cap)

    def padded_length(self, indices: np.ndarray) -> int:
        """Length the batch of ``indices`` is padded to."""
        return self.pad_length(int(self.lengths[indices].max()))

    def batch_shape(self, indices: np.ndarray) -> tuple[int, int]:
        """``(rows, positions per row)`` of the batch of ``indices``: one example per row."""
        return len(indices), self.padded_length(indices)


class LengthGroupedBatcher(BatchPlan):
    """Deterministic, infinitely repeating plan of length-grouped batches.

    Args:
        lengths: sequence length of every example.
        batch_size: rows per batch.
        seed: shuffling seed.
        window_batches: window size in batches (sorting happens within a window).
        pad_multiple: round each batch's length up to a multiple of this.
        bucket_cap: if set, then round it up to a power of two, at most this.

    Raises:
        ValueError: fewer examples than one batch, or a non-positive size.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        seed: int,
        window_batches: int = 50,
        pad_multiple: int = 1,
        bucket_cap: int | None = None,
    ) -> None:
        if batch_size < 1 or window_batches < 1 or pad_multiple < 1:
            raise ValueError("batch_size, window_batches and pad_multiple must be >= 1")
        self.lengths = np.asarray(lengths, np.int64)
        if len(self.lengths) < batch_size:
            raise ValueError(
                f"{len(self.lengths)} examples cannot fill one batch of {batch_size}"
            )
        self.batch_size, self.seed = batch_size, seed
        self.window_batches, self.pad_multiple = window_batches, pad_multiple
        self.bucket_cap = bucket_cap  # pad to power-of-two buckets, the last one this
        self._epochs: dict[int, tuple[np.ndarray, ...]] = {}

    @property
    def batches_per_epoch(self) -> int:
        """Number of (full) batches in one epoch."""
        return len(self.lengths) // self.batch_size

    def _plan(self, epoch: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))[: self.batches_per_epoch * self.batch_size]
        window = self.window_batches * self.batch_size
        batches = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches.extend(np.split(chunk, len(chunk) // self.batch_size))
        return tuple(batches[i] for i in rng.permutation(len(batches)))


def collate(
    examples: list[Example], indices: np.ndarray, pad_id: int, seq_len: int
) -> dict[str, np.ndarray]:
    """Stack the examples at ``indices`` into right-padded ``(b, seq_len)`` arrays.

    Returns:
        ``{"tokens": int32, "targets": int32, "loss_mask": float32}``; padded positions
        hold ``pad_id`` and mask 0. Right padding is invisible to real positions under
        the causal mask, so no attention mask is needed.

    Example:
        >>> from train.data import Example
        >>> ex = Example(np.array([256, 7, 8, 257], np.int32), prompt_len=2)
        >>> b = collate([ex], np.array([0]), pad_id=258, seq_len=4)
        >>> b["tokens"].tolist(), b["targets"].tolist(), b["loss_mask"].tolist()
        ([[256, 7, 8, 258]], [[7, 8, 257, 258]], [[0.0, 1.0, 1.0, 0.0]])
    """
    tokens = np.full((len(indices), seq_len), pad_id, np.int32)
    targets = np.full((len(indices), seq_len), pad_id, np.int32)
    loss_mask = np.zeros((len(indices), seq_len), np.float32)
    for row, i in enumerate(indices):
        ex = examples[int(i)]
        tokens[row, : ex.length] = ex.ids[:-1]
        targets[row, : ex.length] = ex.ids[1:]
        loss_mask[row, : ex.length] = ex.loss_mask
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask}


@dataclasses.dataclass(frozen=True)
class PadStats:
    """Padding over a run of batches.

    Attributes:
        real_tokens: non-pad positions.
        positions: all positions computed (``sum(b * padded_len)``).
        distinct_shapes: number of different ``(b, s)`` shapes.
    """

    real_tokens: int
    positions: int
    distinct_shapes: int

    @property
    def pad_fraction(self) -> float:
        """Pad positions / all positions."""
        return 1.0 - self.real_tokens / self.positions if self.positions else 0.0


def bucket_length(s: int, max_len: int) -> int:
    """The power-of-two bucket of length ``s``; the last bucket is ``max_len``.

    Example:
        >>> [bucket_length(s, 768) for s in (1, 100, 128, 129, 700)]
        [1, 128, 128, 256, 768]
    """
    return min(1 << max(0, (s - 1).bit_length()), max_len)


def pad_stats(
    batcher: LengthGroupedBatcher | PackedBatcher, steps: int, pad_to: int | None = None,
    run_lengths: Mapping[str, int] | None = None,
) -> PadStats:
    """Padding of the first ``steps`` batches of ``batcher``'s plan.

    Args:
        batcher: the batch plan: length-grouped, or packed (several examples per row,
            ``train.packing``; its padding is what the packed rows leave empty).
        steps: number of batches, from step 0.
        pad_to: lay out every batch's examples one per row padded to this length
            instead (e.g. the data set's longest sequence, for comparison).
        run_lengths: step (as a string) -> the length that step ran at, where a compile
            plan padded it further than the batch plan.

    Example:
        >>> b = LengthGroupedBatcher(np.array([10, 10, 30, 30]), batch_size=2, seed=0)
        >>> pad_stats(b, 2).pad_fraction, round(pad_stats(b, 2, pad_to=30).pad_fraction, 3)
        (0.0, 0.333)
    """
    real = positions = 0
    shapes = set()
    for step in range(steps):
        indices = batcher.batch_indices(step)
        rows, seq_len = (len(indices), pad_to) if pad_to is not None else batcher.batch_shape(
            indices)
        if pad_to is None and run_lengths and str(step) in run_lengths:
            seq_len = max(seq_len, run_lengths[str(step)])
        real += int(batcher.lengths[indices].sum())
        positions += rows * seq_len
        shapes.add((rows, seq_len))
    return PadStats(real, positions, len(shapes))
