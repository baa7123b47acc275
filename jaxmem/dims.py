"""Dim expressions as sympy: the vocabulary every stage speaks.

JAX's symbolic dims (``_DimExpr``) become sympy expressions over positive
integer symbols, read from their printed form (stable across JAX versions);
constraint strings become ``g >= 0``.

Example:
    >>> import jax
    >>> b, s = jax.export.symbolic_shape("b, s")
    >>> to_sympy(b * s // 2)
    floor(b*s/2)
    >>> parse_constraint("b*s <= 4096")
    -b*s + 4096
"""

from __future__ import annotations

import re
from typing import Any

import sympy

from jaxmem.errors import SymbolicError


def sym(name: str) -> sympy.Symbol:
    """The sympy symbol jaxmem uses for dimension variable ``name``."""
    return sympy.Symbol(name, integer=True, positive=True)


_FUNCS = {"floordiv": lambda a, b: sympy.floor(a / b), "mod": sympy.Mod, "max": sympy.Max,
          "min": sympy.Min, "non_negative": lambda a: sympy.Max(a, 0)}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def to_sympy(dim: Any) -> sympy.Expr:
    """Converts an int or a JAX symbolic dimension (``_DimExpr``) to a sympy expression.

    Uses the printed form of the dim expression, which is stable across JAX
    versions, rather than its private term structure.

    Args:
        dim: an int or a JAX dim expression.

    Returns:
        A sympy expression over :func:`sym` symbols.

    Raises:
        SymbolicError: the printed form cannot be read.
    """
    if isinstance(dim, int):
        return sympy.Integer(dim)
    text = str(dim)
    if text.lstrip("-").isdigit():
        return sympy.Integer(int(text))
    return parse_expr(text)


def parse_expr(text: str) -> sympy.Expr:
    """Reads a printed dim expression (``"b*s + floordiv(s, 2)"``) into sympy.

    Args:
        text: JAX's printed form; ``floordiv``, ``mod``, ``max``, ``min`` and
            ``non_negative`` are understood.

    Returns:
        A sympy expression over :func:`sym` symbols.

    Raises:
        SymbolicError: the text is not an expression.
    """
    local: dict[str, Any] = dict(_FUNCS)
    for name in _IDENT.findall(text):
        if name not in _FUNCS:
            local[name] = sym(name)
    try:
        return sympy.sympify(text.replace("^", "**"), locals=local)
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise SymbolicError(f"cannot read dimension expression {text!r}: {e}") from e


def parse_constraint(text: str) -> sympy.Expr:
    """Parses ``"lhs OP rhs"`` into ``g`` with the constraint meaning ``g >= 0``.

    Args:
        text: ``lhs OP rhs`` with OP one of ``<=``, ``>=``, ``==``, ``<``, ``>``
            (``==`` is read as ``<=``, the upper bound).

    Returns:
        The expanded sympy expression ``g``.

    Raises:
        SymbolicError: the text is not such a constraint.
    """
    m = re.fullmatch(r"\s*(.+?)\s*(<=|>=|==|<|>)\s*(.+?)\s*", text)
    if m is None:
        raise SymbolicError(f"cannot parse constraint {text!r}: expected 'lhs <= rhs', "
                            "'lhs >= rhs' or 'lhs == rhs'")
    lhs, op, rhs = parse_expr(m.group(1)), m.group(2), parse_expr(m.group(3))
    if op in ("<=", "=="):
        return sympy.expand(rhs - lhs)
    if op == "<":
        return sympy.expand(rhs - lhs - 1)
    if op == ">=":
        return sympy.expand(lhs - rhs)
    return sympy.expand(lhs - rhs - 1)


