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
    temps = [b for b in buffers if b.kind == "temp"]
    sizes: dict[sympy.Expr, int] = {}  # distinct sizes: a train step has a few hundred
    which = [sizes.setdefault(b.nbytes, len(sizes)) for b in temps]
    terms = [_integer_terms(e) for e in (*sizes, *extra.values())]
    if any(t is None for t in terms):
        return None
    absolute = [sum(abs(c) for _, c in t) for t in terms]  # type: ignore[union-attr]
    if 2 * sum(absolute[i] for i in which) + sum(absolute[len(sizes):]) >= LIMIT:
        return None
    columns: dict[sympy.Expr, int] = {}
    for t in terms:
        for m, _ in t:  # type: ignore[union-attr]
            columns.setdefault(m, len(columns))
    coeffs = np.zeros((len(terms), max(len(columns), 1)), dtype=np.int64)
    for i, t in enumerate(terms):
        for m, c in t:  # type: ignore[union-attr]
            coeffs[i, columns[m]] += c
    live = np.zeros((n + 2, coeffs.shape[1]), dtype=np.int64)
    if temps:
        rows = coeffs[np.array(which, dtype=np.int64)]
        # Python indexing as a list of n + 2 slots would: a start of -1 lands past the end.
        starts = np.array([b.start for b in temps], dtype=np.int64) % (n + 2)
        np.add.at(live, starts, rows)
        np.subtract.at(live, np.array([b.end + 1 for b in temps], dtype=np.int64), rows)
    points = np.cumsum(live, axis=0)[:n]
    for i, p in enumerate(extra):
        points[p] += coeffs[len(sizes) + i]
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
