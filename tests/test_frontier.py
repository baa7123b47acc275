"""The frontier's cheap passes (``jaxmem.memory.frontier``) against their plain definitions.

``undominated`` on its integer matrix must keep exactly the positions, in the same
order and with the same tally, as the sequential sweep over dictionaries it replaces;
``sample_values`` must be the exact values of the points at the sample points.
"""

from __future__ import annotations

import collections

import sympy
from hypothesis import given
from hypothesis import strategies as st

from jaxmem.fastexpr import compile_expr
from jaxmem.memory.frontier import dominates, row_sign, sample_values, undominated
from jaxmem.symbolic import Cmp, ShapeDomain, compare, sym

B, S = sym("b"), sym("s")
MONOMIALS = [sympy.Integer(1), B, S, B * S, B * S ** 2]
point = st.dictionaries(st.sampled_from(MONOMIALS),
                        st.integers(-3, 3).map(sympy.Integer), max_size=4).map(
    lambda d: {m: c for m, c in d.items() if c != 0})


def sweep(points: list[dict], tally: collections.Counter) -> list[int]:
    """The sequential sweep as it was written before the matrix form."""
    keep: list[int] = []
    seen: set[frozenset] = set()
    for p, pt in enumerate(points):
        key = frozenset(pt.items())
        if key in seen:
            continue
        seen.add(key)
        if any(dominates(points[q], pt) for q in keep):
            tally["symbolic"] += 1
            continue
        before = len(keep)
        keep = [q for q in keep if not dominates(pt, points[q])]
        tally["symbolic"] += 1 if before != len(keep) else 0
        keep.append(p)
    return keep


@given(st.lists(point, max_size=30))
def test_matrix_sweep_equals_the_dictionary_sweep(points) -> None:
    fast, slow = collections.Counter(), collections.Counter()
    assert undominated(points, fast) == sweep(points, slow)
    assert fast == slow


def test_non_integer_coefficients_take_the_dictionary_sweep() -> None:
    points = [{B: sympy.Rational(1, 2)}, {B: sympy.Integer(1)}, {S: sympy.Integer(1)}]
    tally = collections.Counter()
    assert undominated(points, tally) == sweep(points, collections.Counter()) == [1, 2]
    assert tally == {"symbolic": 1}


@given(st.lists(point, min_size=1, max_size=5))
def test_sample_values_are_exact(points) -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s <= 512"))
    values = sample_values(points, range(len(points)), dom)
    for p, pt in enumerate(points):
        f = compile_expr([B, S], sympy.Add(*[c * m for m, c in pt.items()]))
        assert values[p] == tuple(f(x["b"], x["s"]) for x in dom.sample_points())


wide = st.dictionaries(st.sampled_from(MONOMIALS), st.integers(-10 ** 6, 10 ** 6).map(
    sympy.Integer), min_size=1, max_size=5)


@given(wide, wide)
def test_row_sign_is_what_compare_answers(a, b) -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 8", "s <= 512"))
    sign = row_sign(a, b, dom, {})
    expr = lambda d: sympy.Add(*[c * m for m, c in d.items()])  # noqa: E731
    c = compare(expr(a), expr(b), dom)
    if sign is not None:
        assert c.result == (Cmp.GT if sign > 0 else Cmp.LT) and c.decided_by == "symbolic"
    coeffs = [a.get(m, 0) - b.get(m, 0) for m in MONOMIALS]
    if c.result in (Cmp.GT, Cmp.LT) and min(coeffs) < 0 < max(coeffs):
        # A mixed-sign difference compare proves one-signed: row_sign proves it too,
        # unless only factoring could (then it must say so by refusing, not by a sign).
        assert sign in (None, 1 if c.result == Cmp.GT else -1)


def test_row_sign_decides_a_memory_model_difference() -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 8", "s <= 512"))
    a = {B * S ** 2: sympy.Integer(128), sympy.Integer(1): sympy.Integer(-4)}
    b = {B * S: sympy.Integer(513048)}
    assert row_sign(a, b, dom, {}) == -1
    assert row_sign(b, a, dom, {}) == 1
    assert row_sign({B: sympy.Integer(2)}, {B: sympy.Integer(1)}, dom, {}) is None  # one sign
