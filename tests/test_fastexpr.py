"""jaxmem.fastexpr: compiled expressions equal sympy's own evaluation, without lambdify."""

from __future__ import annotations

import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.fastexpr import compile_expr
from jaxmem.symbolic import sym

B, S = sym("b"), sym("s")

_LEAVES = st.sampled_from([B, S, B * S, sympy.Integer(3), sympy.Rational(1, 2) * B, S ** 2])


def _conditions(exprs: st.SearchStrategy) -> st.SearchStrategy:
    relation = st.builds(lambda r, x, y: r(x, y),
                         st.sampled_from([sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt]), exprs, exprs)
    return st.recursive(relation, lambda c: st.one_of(
        st.builds(sympy.Not, c), st.builds(sympy.And, c, c), st.builds(sympy.Or, c, c),
        st.builds(sympy.ITE, c, c, c)), max_leaves=4)


def _extend(exprs: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.builds(lambda x, y: x + y, exprs, exprs), st.builds(lambda x, y: x * y, exprs, exprs),
        st.builds(sympy.Max, exprs, exprs), st.builds(sympy.Min, exprs, exprs),
        st.builds(lambda x, c, y: sympy.Piecewise((x, c), (y, True)), exprs,
                  _conditions(_LEAVES), exprs))


_EXPRS = st.recursive(_LEAVES, _extend, max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(_EXPRS, st.integers(1, 64), st.integers(1, 64))
def test_compiled_equals_sympy(expr: sympy.Expr, b: int, s: int) -> None:
    f = compile_expr([B, S], expr)
    assert f.__code__.co_filename == "<jaxmem.fastexpr>", expr  # not lambdify's fallback
    assert f(b, s) == expr.subs({B: b, S: s}), expr


def test_if_then_else_conditions_compile() -> None:
    # sympy writes a Piecewise's nested conditions as ITE; lambdify took 15 ms each.
    cond = sympy.ITE(B <= 4, S <= 8, sympy.Not(S <= 2))
    expr = sympy.Piecewise((B * S, cond), (B, True))
    f = compile_expr([B, S], expr)
    assert f.__code__.co_filename == "<jaxmem.fastexpr>"
    assert [f(2, 8), f(2, 9), f(8, 2), f(8, 3)] == [16, 2, 8, 24]
