"""Symbolic shape domain and comparisons (``jaxmem.symbolic``).

Covers: every comparison outcome, the split point of ``4096*b*s`` vs ``32*b*s^2``,
multi-symbol constraints used in decisions, ``floordiv``/``mod``/``max``/``min``
falling back to sampling without crashing, how decisions are tallied, and two
properties: a symbolic answer is never contradicted by evaluating the two sides at
points of the domain, and ``to_sympy`` evaluates JAX dim polynomials exactly as
JAX does.
"""

from __future__ import annotations

import jax
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem import SymbolicError
from jaxmem.fastexpr import compile_expr
from jaxmem.symbolic import Cmp, ShapeDomain, compare, sym, to_sympy

B, S = sym("b"), sym("s")


# --- comparisons ---------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b", "expected"), [
    (4 * B * S, 8 * B * S, Cmp.LT),
    (B * S, B * S, Cmp.EQ),
    (8 * B * S + 4, 8 * B * S, Cmp.GT),
    (B * S, B, Cmp.GE),  # equal when s = 1
    (B, B * S, Cmp.LE),
    (B ** 2, 17 * B, Cmp.LT),  # b <= 16 makes b^2 < 17 b
])
def test_compare_outcomes(bs_domain: ShapeDomain, a, b, expected: Cmp) -> None:
    c = compare(a, b, bs_domain)
    assert c.result == expected
    assert c.decided_by == "symbolic"
    assert c.split is None


def test_flip_is_an_involution() -> None:
    for c in Cmp:
        assert c.flip().flip() == c
    assert Cmp.LT.flip() == Cmp.GT and Cmp.LE.flip() == Cmp.GE and Cmp.EQ.flip() == Cmp.EQ


def test_split_of_linear_against_quadratic_sequence_memory(bs_domain: ShapeDomain) -> None:
    # Activations (4096 b s bytes) against attention scores (32 b s^2 bytes).
    c = compare(4096 * B * S, 32 * B * S ** 2, bs_domain)
    assert c.result == Cmp.UNKNOWN and c.decided_by == "symbolic"
    assert c.split is not None
    assert (c.split.symbol, c.split.at, c.split.below, c.split.above) == ("s", 128, Cmp.GT, Cmp.LT)
    assert "LT iff s > 128" in str(c.split)
    # The split is where the two really cross.
    for s in (1, 127, 129, 512):
        lhs, rhs = 4096 * 3 * s, 32 * 3 * s * s
        assert (lhs < rhs) == (s > 128)


def test_split_outside_the_domain_is_decided(bs_domain: ShapeDomain) -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s <= 100"))
    assert compare(4096 * B * S, 32 * B * S ** 2, dom).result == Cmp.GT
    assert compare(4096 * B * S, 32 * B * S ** 2, bs_domain).result == Cmp.UNKNOWN


def test_multi_symbol_constraint_is_used() -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b*s <= 4096",))
    assert dom.constraints, "b*s <= 4096 is kept as a general constraint"
    c = compare(B * S, 5000, dom)
    assert c.result == Cmp.LT and c.decided_by == "symbolic"
    assert compare(B * S, 4096, dom).result == Cmp.LE
    # Without the constraint the same question has no answer on an unbounded box.
    free = ShapeDomain.from_constraints(("b", "s"))
    assert compare(B * S, 5000, free).result == Cmp.UNKNOWN


def test_bounds_and_membership() -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s >= 2", "s <= 512",
                                                    "b*s <= 2048"))
    assert dom.bounds("b") == (1, 16) and dom.bounds("s") == (2, 512)
    assert dom.contains({"b": 4, "s": 512}) is None
    assert "below its lower bound" in dom.contains({"b": 4, "s": 1})
    assert "above its upper bound" in dom.contains({"b": 17, "s": 8})
    assert "b*s <= 2048" in dom.contains({"b": 16, "s": 512})


def test_empty_range_is_an_error() -> None:
    with pytest.raises(SymbolicError, match="empty"):
        ShapeDomain.from_constraints(("b",), ("b <= 4", "b >= 8"))


def test_unparseable_constraint_is_an_error() -> None:
    with pytest.raises(SymbolicError, match="cannot parse"):
        ShapeDomain.from_constraints(("b",), ("b is small",))


@pytest.mark.parametrize("expr", [
    sympy.floor(B * S / 3) * 4,
    sympy.Mod(B * S, 7) + 8 * B,
    sympy.Max(B, S) * 4,
    sympy.Min(B * S, 256) * 4,
])
def test_non_polynomials_fall_back_without_crashing(bs_domain: ShapeDomain, expr) -> None:
    c = compare(expr, 4 * B * S, bs_domain)
    assert c.decided_by in ("symbolic", "fallback")
    assert c.result in set(Cmp)
    assert compare(expr, expr, bs_domain).result == Cmp.EQ


