"""Packing: several examples per fixed-size row, one batch shape, one compile.

Every epoch: shuffle all examples with ``numpy.random.default_rng([seed, epoch])``,
cut the order into windows of ``window_batches * batch_size`` examples, pack each
window into rows of ``row_len`` positions by best-fit decreasing (longest example
first, each into the fullest row it still fits, else a new row), shuffle all rows,
and cut them into batches of ``batch_size`` rows. The last batch of an epoch is
filled up with empty rows (all padding), so no example is left out and the batch
shape is always ``(batch_size, row_len)``.

An example keeps its own inputs and targets, exactly as :func:`train.batching.collate`
lays it out alone in a row (inputs ``ids[:-1]``, targets ``ids[1:]``, the example's
loss mask): a segment's last input predicts that example's own EOS, and no target
is ever taken from the next segment. ``segment_ids`` number the examples of a row
``1, 2, ...`` (0 = padding) and ``positions`` restart at 0 for each, so the model
(``Llama(..., positions=, segment_ids=)``) computes every example as if it were
alone: the loss of a packed batch is the same per-token mean over real targets as
the loss of the same examples unpacked.

An example longer than ``row_len`` is dropped and counted (``dropped_too_long``),
as :func:`train.data.build_dataset` does with records longer than ``--max-len``;
nothing is truncated.

Like :class:`train.batching.LengthGroupedBatcher`, the plan is a pure function of
``(lengths, batch_size, row_len, seed, window_batches)``, so a resumed run sees
the same batches as an uninterrupted one; ``batch_indices(step)`` (the batch's
example indices) and ``padded_length`` make it a drop-in for the training loop.

Example:
    >>> packer = PackedBatcher(np.array([5, 3, 2, 6, 4]), batch_size=2, row_len=8, seed=0)
    >>> packer.batch_shape(packer.batch_indices(0)), packer.batches_in_epoch(0)
    ((2, 8), 2)
"""

from __future__ import annotations

import bisect

import numpy as np

from train.data import Example


def pack_rows(lengths: np.ndarray, order: np.ndarray, row_len: int) -> list[np.ndarray]:
    """Best-fit decreasing: pack the examples ``order`` (each of ``lengths[i] <= row_len``).

    Returns:
        One array of example indices per row, in the order they sit in the row.

    Example:
        >>> [r.tolist() for r in pack_rows(np.array([5, 3, 2, 6, 4]), np.arange(5), 8)]
        [[3, 2], [0, 1], [4]]
    """
    by_length = order[np.argsort(-lengths[order], kind="stable")]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free positions, row), sorted: best fit = first >= n
    for i in by_length.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            room, row = row_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, row))
    return [np.asarray(r, np.int64) for r in rows]


