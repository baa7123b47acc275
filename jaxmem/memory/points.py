"""Temporary bytes live at each program point, as one matrix of integer coefficients.

A train step of 22 layers has about ten thousand program points, and a plan
derivation builds a memory model per candidate plan: summing the live buffers'
``{monomial: coefficient}`` dictionaries point by point, then keeping a tuple of
pairs per point, was a third of each model's time. With integer coefficients
(bytes of integer-sized dims: every case measured) :func:`live_table` does the
sweep as a cumulative sum over an ``int64`` matrix, one column per monomial, and
:class:`PointTable` hands out a point's pairs only when asked for them.

Example:
    >>> import sympy
    >>> from jaxmem.memory.liveness import Buffer
    >>> b = sympy.Symbol("b")
    >>> bufs = [Buffer(0, 4 * b, 0, 1, "temp"), Buffer(1, 2 * b + 8, 1, 2, "temp")]
    >>> table = live_table(bufs, {}, 3)
    >>> [dict(table[p]) for p in range(3)]
    [{b: 4}, {b: 6, 1: 8}, {b: 2, 1: 8}]
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import sympy

from jaxmem.fastexpr import linear_terms
from jaxmem.memory.liveness import Buffer

#: Coefficients at least this large (in absolute value, summed over all buffers)
#: leave the matrix path: ``int64`` sums could overflow.
LIMIT = 2 ** 62

Pair = tuple[sympy.Expr, sympy.Expr]


class PointTable(Sequence[tuple[Pair, ...]]):
    """Live temporary bytes per order position: ``table[p]`` is point ``p``'s nonzero
    ``(monomial, coefficient)`` pairs, as ``MemoryModel.points`` holds them.

    Attributes:
        monomials: the monomial of each column.
        matrix: ``[positions, monomials]`` ``int64`` coefficients.
    """

    def __init__(self, monomials: Sequence[sympy.Expr], matrix: np.ndarray) -> None:
        self.monomials = tuple(monomials)
        self.matrix = matrix
        self.matrix.setflags(write=False)

    def __len__(self) -> int:
        return int(self.matrix.shape[0])

    def __getitem__(self, p: Any) -> Any:
        if isinstance(p, slice):
            return tuple(self[q] for q in range(*p.indices(len(self))))
        row = self.matrix[p]
        return tuple((self.monomials[j], sympy.Integer(int(row[j])))
                     for j in np.flatnonzero(row))

    def __iter__(self) -> Iterator[tuple[Pair, ...]]:
        return (self[p] for p in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(
                dict(a) == dict(b) for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(frozenset(p) for p in self))

    def __repr__(self) -> str:
        return f"PointTable({len(self)} points, {len(self.monomials)} monomials)"


def live_table(buffers: Sequence[Buffer], extra: Mapping[int, sympy.Expr], n: int
               ) -> PointTable | None:
    """The temporary bytes live at each of the ``n`` order positions (``extra[p]``
    added at ``p`` alone), or None where a coefficient is not an integer or the sums
    could overflow ``int64`` (the caller then sums dictionaries).

    A temporary counts from its ``start`` to its ``end`` inclusive.
    """
    columns: dict[sympy.Expr, int] = {}
    rows: list[int] = []
    cols: list[int] = []
    vals: list[int] = []
    total = 0

    def add(e: sympy.Expr, row: int, sign: int) -> bool:
        nonlocal total
        terms = _integer_terms(e)
        if terms is None:
            return False
        for m, c in terms:
            rows.append(row)
            cols.append(columns.setdefault(m, len(columns)))
            vals.append(sign * c)
            total += abs(c)
        return True

    for buf in buffers:
        if buf.kind != "temp":
            continue
        # Python indexing as a list of n + 2 slots would: a start of -1 lands past the end.
        start = buf.start if buf.start >= 0 else n + 2 + buf.start
        if not (add(buf.nbytes, start, 1) and add(buf.nbytes, buf.end + 1, -1)):
            return None
    deltas = len(rows)
    for p, e in extra.items():
        if not add(e, p, 1):
            return None
    if total >= LIMIT:
        return None
    width = max(len(columns), 1)
    live = np.zeros((n + 2, width), dtype=np.int64)
    np.add.at(live, (np.array(rows[:deltas], dtype=np.int64),
                     np.array(cols[:deltas], dtype=np.int64)),
              np.array(vals[:deltas], dtype=np.int64))
    points = np.cumsum(live, axis=0)[:n]
    if len(rows) > deltas:
        np.add.at(points, (np.array(rows[deltas:], dtype=np.int64),
                           np.array(cols[deltas:], dtype=np.int64)),
                  np.array(vals[deltas:], dtype=np.int64))
    return PointTable(list(columns), np.ascontiguousarray(points))


@functools.lru_cache(maxsize=65536)
def _integer_terms(e: sympy.Expr) -> tuple[tuple[sympy.Expr, int], ...] | None:
    """``linear_terms(e)`` with Python int coefficients; None if one is not an integer."""
    terms = linear_terms(e)
    if not all(isinstance(c, int) or getattr(c, "is_Integer", False) for _, c in terms):
        return None
    return tuple((m, int(c)) for m, c in terms)


def distinct_rows(matrix: np.ndarray) -> list[int]:
    """Positions of the first occurrence of each distinct row, in order."""
    if len(matrix) == 0:
        return []
    _, first = np.unique(matrix, axis=0, return_index=True)
    return sorted(int(i) for i in first)