def test_decided_by_counts(bs_domain: ShapeDomain) -> None:
    decisions = [compare(a, b, bs_domain).decided_by for a, b in [
        (B * S, 2 * B * S), (4096 * B * S, 32 * B * S ** 2),
        (sympy.floor(S / 2) * B, B * S), (sympy.Mod(S, 3), 5)]]
    assert decisions.count("symbolic") == 2
    assert decisions.count("fallback") == 2
    # The ablation never reasons symbolically.
    assert compare(B * S, 2 * B * S, bs_domain, symbolic=False).decided_by == "fallback"


# --- properties ----------------------------------------------------------------------------

monomials = st.sampled_from([sympy.Integer(1), B, S, B * S, S ** 2, B * S ** 2, B ** 2])
polys = st.lists(st.tuples(st.integers(-64, 64), monomials), min_size=1, max_size=4).map(
    lambda terms: sympy.Add(*[c * m for c, m in terms]))


@given(polys, polys, st.lists(st.tuples(st.integers(1, 16), st.integers(1, 512)),
                              min_size=8, max_size=8))
def test_symbolic_answers_hold_at_domain_points(a, b, points) -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s <= 512"))
    c = compare(a, b, dom)
    if c.decided_by != "symbolic":
        return
    fa, fb = compile_expr([B, S], a), compile_expr([B, S], b)
    corners = [(1, 1), (1, 512), (16, 1), (16, 512)]
    for bv, sv in points + corners:
        x, y = fa(bv, sv), fb(bv, sv)
        if c.result == Cmp.UNKNOWN:
            assert c.split is not None
            at = float(c.split.at)
            v = {"b": bv, "s": sv}[c.split.symbol]
            if v == at:
                continue
            side = c.split.below if v < at else c.split.above
        else:
            side = c.result
        ok = {Cmp.LT: x < y, Cmp.LE: x <= y, Cmp.EQ: x == y, Cmp.GE: x >= y, Cmp.GT: x > y}
        assert ok[side], (a, b, c, bv, sv, x, y)


DIM_TERMS = ["b", "s", "b*s", "s*s", "2*b", "floordiv(s, 2)", "floordiv(b*s + 3, 4)",
             "mod(b*s, 5)", "max(b, s)", "min(b, 2*s)", "3"]


@given(st.lists(st.tuples(st.integers(1, 5), st.sampled_from(DIM_TERMS)), min_size=1,
                max_size=4),
       st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=4, max_size=4))
def test_to_sympy_matches_jax_evaluation(terms, points) -> None:
    text = " + ".join(f"{c}*{t}" for c, t in terms)
    dim = jax.export.symbolic_shape(f"b, s, {text}")[2]
    expr = to_sympy(dim)
    if isinstance(dim, int):  # the terms folded to a constant
        assert expr == dim
        return
    evaluate = getattr(dim, "_evaluate", None)
    if evaluate is None:  # JAX without its (private) evaluator: nothing to compare with
        pytest.skip("this JAX has no _DimExpr._evaluate")
    for bv, sv in points:
        want = int(evaluate({"b": bv, "s": sv}))
        got = expr.subs({B: bv, S: sv})
        assert got == want, (text, str(dim), expr, bv, sv)


def test_to_sympy_of_plain_ints_and_symbols() -> None:
    assert to_sympy(7) == 7
    b, s = jax.export.symbolic_shape("b, s")
    assert to_sympy(b * s) == B * S
    assert to_sympy(2 * s + 1) == 2 * S + 1
    assert to_sympy(b * s // 2) == sympy.floor(B * S / 2)


def test_extreme_points_follow_a_token_budget() -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 64", "s <= 512", "b*s <= 4096"))
    points = dom.extreme_points()
    assert {tuple(p.values()) for p in points} == {(64, 64), (8, 512)}
    for p in points:  # inside the domain, and no symbol can grow
        assert dom.contains(p) is None
        assert all(dom.contains({**p, n: v + 1}) is not None for n, v in p.items())
    box = ShapeDomain.from_constraints(("b", "s"), ("b <= 64", "s <= 512"))
    assert box.extreme_points() == [box.corner()]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.integers(1, 512), st.integers(64, 20000))
def test_sample_points_satisfy_the_constraints_and_reach_the_edge(b, s, tokens) -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), (f"b <= {b}", f"s <= {s}",
                                                    f"b*s <= {tokens}"))
    points = dom.sample_points()
    assert points and all(dom.contains(p) is None for p in points)
    for p in dom.extreme_points():
        assert p in points
        assert all(dom.contains({**p, n: v + 1}) is not None for n, v in p.items())
