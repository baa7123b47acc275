"""Temporaries kept inside output buffers that are not written yet (XLA's buffer reuse).

XLA's buffer assigner gives every output of the executable its own allocation
for the whole run, then places each temporary, largest first, into the smallest
existing allocation that can hold it and whose other occupants are never live at
the same time (``BufferAssigner::AssignSingleHloBuffer``). An output allocation
is free until the output is written, so a temporary that fits and dies before
that costs no ``temp`` bytes. In a train step the outputs (new parameters and
optimizer state) are written at the end, so at small shapes most activations
hide there; at large shapes they no longer fit and nothing hides.

At one program point the best placement is a matching of live temporaries to
free output allocations, one temporary per allocation, each no larger than its
allocation; largest first into the smallest that fits is optimal. Because the
allocations of a train step have fixed sizes, this can be written without
sorting the (symbolic) temporary sizes: see :func:`point_expression`. Fits are
``Piecewise`` steps in the dims, so the result is piecewise polynomial.

Which program point is the maximum is found numerically on sample points of
the domain (its corners included): a few points whose maximum is within
``TOLERANCE`` of the best at every sample are kept, and the peak is the ``Max``
of their symbolic expressions. Output groups holding a negligible share of the
output bytes, and size classes negligible at a point, are left out of the
placement (never hidden), which keeps the expression small and errs high.

Example:
    >>> import sympy
    >>> from jaxmem.symbolic import ShapeDomain, sym
    >>> dom = ShapeDomain.from_constraints(("b",), ("b <= 64",))
    >>> b = sym("b")
    >>> expr = point_expression([(4 * b, 3)], [(sympy.Integer(100), 2)], dom, {})
    >>> [expr.subs(b, v) for v in (8, 30)]
    [32, 360]
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence

import numpy as np
import sympy

from jaxmem.fastexpr import sum_at
from jaxmem.symbolic import Cmp, ShapeDomain, compare, sym

Item = tuple[sympy.Expr, int]  # (size, count)


def fit_step(e: sympy.Expr, k: sympy.Expr, dom: ShapeDomain,
          tally: collections.Counter[str], cache: dict, symbolic: bool = True) -> sympy.Expr:
    """1 where a temporary of size ``e`` fits an allocation of size ``k``, else 0.

    ``cache``: the caller's memo; each decision it has not seen is counted in ``tally``
    by what decided it.
    """
    key = (e, k)
    if key not in cache:
        cache[key], decided_by = _fit_decision(e, k, dom, symbolic)
        tally[decided_by] += 1
    return cache[key]


@functools.lru_cache(maxsize=65536)
def _fit_decision(e: sympy.Expr, k: sympy.Expr, dom: ShapeDomain, symbolic: bool
                  ) -> tuple[sympy.Expr, str]:
    """:func:`fit_step`'s step and what decided it, shared by every memory model of a
    step: the levels' models ask about the same sizes and allocations."""
    mono = _monotone_fit(e, k, dom) if symbolic else None
    if mono is not None:
        return mono, "symbolic"
    c = compare(e, k, dom, symbolic=symbolic)
    if c.result in (Cmp.LT, Cmp.LE, Cmp.EQ):
        return sympy.Integer(1), c.decided_by
    if c.result == Cmp.GT:
        return sympy.Integer(0), c.decided_by
    return sympy.Piecewise((1, sympy.Le(e, k)), (0, True)), c.decided_by


def _monotone_fit(e: sympy.Expr, k: sympy.Expr, dom: ShapeDomain) -> sympy.Expr | None:
    """Decides ``e <= k`` for a size ``e`` with non-negative coefficients and a number ``k``.

    Such a polynomial grows with every dim, so its extremes on the box are at the
    smallest and largest corners: at most ``k`` at the largest corner (of a
    bounded domain) fits everywhere, above it at the smallest corner nowhere,
    otherwise the fit is a genuine step.
    Sizes of several dims (``b*s**2``) have no single split point, which is why
    :func:`jaxmem.symbolic.compare` would sample them.
    """
    if not k.is_number:
        return None
    if e.is_number:  # static shapes: nothing to decide symbolically
        return sympy.Integer(1 if e <= k else 0)
    syms = [sym(n) for n in dom.symbols]
    try:
        poly = sympy.Poly(e, *syms)
    except (sympy.PolynomialError, sympy.polys.polyerrors.GeneratorsNeeded):
        return None
    if any(c < 0 for c in poly.coeffs()):
        return None
    if e.subs(_at(dom.smallest_corner())) > k:
        return sympy.Integer(0)
    if dom.bounded and e.subs(_at(dom.corner())) <= k:
        return sympy.Integer(1)
    if dom.constraints:
        return None  # general constraints cut the box: let compare use them
    return sympy.Piecewise((1, sympy.Le(e, k)), (0, True))


