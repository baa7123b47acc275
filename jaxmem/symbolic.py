"""The symbolic shape graph: JAX dim expressions as sympy, symbol ranges, comparisons.

A :class:`ShapeDomain` is the set of shapes a function may be called with: one
integer symbol per dimension variable, a range per symbol, and the declared
constraints. :func:`compare` decides how two byte expressions relate on the whole
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
import itertools
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import sympy

from jaxmem._errors import SymbolicError

DEFAULT_MAX_DIM = 1 << 16  # sampling cap for symbols with no declared upper bound


class Cmp(enum.Enum):
    """How ``a`` relates to ``b`` on the whole domain."""

    LT = "<"
    LE = "<="
    EQ = "=="
    GE = ">="
    GT = ">"
    UNKNOWN = "?"

    def flip(self) -> Cmp:
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
        at = self.at
        if getattr(at, "is_Integer", False):
            return (f"{self.below.name} iff {self.symbol} < {at}, EQ at {self.symbol} = {at}, "
                    f"{self.above.name} iff {self.symbol} > {at}")
        return (f"{self.below.name} iff {self.symbol} < {at}, "
                f"{self.above.name} iff {self.symbol} > {at}")


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


@dataclasses.dataclass(frozen=True)
class ShapeDomain:
    """Symbols, their integer ranges and the constraints between them.

    Attributes:
        symbols: symbol names in declaration order.
        lower: lower bound per symbol (dims are at least 1).
        upper: upper bound per symbol, or None when unbounded.
        constraints: the declared constraints as sympy relationals ``g >= 0``.
        constraint_text: the constraints as the user wrote them.
    """

    symbols: tuple[str, ...]
    lower: tuple[int, ...]
    upper: tuple[int | None, ...]
    constraints: tuple[sympy.Expr, ...] = ()
    constraint_text: tuple[str, ...] = ()

    @staticmethod
    def from_constraints(symbols: Iterable[str], constraints: Iterable[str] = ()) -> ShapeDomain:
        """Builds a domain from symbol names and JAX-style constraint strings.

        Args:
            symbols: names of the dimension variables.
            constraints: strings like ``"b <= 16"``, ``"s >= 2"``, ``"b*s <= 4096"``.

        Raises:
            SymbolicError: a constraint cannot be parsed.
        """
        symbols = tuple(symbols)
        lower = {n: 1 for n in symbols}
        upper: dict[str, int | None] = {n: None for n in symbols}
        exprs: list[sympy.Expr] = []
        # Constraints on dims the function never sees (declared in the same
        # symbolic_shape scope) do not bound its shapes; keep only the others.
        texts = tuple(t for t in constraints
                      if {str(x) for x in _parse_constraint(t).free_symbols} <= set(symbols))
        for text in texts:
            g = _parse_constraint(text)
            free = g.free_symbols
            if len(free) == 1 and g.is_polynomial() and sympy.degree(g, *free) == 1:
                (sym,) = free
                coeff = g.coeff(sym)
                bound = -(g - coeff * sym) / coeff
                name = str(sym)
                if name in lower:
                    if coeff > 0:  # sym >= bound
                        lower[name] = max(lower[name], int(math.ceil(bound)))
                    else:  # sym <= bound
                        cap = int(math.floor(bound))
                        upper[name] = cap if upper[name] is None else min(upper[name], cap)
                    continue
            exprs.append(g)
        for n in symbols:
            hi = upper[n]
            if hi is not None and hi < lower[n]:
                raise SymbolicError(f"constraints leave symbol {n!r} empty: {lower[n]} > {hi}")
        return ShapeDomain(symbols, tuple(lower[n] for n in symbols),
                           tuple(upper[n] for n in symbols), tuple(exprs), texts)

    def bounds(self, name: str) -> tuple[int, int | None]:
        i = self.symbols.index(name)
        return self.lower[i], self.upper[i]

    def contains(self, point: Mapping[str, int]) -> str | None:
        """Returns None when ``point`` is in the domain, else a message naming the bound."""
        for n, lo, hi in zip(self.symbols, self.lower, self.upper, strict=True):
            v = point[n]
            if v < lo:
                return f"dimension {n}={v} is below its lower bound {lo}"
            if hi is not None and v > hi:
                return f"dimension {n}={v} is above its upper bound {hi}"
        if not self.constraints:
            return None
        values = [point[n] for n in self.symbols]
        for check, text in self._checks:
            if check(*values) < 0:
                return f"constraint {text!r} is violated at {dict(point)}"
        return None

    @functools.cached_property
    def _checks(self) -> tuple[tuple[Callable[..., Any], str], ...]:
        """The general constraints compiled once (``contains`` runs on every call)."""
        args = [sym(n) for n in self.symbols]
        return tuple((sympy.lambdify(args, g, modules=["math"]), text)
                     for g, text in zip(self.constraints, self._general_texts(), strict=False))

    def _general_texts(self) -> list[str]:
        out = []
        for text in self.constraint_text:
            g = _parse_constraint(text)
            free = g.free_symbols
            single = (len(free) == 1 and g.is_polynomial() and sympy.degree(g, *free) == 1
                      and str(next(iter(free))) in self.symbols)
            if not single:
                out.append(text)
        return out

    def sample_points(self, n: int = 48, seed: int = 0) -> list[dict[str, int]]:
        """Corners of the box plus random points that satisfy the constraints."""
        rng = random.Random(seed)
        his = [hi if hi is not None else max(lo, DEFAULT_MAX_DIM) for lo, hi in
               zip(self.lower, self.upper, strict=True)]
        cands = [dict(zip(self.symbols, c, strict=True))
                 for c in itertools.product(*[sorted({lo, hi}) for lo, hi in
                                              zip(self.lower, his, strict=True)])]
        for _ in range(n * 4):
            cands.append({s: _log_uniform(rng, lo, hi) for s, lo, hi in
                          zip(self.symbols, self.lower, his, strict=True)})
        pts = [p for p in cands if self._satisfies(p)]
        return pts[: n + 2 ** len(self.symbols)]

    def _satisfies(self, p: Mapping[str, int]) -> bool:
        subs = {sym(k): v for k, v in p.items()}
        return all(g.subs(subs) >= 0 for g in self.constraints)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return min(hi, max(lo, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


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

    Example:
        >>> import jax
        >>> b, s = jax.export.symbolic_shape("b, s")
        >>> to_sympy(b * s // 2)
        floor(b*s/2)
    """
    if isinstance(dim, int):
        return sympy.Integer(dim)
    text = str(dim)
    if text.lstrip("-").isdigit():
        return sympy.Integer(int(text))
    return _parse_expr(text)


