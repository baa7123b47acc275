"""Token-budget batching (fairseq's ``max_tokens``): batches of ``b`` rows with ``b * s <= T``.

``s`` is the batch's padded length (its longest row, rounded up by ``pad_multiple``
or to a power-of-two bucket as in :mod:`train.batching`), so the budget counts every
position computed, padding included. Short sequences then come many to a batch
(up to ``max_batch`` rows) and long ones few, and the batch shape ``(b, s)`` ranges
over a 2-D domain instead of a line.

Every epoch, as fairseq's ``batch_by_size``: shuffle all examples with
``numpy.random.default_rng([seed, epoch])``, sort them by length (stable, so equal
lengths keep the shuffled order), cut the sorted order greedily into batches (a
batch takes the next example while ``rows + 1 <= max_batch`` and
``(rows + 1) * padded_len <= max_tokens``), and shuffle the order of the batches.
The sorted lengths are the same every epoch, so the cut points, the number of
batches per epoch and the set of batch shapes are too (later epochs compile
nothing new); which examples share a batch, and the order, change.

Every example appears exactly once per epoch: none is dropped. One whose padded
length alone exceeds ``max_tokens`` is an error naming it (records longer than
``--max-len`` never get here: :func:`train.data.build_dataset` drops and counts
them, as it does without ``--max-tokens``). The plan is a pure function of
``(lengths, max_tokens, max_batch, seed, pad_multiple, bucket_cap)``, so a resumed run
sees the same batches as an uninterrupted one.

Example:
    >>> batcher = TokenBudgetBatcher(np.array([10, 10, 10, 40, 40, 90]), max_tokens=100,
    ...                              max_batch=8, seed=0)
    >>> batcher.batches_per_epoch, sorted(batcher.batch_shape(b) for b in batcher.epoch(0))
    (3, [(1, 90), (2, 40), (3, 10)])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from train.batching import BatchPlan


def budget_cuts(sorted_padded: np.ndarray, max_tokens: int, max_batch: int) -> np.ndarray:
    """Rows of each batch when ascending padded lengths are cut greedily under the budget.

    Args:
        sorted_padded: every example's padded length, ascending.
        max_tokens: the budget ``T``: rows × padded length of a batch is at most this.
        max_batch: the most rows of a batch.

    Returns:
        int64 rows per batch, in order; they sum to ``len(sorted_padded)``.

    Raises:
        ValueError: an example's padded length is over ``max_tokens``.

    Example:
        >>> budget_cuts(np.array([10, 10, 10, 40, 40, 90]), 100, 8).tolist()
        [3, 2, 1]
        >>> budget_cuts(np.array([1, 1, 1, 1, 1]), 100, 2).tolist()
        [2, 2, 1]
    """
    sizes: list[int] = []
    rows = 0
    for n in sorted_padded.tolist():  # ascending: the new example sets the batch's length
        if rows and (rows + 1 > max_batch or (rows + 1) * n > max_tokens):
            sizes.append(rows)
            rows = 0
        rows += 1
    if rows:
        sizes.append(rows)
    return np.asarray(sizes, np.int64)


class TokenBudgetBatcher(BatchPlan):
    """Deterministic, infinitely repeating plan of batches with ``rows * padded_len <= T``.

    A :class:`train.batching.BatchPlan`, as :class:`train.batching.LengthGroupedBatcher` (``epoch``,
    ``batches_per_epoch``, ``batch_indices``, ``padded_length``, ``batch_shape``).

    Args:
        lengths: sequence length of every example.
        max_tokens: the token budget ``T`` of one batch (padded positions included).
        max_batch: the most rows of a batch (``--batch-size``).
        seed: shuffling seed.
        pad_multiple: round each batch's length up to a multiple of this.
        bucket_cap: if set, then round it up to a power of two, at most this.

    Raises:
        ValueError: a non-positive size, no examples, or an example whose padded
            length is over ``max_tokens`` (named by index and length).
    """

    def __init__(
        self, lengths: np.ndarray, max_tokens: int, max_batch: int, seed: int,
        pad_multiple: int = 1, bucket_cap: int | None = None,
    ) -> None:
        if min(max_tokens, max_batch, pad_multiple) < 1:
            raise ValueError(f"max_tokens ({max_tokens}), max_batch ({max_batch}) and "
                             f"pad_multiple ({pad_multiple}) must be >= 1")
        self.lengths = np.asarray(lengths, np.int64)
        if not len(self.lengths):
            raise ValueError("no examples to batch")
        self.max_tokens, self.max_batch, self.seed = max_tokens, max_batch, seed
        self.pad_multiple, self.bucket_cap = pad_multiple, bucket_cap
        padded = np.array([self.pad_length(int(n)) for n in self.lengths], np.int64)
        over = np.flatnonzero(padded > max_tokens)
        if len(over):
            i = int(over[np.argmax(padded[over])])
            raise ValueError(
                f"--max-tokens {max_tokens}: example {i} has {self.lengths[i]} tokens "
                f"(padded to {padded[i]}), more than one batch may hold ({len(over)} such "
                "examples); raise --max-tokens, or lower --max-len to drop them")
        self._sizes = budget_cuts(np.sort(padded), max_tokens, max_batch)
        self._epochs: dict[int, tuple[np.ndarray, ...]] = {}

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in every epoch (the same each epoch)."""
        return len(self._sizes)

    def _plan(self, epoch: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        order = order[np.argsort(self.lengths[order], kind="stable")]
        batches = np.split(order, np.cumsum(self._sizes)[:-1])
        return tuple(batches[i] for i in rng.permutation(len(batches)))

    def describe(self) -> dict[str, object]:
        """The plan's settings and the spread of its batch shapes (the same every epoch)."""
        return {"max_tokens": self.max_tokens, "max_batch": self.max_batch,
                "batches_per_epoch": self.batches_per_epoch,
                **shape_spread(self, self.batches_per_epoch)}


def shape_spread(batcher: Any, steps: int,
                 run_lengths: dict[str, int] | None = None) -> dict[str, int | None]:
    """The spread of the batch shapes steps ``0 .. steps - 1`` ran at.

    Args:
        batcher: the batch plan (any with ``batch_indices`` and ``batch_shape``).
        steps: number of steps, from step 0.
        run_lengths: step (as a string) -> the length it ran at, where a compile plan
            padded it further than the batch plan.

    Returns:
        ``{"b_min", "b_max", "s_min", "s_max", "tokens_max", "distinct_shapes"}``
        (None figures when no step ran).

    Example:
        >>> batcher = TokenBudgetBatcher(np.array([10, 10, 90]), 100, 8, seed=0)
        >>> shape_spread(batcher, 2)
        {'b_min': 1, 'b_max': 2, 's_min': 10, 's_max': 90, 'tokens_max': 90, 'distinct_shapes': 2}
    """
    shapes = set()
    for step in range(steps):
        rows, length = batcher.batch_shape(batcher.batch_indices(step))
        shapes.add((rows, max(length, (run_lengths or {}).get(str(step), 0))))
    b, s = [r for r, _ in shapes], [n for _, n in shapes]
    return {"b_min": min(b, default=None), "b_max": max(b, default=None),
            "s_min": min(s, default=None), "s_max": max(s, default=None),
            "tokens_max": max((r * n for r, n in shapes), default=None),
            "distinct_shapes": len(shapes)}
