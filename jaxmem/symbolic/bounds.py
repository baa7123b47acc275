"""Cheap sound sign proofs for a polynomial over the domain's box, in integer arithmetic.

:func:`jaxmem.symbolic.compare` factors ``a - b`` with sympy before it looks at
signs, about 5 ms a comparison; a memory model of a 22-layer step asks a few dozen,
and a plan derivation builds about twenty models. Most of those differences have
one sign on the whole box of dim ranges, provable without factoring:

* **shifted coefficients**: ``x = lo + t`` (``t >= 0``): if the constant is
  ``> 0`` and every other coefficient ``>= 0``, the polynomial is positive (the
  same from the upper corner, ``x = hi - t``, where every dim is bounded);
* **absorption**: each positive term ``c*m`` is at most ``c * max(m/m') * m'`` for
  any negative term ``c'*m'`` (the ratio's largest value on the box, its
  exponents' signs picking the corner), so if the negative terms can take every
  positive one with budget left over, the polynomial is negative.

Either proof holds on the box, a superset of the domain, so it holds on the
domain. :func:`box_sign` answers only strict signs it proved and None otherwise
(the caller then runs its full comparison): a refused proof costs nothing but time.

Example:
    >>> import sympy
    >>> from jaxmem.symbolic.domain import ShapeDomain
    >>> b, s = sympy.symbols("b s", integer=True, positive=True)
    >>> dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 8", "s <= 512"))
    >>> box_sign(128 * b * s**2 - 513048 * b * s - 4, dom)
    -1
    >>> box_sign(127996 * b * s - 4, dom), box_sign(b * s - 64, dom) is None
    (1, True)
"""

from __future__ import annotations

import fractions
import math
from collections.abc import Sequence

import sympy

from jaxmem.symbolic.domain import ShapeDomain

Poly = dict[tuple[int, ...], int]  # exponents per domain symbol -> integer coefficient


def box_sign(diff: sympy.Expr, dom: ShapeDomain) -> int | None:
    """``1`` if ``diff > 0`` on the whole box of ``dom``'s ranges, ``-1`` if ``< 0``.

    Args:
        diff: an expanded polynomial in the domain's symbols.
        dom: the domain (its lower bounds must be >= 1: dims are positive).

    Returns:
        ``1``, ``-1``, or None when neither proof settles it (or ``diff`` is not an
        integer polynomial of the domain's symbols).
    """
    poly = integer_poly(diff, dom.symbols)
    return None if poly is None else poly_sign(poly, dom)


def poly_sign(poly: Poly, dom: ShapeDomain) -> int | None:
    """:func:`box_sign` of a polynomial given as exponent tuples (one per domain symbol)
    and integer coefficients.

    Example:
        >>> dom = ShapeDomain.from_constraints(("b",), ("b <= 8",))
        >>> poly_sign({(2,): -1, (0,): 65}, dom), poly_sign({(1,): 1, (0,): -4}, dom)
        (1, None)
    """
    if any(lo < 1 for lo in dom.lower):
        return None
    for sign in (1, -1):
        p = poly if sign == 1 else {e: -c for e, c in poly.items()}
        if _positive_by_shift(p, dom) or _positive_by_absorption(p, dom):
            return sign
    return None


def integer_poly(diff: sympy.Expr, symbols: Sequence[str]) -> Poly | None:
    """``diff`` as exponent tuples and integer coefficients (rationals scaled by their
    common denominator, which keeps the sign), or None if it is not a polynomial in
    ``symbols`` with rational coefficients."""
    index = {s: i for i, s in enumerate(symbols)}
    terms: list[tuple[tuple[int, ...], fractions.Fraction]] = []
    for term in sympy.Add.make_args(diff):
        c, m = term.as_coeff_Mul()
        if not c.is_Rational:
            return None
        exps = [0] * len(symbols)
        for base, e in (() if m == 1 else m.as_powers_dict().items()):
            i = index.get(str(base)) if base.is_Symbol else None
            if i is None or not e.is_Integer or e < 0:
                return None
            exps[i] += int(e)
        terms.append((tuple(exps), fractions.Fraction(int(c.p), int(c.q))))
    scale = math.lcm(*[c.denominator for _, c in terms]) if terms else 1
    out: Poly = {}
    for exps, c in terms:
        out[exps] = out.get(exps, 0) + int(c * scale)
    return {e: c for e, c in out.items() if c != 0}


def _positive_by_shift(poly: Poly, dom: ShapeDomain) -> bool:
    """Every coefficient of ``poly(lo + t)`` (or of ``poly(hi - t)``) is ``>= 0`` and the
    constant ``> 0``."""
    if _shifted_positive(poly, dom.lower, 1):
        return True
    if any(hi is None for hi in dom.upper):
        return False
    return _shifted_positive(poly, dom.upper, -1)  # type: ignore[arg-type]


def _shifted_positive(poly: Poly, origin: Sequence[int], direction: int) -> bool:
    shifted: Poly = {}
    for exps, c in poly.items():
        # (o + d*t)^e = sum_k C(e, k) o^(e-k) d^k t^k, one factor per symbol.
        parts: list[tuple[tuple[int, ...], int]] = [((), c)]
        for o, e in zip(origin, exps, strict=True):
            parts = [(ks + (k,), v * math.comb(e, k) * o ** (e - k) * direction ** k)
                     for ks, v in parts for k in range(e + 1)]
        for ks, v in parts:
            shifted[ks] = shifted.get(ks, 0) + v
    const = shifted.pop(tuple(0 for _ in origin), 0)
    return const > 0 and all(v >= 0 for v in shifted.values())


def _positive_by_absorption(poly: Poly, dom: ShapeDomain) -> bool:
    """Every negative term fits, scaled by its largest ratio on the box, into what is
    left of one positive term, and some positive budget remains."""
    budget = {e: c for e, c in poly.items() if c > 0}
    for exps, c in sorted(poly.items()):
        if c >= 0:
            continue
        best = None
        for m in sorted(budget):  # sorted: the proof depends on the terms, not their order
            left = budget[m]
            ratio = _max_ratio(exps, m, dom)
            if ratio is not None and -c * ratio <= left and (best is None or ratio < best[1]):
                best = (m, ratio)
        if best is None:
            return False
        budget[best[0]] -= -c * best[1]
    return any(v > 0 for v in budget.values())


def _max_ratio(num: tuple[int, ...], den: tuple[int, ...], dom: ShapeDomain
               ) -> fractions.Fraction | None:
    """The largest value of the monomial ratio ``num / den`` on the box (None: unbounded)."""
    out = fractions.Fraction(1)
    for a, b, lo, hi in zip(num, den, dom.lower, dom.upper, strict=True):
        e = a - b
        if e > 0:
            if hi is None:
                return None
            out *= hi ** e
        elif e < 0:
            out /= lo ** -e
    return out
