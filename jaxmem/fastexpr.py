"""Compile a sympy expression into a Python function, sharing repeated subexpressions.

``sympy.lambdify`` prints the expression as a tree: a subexpression used in many
places (the ``Piecewise`` steps of a peak with output reuse) is printed, and
evaluated, once per use, and ``lambdify(cse=True)`` spends seconds finding the
repetitions. Sympy already shares equal subexpressions by hash, so walking the
expression as a DAG and naming each distinct node once gives the same result in
linear time.

Example:
    >>> import sympy
    >>> b, s = sympy.symbols("b s", integer=True, positive=True)
    >>> step = sympy.Piecewise((1, b * s <= 64), (0, True))
    >>> f = compile_expr([b, s], sympy.Max(3 * step * b, 2 * step + s))
    >>> f(4, 8), f(16, 8)
    (12, 8)
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sympy

_RELATIONS = {sympy.Le: "<=", sympy.Lt: "<", sympy.Ge: ">=", sympy.Gt: ">", sympy.Eq: "==",
              sympy.Ne: "!="}


def compile_expr(symbols: Sequence[sympy.Symbol], expr: sympy.Expr) -> Callable[..., Any]:
    """A Python function of ``symbols`` that evaluates ``expr`` (exact for integers).

    Args:
        symbols: the arguments, in order.
        expr: a sympy expression built from integers, rationals, symbols, ``+``,
            ``*``, integer powers, ``Min``, ``Max``, ``Piecewise``, ``floor``,
            ``Mod``, relations, ``And``, ``Or``, ``Not`` and ``ITE``; anything else
            falls back to ``sympy.lambdify``.

    Returns:
        The function.
    """
    names = {s: f"a{i}" for i, s in enumerate(symbols)}
    lines: list[str] = []
    memo: dict[sympy.Basic, str] = {}
    try:
        result = _emit(sympy.sympify(expr), names, memo, lines)
    except NotImplementedError:
        return sympy.lambdify(list(symbols), expr, modules=["math"])
    body = "\n".join(f"    {line}" for line in lines)
    src = f"def _f({', '.join(names.values())}):\n{body}\n    return {result}\n"
    scope: dict[str, Any] = {"Fraction": _fraction, "floor": math.floor}
    exec(compile(src, "<jaxmem.fastexpr>", "exec"), scope)  # noqa: S102 - generated above
    return scope["_f"]


def _fraction(p: int, q: int) -> Any:
    from fractions import Fraction

    return Fraction(p, q)


def _emit(e: sympy.Basic, names: dict, memo: dict, lines: list[str]) -> str:
    """Code for ``e``; distinct composite nodes are assigned to a temporary once."""
    if e in names:
        return names[e]
    if e.is_Integer:
        return f"({int(e)})"
    if e.is_Rational:
        return f"Fraction({int(e.p)}, {int(e.q)})"
    if e is sympy.true:
        return "True"
    if e is sympy.false:
        return "False"
    if e in memo:
        return memo[e]
    code = _node(e, names, memo, lines)
    var = f"t{len(memo)}"
    lines.append(f"{var} = {code}")
    memo[e] = var
    return var


def _node(e: sympy.Basic, names: dict, memo: dict, lines: list[str]) -> str:
    if isinstance(e, sympy.Piecewise):
        code = "None"
        for val, cond in reversed([pair.args for pair in e.args]):
            code = (f"({_emit(val, names, memo, lines)} if {_emit(cond, names, memo, lines)} "
                    f"else {code})")
        return code
    args = [_emit(a, names, memo, lines) for a in e.args]
    if isinstance(e, sympy.Add):
        return " + ".join(args)
    if isinstance(e, sympy.Mul):
        return " * ".join(args)
    if isinstance(e, sympy.Pow):
        exp = e.args[1]
        if exp.is_Integer and int(exp) >= 0:
            return f"{args[0]} ** {int(exp)}"
        return f"{args[0]} ** {args[1]}"
    if isinstance(e, sympy.Min):
        return f"min({', '.join(args)})"
    if isinstance(e, sympy.Max):
        return f"max({', '.join(args)})"
    if type(e) in _RELATIONS:
        return f"({args[0]} {_RELATIONS[type(e)]} {args[1]})"
    if isinstance(e, sympy.And):
        return " and ".join(f"({a})" for a in args)
    if isinstance(e, sympy.Or):
        return " or ".join(f"({a})" for a in args)
    if isinstance(e, sympy.ITE):
        return f"({args[1]} if {args[0]} else {args[2]})"
    if isinstance(e, sympy.Not):
        return f"(not {args[0]})"
    if isinstance(e, sympy.floor):
        return f"floor({args[0]})"
    if isinstance(e, sympy.Mod):
        return f"({args[0]} % {args[1]})"
    raise NotImplementedError(type(e).__name__)


def linear_terms(e: sympy.Expr) -> tuple[tuple[sympy.Expr, sympy.Expr], ...]:
    """``(monomial, coefficient)`` pairs of ``sympy.expand(e)``, cached by expression.

    Example:
        >>> b = sympy.Symbol("b")
        >>> linear_terms(2 * b * (b + 3))
        ((b**2, 2), (b, 6))
    """
    return _linear_terms(e)


@functools.lru_cache(maxsize=65536)
def _linear_terms(e: sympy.Expr) -> tuple[tuple[sympy.Expr, sympy.Expr], ...]:
    out: dict[sympy.Expr, sympy.Expr] = {}
    for term in sympy.Add.make_args(sympy.expand(e)):
        c, m = term.as_coeff_Mul()
        out[m] = out.get(m, 0) + c
    return tuple(out.items())


def expanded_sum(exprs: Iterable[sympy.Expr]) -> sympy.Expr:
    """``sympy.expand(sympy.Add(*exprs))``, summed as coefficient dictionaries.

    A train step's FLOPs are a sum over thousands of nodes sharing a few distinct
    expressions; sympy's ``Add`` of them all, then ``expand``, took seconds.

    Example:
        >>> b = sympy.Symbol("b")
        >>> expanded_sum([b * (b + 1), 2 * b, b * (b + 1)])
        2*b**2 + 4*b
    """
    total: dict[sympy.Expr, sympy.Expr] = {}
    for e, count in collections.Counter(exprs).items():
        for m, c in _linear_terms(e):
            total[m] = total.get(m, 0) + count * c
    return sympy.Add(*[c * m for m, c in total.items() if c != 0])


def sum_at(exprs: Iterable[sympy.Expr], subs: Mapping[sympy.Symbol, int]) -> sympy.Expr:
    """``sympy.Add(*exprs).subs(subs)``, each distinct expression evaluated once (exact).

    Example:
        >>> b = sympy.Symbol("b")
        >>> sum_at([4 * b, 4 * b, b ** 2], {b: 3})
        33
    """
    exprs = list(exprs)
    point = tuple(sorted(subs.items(), key=lambda kv: str(kv[0])))
    total = sympy.Integer(0)
    for e, count in collections.Counter(exprs).items():
        value = _at(sympy.sympify(e), point)
        if not value.is_Rational:  # a symbol left free, or a float: sympy's own way
            return sympy.Add(*exprs).subs(dict(subs))
        total += count * value
    return total


def pairs_at(pairs: Iterable[tuple[sympy.Expr, sympy.Expr]],
             subs: Mapping[sympy.Symbol, int]) -> sympy.Expr:
    """``sum(c * m for m, c in pairs).subs(subs)`` without building the sum: each
    monomial is evaluated once per point (a live set's ``(monomial, coefficient)`` pairs).

    Example:
        >>> b = sympy.Symbol("b")
        >>> pairs_at([(b, 4), (b**2, 1), (sympy.Integer(1), 8)], {b: 3})
        29
    """
    point = tuple(sorted(subs.items(), key=lambda kv: str(kv[0])))
    return sympy.Integer(0) + sum(c * _at(m, point) for m, c in pairs)


@functools.lru_cache(maxsize=65536)
def _at(e: sympy.Expr, point: tuple[tuple[sympy.Symbol, int], ...]) -> sympy.Expr:
    return sympy.sympify(e.subs(dict(point)))
