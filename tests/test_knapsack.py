"""The knapsack over residual roles (``jaxmem.plan.knapsack``) against brute force."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.plan.knapsack import frontier, spread

_ITEMS = st.lists(st.tuples(st.integers(1, 50), st.integers(0, 50)), max_size=8)


def _brute(items):
    subsets = [frozenset(c) for n in range(len(items) + 1)
               for c in itertools.combinations(range(len(items)), n)]
    figures = {s: (sum(items[k][0] for k in s), sum(items[k][1] for k in s)) for s in subsets}
    return {(b, f) for b, f in figures.values()
            if not any(b2 <= b and f2 >= f and (b2, f2) != (b, f) for b2, f2 in figures.values())}


@settings(max_examples=300, deadline=None)
@given(_ITEMS)
def test_the_frontier_is_every_undominated_subset(items):
    front = frontier([(float(b), float(f)) for b, f in items])
    assert {(int(b), int(f)) for b, f, _ in front} == _brute(items)
    for b, f, s in front:  # each figure is its set's
        assert (b, f) == (sum(items[k][0] for k in s), sum(items[k][1] for k in s))
    assert [f for _, f, _ in front] == sorted({f for _, f, _ in front})


@settings(max_examples=100, deadline=None)
@given(_ITEMS, st.floats(0.0, 0.2))
def test_a_tolerance_only_thins_the_frontier(items, tolerance):
    exact = frontier([(float(b), float(f)) for b, f in items])
    thin = frontier([(float(b), float(f)) for b, f in items], tolerance)
    assert len(thin) <= len(exact)
    # Whatever the exact frontier spares at some bytes, the thinned one spares nearly as
    # much at about as many bytes.
    for b, f, _ in exact:
        assert any(b2 <= b * (1 + tolerance) ** len(items) + 1e-9
                   and f2 >= f / (1 + tolerance) ** len(items) - 1e-9 for b2, f2, _ in thin)


def test_spread_picks_inner_choices_in_order():
    front = [(float(b), float(b), frozenset({b})) for b in range(20)]
    picked = spread(front, 3)
    assert len(picked) == 3 and picked == sorted(picked, key=lambda c: c[0])
    assert front[0] not in picked and front[-1] not in picked
    assert spread(front[:3], 3) == front[1:2]
