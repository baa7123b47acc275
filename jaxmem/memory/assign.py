"""Temporaries in output allocations, placed as XLA's buffer assigner places them.

XLA gives every output of the executable its own allocation and walks the
remaining buffers largest first, putting each into the smallest existing
allocation that can hold it and none of whose occupants is live at the same
time (``BufferAssigner::AssignSingleHloBuffer``); what finds no place goes to
the temp heap. An output's allocation is occupied from the moment the output is
written, so a temporary can sit in it only if it *dies* before that write, and
it sits there for its whole life: under XLA's CPU schedule, which writes each
optimizer update as soon as its gradient exists (:mod:`jaxmem.memory.schedule`),
a forward residual can hide only in the output of a layer whose backward pass
comes after its own. Matching the temporaries live at each point to the free
allocations independently (:func:`jaxmem.memory.reuse.reuse_peak`) ignores both
and hides too much (gpt 2x256 at (4, 128): 10.5 MiB where XLA hides 7.5).

:func:`assignment_peak` runs that greedy assignment at a few reference shapes of
the domain, keeps each distinct assignment (which temporary goes to which output),
and writes the heap's peak under each symbolically: a placed temporary is hidden
where it fits its allocation (a step in the dims), every other one counts. Each
assignment is feasible at every shape (live ranges do not depend on it), so the
``Min`` over them, of the ``Max`` over their candidate points, is the peak.

Example:
    >>> import collections, sympy
    >>> from jaxmem.symbolic import ShapeDomain, sym
    >>> dom = ShapeDomain.from_constraints(("b",), ("b <= 64",))
    >>> b = sym("b")
    >>> temps = [(4 * b, 0, 1), (4 * b, 2, 3)]  # one after the other
    >>> outs = [(sympy.Integer(100), 4)]  # written after both: both may use it
    >>> expr, _ = assignment_peak(temps, outs, {}, 5, dom, collections.Counter())
    >>> [int(expr.subs(b, v)) for v in (8, 30)]
    [0, 120]
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Mapping, Sequence

import numpy as np
import sympy

from jaxmem.memory.placement import place
from jaxmem.memory.reuse import TOLERANCE, cover, fit_step, lattice
from jaxmem.symbolic import ShapeDomain, sym

Temp = tuple[sympy.Expr, int, int]  # (size, first position, last position)

#: reference shapes the greedy assignment runs at (the domain's first sample points:
#: its corners, then points spread over it). 8 left linen 2x256 at (4, 128) +4.6 %
#: over XLA, 20 or more +2.3 %; the greedy costs milliseconds per shape.
REFERENCES = 24


def greedy_assignment(sizes: np.ndarray, spans: Sequence[tuple[int, int]],
                      alloc: np.ndarray, writes: Sequence[int],
                      first: np.ndarray | None = None) -> tuple[int, ...]:
    """XLA's placement at one shape: per temporary, the output allocation it sits in or -1.

    Args:
        sizes: bytes of each temporary.
        spans: (first, last) position of each temporary.
        alloc: bytes of each output allocation.
        writes: position where each output is written (it is occupied from there on).
        first: the spans' first positions as an array, when the caller has it (one
            model runs the placement at 24 shapes over the same spans).
    """
    # Python floats and lists in the loop (numpy scalars were most of its time); stable
    # sorts on the same keys as ``sorted(key=(alloc, write))`` and ``(-size, start)``.
    size_arr = np.asarray(sizes).reshape(-1)
    sizes_l, alloc_l = size_arr.tolist(), np.asarray(alloc).tolist()
    first = np.array([s for s, _ in spans], dtype=np.int64) if first is None else first
    by_size = np.lexsort((np.asarray(writes, dtype=np.int64).reshape(-1),
                          np.asarray(alloc_l, dtype=np.float64).reshape(-1))).tolist()
    keys = [alloc_l[a] for a in by_size]
    order = np.lexsort((first.reshape(-1), -size_arr.astype(np.float64)))
    # Only temporaries some allocation can hold are tried (the others find none).
    largest = max(alloc_l, default=0.0)
    fit = size_arr[order]
    tried = order[(fit > 0) & (fit <= largest)].tolist()
    if all(spans[i][0] <= spans[i][1] for i in tried):
        return tuple(place(tried, sizes_l, spans, keys, by_size, writes, len(sizes_l)))
    return tuple(_walk(tried, sizes_l, spans, keys, by_size, writes))


def _walk(tried: Sequence[int], sizes: Sequence[float], spans: Sequence[tuple[int, int]],
          keys: Sequence[float], by_size: Sequence[int], writes: Sequence[int]) -> list[int]:
    """:func:`~jaxmem.memory.placement.place` one allocation at a time (also for empty
    spans, ``first > last``, which the bitset form does not take)."""
    starts: list[list[int]] = [[] for _ in by_size]  # per allocation: its occupants, sorted
    ends: list[list[int]] = [[] for _ in by_size]
    out = [-1] * len(sizes)
    for i in tried:
        s, t = spans[i]
        for k in range(bisect.bisect_left(keys, sizes[i]), len(by_size)):
            a = by_size[k]
            if writes[a] <= t:
                continue
            occupants = starts[a]
            j = bisect.bisect_left(occupants, s)
            if (j > 0 and ends[a][j - 1] >= s) or (j < len(occupants) and occupants[j] <= t):
                continue
            occupants.insert(j, s)
            ends[a].insert(j, t)
            out[i] = a
            break
    return out


def assignment_peak(temps: Sequence[Temp], outputs: Sequence[tuple[sympy.Expr, int]],
                    extra: Mapping[int, sympy.Expr], n_points: int, dom: ShapeDomain,
                    tally: collections.Counter[str], symbolic: bool = True
                    ) -> tuple[sympy.Expr, tuple[int, ...]]:
    """Most temporary bytes live at once (XLA's temp heap) when temporaries may sit in
    output allocations not written yet, placed as XLA places them.

    Args:
        temps: temporaries as (size, first position, last position).
        outputs: output allocations as (size, position where the output is written).
        extra: bytes a control-flow body needs at its position (never hidden).
        n_points: number of program points.
        dom: the shape domain.
        tally: counts how the fit comparisons were decided.
        symbolic: False decides fits by sampling only (the ablation).

    Returns:
        ``(temp_bytes, candidates)``: a ``Min`` over assignments of the ``Max`` over
        their candidate points, and those points.
    """
    if n_points == 0:
        return sympy.Integer(0), ()
    temps = [t for t in temps if t[0] != 0]
    samples, sizes, alloc, extras = _sampled(temps, outputs, extra, dom)
    spans = [(max(s, 0), min(t, n_points - 1)) for _, s, t in temps]
    writes = [w for _, w in outputs]
    first = np.array([s for s, _ in spans], dtype=np.int64)
    plans = reference_plans(sizes, spans, alloc, writes, first, min(REFERENCES, len(samples)))
    tables = heap_tables(plans, sizes, alloc, spans, n_points, sorted(extra), extras)
    fit_cache: dict = {}
    exprs, chosen_all = [], set()
    for j in _cover_plans(tables):
        chosen = cover(tables[j], TOLERANCE)
        chosen_all.update(chosen)
        point_exprs = [_point_expression(plans[j], temps, outputs, spans, p, extra, dom,
                                         fit_cache, tally, symbolic) for p in chosen]
        exprs.append(lattice(sympy.Max, list(dict.fromkeys(point_exprs))))
    return lattice(sympy.Min, list(dict.fromkeys(exprs))), tuple(sorted(chosen_all))


def reference_plans(sizes: np.ndarray, spans: Sequence[tuple[int, int]], alloc: np.ndarray,
                     writes: Sequence[int], first: np.ndarray, n: int) -> list[tuple[int, ...]]:
    """The distinct :func:`greedy_assignment` of the first ``n`` samples, in sample order.

    The walk reads the sizes only through three orders: the temporaries' placement
    order (with which of them any allocation can hold), the allocations' walk order,
    and where each temporary's walk starts. Samples that agree on all three get the
    same assignment, so it is computed once (on a 22-layer step without donation,
    17 walks instead of 24).

    Example:
        >>> sizes, alloc = np.array([[8.0], [16.0]]), np.array([[8.0], [8.0]])
        >>> reference_plans(sizes, [(0, 1)], alloc, [3], np.array([0]), 2)
        [(0,), (-1,)]
    """
    walks: dict[tuple[bytes, ...], tuple[int, ...]] = {}
    plans = []
    for r in range(n):
        size_arr = np.asarray(sizes[r], dtype=np.float64).reshape(-1)
        alloc_arr = np.asarray(alloc[r], dtype=np.float64).reshape(-1)
        by_size = np.lexsort((np.asarray(writes, dtype=np.int64).reshape(-1), alloc_arr))
        order = np.lexsort((first.reshape(-1), -size_arr))
        fit = size_arr[order]
        tried = order[(fit > 0) & (fit <= (alloc_arr.max() if len(alloc_arr) else 0.0))]
        start = np.searchsorted(alloc_arr[by_size], size_arr[tried], side="left")
        key = tuple(a.astype(np.int64).tobytes() for a in (tried, by_size, start))
        if key not in walks:
            walks[key] = greedy_assignment(sizes[r], spans, alloc[r], writes, first)
        plans.append(walks[key])
    return list(dict.fromkeys(plans))


def _sampled(temps: Sequence[Temp], outputs: Sequence[tuple[sympy.Expr, int]],
             extra: Mapping[int, sympy.Expr], dom: ShapeDomain
             ) -> tuple[list[dict[str, int]], np.ndarray, np.ndarray, np.ndarray]:
    """Sizes of the temporaries, allocations and bodies at the domain's sample points."""
    samples = dom.sample_points()
    exprs = [*[e for e, _, _ in temps], *[k for k, _ in outputs],
             *[extra[p] for p in sorted(extra)]]
    column: dict[sympy.Expr, int] = {}
    index = np.array([column.setdefault(e, len(column)) for e in exprs], dtype=np.int64)
    distinct = list(column)
    fn = sympy.lambdify([sym(n) for n in dom.symbols], distinct, modules=["math"])
    vals = np.array([np.asarray(fn(*[p[n] for n in dom.symbols]), dtype=np.float64)
                     .reshape(-1) for p in samples]).reshape(len(samples), -1)
    vals = vals[:, index] if len(index) else np.zeros((len(samples), 0))
    n_t, n_o = len(temps), len(outputs)
    return samples, vals[:, :n_t], vals[:, n_t:n_t + n_o], vals[:, n_t + n_o:]


def heap_tables(plans: Sequence[Sequence[int]], sizes: np.ndarray, alloc: np.ndarray,
                 spans: Sequence[tuple[int, int]], n_points: int, extra_pos: Sequence[int],
                 extras: np.ndarray) -> list[np.ndarray]:
    """:func:`_heap_table` of each assignment: the heap with nothing hidden, swept once,
    less what each assignment hides (with donated state a step has one or two output
    allocations free, and each assignment hides a temporary or two).

    Byte counts are integers: below 2**52 in all, every sum and difference is exact
    in float64, so the tables are those of :func:`_heap_table` to the byte.

    Example:
        >>> sizes, alloc = np.array([[8.0, 4.0]]), np.array([[8.0]])
        >>> [t.tolist() for t in heap_tables([(0, -1), (-1, -1)], sizes, alloc,
        ...                                  [(0, 1), (1, 2)], 3, [], np.zeros((1, 0)))]
        [[[0.0, 4.0, 4.0]], [[8.0, 12.0, 4.0]]]
    """
    if not spans or not sizes.sum() < 2 ** 52:
        return [_heap_table(plan, sizes, alloc, spans, n_points, extra_pos, extras)
                for plan in plans]
    first = np.array([s for s, _ in spans], dtype=np.int64)
    last = np.array([t for _, t in spans], dtype=np.int64) + 1
    base = _swept(sizes, first, last, n_points)
    tables = []
    for plan in plans:
        placed = np.array(plan, dtype=np.int64)
        cols = np.flatnonzero(placed >= 0)
        hidden = np.where(sizes[:, cols] <= alloc[:, placed[cols]], sizes[:, cols], 0.0)
        table = base - _swept(hidden, first[cols], last[cols], n_points) if len(cols) else (
            base.copy())
        if extra_pos:
            table[:, extra_pos] += extras
        tables.append(table)
    return tables


def _swept(rows: np.ndarray, first: np.ndarray, last: np.ndarray, n_points: int
           ) -> np.ndarray:
    """``[samples, n_points]``: per sample, the sum of ``rows[:, i]`` over the columns ``i``
    with ``first[i] <= p < last[i]`` (one ``bincount`` of every sample's difference row)."""
    n_samples, width = rows.shape[0], n_points + 1
    at = np.concatenate([first, last])
    flat = (np.arange(n_samples, dtype=np.int64)[:, None] * width + at[None, :]).ravel()
    diff = np.bincount(flat, np.concatenate([rows, -rows], axis=1).ravel(),
                       minlength=n_samples * width).reshape(n_samples, width)
    return np.cumsum(diff, axis=1)[:, :n_points]


def _heap_table(plan: Sequence[int], sizes: np.ndarray, alloc: np.ndarray,
                spans: Sequence[tuple[int, int]], n_points: int, extra_pos: Sequence[int],
                extras: np.ndarray) -> np.ndarray:
    """``[samples, points]`` heap bytes under one assignment (a placed temporary that
    does not fit its allocation at a sample counts there)."""
    placed = np.array(plan, dtype=np.int64)
    fits = np.zeros_like(sizes, dtype=bool)
    on = placed >= 0
    if on.any():
        fits[:, on] = sizes[:, on] <= alloc[:, placed[on]]
    heap = np.where(fits, 0.0, sizes)  # [samples, temps]
    diff = np.zeros((n_points + 1, sizes.shape[0]))
    if spans:
        first = np.array([s for s, _ in spans])
        last = np.array([t for _, t in spans]) + 1
        if heap.sum() < 2 ** 52:
            # Integral byte counts sum exactly in any order: one sorted reduction instead
            # of np.add.at (half of this function's time).
            _add_rows(diff, np.concatenate([first, last]), np.concatenate([heap.T, -heap.T]))
        else:
            np.add.at(diff, first, heap.T)
            np.add.at(diff, last, -heap.T)
    table = np.cumsum(diff, axis=0)[:n_points].T
    if extra_pos:
        table[:, extra_pos] += extras
    return table


def _add_rows(out: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """``np.add.at(out, index, rows)`` by sorting ``index`` and reducing each run."""
    order = np.argsort(index, kind="stable")
    idx = index[order]
    starts = np.flatnonzero(np.concatenate([[True], idx[1:] != idx[:-1]]))
    out[idx[starts]] += np.add.reduceat(rows[order], starts, axis=0)


def _cover_plans(tables: Sequence[np.ndarray]) -> list[int]:
    """Few assignments whose best peak is within ``TOLERANCE`` of the best at every sample."""
    peaks = np.array([t.max(axis=1) for t in tables])  # [plans, samples]
    return cover(-peaks.T, TOLERANCE)


def _point_expression(plan: Sequence[int], temps: Sequence[Temp],
                      outputs: Sequence[tuple[sympy.Expr, int]],
                      spans: Sequence[tuple[int, int]], p: int,
                      extra: Mapping[int, sympy.Expr], dom: ShapeDomain, fit_cache: dict,
                      tally: collections.Counter[str], symbolic: bool) -> sympy.Expr:
    """Heap bytes at point ``p`` under ``plan``: placed temporaries count where they do
    not fit their allocation."""
    counts: collections.Counter[tuple[sympy.Expr, sympy.Expr | None]] = collections.Counter()
    for i, (s, t) in enumerate(spans):
        if s <= p <= t:
            a = plan[i]
            counts[(temps[i][0], outputs[a][0] if a >= 0 else None)] += 1
    terms = []
    for (e, k), n in counts.items():
        unfit = 1 if k is None else 1 - fit_step(e, k, dom, tally, fit_cache, symbolic)
        if unfit != 0:
            terms.append(n * e * unfit)
    return sympy.Add(*terms, extra.get(p, 0))
