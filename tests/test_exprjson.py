"""Sympy expressions as JSON rows (``jaxmem.exprjson``): the very tree comes back, or nothing."""

from __future__ import annotations

import json

import pytest
import sympy
from hypothesis import given
from hypothesis import strategies as st

from jaxmem.dims import sym
from jaxmem.exprjson import ExprTable, UnencodableError, decode_table

B, S = sym("b"), sym("s")


def _round_trip(*exprs: sympy.Basic) -> list[sympy.Basic]:
    table = ExprTable()
    ids = [table.add(e) for e in exprs]
    rows = json.loads(json.dumps(table.rows))  # what the disk holds is JSON
    back = decode_table(rows)
    return [back[i] for i in ids]


atoms = st.sampled_from([B, S, sympy.Integer(3), sympy.Integer(-2), sympy.Rational(1, 43)])


def _combine(children: st.SearchStrategy) -> st.SearchStrategy:
    def unevaluated(cls: type) -> st.SearchStrategy:
        return st.lists(children, min_size=2, max_size=4).map(
            lambda xs: cls(*xs, evaluate=False))

    piecewise = st.tuples(children, children, children).map(
        lambda t: sympy.Piecewise((t[0], sympy.Le(t[1] * B, 64)), (t[2], True)))
    return st.one_of(st.lists(children, min_size=2, max_size=4).map(lambda xs: sympy.Add(*xs)),
                     st.lists(children, min_size=2, max_size=3).map(lambda xs: sympy.Mul(*xs)),
                     unevaluated(sympy.Max), unevaluated(sympy.Min), piecewise,
                     children.map(sympy.floor))


@given(st.recursive(atoms, _combine, max_leaves=12))
def test_any_byte_expression_comes_back_as_the_same_tree(expr: sympy.Basic) -> None:
    (back,) = _round_trip(expr)
    assert back == expr  # structural: same classes, same arguments in the same order
    assert back.subs({B: 3, S: 5}) == expr.subs({B: 3, S: 5})


def test_max_keeps_its_argument_order_and_shared_subtrees_are_stored_once() -> None:
    inner = sympy.Piecewise((1, B * S <= 64), (0, True))
    # Arguments in an order Max's own constructor would not choose.
    e = sympy.Basic.__new__(sympy.Max, 4 * B * inner + 3, sympy.Integer(18))
    table = ExprTable()
    table.add(e)
    table.add(e + inner)
    assert sum(1 for r in table.rows if r[:2] == ["app", "Piecewise"]) == 1
    (back,) = _round_trip(e)
    assert back.args == e.args
    assert back.subs({B: 2, S: 4}) == e.subs({B: 2, S: 4})


def test_symbols_keep_their_assumptions() -> None:
    (back,) = _round_trip(B)
    assert back == B and back.is_positive and back.is_integer
    assert _round_trip(sympy.Symbol("b"))[0] != B


@pytest.mark.parametrize("expr", [sympy.Float(1.5) * B, sympy.Function("f")(B)])
def test_what_cannot_be_stored_faithfully_is_refused(expr: sympy.Basic) -> None:
    with pytest.raises(UnencodableError):
        ExprTable().add(expr)


@pytest.mark.parametrize("rows", [
    [["app", "eval", []]],                        # not a sympy class: never looked up as code
    [["app", "Symbol", []]],                      # a class, but rebuilt differently
    [["one", "__class__"]],
    [["int", "7"], ["app", "Add", [0, 5]]],       # a child that does not exist
    [["what", 1]],
])
def test_malformed_rows_raise_value_errors(rows: list) -> None:
    with pytest.raises((ValueError, IndexError, TypeError)):
        decode_table(rows)
