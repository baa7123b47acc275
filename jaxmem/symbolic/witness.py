"""Exact witnesses at the domain's sample points: answers no sympy proof can change.

A comparison over the whole domain asks a universal question ("is ``a <= b``
everywhere?"). Proving the answer is yes takes sympy (factoring, root isolation:
milliseconds per comparison, seconds per memory model); one point of the domain
where it is no settles it at once, soundly, when the values there are exact
(integers or fractions, as byte counts are). The memory model's frontier and the
planner ask mostly questions whose answer is no, so they look for such a point
among the domain's sample points (:meth:`ShapeDomain.sample_points`, corners
included, the points the sampling fallback uses) before asking for a proof.
Decisions made this way are counted as ``fallback`` (decided at the sample points).

Example:
    >>> import collections
    >>> dom = ShapeDomain.from_constraints(("s",), ("s <= 512",))
    >>> signs_differ((1, 5), (2, 3)), signs_differ((1, 5), (1, 3))
    (True, False)
    >>> lowers_somewhere(sym("s") ** 2, 128 * sym("s"), dom, True, collections.Counter())
    True
"""

from __future__ import annotations

import collections
import fractions
from collections.abc import Sequence
from typing import Any

import sympy

from jaxmem.dims import sym
from jaxmem.fastexpr import compile_expr
from jaxmem.symbolic.compare import Cmp, compare
from jaxmem.symbolic.domain import ShapeDomain

_NON_POLYNOMIAL = (sympy.Piecewise, sympy.Min, sympy.floor, sympy.Mod)


def is_exact(value: Any) -> bool:
    """Whether ``value`` is an exact number (an int or a fraction, not a float).

    Example:
        >>> is_exact(3), is_exact(fractions.Fraction(1, 3)), is_exact(0.5)
        (True, True, False)
    """
    return isinstance(value, (int, fractions.Fraction))


def signs_differ(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    """Whether ``a - b`` is positive at one sample point and negative at another.

    Then neither of ``a`` and ``b`` is below the other on the whole domain: a sound
    comparison answers UNKNOWN. ``None`` (values not known exactly) decides nothing.
    """
    if a is None or b is None:
        return False
    above = below = False
    for x, y in zip(a, b, strict=True):
        above, below = above or x > y, below or x < y
        if above and below:
            return True
    return False


def lowers_somewhere(new: sympy.Expr, old: sympy.Expr, dom: ShapeDomain, symbolic: bool,
                     tally: collections.Counter[str]) -> bool:
    """Whether ``new`` is below ``old`` somewhere in the domain.

    A sample point where ``new`` is exactly below ``old`` says yes. Otherwise
    polynomials and maxima of polynomials are compared symbolically; peaks with
    piecewise steps (output-buffer reuse) would make sympy expand huge
    differences, so for those the sample points decide (none below: no). Both
    sample-point answers are counted as ``fallback``.

    Example:
        >>> dom = ShapeDomain.from_constraints(("s",), ("s <= 512",))
        >>> lowers_somewhere(sym("s") ** 2, sym("s"), dom, True, collections.Counter())
        False
    """
    syms = [sym(n) for n in dom.symbols]
    f_new, f_old = compile_expr(syms, new), compile_expr(syms, old)
    values = [(f_new(*args), f_old(*args))
              for args in ([p[n] for n in dom.symbols] for p in dom.sample_points())]
    below = any(a < b for a, b in values)
    exact = all(is_exact(v) for pair in values for v in pair)
    if symbolic and not (below and exact) and not (new.has(*_NON_POLYNOMIAL)
                                                   or old.has(*_NON_POLYNOMIAL)):
        # No exact witness below: only a proof can say it never lowers the peak.
        c = compare(new, old, dom, symbolic=True)
        tally[c.decided_by] += 1
        return c.result not in (Cmp.GE, Cmp.GT, Cmp.EQ)
    tally["fallback"] += 1
    return below
