"""The cheap passes of the memory model's frontier: dominance and values at sample points.

The frontier keeps the program points whose live bytes may be the maximum
somewhere in the domain. A point whose every coefficient (over monomials of the
dims, each >= 1 on the domain) is at most another's can never be: the
:func:`undominated` pass drops those, in one sequential sweep, as a matrix of
integer coefficients where it can (a train step of 22 layers has about ten
thousand points and was spending most of its memory-model time in per-pair
dictionary comparisons). :func:`sample_values` gives the exact value of each
remaining point at the domain's sample points, so that pairs whose order
changes between two sample points need no sympy comparison
(:func:`jaxmem.symbolic.signs_differ`), and :func:`row_sign` gives the answer of
the comparison's integer proof from two points' coefficients, without sympy.

Example:
    >>> import collections, sympy
    >>> b = sympy.Symbol("b")
    >>> points = [{b: 4}, {b: 2, sympy.Integer(1): 1}, {b: 4}, {b: 8}]
    >>> undominated(points, collections.Counter())
    [1, 3]
"""

from __future__ import annotations

import collections
import fractions
from collections.abc import Sequence

import numpy as np
import sympy

from jaxmem.fastexpr import compile_expr
from jaxmem.memory.points import PointTable, distinct_rows
from jaxmem.symbolic import Cmp, Comparison, ShapeDomain, compare, is_exact, signs_differ, sym
from jaxmem.symbolic.bounds import integer_poly, poly_sign

LinExpr = dict[sympy.Expr, sympy.Expr]  # monomial -> coefficient; all monomials are >= 1


def dominates(a: LinExpr, b: LinExpr) -> bool:
    """Whether ``a >= b`` coefficient by coefficient (so everywhere on the domain)."""
    return all(a.get(m, 0) >= c for m, c in b.items()) and all(
        c >= 0 or m in b for m, c in a.items())


def distinct(points: Sequence[LinExpr]) -> list[int]:
    """Positions of the first occurrence of each distinct point."""
    seen: set[frozenset] = set()
    out = []
    for p, pt in enumerate(points):
        key = frozenset(pt.items())
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def undominated(points: Sequence[LinExpr], tally: collections.Counter[str]) -> list[int]:
    """Distinct positions that no later-kept position dominates, in program order.

    A sweep in program order: a point dominated by one kept so far is dropped, else
    it drops the kept points it dominates and is kept. Each drop counts as one
    ``symbolic`` decision. With integer coefficients the sweep runs on an ``int64``
    matrix (``dominates`` is a row-wise ``>=`` there); otherwise on the dictionaries.
    """
    order = distinct(points)
    matrix = _coefficients(points, order)
    keep: list[int] = []
    if matrix is None:
        for p in order:
            if any(dominates(points[q], points[p]) for q in keep):
                tally["symbolic"] += 1
                continue
            before = len(keep)
            keep = [q for q in keep if not dominates(points[p], points[q])]
            tally["symbolic"] += 1 if before != len(keep) else 0
            keep.append(p)
        return keep
    return [order[i] for i in _sweep(matrix, tally)]


def undominated_table(table: PointTable, tally: collections.Counter[str]) -> list[int]:
    """:func:`undominated` of a :class:`~jaxmem.memory.points.PointTable`'s points,
    on its matrix (no dictionaries built; :func:`~jaxmem.memory.points.live_table` keeps
    its entries below ``2**62``, as :func:`undominated` requires)."""
    order = distinct_rows(table.matrix)
    return [order[i] for i in _sweep(table.matrix[order], tally)]


def _sweep(matrix: np.ndarray, tally: collections.Counter[str]) -> list[int]:
    """Rows of ``matrix`` that no later-kept row dominates (the sweep of :func:`undominated`)."""
    # A row some earlier row dominates is dropped on arrival whatever the sweep kept so far
    # (a dominating row no longer kept was dropped for one that dominates it too): those
    # near a dominating row are found in one vectorised pass, the rest swept one by one.
    nearby = _dominated_nearby(matrix, _WINDOW)
    tally["symbolic"] += int(nearby.sum())
    rows = np.zeros(0, dtype=np.int64)  # rows of ``matrix`` kept so far
    for i in np.flatnonzero(~nearby).tolist():
        kept, row = matrix[rows], matrix[i]
        if (kept >= row).all(axis=1).any():
            tally["symbolic"] += 1
            continue
        below = (row >= kept).all(axis=1)
        if below.any():
            rows = rows[~below]
            tally["symbolic"] += 1
        rows = np.append(rows, i)
    return [int(i) for i in rows]


