"""The shape domain: the set of shapes a function may be called with.

One integer symbol per dimension variable, a range per symbol, and the
declared constraints between them. The domain decides which points are in it
(:meth:`ShapeDomain.contains`) and where every stage evaluates what it cannot
decide symbolically: its corners (:meth:`ShapeDomain.corner`,
:meth:`ShapeDomain.smallest_corner`) and sample points
(:meth:`ShapeDomain.sample_points`). A symbol with no declared upper bound is
evaluated at :data:`UNBOUNDED_DIM`.

Example:
    >>> dom = ShapeDomain.from_constraints(("b", "s"), ("b <= 16", "s <= 512", "b*s <= 4096"))
    >>> dom.bounds("s")
    (1, 512)
    >>> dom.corner(), dom.smallest_corner()
    ({'b': 16, 's': 512}, {'b': 1, 's': 1})
    >>> [c.text for c in dom.constraints]
    ['b*s <= 4096']
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import sympy

from jaxmem.dims import parse_constraint, sym
from jaxmem.errors import SymbolicError

#: Where a symbol with no declared upper bound is evaluated: its value at the
#: domain's largest corner and the cap of its sample points (or its lower bound,
#: when that is larger).
UNBOUNDED_DIM = 1 << 16


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A general constraint (one no single-symbol bound expresses).

    Attributes:
        expr: the constraint as a sympy expression ``g``, meaning ``g >= 0``.
        text: the constraint as the user wrote it.
    """

    expr: sympy.Expr
    text: str


