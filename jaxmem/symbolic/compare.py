"""Comparisons of byte expressions over a whole :class:`~jaxmem.symbolic.ShapeDomain`.

:func:`compare` decides how two byte expressions relate on the whole
domain, the way BladeDISC++ does: symbolically when it can (sign of each factor
of ``a - b`` from the ranges; one root of a univariate factor becomes a split
point), by sampling the domain otherwise. Every decision records how it was made
so that ``report.comparisons`` can say how much was decided symbolically.

Example:
    >>> import sympy
    >>> b, s = sympy.symbols("b s", integer=True, positive=True)
    >>> dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s <= 512"))
    >>> c = compare(4096 * b * s, 32 * b * s**2, dom)
    >>> c.result, str(c.split)
    (<Cmp.UNKNOWN: '?'>, 'GT iff s < 128, EQ at s = 128, LT iff s > 128')
"""

from __future__ import annotations

import dataclasses
import enum
import fractions
import functools
from collections.abc import Callable
from typing import Any

import sympy

from jaxmem.dims import sym
from jaxmem.symbolic.bounds import box_sign
from jaxmem.symbolic.domain import ShapeDomain


class Cmp(enum.Enum):
    """How ``a`` relates to ``b`` on the whole domain."""

    LT = "<"
    LE = "<="
    EQ = "=="
    GE = ">="
    GT = ">"
    UNKNOWN = "?"

    def flip(self) -> Cmp:
        """How ``b`` relates to ``a``."""
        return _FLIP[self]


_FLIP = {Cmp.LT: Cmp.GT, Cmp.LE: Cmp.GE, Cmp.EQ: Cmp.EQ, Cmp.GE: Cmp.LE, Cmp.GT: Cmp.LT,
         Cmp.UNKNOWN: Cmp.UNKNOWN}


