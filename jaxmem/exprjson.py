"""Sympy expressions as JSON data: a shared table of nodes, rebuilt without evaluation.

jaxmem's symbolic peaks are large ``Max`` and ``Piecewise`` trees whose branches
repeat. ``pickle`` rebuilds them through sympy's evaluating constructors (minutes
on the tiny Llama step, and the result is not the same tree); ``srepr`` prints each
repetition again. An :class:`ExprTable` stores every distinct subexpression once,
as a row of plain JSON values, and :func:`decode_table` rebuilds each row with
``evaluate=False``, so the result is the very tree that was stored. Decoding runs
no code from the data: class names are looked up in sympy's namespace and must
name a sympy class.

Example:
    >>> import sympy
    >>> b = sympy.Symbol("b", integer=True, positive=True)
    >>> e = sympy.Max(4 * b + 1, b**2, evaluate=False)
    >>> table = ExprTable()
    >>> i = table.add(e)
    >>> decode_table(table.rows)[i] == e
    True
"""

from __future__ import annotations

from typing import Any

import sympy
from sympy.core.operations import LatticeOp
from sympy.functions.elementary.miscellaneous import MinMaxBase
from sympy.functions.elementary.piecewise import ExprCondPair

Row = list[Any]

# Classes a byte expression may hold that sympy does not export by name.
_EXTRA: dict[str, type] = {"ExprCondPair": ExprCondPair}


class UnencodableError(ValueError):
    """An expression holds a sympy object the table cannot store faithfully."""


class ExprTable:
    """Rows of distinct subexpressions, children before parents; :meth:`add` returns a row."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.index: dict[sympy.Basic, int] = {}

    def add(self, expr: Any) -> int:
        """The row of ``expr`` (added with its subexpressions if new)."""
        expr = sympy.sympify(expr)
        found = self.index.get(expr)
        if found is not None:
            return found
        # An explicit stack: peaks nest deeper than Python's recursion limit allows.
        stack = [(expr, False)]
        while stack:
            e, ready = stack.pop()
            if e in self.index:
                continue
            if not ready and e.args:
                stack.append((e, True))
                stack.extend((a, False) for a in reversed(e.args) if a not in self.index)
                continue
            self.index[e] = len(self.rows)
            self.rows.append(self._row(e))
        return self.index[expr]

    def _row(self, e: sympy.Basic) -> Row:
        if isinstance(e, sympy.Symbol):
            return ["sym", e.name, sorted(k for k, v in e.assumptions0.items() if v is True),
                    sorted(k for k, v in e.assumptions0.items() if v is False)]
        if e.is_Integer:
            return ["int", str(int(e))]
        if e.is_Rational:
            return ["rat", str(int(e.p)), str(int(e.q))]
        if e.args:
            name = type(e).__name__
            if _class(name) is not type(e):
                raise UnencodableError(f"cannot store a {type(e).__module__}.{name}")
            return ["app", name, [self.index[a] for a in e.args]]
        name = type(e).__name__
        if getattr(sympy.S, name, None) is not e:  # a singleton: oo, zoo, nan, true, false
            raise UnencodableError(f"cannot store the atom {e!r} ({name})")
        return ["one", name]


def _class(name: str) -> type | None:
    cls = _EXTRA.get(name, getattr(sympy, name, None))
    return cls if isinstance(cls, type) and issubclass(cls, sympy.Basic) else None


def decode_table(rows: list[Row]) -> list[sympy.Basic]:
    """The expressions of an :class:`ExprTable`'s rows (``ValueError`` on malformed rows)."""
    out: list[sympy.Basic] = []
    for row in rows:
        out.append(_decode_row(row, out))
    return out


def _decode_row(row: Row, done: list[sympy.Basic]) -> sympy.Basic:
    tag = row[0]
    if tag == "sym":
        facts = {k: True for k in row[2]} | {k: False for k in row[3]}
        return sympy.Symbol(str(row[1]), **facts)
    if tag == "int":
        return sympy.Integer(int(row[1]))
    if tag == "rat":
        return sympy.Rational(int(row[1]), int(row[2]))
    if tag == "one":
        atom = getattr(sympy.S, str(row[1]), None)
        if not isinstance(atom, sympy.Basic):
            raise ValueError(f"unknown sympy singleton {row[1]!r}")
        return atom
    if tag == "app":
        cls = _class(str(row[1]))
        if cls is None:
            raise ValueError(f"unknown sympy class {row[1]!r}")
        args = [done[int(i)] for i in row[2]]
        if issubclass(cls, (MinMaxBase, LatticeOp)):
            return _unordered(cls, args)
        try:
            obj = cls(*args, evaluate=False)
        except TypeError:  # a class without an evaluate flag (ExprCondPair)
            obj = cls(*args)
        # The constructor must have kept the node as stored: same class, same children.
        if type(obj) is not cls or len(obj.args) != len(args) or any(
                a is not b and a != b for a, b in zip(obj.args, args, strict=True)):
            raise ValueError(f"sympy rebuilt a stored {cls.__name__} differently")
        return obj
    raise ValueError(f"unknown row tag {tag!r}")


def _unordered(cls: type, args: list[sympy.Basic]) -> sympy.Basic:
    """``Max``, ``Min``, ``And``, ``Or`` with their arguments in the stored order.

    Their constructors sort the arguments (ties in hash order), so the stored tree
    would come back permuted; this builds the object as those constructors do after
    sorting: the arguments, and the set of them the class consults.
    """
    obj = sympy.Basic.__new__(cls, *args)
    obj._argset = frozenset(args)
    return obj