def point_expression(items: Sequence[Item], allocations: Sequence[Item], dom: ShapeDomain,
                     fit_cache: dict, tally: collections.Counter[str] | None = None,
                     symbolic: bool = True) -> sympy.Expr:
    """Temporary bytes left at one point after hiding ``items`` in ``allocations``.

    Allocation sizes are sorted (``K_1 > K_2 > ...``, ``m_g`` of each); an item's
    *tier* is the number of sizes it fits, so tier-``g`` items can use the
    allocations of sizes ``1..g`` and are larger than every item of a higher
    tier. Largest first is then tier by tier, in a fixed order: with ``I_g``
    items in tier ``g`` and ``C_g = m_1 + ... + m_g``, the items placed in tiers
    up to ``g`` are ``M_g = min(M_g-1 + I_g, C_g)``. Inside a tier the
    ``M_g - M_g-1`` placed items are counted at the tier's mean size (sizes
    inside a tier lie between two allocation sizes; the mean never hides more
    than largest-first would). Tier membership is piecewise in the shape, so
    the expression is a small piecewise polynomial, with no order of the item
    sizes to decide.

    Args:
        items: live temporaries as (size, count).
        allocations: free output allocations as (size, count); sizes must not
            depend on the dims (outputs of a train step are parameters and
            optimizer state) or must at least keep one order on the domain.
        dom: the shape domain (to decide which sizes fit where).
        fit_cache: memo of fit decisions, shared between points.
        tally: counts how fit comparisons were decided.
        symbolic: False decides fits by sampling only (the ablation).

    Returns:
        A sympy expression (polynomial, or piecewise where fits depend on the shape).
    """
    tally = collections.Counter() if tally is None else tally
    total = sympy.Add(*[e * n for e, n in items])
    allocs = _sorted_allocations(allocations, dom)
    if not allocs or not items:
        return total
    fits = [[fit_step(e, k, dom, tally, fit_cache, symbolic) for k, _ in allocs]
            for e, _ in items]
    # Items that fit nowhere on the whole domain take no part (their tier is 0).
    keep = [i for i, f in enumerate(fits) if any(x != 0 for x in f)]
    items, fits = [items[i] for i in keep], [fits[i] for i in keep]
    # hidden = sum_g (M_g - M_g-1) * mean_g = sum_g M_g * (mean_g - mean_g+1): each M_g
    # (a chain of two-argument minima) then appears once in the expression tree.
    placed, means = _placed_per_tier(items, fits, allocs)
    hidden = []
    for g, m_g in enumerate(placed):
        if m_g == 0:
            continue
        drop = means[g] - (means[g + 1] if g + 1 < len(means) else 0)
        hidden.append(m_g * drop if m_g.is_number else sympy.Mul(m_g, drop, evaluate=False))
    return sympy.Add(total, *[-h for h in hidden]) if hidden else total


def _placed_per_tier(items: Sequence[Item], fits: Sequence[Sequence[sympy.Expr]],
                     allocs: Sequence[Item]) -> tuple[list[sympy.Expr], list[sympy.Expr]]:
    """Items placed in tiers up to ``g`` (``M_g``) and each tier's mean item size.

    Tiers no item belongs to anywhere on the domain are skipped in both lists.
    """
    placed: list[sympy.Expr] = []
    means: list[sympy.Expr] = []
    last: sympy.Expr = sympy.Integer(0)
    capacity = 0
    for g, (_, m) in enumerate(allocs):
        capacity += m
        member = [f[g] - (f[g + 1] if g + 1 < len(allocs) else 0) for f in fits]
        count = sympy.Add(*[n * w for (_, n), w in zip(items, member, strict=True)])
        if count == 0:
            continue
        weight = sympy.Add(*[e * n * w for (e, n), w in zip(items, member, strict=True)])
        last = _min2(last + count, sympy.Integer(capacity))
        placed.append(last)
        means.append(weight / count if count.is_number
                     else weight / lattice(sympy.Max, [count, sympy.Integer(1)]))
    return placed, means