class PackedBatcher:
    """Deterministic, infinitely repeating plan of packed batches ``(batch_size, row_len)``.

    Args:
        lengths: sequence length of every example.
        batch_size: rows per batch.
        row_len: positions per row.
        seed: shuffling seed.
        window_batches: packing window, in batches' worth of examples.

    Raises:
        ValueError: a non-positive size, or no example fits a row.
    """

    def __init__(
        self, lengths: np.ndarray, batch_size: int, row_len: int, seed: int,
        window_batches: int = 50,
    ) -> None:
        if min(batch_size, row_len, window_batches) < 1:
            raise ValueError("batch_size, row_len and window_batches must be >= 1")
        self.lengths = np.asarray(lengths, np.int64)
        self.kept = np.flatnonzero(self.lengths <= row_len)
        self.dropped_too_long = len(self.lengths) - len(self.kept)
        if not len(self.kept):
            raise ValueError(f"no example fits a row of {row_len} positions")
        self.batch_size, self.row_len, self.seed = batch_size, row_len, seed
        self.window_batches = window_batches
        self._epochs: dict[int, list[list[np.ndarray]]] = {}
        self._starts = [0]  # first step of each epoch planned so far

    def _plan(self, epoch: int) -> list[list[np.ndarray]]:
        rng = np.random.default_rng([self.seed, epoch])
        order = self.kept[rng.permutation(len(self.kept))]
        window = self.window_batches * self.batch_size
        rows = [row for start in range(0, len(order), window)
                for row in pack_rows(self.lengths, order[start : start + window], self.row_len)]
        rows = [rows[i] for i in rng.permutation(len(rows))]
        rows += [np.zeros(0, np.int64)] * (-len(rows) % self.batch_size)
        return [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]

    def epoch(self, epoch: int) -> list[list[np.ndarray]]:
        """The batches of ``epoch``, each a list of ``batch_size`` rows of example indices."""
        if epoch not in self._epochs:  # keep two: compile-ahead looks across epoch ends
            self._epochs = {e: p for e, p in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = self._plan(epoch)
        return self._epochs[epoch]

    def batches_in_epoch(self, epoch: int) -> int:
        """Number of batches of ``epoch`` (packing varies a little between epochs)."""
        return len(self.epoch(epoch))

    @property
    def batches_per_epoch(self) -> int:
        """Batches of epoch 0 (later epochs may have a few more or fewer; every batch has
        the same shape, so what this is used for, announcing shapes to compile ahead,
        does not depend on it)."""
        return self.batches_in_epoch(0)

    def _locate(self, step: int) -> tuple[int, int]:
        while self._starts[-1] <= step:
            self._starts.append(self._starts[-1] + self.batches_in_epoch(len(self._starts) - 1))
        epoch = bisect.bisect_right(self._starts, step) - 1
        return epoch, step - self._starts[epoch]

    def batch_rows(self, step: int) -> list[np.ndarray]:
        """Example indices of each row of the batch run at 0-based ``step``."""
        epoch, i = self._locate(step)
        return self.epoch(epoch)[i]

    def batch_indices(self, step: int) -> np.ndarray:
        """Example indices of the batch run at ``step``, row by row."""
        return np.concatenate(self.batch_rows(step))

    def padded_length(self, indices: np.ndarray) -> int:
        """Length of every row: ``row_len``."""
        return self.row_len

    def batch_shape(self, indices: np.ndarray) -> tuple[int, int]:
        """``(rows, positions per row)`` of every batch."""
        return self.batch_size, self.row_len

    def describe(self) -> dict[str, object]:
        """The plan's settings and epoch 0's figures, for the run summary."""
        rows = [r for batch in self.epoch(0) for r in batch if len(r)]
        return {"row_len": self.row_len, "batches_per_epoch": self.batches_in_epoch(0),
                "examples_per_row": round(len(self.kept) / len(rows), 3),
                "dropped_too_long": self.dropped_too_long}


def collate_packed(
    examples: list[Example], rows: list[np.ndarray], pad_id: int, row_len: int
) -> dict[str, np.ndarray]:
    """Lay the examples of each row side by side into ``(len(rows), row_len)`` arrays.

    Returns:
        ``{"tokens", "targets", "loss_mask", "segment_ids", "positions"}``; padding
        holds ``pad_id``, loss mask 0, segment id 0 and position 0.

    Example:
        >>> a = Example(np.array([256, 7, 257], np.int32), prompt_len=1)
        >>> b = Example(np.array([256, 8, 9, 257], np.int32), prompt_len=2)
        >>> out = collate_packed([a, b], [np.array([0, 1])], pad_id=258, row_len=6)
        >>> out["tokens"].tolist(), out["targets"].tolist()
        ([[256, 7, 256, 8, 9, 258]], [[7, 257, 8, 9, 257, 258]])
        >>> out["segment_ids"].tolist(), out["positions"].tolist(), out["loss_mask"].tolist()
        ([[1, 1, 2, 2, 2, 0]], [[0, 1, 0, 1, 2, 0]], [[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    """
    shape = (len(rows), row_len)
    tokens, targets = np.full(shape, pad_id, np.int32), np.full(shape, pad_id, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    segment_ids, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    for r, row in enumerate(rows):
        start = 0
        for segment, i in enumerate(row.tolist(), start=1):
            ex = examples[i]
            end = start + ex.length
            if end > row_len:
                raise ValueError(f"row {r} holds {end} positions, more than {row_len}")
            tokens[r, start:end], targets[r, start:end] = ex.ids[:-1], ex.ids[1:]
            loss_mask[r, start:end] = ex.loss_mask
            segment_ids[r, start:end] = segment
            positions[r, start:end] = np.arange(ex.length)
            start = end
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask,
            "segment_ids": segment_ids, "positions": positions}
