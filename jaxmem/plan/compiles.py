"""Compile planning: which exact shapes to compile, and which calls run padded on another.

XLA compiles one executable per concrete shape. Given the calls a caller announces
(an epoch's batch shapes), the dims it may pad (right-padding that leaves results
unchanged, declared by the caller) and two cost models, :func:`plan_compiles`
chooses the set of shapes to compile and the covering shape each call runs at so
that the predicted wall time, compile seconds plus the sum of step seconds, is
least. Shapes already compiled cost nothing to use. A shape where no level fits
the budget (``step_s`` is None there) is never chosen as a cover.

With one padded dim the choice is an exact dynamic program over the sorted
candidate values (each call runs on the smallest chosen cover at or above it, which
is optimal when step time does not fall as the padded dim grows); with more, an
exhaustive search over small candidate sets and a greedy descent over large ones.

Example:
    >>> problem = CompileProblem(
    ...     names=("b", "s"), calls=((8, 100),) * 50 + ((8, 120), (8, 500)), pad_dims=("s",),
    ...     step_s=lambda d: 1e-3 * d[1], compile_s=lambda d: 2.0)
    >>> plan = plan_compiles(problem)
    >>> plan.compile, plan.cover((8, 100))
    (((8, 100), (8, 500)), (8, 100))
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

Shape = tuple[int, ...]

_EXHAUSTIVE_MAX = 12  # candidate covers searched exhaustively when several dims pad


@dataclasses.dataclass(frozen=True)
class CompileProblem:
    """The upcoming calls and what compiling and running each shape is predicted to cost.

    Attributes:
        names: dim names, in the order of every shape tuple.
        calls: upcoming call shapes in run order (repeats are separate calls).
        pad_dims: the dims a call may be padded along (a covering shape is at least
            the call's value there and equal elsewhere).
        step_s: predicted seconds of one step at a shape; None where nothing fits.
        compile_s: predicted seconds to compile a shape.
        compiled: shapes whose executables exist already (no compile cost).
    """

    names: tuple[str, ...]
    calls: tuple[Shape, ...]
    pad_dims: tuple[str, ...]
    step_s: Callable[[Shape], float | None]
    compile_s: Callable[[Shape], float]
    compiled: frozenset[Shape] = frozenset()

    def __post_init__(self) -> None:
        unknown = [d for d in self.pad_dims if d not in self.names]
        if unknown:
            raise ValueError(f"pad_dims {unknown} are not among the dims {self.names}")
        bad = [c for c in self.calls if len(c) != len(self.names)]
        if bad:
            raise ValueError(f"call shape {bad[0]} does not have one value per dim "
                             f"{self.names}")


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    """Which shapes to compile and where each announced call runs.

    Attributes:
        names: dim names of every shape.
        covers: call shape -> the shape it runs at (itself when not padded).
        compile: shapes to compile (not compiled yet), smallest first.
        compile_s: predicted seconds of those compiles.
        step_s: predicted seconds of all announced steps at their covers.
        pad_fraction: share of the covers' elements (product of dims) that is padding.
        infeasible: call shapes with no shape that fits the budget to run at.
    """

    names: tuple[str, ...]
    covers: Mapping[Shape, Shape]
    compile: tuple[Shape, ...]
    compile_s: float
    step_s: float
    pad_fraction: float
    infeasible: tuple[Shape, ...] = ()

    @property
    def predicted_s(self) -> float:
        """Predicted wall seconds: compiles plus steps."""
        return self.compile_s + self.step_s

    def cover(self, shape: Sequence[int]) -> Shape:
        """The shape a call of ``shape`` runs at (``shape`` itself if it was not announced)."""
        return self.covers.get(tuple(shape), tuple(shape))

    def describe(self) -> str:
        """One line: executables, padding and predicted seconds."""
        padded = sum(1 for c, v in self.covers.items() if c != v)
        return (f"compile plan: {len(self.compile)} new executable(s) for "
                f"{len(self.covers)} call shape(s) ({padded} padded), padding "
                f"{self.pad_fraction:.1%} of elements, predicted {self.predicted_s:.2f} s "
                f"({self.compile_s:.2f} s compiling, {self.step_s:.2f} s in steps)"
                + (f"; no fitting shape for {list(self.infeasible)}" if self.infeasible else ""))


def plan_compiles(problem: CompileProblem) -> CompilePlan:
    """The covering shapes of least predicted wall time (compiles + steps).

    Args:
        problem: calls, paddable dims and cost models.

    Returns:
        The :class:`CompilePlan`.
    """
    problem = dataclasses.replace(problem, step_s=functools.cache(problem.step_s),
                                  compile_s=functools.cache(problem.compile_s))
    pad_axes = [problem.names.index(d) for d in problem.pad_dims]
    counts = collections.Counter(problem.calls)
    groups: dict[Shape, list[Shape]] = collections.defaultdict(list)
    for shape in counts:
        groups[_fixed(shape, pad_axes)].append(shape)
    covers: dict[Shape, Shape] = {}
    for key, shapes in groups.items():
        compiled = [c for c in problem.compiled if _fixed(c, pad_axes) == key]
        usable = [c for c in sorted({*shapes, *compiled}) if problem.step_s(c) is not None]
        servable = [s for s in shapes if any(_covers(c, s) for c in usable)]
        covers.update({s: s for s in shapes if s not in servable})
        if not servable:
            continue
        shapes = servable
        if len(pad_axes) == 1:
            chosen = _chain_optimum(problem, counts, shapes, usable, pad_axes[0])
        else:
            chosen = _subset_optimum(problem, counts, shapes, usable, pad_axes)
        covers.update(_assign(problem, shapes, chosen))
    return _summarise(problem, counts, covers)


def _fixed(shape: Shape, pad_axes: Sequence[int]) -> Shape:
    return tuple(v for i, v in enumerate(shape) if i not in pad_axes)


def _covers(cover: Shape, shape: Shape) -> bool:
    return all(c >= v for c, v in zip(cover, shape, strict=True))


def _cost_to_add(problem: CompileProblem, shape: Shape) -> float:
    return 0.0 if shape in problem.compiled else problem.compile_s(shape)


def _chain_optimum(problem: CompileProblem, counts: Mapping[Shape, int], shapes: list[Shape],
                   usable: list[Shape], axis: int) -> list[Shape]:
    """Exact: ``best[j]`` is the least cost of serving every call up to candidate ``j``
    with ``j`` chosen; the calls between two chosen candidates run on the upper one."""
    values = sorted(v[axis] for v in shapes for _ in range(counts[v]))
    served = [bisect.bisect_right(values, c[axis]) for c in usable]  # calls at or below
    best: list[float] = []
    back: list[int] = []  # the chosen candidate below j in best[j]'s plan (-1: none)
    for j, top in enumerate(usable):
        step, add = problem.step_s(top) or 0.0, _cost_to_add(problem, top)
        cost, below = min([(add + served[j] * step, -1)] + [
            (best[i] + add + (served[j] - served[i]) * step, i) for i in range(j)])
        best.append(cost)
        back.append(below)
    top_value = max(values)
    j = min((j for j, c in enumerate(usable) if c[axis] >= top_value), key=best.__getitem__)
    chosen = []
    while j >= 0:
        chosen.append(usable[j])
        j = back[j]
    return chosen[::-1]


def _total(problem: CompileProblem, counts: Mapping[Shape, int], shapes: list[Shape],
           chosen: Sequence[Shape]) -> float:
    cost = sum(_cost_to_add(problem, c) for c in chosen)
    for shape in shapes:
        steps = [problem.step_s(c) for c in chosen if _covers(c, shape)]
        steps = [s for s in steps if s is not None]
        cost += counts[shape] * min(steps) if steps else math.inf
    return cost


def _subset_optimum(problem: CompileProblem, counts: Mapping[Shape, int], shapes: list[Shape],
                    usable: list[Shape], pad_axes: list[int]) -> list[Shape]:
    if not pad_axes or len(usable) > _EXHAUSTIVE_MAX:
        return _subset_greedy(problem, counts, shapes, usable)
    subsets = itertools.chain.from_iterable(
        itertools.combinations(usable, k) for k in range(1, len(usable) + 1))
    return list(min(subsets, key=lambda c: _total(problem, counts, shapes, c), default=()))


def _subset_greedy(problem: CompileProblem, counts: Mapping[Shape, int], shapes: list[Shape],
                   usable: list[Shape]) -> list[Shape]:
    """Start from every usable candidate; drop the one whose loss helps most, while any does."""
    chosen = list(usable)
    cost = _total(problem, counts, shapes, chosen)
    while len(chosen) > 1:
        trials = [(_total(problem, counts, shapes, chosen[:i] + chosen[i + 1:]), i)
                  for i in range(len(chosen))]
        trial, i = min(trials)
        if not trial < cost:
            break
        cost = trial
        del chosen[i]
    return chosen


def _assign(problem: CompileProblem, shapes: list[Shape],
            chosen: Sequence[Shape]) -> dict[Shape, Shape]:
    out = {}
    for shape in shapes:
        options = [(problem.step_s(c), c) for c in chosen if _covers(c, shape)]
        options = [(s, c) for s, c in options if s is not None]
        out[shape] = min(options)[1] if options else shape
    return out


def _summarise(problem: CompileProblem, counts: Mapping[Shape, int],
               covers: dict[Shape, Shape]) -> CompilePlan:
    infeasible = tuple(sorted(s for s, c in covers.items() if problem.step_s(c) is None))
    used = sorted({c for s, c in covers.items() if s not in infeasible})
    new = tuple(c for c in used if c not in problem.compiled)
    step_s = sum(counts[s] * (problem.step_s(c) or 0.0) for s, c in covers.items()
                 if s not in infeasible)
    real = sum(n * math.prod(s) for s, n in counts.items())
    total = sum(n * math.prod(covers[s]) for s, n in counts.items())
    return CompilePlan(problem.names, dict(covers), new,
                       sum(problem.compile_s(c) for c in new), step_s,
                       1.0 - real / total if total else 0.0, infeasible)


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Predicted step seconds as ``fixed_s + s_per_flop * flops`` (FLOPs of the level run).

    Example:
        >>> model = fit_step_model([(1e9, 0.02), (3e9, 0.04)], prior_s_per_flop=1e-12)
        >>> round(model.fixed_s, 6), round(model(2e9), 6)
        (0.01, 0.03)
    """

    fixed_s: float
    s_per_flop: float

    def __call__(self, flops: float) -> float:
        return self.fixed_s + self.s_per_flop * flops


def fit_step_model(samples: Sequence[tuple[float, float]],
                   prior_s_per_flop: float) -> StepModel:
    """The step model from measured ``(flops, seconds)`` pairs: a least-squares line where
    the FLOPs vary and its slope is positive, else seconds proportional to FLOPs; the
    prior rate when nothing was measured."""
    if not samples:
        return StepModel(0.0, prior_s_per_flop)
    xs, ys = zip(*samples, strict=True)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var > 0:
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
        if slope > 0 and my - slope * mx >= 0:
            return StepModel(my - slope * mx, slope)
    return StepModel(0.0, my / mx if mx > 0 else prior_s_per_flop)