def _parse_expr(text: str) -> sympy.Expr:
    local: dict[str, Any] = dict(_FUNCS)
    for name in _IDENT.findall(text):
        if name not in _FUNCS:
            local[name] = sym(name)
    try:
        return sympy.sympify(text.replace("^", "**"), locals=local)
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise SymbolicError(f"cannot read dimension expression {text!r}: {e}") from e


def _parse_constraint(text: str) -> sympy.Expr:
    """Parses ``"lhs OP rhs"`` into ``g`` with the constraint meaning ``g >= 0``."""
    m = re.fullmatch(r"\s*(.+?)\s*(<=|>=|==|<|>)\s*(.+?)\s*", text)
    if m is None:
        raise SymbolicError(f"cannot parse constraint {text!r}: expected 'lhs <= rhs', "
                            "'lhs >= rhs' or 'lhs == rhs'")
    lhs, op, rhs = _parse_expr(m.group(1)), m.group(2), _parse_expr(m.group(3))
    if op in ("<=", "=="):
        return sympy.expand(rhs - lhs)
    if op == "<":
        return sympy.expand(rhs - lhs - 1)
    if op == ">=":
        return sympy.expand(lhs - rhs)
    return sympy.expand(lhs - rhs - 1)


# --- comparisons -------------------------------------------------------------------------


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


