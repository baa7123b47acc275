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

import math
from collections.abc import Callable, Sequence
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
            ``Mod`` and relations; anything else falls back to ``sympy.lambdify``.

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
    if isinstance(e, sympy.floor):
        return f"floor({args[0]})"
    if isinstance(e, sympy.Mod):
        return f"({args[0]} % {args[1]})"
    raise NotImplementedError(type(e).__name__)