#: How many preceding rows :func:`_dominated_nearby` compares each row with: adjacent
#: program points differ by a buffer or two, so a falling point is mostly dominated by
#: one just before it.
_WINDOW = 8


def _dominated_nearby(matrix: np.ndarray, window: int) -> np.ndarray:
    """Per row, whether one of the ``window`` rows before it is ``>=`` it everywhere."""
    out = np.zeros(len(matrix), dtype=bool)
    for d in range(1, min(window, len(matrix) - 1) + 1):
        out[d:] |= (matrix[:-d] >= matrix[d:]).all(axis=1)
    return out


def _coefficients(points: Sequence[LinExpr], order: Sequence[int]) -> np.ndarray | None:
    """``[len(order), monomials]`` integer coefficients, or None if one is not an integer
    that fits in ``int64``."""
    monomials: dict[sympy.Expr, int] = {}
    for p in order:
        for m in points[p]:
            monomials.setdefault(m, len(monomials))
    out = np.zeros((len(order), max(len(monomials), 1)), dtype=np.int64)
    limit = 2 ** 62
    for i, p in enumerate(order):
        for m, c in points[p].items():
            if not (isinstance(c, int) or getattr(c, "is_Integer", False)):
                return None
            value = int(c)
            if abs(value) >= limit:
                return None
            out[i, monomials[m]] = value
    return out


def row_sign(a: LinExpr, b: LinExpr, dom: ShapeDomain,
             exponents: dict[sympy.Expr, tuple[int, ...] | None]) -> int | None:
    """:func:`~jaxmem.symbolic.bounds.poly_sign` of ``a - b`` from the points' integer
    coefficients, without building the sympy difference :func:`~jaxmem.symbolic.compare`
    would expand: what ``compare`` answers for it where this returns a sign.

    None where the difference's coefficients have one sign (``compare``'s own first
    test decides those), a coefficient is not an integer, or a monomial is not one of
    the domain's symbols' (``exponents`` caches each monomial's exponent tuple).
    """
    poly: dict[tuple[int, ...], int] = {}
    for m in {**a, **b}:
        c = a.get(m, 0) - b.get(m, 0)
        if c == 0:
            continue
        if not (isinstance(c, int) or getattr(c, "is_Integer", False)):
            return None
        if m not in exponents:
            mono = integer_poly(m, dom.symbols)  # a monomial: {its exponents: 1}
            exponents[m] = next(iter(mono)) if mono and list(mono.values()) == [1] else None
        e = exponents[m]
        if e is None:
            return None
        poly[e] = poly.get(e, 0) + int(c)
    poly = {e: c for e, c in poly.items() if c != 0}
    if all(c >= 0 for c in poly.values()) or all(c <= 0 for c in poly.values()):
        return None
    return poly_sign(poly, dom)


def sample_values(points: Sequence[LinExpr], keep: Sequence[int], dom: ShapeDomain
                  ) -> dict[int, tuple[int, ...] | None]:
    """Exact values of the kept points at the domain's sample points (None: not exact)."""
    samples = dom.sample_points()
    syms = [sym(n) for n in dom.symbols]
    monomials: dict[sympy.Expr, tuple[int, ...] | None] = {}

    def at_samples(m: sympy.Expr) -> tuple[int, ...] | None:
        if m not in monomials:
            f = compile_expr(syms, m)
            vals = tuple(f(*[p[n] for n in dom.symbols]) for p in samples)
            monomials[m] = vals if all(is_exact(v) for v in vals) else None
        return monomials[m]

    out: dict[int, tuple[int, ...] | None] = {}
    for p in keep:
        total: list | None = [0] * len(samples)
        for m, c in points[p].items():
            vals = at_samples(m)
            if vals is None or not (isinstance(c, int) or c.is_Rational):
                total = None
                break
            coeff = (c if isinstance(c, int) else int(c) if c.is_Integer
                     else fractions.Fraction(int(c.p), int(c.q)))
            total = [t + coeff * v for t, v in zip(total, vals, strict=True)]
        out[p] = None if total is None else tuple(total)
    return out