def _sorted_allocations(allocations: Sequence[Item], dom: ShapeDomain) -> list[Item]:
    """Allocation groups largest first (at the smallest corner, then at the largest one)."""
    low, high = _at(dom.smallest_corner()), _at(dom.corner())
    merged: dict[sympy.Expr, int] = {}
    for k, m in allocations:
        if m:
            merged[k] = merged.get(k, 0) + m
    # Ties at the smallest corner (4*b*s vs 4*b*s**2 at s=1) are broken at the
    # largest corner, so that the larger size comes first wherever they differ.
    return sorted(merged.items(),
                  key=lambda km: (-float(km[0].subs(low)), -float(km[0].subs(high))))


def _min2(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    """``min(a, b)``, folded when both are numbers (sympy's Min sorts: slow)."""
    if a.is_number and b.is_number:
        return a if a <= b else b
    if a == b:
        return a
    return lattice(sympy.Min, [a, b])


def lattice(cls: type, args: Sequence[sympy.Expr]) -> sympy.Expr:
    """``Min``/``Max`` of distinct ``args`` without sympy's canonical ordering.

    ``Min(..., evaluate=False)`` still sorts its arguments, counting the nodes of
    every argument, which dominates the analysis time on large expressions.
    """
    args = list(dict.fromkeys(args))
    if len(args) == 1:
        return args[0]
    obj = sympy.Expr.__new__(cls, *args)
    obj._argset = frozenset(args)
    return obj


def hidden_bytes_numeric(counts: np.ndarray, free: np.ndarray, sizes: np.ndarray,
                         alloc: np.ndarray) -> np.ndarray:
    """The same greedy at one concrete shape, for every program point at once.

    Args:
        counts: ``[points, classes]`` live temporaries per size class.
        free: ``[points, groups]`` free output allocations per size group.
        sizes: ``[classes]`` bytes of each class at the shape.
        alloc: ``[groups]`` bytes of each allocation group at the shape.

    Returns:
        ``[points]`` bytes hidden in output allocations.
    """
    order = np.argsort(-alloc, kind="stable")
    alloc, free = alloc[order], free[:, order]
    tier = (sizes[:, None] <= alloc[None, :]).sum(axis=1)  # allocations each class fits
    placed = np.zeros(counts.shape[0], dtype=np.int64)
    hidden = np.zeros(counts.shape[0], dtype=np.float64)
    capacity = np.zeros(counts.shape[0], dtype=np.int64)
    for g in range(alloc.shape[0]):
        capacity = capacity + free[:, g]
        members = tier == g + 1
        count = counts[:, members].sum(axis=1)
        weight = counts[:, members] @ sizes[members]
        now = np.minimum(placed + count, capacity)
        hidden += (now - placed) * np.where(count > 0, weight / np.maximum(count, 1), 0.0)
        placed = now
    return hidden


def reuse_peak(temps: Sequence[tuple[sympy.Expr, int, int]],
               outputs: Sequence[tuple[sympy.Expr, int]], extra: Mapping[int, sympy.Expr],
               n_points: int, dom: ShapeDomain, tally: collections.Counter[str],
               symbolic: bool = True) -> tuple[sympy.Expr, tuple[int, ...]]:
    """Most temporary bytes live at once when temporaries may hide in output buffers.

    Args:
        temps: temporaries as (size, first position, last position).
        outputs: output allocations temporaries may use, as (size, position
            where the output is written); usable strictly before it.
        extra: bytes a control-flow body needs at its position (never hidden).
        n_points: number of program points.
        dom: the shape domain.
        tally: counts how comparisons were decided.
        symbolic: False decides fits by sampling only (the ablation).

    Returns:
        ``(temp_bytes, candidates)``: the peak as a ``Max`` over the candidate
        points' expressions, and those points.
    """
    classes = list(dict.fromkeys(e for e, _, _ in temps))
    outputs = _significant(outputs, dom)
    groups = list(dict.fromkeys(k for k, _ in outputs))
    if n_points == 0:
        return sympy.Integer(0), ()
    class_col, group_col = _columns(classes), _columns(groups)
    counts = _intervals(n_points, len(classes), [(class_col[e], s, t) for e, s, t in temps])
    free = _intervals(n_points, len(groups),
                      [(group_col[k], 0, w - 1) for k, w in outputs if w > 0])
    extra_pos = sorted(extra)
    symbols = [sym(n) for n in dom.symbols]
    size_fn = sympy.lambdify(symbols, [*classes, *groups, *[extra[p] for p in extra_pos]],
                             modules=["math"])
    rows, class_sizes = [], []
    for point in dom.sample_points():
        vals = np.array(size_fn(*[point[n] for n in dom.symbols]), dtype=np.float64)
        sizes, alloc = vals[:len(classes)], vals[len(classes):len(classes) + len(groups)]
        live = counts @ sizes - hidden_bytes_numeric(counts, free, sizes, alloc)
        if extra_pos:
            live[extra_pos] += vals[len(classes) + len(groups):]
        rows.append(live)
        class_sizes.append(sizes)
    table = np.array(rows)  # [samples, points]
    chosen = cover(table, TOLERANCE)
    fit_cache: dict = {}
    exprs = []
    for p in chosen:
        # Classes too small to matter at this point are not worth a step each.
        share = np.array(class_sizes)[:, :] * counts[p][None, :]
        tiny = (share <= TOLERANCE * np.maximum(table[:, p:p + 1], 1.0)).all(axis=0)
        items = [(classes[c], int(counts[p, c])) for c in range(len(classes))
                 if counts[p, c] and not tiny[c]]
        rest = sympy.Add(*[classes[c] * int(counts[p, c]) for c in range(len(classes))
                           if counts[p, c] and tiny[c]])
        allocs = [(groups[g], int(free[p, g])) for g in range(len(groups)) if free[p, g]]
        exprs.append(point_expression(items, allocs, dom, fit_cache, tally, symbolic) + rest
                     + extra.get(p, 0))
    exprs = list(dict.fromkeys(exprs))
    temp = exprs[0] if len(exprs) == 1 else lattice(sympy.Max, exprs)
    return temp, tuple(chosen)


def _columns(keys: Sequence[sympy.Expr]) -> dict[sympy.Expr, int]:
    """Each key's position, found by hash (``list.index`` compared sympy sizes one by one,
    for every temporary of a 22-layer step)."""
    return {k: i for i, k in enumerate(keys)}


#: Relative slack of the candidate search: a program point stands in for another
#: where it is within this fraction of it, and a size class whose bytes stay below
#: this fraction of a point's total is never hidden (a conservative rounding).
TOLERANCE = 0.002


def cover(table: np.ndarray, tol: float) -> list[int]:
    """Few program points whose maximum is within ``tol`` of the best at every sample.

    Args:
        table: ``[samples, points]`` temporary bytes.
        tol: relative slack.

    Returns:
        Point indices, sorted; greedy set cover, starting from the point that is
        close to the best at most samples.
    """
    best = table.max(axis=1, keepdims=True)
    close = table >= best - tol * np.abs(best)  # [samples, points]
    uncovered = np.ones(table.shape[0], dtype=bool)
    chosen: list[int] = []
    while uncovered.any():
        gain = close[uncovered].sum(axis=0)
        p = int(np.argmax(gain))
        chosen.append(p)
        uncovered &= ~close[:, p]
    return sorted(chosen)


#: Output allocations of one size whose bytes together are below this fraction of
#: all output bytes are left out: they can hide at most that much, and every one
#: of them adds a step to the peak expression.
MIN_GROUP_FRACTION = 0.005
#: Allocations smaller than this (scalars, bias vectors) are left out for the same
#: reason: each saves at most a few KiB.
MIN_ALLOCATION_BYTES = 4096


def _significant(outputs: Sequence[tuple[sympy.Expr, int]], dom: ShapeDomain
                 ) -> list[tuple[sympy.Expr, int]]:
    """Outputs whose size group holds at least ``MIN_GROUP_FRACTION`` of all output bytes.

    Shares and sizes are taken at the domain's largest corner.
    """
    hi = _at(dom.corner())
    per_group: dict[sympy.Expr, float] = collections.defaultdict(float)
    size = {k: float(sum_at([k], hi)) for k in dict.fromkeys(k for k, _ in outputs)}
    for k, _ in outputs:
        per_group[k] += size[k]
    total = sum(per_group.values())
    return [(k, w) for k, w in outputs if per_group[k] >= MIN_GROUP_FRACTION * total
            and size[k] >= MIN_ALLOCATION_BYTES]


def _at(point: Mapping[str, int]) -> dict[sympy.Symbol, int]:
    """A point of the domain as a substitution of its symbols."""
    return {sym(n): v for n, v in point.items()}


def _intervals(n_points: int, width: int, spans: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """``[n_points, width]`` counts of (column, first, last) intervals covering each point."""
    diff = np.zeros((n_points + 1, max(width, 1)), dtype=np.int64)
    for col, first, last in spans:
        first, last = max(first, 0), min(last, n_points - 1)
        if last < first:
            continue
        diff[first, col] += 1
        diff[last + 1, col] -= 1
    return np.cumsum(diff, axis=0)[:n_points, :width]