def _sign_from_shift(poly_expr: sympy.Expr, dom: ShapeDomain) -> int | None:
    """Sign of a polynomial on the box: +1 (>0), 0 (>=0 with equality possible), -1, or None.

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
            return 1
        if const == 0 and not others:
            return 0
        if const == 0:
            return 2  # >= 0, zero only at the lower corner
    if all(c <= 0 for c in others):
        if const < 0:
            return -1
        if const == 0:
            return -2 if others else 0
    if all(dom.bounds(n)[1] is not None for n in names):
        hi = sympy.expand(poly_expr.subs({sym(n): dom.bounds(n)[1] - ts[n] for n in names}))
        coeffs = _coeffs(hi)
        if coeffs is not None:
            const = coeffs.get(sympy.Integer(1), 0)
            others = [c for m, c in coeffs.items() if m != 1]
            if all(c >= 0 for c in others) and const > 0:
                return 1
            if all(c <= 0 for c in others) and const < 0:
                return -1
    return None


def _coeffs(e: sympy.Expr) -> dict[sympy.Expr, sympy.Expr] | None:
    out: dict[sympy.Expr, sympy.Expr] = {}
    for term in sympy.Add.make_args(e):
        c, m = term.as_coeff_Mul()
        if not c.is_number:
            return None
        out[m] = out.get(m, 0) + c
    return out


def _sign_from_constraints(f: sympy.Expr, dom: ShapeDomain) -> int | None:
    """Sign of ``f`` when it is a positive multiple of a constraint ``g >= 0`` plus a constant."""
    for g in dom.constraints:
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
                return 1 if rest > 0 else 2
            if k < 0 and rest <= 0:
                return -1 if rest < 0 else -2
    return None


def _factor_sign(f: sympy.Expr, dom: ShapeDomain) -> int | None:
    if f.is_number:
        return 1 if f > 0 else (-1 if f < 0 else 0)
    if all(str(s) in dom.symbols for s in f.free_symbols) and f.is_polynomial():
        s = _sign_from_shift(f, dom)
        if s is not None:
            return s
        return _sign_from_constraints(f, dom)
    return None


def _combine(signs: list[int]) -> Cmp | None:
    """Combines factor signs (+1 >0, 2 >=0, 0 ==0, -1 <0, -2 <=0) into a Cmp of the product."""
    if any(s == 0 for s in signs):
        return Cmp.EQ
    neg = sum(1 for s in signs if s < 0) % 2
    weak = any(abs(s) == 2 for s in signs)
    if neg:
        return Cmp.LE if weak else Cmp.LT
    return Cmp.GE if weak else Cmp.GT


def _symbolic(diff: sympy.Expr, dom: ShapeDomain) -> Comparison | None:
    if diff.is_number:
        return Comparison(_combine([_factor_sign(diff, dom)]), None, "symbolic")
    if not diff.is_polynomial(*[sym(n) for n in dom.symbols]):
        return None
    coeff, factors = sympy.factor_list(diff)
    known: list[int] = [1 if coeff > 0 else -1]
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
        if len(roots) == 1 and all(abs(k) != 2 for k in known) and 0 not in known:
            r = roots[0]
            below = _combine(known + [_factor_sign(f.subs(x, r - sympy.Rational(1, 2)), dom)])
            above = _combine(known + [_factor_sign(f.subs(x, r + sympy.Rational(1, 2)), dom)])
            if below in (Cmp.LT, Cmp.GT) and above in (Cmp.LT, Cmp.GT) and below != above:
                at = sympy.nsimplify(r) if r.is_Rational else r
                return Comparison(Cmp.UNKNOWN, Split(str(x), at, below, above), "symbolic")
        if not roots:  # no sign change inside the range: the sign at any point holds
            s = _factor_sign(f.subs(x, lo), dom)
            return Comparison(_combine(known + [s] if s else known + [0]), None, "symbolic")
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
    signs = set()
    for p in _samples(dom):
        v = ev(p)
        signs.add((v > 0) - (v < 0))
    if signs == {1}:
        r = Cmp.GT
    elif signs == {-1}:
        r = Cmp.LT
    elif signs == {0}:
        r = Cmp.EQ
    elif signs == {0, 1}:
        r = Cmp.GE
    elif signs == {0, -1}:
        r = Cmp.LE
    else:
        r = Cmp.UNKNOWN
    return Comparison(r, None, "fallback")


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
        try:
            c = _symbolic(diff, dom)
        except (sympy.PolynomialError, sympy.polys.polyerrors.PolificationFailed,
                NotImplementedError, TypeError):
            c = None
        if c is not None:
            return c
    return _sampled(diff, dom)