#: Sympy comparisons per model for the points dominance leaves. A point kept unpruned
#: only lengthens the ``Max`` (its value is the same), and on a 22-layer step each
#: comparison costs about 12 ms: 96 made plan derivation 12.8 s, 24 makes it 8.7 s.
COMPARE_BUDGET = 24


def to_expr(d: LinExpr) -> sympy.Expr:
    """The sum of a point's ``{monomial: coefficient}`` terms.

    Example:
        >>> b = sympy.Symbol("b")
        >>> to_expr({b: 4, sympy.Integer(1): 8})
        4*b + 8
    """
    return sympy.Add(*[c * m for m, c in d.items() if c != 0])


def max_expr(exprs: list[sympy.Expr]) -> sympy.Expr:
    """``Max`` without sympy's pairwise simplification (quadratic and slow on long sums).

    Example:
        >>> b = sympy.Symbol("b")
        >>> max_expr([b]), max_expr([])
        (b, 0)
    """
    if not exprs:
        return sympy.Integer(0)
    if len(exprs) == 1:
        return exprs[0]
    return sympy.Max(*exprs, evaluate=False)


def candidate_points(points: Sequence[LinExpr] | PointTable, dom: ShapeDomain,
                     tally: collections.Counter[str], symbolic: bool) -> list[int]:
    """Positions whose live bytes may be the maximum somewhere in the domain: those no
    other dominates, then those the comparisons (at most :data:`COMPARE_BUDGET`) cannot
    prune; each decision is counted in ``tally``.

    Example:
        >>> b = sympy.Symbol("b")
        >>> dom = ShapeDomain.from_constraints(("b",), ("b <= 8",))
        >>> candidate_points([{b: 4}, {b: 2, sympy.Integer(1): 1}, {b: 8}], dom,
        ...                  collections.Counter(), True)
        [2]
    """
    if isinstance(points, PointTable):
        keep = (undominated_table(points, tally) if symbolic
                else distinct_rows(points.matrix))
        points = {p: dict(points[p]) for p in keep}  # type: ignore[assignment]
    else:
        keep = undominated(points, tally) if symbolic else distinct(points)
    # What dominance cannot settle goes to the comparison oracle, within a budget of
    # calls: a point kept unpruned only makes the Max longer, never wrong.
    survivors: list[int] = []
    budget = COMPARE_BUDGET
    values = sample_values(points, keep, dom)
    exponents: dict = {}  # monomial -> exponent tuple, for row_sign
    for p in keep:
        expr = None  # built only for compare
        dominated = False
        for q in list(survivors):
            if budget <= 0:
                break
            budget -= 1
            if signs_differ(values[p], values[q]):
                # Above at one sample point and below at another: neither can prune the
                # other, as compare would find after seconds of factoring (an exact
                # witness, decided at the sample points).
                tally["fallback"] += 1
                continue
            # compare's answer where the integer proof settles it, without sympy.
            sign = row_sign(points[p], points[q], dom, exponents) if symbolic else None
            if sign:
                c = Comparison(Cmp.GT if sign > 0 else Cmp.LT, None, "symbolic")
            else:
                expr = to_expr(points[p]) if expr is None else expr
                c = compare(expr, to_expr(points[q]), dom, symbolic=symbolic)
            tally[c.decided_by] += 1
            if c.result in (Cmp.LT, Cmp.LE, Cmp.EQ):
                dominated = True
                break
            if c.result in (Cmp.GT, Cmp.GE):
                survivors.remove(q)
        if not dominated:
            survivors.append(p)
    return sorted(survivors)