@dataclasses.dataclass(frozen=True)
class Split:
    """Where a comparison changes sign: at ``symbol = at`` (``at`` may be fractional)."""

    symbol: str
    at: sympy.Expr
    below: Cmp  # result for symbol < at
    above: Cmp  # result for symbol > at

    def __str__(self) -> str:
        x, at = self.symbol, self.at
        eq = f"EQ at {x} = {at}, " if getattr(at, "is_Integer", False) else ""
        return f"{self.below.name} iff {x} < {at}, {eq}{self.above.name} iff {x} > {at}"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The answer of :func:`compare`.

    Attributes:
        result: LT/LE/EQ/GE/GT on the whole domain, or UNKNOWN.
        split: for UNKNOWN results decided symbolically, where the sign changes.
        decided_by: ``"symbolic"`` or ``"fallback"`` (sampling).
    """

    result: Cmp
    split: Split | None
    decided_by: str


def _coefficient_sign(diff: sympy.Expr) -> Cmp | None:
    """Sign from coefficients alone: every monomial of dims is >= 1 on the domain."""
    coeffs = _coeffs(diff)
    if coeffs is None or any(not getattr(m, "is_Mul", False) and not getattr(m, "is_Symbol", False)
                             and not getattr(m, "is_Pow", False) and m != 1 for m in coeffs):
        return None
    if any(not (m == 1 or m.is_polynomial()) for m in coeffs):
        return None
    vals = list(coeffs.values())
    if all(c >= 0 for c in vals):
        return Cmp.EQ if all(c == 0 for c in vals) else Cmp.GT
    if all(c <= 0 for c in vals):
        return Cmp.LT
    return None


class Sign(enum.Enum):
    """The sign of one factor of ``a - b`` on the whole domain."""

    POSITIVE = ">0"
    NONNEGATIVE = ">=0"  # may be zero
    ZERO = "==0"
    NONPOSITIVE = "<=0"  # may be zero
    NEGATIVE = "<0"

    @staticmethod
    def of(number: Any) -> Sign:
        """The sign of a number (a sympy number, an int, a fraction or a float)."""
        return Sign.POSITIVE if number > 0 else (Sign.NEGATIVE if number < 0 else Sign.ZERO)

    @property
    def flips(self) -> bool:
        """Whether the factor flips the sign of a product (it is < 0 or <= 0)."""
        return self in (Sign.NEGATIVE, Sign.NONPOSITIVE)

    @property
    def weak(self) -> bool:
        """Whether the factor may be zero without being zero everywhere (>= 0 or <= 0)."""
        return self in (Sign.NONNEGATIVE, Sign.NONPOSITIVE)

    @property
    def strict(self) -> bool:
        """Whether the factor is never zero (> 0 or < 0)."""
        return self in (Sign.POSITIVE, Sign.NEGATIVE)


def _sign_from_shift(poly_expr: sympy.Expr, dom: ShapeDomain) -> Sign | None:
    """Sign of a polynomial on the box, or None when the shifts do not settle it.

    Substitutes ``x = lo + t`` (t >= 0): if every coefficient in ``t`` is >= 0 the
    minimum is the constant term. The same from the upper corner where bounded.
    """
    names = [str(s) for s in poly_expr.free_symbols]
    if any(n not in dom.symbols for n in names):
        return None
    ts = {n: sympy.Symbol(f"_t_{n}", nonnegative=True) for n in names}
    lo = sympy.expand(poly_expr.subs({sym(n): dom.bounds(n)[0] + ts[n] for n in names}))
    coeffs = _coeffs(lo)
    if coeffs is None:
        return None
    const = coeffs.get(sympy.Integer(1), 0)
    others = [c for m, c in coeffs.items() if m != 1]
    if all(c >= 0 for c in others):
        if const > 0:
            return Sign.POSITIVE
        if const == 0 and not others:
            return Sign.ZERO
        if const == 0:
            return Sign.NONNEGATIVE  # zero only at the lower corner
    if all(c <= 0 for c in others):
        if const < 0:
            return Sign.NEGATIVE
        if const == 0:
            return Sign.NONPOSITIVE if others else Sign.ZERO
    if all(dom.bounds(n)[1] is not None for n in names):
        hi = sympy.expand(poly_expr.subs({sym(n): dom.bounds(n)[1] - ts[n] for n in names}))
        coeffs = _coeffs(hi)
        if coeffs is not None:
            const = coeffs.get(sympy.Integer(1), 0)
            others = [c for m, c in coeffs.items() if m != 1]
            if all(c >= 0 for c in others) and const > 0:
                return Sign.POSITIVE
            if all(c <= 0 for c in others) and const < 0:
                return Sign.NEGATIVE
    return None


def _coeffs(e: sympy.Expr) -> dict[sympy.Expr, sympy.Expr] | None:
    out: dict[sympy.Expr, sympy.Expr] = {}
    for term in sympy.Add.make_args(e):
        c, m = term.as_coeff_Mul()
        if not c.is_number:
            return None
        out[m] = out.get(m, 0) + c
    return out


def _sign_from_constraints(f: sympy.Expr, dom: ShapeDomain) -> Sign | None:
    """Sign of ``f`` when it is a positive multiple of a constraint ``g >= 0`` plus a constant."""
    for constraint in dom.constraints:
        g = constraint.expr
        gc, fc = _coeffs(g), _coeffs(f)
        if not gc or not fc:
            continue
        lead = next((m for m in gc if m != 1), None)
        if lead is None or lead not in fc:
            continue
        k = fc[lead] / gc[lead]
        rest = sympy.expand(f - k * g)
        if rest.is_number:
            if k > 0 and rest >= 0:
                return Sign.POSITIVE if rest > 0 else Sign.NONNEGATIVE
            if k < 0 and rest <= 0:
                return Sign.NEGATIVE if rest < 0 else Sign.NONPOSITIVE
    return None


def _factor_sign(f: sympy.Expr, dom: ShapeDomain) -> Sign | None:
    if f.is_number:
        return Sign.of(f)
    if all(str(s) in dom.symbols for s in f.free_symbols) and f.is_polynomial():
        s = _sign_from_shift(f, dom)
        if s is not None:
            return s
        return _sign_from_constraints(f, dom)
    return None


def _combine(signs: list[Sign]) -> Cmp:
    """How the product of factors with these signs compares with zero."""
    if Sign.ZERO in signs:
        return Cmp.EQ
    negative = sum(1 for s in signs if s.flips) % 2
    weak = any(s.weak for s in signs)
    if negative:
        return Cmp.LE if weak else Cmp.LT
    return Cmp.GE if weak else Cmp.GT


def _symbolic(diff: sympy.Expr, dom: ShapeDomain) -> Comparison | None:
    if diff.is_number:
        return Comparison(_combine([Sign.of(diff)]), None, "symbolic")
    if not diff.is_polynomial(*[sym(n) for n in dom.symbols]):
        return None
    coeff, factors = sympy.factor_list(diff)
    known: list[Sign] = [Sign.POSITIVE if coeff > 0 else Sign.NEGATIVE]
    unknown: list[tuple[sympy.Expr, int]] = []
    for f, mult in factors:
        s = _factor_sign(f, dom)
        if s is None:
            unknown.append((f, mult))
        else:
            known.extend([s] * mult)
    if not unknown:
        return Comparison(_combine(known), None, "symbolic")
    if len(unknown) == 1 and len(unknown[0][0].free_symbols) == 1 and unknown[0][1] % 2 == 1:
        f = unknown[0][0]
        (x,) = f.free_symbols
        lo, hi = dom.bounds(str(x))
        roots = [r for r in sympy.real_roots(sympy.Poly(f, x))
                 if r > lo and (hi is None or r < hi)]
        if len(roots) == 1 and all(k.strict for k in known):
            r = roots[0]
            below = _combine([*known, Sign.of(f.subs(x, r - sympy.Rational(1, 2)))])
            above = _combine([*known, Sign.of(f.subs(x, r + sympy.Rational(1, 2)))])
            if below in (Cmp.LT, Cmp.GT) and above in (Cmp.LT, Cmp.GT) and below != above:
                at = sympy.nsimplify(r) if r.is_Rational else r
                return Comparison(Cmp.UNKNOWN, Split(str(x), at, below, above), "symbolic")
        if not roots:  # no sign change inside the range: the sign at any point holds
            return Comparison(_combine([*known, Sign.of(f.subs(x, lo))]), None, "symbolic")
    return None


@functools.lru_cache(maxsize=64)
def _samples(dom: ShapeDomain) -> tuple[tuple[int, ...], ...]:
    pts = dom.sample_points()
    return tuple(tuple(p[n] for n in dom.symbols) for p in pts)


def _evaluator(diff: sympy.Expr, dom: ShapeDomain) -> Callable[[tuple[int, ...]], Any]:
    syms = [sym(n) for n in dom.symbols]
    try:
        terms = sympy.Poly(diff, *syms).terms() if syms else [((), diff)]
    except sympy.PolynomialError:
        terms = None
    if terms is not None and all(c.is_Rational for _, c in terms):
        ts = [(tuple(int(e) for e in mon), int(c) if c.is_Integer else fractions.Fraction(
                  int(c.p), int(c.q))) for mon, c in terms]

        def poly(point: tuple[int, ...]) -> Any:
            total = 0
            for mon, c in ts:
                term = c
                for x, e in zip(point, mon, strict=True):
                    if e:
                        term *= x ** e
                total += term
            return total

        return poly
    fn = sympy.lambdify(syms, diff, modules=["math"])
    return lambda point: fn(*point)


def _sampled(diff: sympy.Expr, dom: ShapeDomain) -> Comparison:
    ev = _evaluator(diff, dom)
    signs = frozenset(Sign.of(v) for v in map(ev, _samples(dom)))
    return Comparison(_SAMPLED.get(signs, Cmp.UNKNOWN), None, "fallback")


#: What the signs of ``a - b`` seen at the sample points say about ``a`` and ``b``.
_SAMPLED = {frozenset({Sign.POSITIVE}): Cmp.GT, frozenset({Sign.NEGATIVE}): Cmp.LT,
            frozenset({Sign.ZERO}): Cmp.EQ, frozenset({Sign.ZERO, Sign.POSITIVE}): Cmp.GE,
            frozenset({Sign.ZERO, Sign.NEGATIVE}): Cmp.LE}


def compare(a: Any, b: Any, dom: ShapeDomain, *, symbolic: bool = True) -> Comparison:
    """Compares two expressions over the whole domain.

    Args:
        a: a sympy expression (or int) over the domain's symbols.
        b: same.
        dom: the domain.
        symbolic: when False, skip symbolic reasoning and sample (the ablation).

    Returns:
        A :class:`Comparison`; never raises for non-polynomial expressions
        (floor, Mod, Max, Min go to the sampling fallback).
    """
    a, b = sympy.sympify(a), sympy.sympify(b)
    if symbolic:
        pieces = _compare_max(a, b, dom)
        if pieces is not None:
            return pieces
    diff = sympy.expand(a - b)
    return _compare_diff(diff, dom, symbolic)


def _max_args(e: sympy.Expr) -> list[sympy.Expr]:
    """``c + Max(x, y)`` as ``[c + x, c + y]``; any other expression as ``[e]``."""
    if isinstance(e, sympy.Max):
        return list(e.args)
    if isinstance(e, sympy.Add):
        maxes = [t for t in e.args if isinstance(t, sympy.Max)]
        if len(maxes) == 1:
            rest = e - maxes[0]
            return [sympy.expand(rest + x) for x in maxes[0].args]
    return [e]


def _compare_max(a: sympy.Expr, b: sympy.Expr, dom: ShapeDomain) -> Comparison | None:
    """Sound rules for maxima: ``max(A) >= max(B)`` if every b is below some a."""
    xs, ys = _max_args(a), _max_args(b)
    if len(xs) == 1 and len(ys) == 1:
        return None
    if any(not x.is_polynomial() for x in xs + ys):
        return None

    def le(u: sympy.Expr, v: sympy.Expr) -> bool:
        return _compare_diff(sympy.expand(u - v), dom, True).result in (Cmp.LT, Cmp.LE, Cmp.EQ)

    a_ge = all(any(le(y, x) for x in xs) for y in ys)
    a_le = all(any(le(x, y) for y in ys) for x in xs)
    if a_ge and a_le:
        return Comparison(Cmp.EQ, None, "symbolic")
    if a_ge:
        return Comparison(Cmp.GE, None, "symbolic")
    if a_le:
        return Comparison(Cmp.LE, None, "symbolic")
    return None


@functools.lru_cache(maxsize=8192)
def _compare_diff(diff: sympy.Expr, dom: ShapeDomain, symbolic: bool) -> Comparison:
    if symbolic:
        quick = _coefficient_sign(diff)
        if quick is not None:
            return Comparison(quick, None, "symbolic")
        # Most differences a memory model asks about have one sign on the whole box,
        # provable in integer arithmetic: factoring them cost ~5 ms each.
        sign = box_sign(diff, dom)
        if sign is not None:
            return Comparison(Cmp.GT if sign > 0 else Cmp.LT, None, "symbolic")
        try:
            c = _symbolic(diff, dom)
        except (sympy.PolynomialError, sympy.polys.polyerrors.PolificationFailed,
                NotImplementedError, TypeError):
            c = None
        if c is not None:
            return c
    return _sampled(diff, dom)