@dataclasses.dataclass(frozen=True)
class ShapeDomain:
    """Symbols, their integer ranges and the constraints between them.

    Attributes:
        symbols: symbol names in declaration order.
        lower: lower bound per symbol (dims are at least 1).
        upper: upper bound per symbol, or None when unbounded.
        constraints: the general constraints (``b*s <= 4096``), each with its text;
            single-symbol bounds are in ``lower`` and ``upper`` instead.
    """

    symbols: tuple[str, ...]
    lower: tuple[int, ...]
    upper: tuple[int | None, ...]
    constraints: tuple[Constraint, ...] = ()

    @staticmethod
    def from_constraints(symbols: Iterable[str], constraints: Iterable[str] = ()) -> ShapeDomain:
        """Builds a domain from symbol names and JAX-style constraint strings.

        Args:
            symbols: names of the dimension variables.
            constraints: strings like ``"b <= 16"``, ``"s >= 2"``, ``"b*s <= 4096"``.

        Returns:
            The domain; single-symbol linear constraints become bounds, the others
            are kept as :class:`Constraint`.

        Raises:
            SymbolicError: a constraint cannot be parsed, or leaves a symbol no value.
        """
        symbols = tuple(symbols)
        lower = {n: 1 for n in symbols}
        upper: dict[str, int | None] = {n: None for n in symbols}
        general: list[Constraint] = []
        # Constraints on dims the function never sees (declared in the same
        # symbolic_shape scope) do not bound its shapes; keep only the others.
        texts = tuple(t for t in constraints
                      if {str(x) for x in parse_constraint(t).free_symbols} <= set(symbols))
        for text in texts:
            g = parse_constraint(text)
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
            general.append(Constraint(g, text))
        for n in symbols:
            hi = upper[n]
            if hi is not None and hi < lower[n]:
                raise SymbolicError(f"constraints leave symbol {n!r} empty: {lower[n]} > {hi}")
        return ShapeDomain(symbols, tuple(lower[n] for n in symbols),
                           tuple(upper[n] for n in symbols), tuple(general))

    def bounds(self, name: str) -> tuple[int, int | None]:
        """The range of symbol ``name``.

        Args:
            name: a symbol of the domain.

        Returns:
            ``(lower, upper)``; ``upper`` is None when the symbol is unbounded.
        """
        i = self.symbols.index(name)
        return self.lower[i], self.upper[i]

    @property
    def bounded(self) -> bool:
        """Whether every symbol has a declared upper bound (so :meth:`corner` is a true maximum)."""
        return all(hi is not None for hi in self.upper)

    def corner(self) -> dict[str, int]:
        """The largest corner of the box: each symbol at its upper bound.

        A symbol with no upper bound is at ``max(lower, UNBOUNDED_DIM)``. General
        constraints are not applied: the corner may lie outside them.

        Returns:
            Symbol name to value, in declaration order.
        """
        return {n: (hi if hi is not None else max(lo, UNBOUNDED_DIM))
                for n, lo, hi in zip(self.symbols, self.lower, self.upper, strict=True)}

    def smallest_corner(self) -> dict[str, int]:
        """The smallest corner of the box: each symbol at its lower bound.

        Returns:
            Symbol name to value, in declaration order.
        """
        return dict(zip(self.symbols, self.lower, strict=True))

    def contains(self, point: Mapping[str, int]) -> str | None:
        """Checks a point against the bounds and the general constraints.

        Args:
            point: a value for every symbol.

        Returns:
            None when ``point`` is in the domain, else a message naming the bound
            or constraint it violates.
        """
        for n, lo, hi in zip(self.symbols, self.lower, self.upper, strict=True):
            v = point[n]
            if v < lo:
                return f"dimension {n}={v} is below its lower bound {lo}"
            if hi is not None and v > hi:
                return f"dimension {n}={v} is above its upper bound {hi}"
        if not self.constraints:
            return None
        values = [point[n] for n in self.symbols]
        for check, c in zip(self._checks, self.constraints, strict=True):
            if check(*values) < 0:
                return f"constraint {c.text!r} is violated at {dict(point)}"
        return None

    @functools.cached_property
    def _checks(self) -> tuple[Callable[..., Any], ...]:
        """The general constraints compiled once (``contains`` runs on every call)."""
        args = [sym(n) for n in self.symbols]
        return tuple(sympy.lambdify(args, c.expr, modules=["math"]) for c in self.constraints)

    def sample_points(self, n: int = 48, seed: int = 0) -> list[dict[str, int]]:
        """Corners of the box, points on the constraints' boundary, and random points.

        Args:
            n: how many random points to keep at most (the corners and boundary
                points come on top).
            seed: seed of the random points.

        Returns:
            The corners between :meth:`smallest_corner` and :meth:`corner` that
            satisfy the general constraints, then (with general constraints) the
            largest shapes along them (:meth:`extreme_points` and points between),
            then log-uniform random points that satisfy them.
        """
        if (n, seed) == (48, 0):  # the points every stage asks for: drawn once
            return [dict(p) for p in self._default_samples]
        return self._draw_samples(n, seed)

    @functools.cached_property
    def _default_samples(self) -> tuple[dict[str, int], ...]:
        return tuple(self._draw_samples(48, 0))

    def _draw_samples(self, n: int, seed: int) -> list[dict[str, int]]:
        rng = random.Random(seed)
        low, high = self.smallest_corner(), self.corner()
        corners = [dict(zip(self.symbols, c, strict=True))
                   for c in itertools.product(*[sorted({low[s], high[s]}) for s in self.symbols])]
        corners = [p for p in corners if self._satisfies(p)]
        edge = [p for p in self._boundary_points() if p not in corners]
        cands = [{s: _log_uniform(rng, low[s], high[s]) for s in self.symbols}
                 for _ in range(n * 4)]
        return corners + edge + [p for p in cands if self._satisfies(p)][:n]

    def extreme_points(self) -> list[dict[str, int]]:
        """The domain's largest shapes: where each stage ranks what it cannot rank everywhere.

        The box's :meth:`corner` when it satisfies the general constraints; else, for
        each symbol in turn, the shape with that symbol as large as the constraints
        allow, then the others in declaration order. With ``b*s <= 4096``, ``b <= 64``
        and ``s <= 512`` these are the matmul-heavy ``(64, 64)`` and the
        attention-heavy ``(8, 512)``.

        Example:
            >>> dom = ShapeDomain.from_constraints(
            ...     ("b", "s"), ("b <= 64", "s <= 512", "b*s <= 4096"))
            >>> dom.extreme_points()
            [{'b': 64, 's': 64}, {'b': 8, 's': 512}]
        """
        corner = self.corner()
        if self._satisfies(corner) or not self._satisfies(self.smallest_corner()):
            return [corner]
        points: list[dict[str, int]] = []
        for first in self.symbols:
            p = self._grow(self.smallest_corner(), [first] + [n for n in self.symbols
                                                              if n != first])
            if p not in points:
                points.append(p)
        return points

    def _boundary_points(self, n: int = 8) -> list[dict[str, int]]:
        """Points on the general constraints' boundary: the first symbol log-spaced over
        its range, the others as large as the constraints then allow."""
        if not self.constraints or not self._satisfies(self.smallest_corner()):
            return []
        first, lo, hi = self.symbols[0], self.lower[0], self.corner()[self.symbols[0]]
        values = sorted({_log_spaced(lo, hi, i, n) for i in range(n + 1)})
        points = list(self.extreme_points())
        for v in values:
            p = self._grow({**self.smallest_corner(), first: v}, list(self.symbols[1:]))
            if self._satisfies(p) and p not in points:
                points.append(p)
        return points

    def _grow(self, point: dict[str, int], order: list[str]) -> dict[str, int]:
        """Raises each symbol of ``order`` in turn as far as the constraints allow (a
        binary search: the point stays inside the domain, if not always at its edge
        when a constraint is not monotone)."""
        p = dict(point)
        high = self.corner()
        for name in order:
            lo, hi = p[name], high[name]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._satisfies({**p, name: mid}):
                    lo = mid
                else:
                    hi = mid - 1
            p[name] = lo
        return p

    def _satisfies(self, p: Mapping[str, int]) -> bool:
        values = [p[n] for n in self.symbols]
        return all(check(*values) >= 0 for check in self._checks)


def _log_spaced(lo: int, hi: int, i: int, n: int) -> int:
    return int(round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / n)))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return min(hi, max(lo, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))
