"""Cheap sign proofs on the domain's box (``jaxmem.symbolic.bounds``).

Covers: the differences a 22-layer memory model asks about are decided (by the
shift and by the absorption proof), sign changes and non-polynomials are refused,
unbounded dims only use the lower corner, and the property that a proved sign
holds at every integer point of the box.
"""

from __future__ import annotations

import itertools

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.symbolic import Cmp, ShapeDomain, compare, sym
from jaxmem.symbolic.bounds import box_sign, integer_poly

B, S = sym("b"), sym("s")
DOM = ShapeDomain.from_constraints(("b", "s"), ("b <= 8", "s <= 512"))


@pytest.mark.parametrize(("diff", "sign"), [
    (127996 * B * S - 4, 1),  # shift from the lower corner
    (-256 * B * S ** 2 - 77320 * B * S + 16384, -1),
    (128 * B * S ** 2 - 513048 * B * S - 4, -1),  # absorption: s <= 512
    (-128 * B * S ** 2 + 65540 * B * S - 1, 1),
    (sympy.Rational(1, 3) * B - sympy.Rational(1, 4), 1),  # rational coefficients
])
def test_decides_one_signed_differences(diff: sympy.Expr, sign: int) -> None:
    assert box_sign(sympy.expand(diff), DOM) == sign


@pytest.mark.parametrize("diff", [
    B * S - 64,  # changes sign inside the box
    128 * B * S ** 2 - 65536 * B * S,  # zero at s = 512: not strictly signed
    sympy.floor(B / 2) - 1,
    B * sym("x") + 1,  # not a domain symbol
    B / S + 1,  # a negative exponent
])
def test_refuses_what_it_cannot_prove(diff: sympy.Expr) -> None:
    assert box_sign(diff, DOM) is None


def test_unbounded_dims_use_the_lower_corner_only() -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 8",))
    assert box_sign(B * S + 3 * S - 2, dom) == 1
    assert box_sign(S ** 2 - 1000 * S * B, dom) is None  # s ** 2 grows past it
    assert box_sign(B * S - 1000 * B * S ** 2, dom) == -1  # shift: -999 b s ... < 0


def test_compare_uses_it_and_says_symbolic() -> None:
    c = compare(128 * B * S ** 2 - 4, 513048 * B * S, DOM)
    assert (c.result, c.decided_by) == (Cmp.LT, "symbolic")


def test_integer_poly_scales_rationals() -> None:
    assert integer_poly(sympy.Rational(1, 2) * B * S + sympy.Rational(1, 3), ("b", "s")) == {
        (1, 1): 3, (0, 0): 2}


terms = st.lists(st.tuples(st.integers(-10 ** 5, 10 ** 5), st.integers(0, 2),
                           st.integers(0, 3)), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(terms, st.integers(1, 3), st.integers(0, 6), st.integers(1, 3), st.integers(0, 30))
def test_a_proved_sign_holds_at_every_point_of_the_box(ts, b_lo, b_span, s_lo, s_span) -> None:
    dom = ShapeDomain.from_constraints(("b", "s"), (
        f"b >= {b_lo}", f"b <= {b_lo + b_span}", f"s >= {s_lo}", f"s <= {s_lo + s_span}"))
    diff = sympy.expand(sympy.Add(*[c * B ** i * S ** j for c, i, j in ts]))
    sign = box_sign(diff, dom)
    if sign is None:
        return
    f = sympy.lambdify((B, S), diff)
    for b, s in itertools.product(range(b_lo, b_lo + b_span + 1),
                                  range(s_lo, s_lo + s_span + 1)):
        assert sign * f(b, s) > 0, (diff, b, s)
