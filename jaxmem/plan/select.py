"""Which level runs at a shape: one pure function over the plan set, the dims and the budget.

At each shape the plan set ranks its levels by predicted step time there
(``order_at``: fastest first; level 0 saves every residual, the fastest but where
its temporaries' page faults cost more than the re-runs, as on a CPU at large shapes).
:func:`select_level` starts at the fastest level whose guard ``peak(dims) <=
budget`` holds and asks ``compile`` — XLA, in ``jaxmem.jit`` — for each
candidate's real peak: on down the ranking while XLA says it does not fit, then
back up it (the guard may have skipped a faster level that XLA would fit). After a
miss the next level compiled is the first predicted to fit, read with the slack XLA
has shown (the most the model over-predicted a compiled level); levels predicted
further over come only when every likelier one missed, and once one level has been
compiled, levels predicted above ``HOPELESS_FACTOR`` times the budget are not
compiled. If nothing fits, the levels predicted within that factor of the smallest
XLA peak are compiled too, so that the error names the truly smallest plan, and the
scheduler's ``microbatches`` hook may split that plan's batch. Without ``compile``
the choice follows the predictions alone (``PlanSet.describe``). Every step is
recorded, so the "why" of a plan is written here, by the code that decided.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> f = jaxmem.jit(lambda x: jax.grad(lambda x: jnp.tanh(jnp.tanh(x)).sum())(x),
    ...                polymorphic_shapes=("b, 8",), constraints=("b <= 64",))
    >>> plans = f.plans(jnp.ones((4, 8)))
    >>> s = select_level(plans, {"b": 4}, None)
    >>> s.level, s.why
    (0, 'no budget given: level 0 (save every residual) runs')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from jaxmem.units import human_bytes

#: Once one level has been compiled, levels predicted above the budget times this factor
#: are not compiled: jaxmem's predictions are within 15 % of XLA's on the programs measured.
HOPELESS_FACTOR = 1.25

class _Level(Protocol):
    @property
    def peak_fn(self) -> Callable[[Mapping[str, int]], int]: ...


class PlanLike(Protocol):
    """What selection reads of a :class:`~jaxmem.plan.levels.PlanSet`: its levels' peaks
    and their ranking by predicted step time at a shape."""

    @property
    def levels(self) -> Sequence[_Level]: ...

    def order_at(self, dims: Mapping[str, int]) -> Sequence[int]: ...


#: ``compile(level, microbatches)`` returns XLA's peak bytes of that executable.
CompileFn = Callable[[int, int], int]
#: A scheduler's ``microbatches`` hook bound to the dims: ``fits(k) -> bool`` in, k out.
MicrobatchFn = Callable[[Callable[[int], bool]], int]


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One level looked at during a selection.

    Attributes:
        level: the level index.
        predicted_peak_bytes: jaxmem's prediction at the dims (of the unsplit level).
        peak_bytes: XLA's figure, or None when it was not compiled.
        outcome: ``fits``, ``over budget``, ``predicted to fit``, ``predicted over budget``,
            ``skipped: excluded`` or ``skipped: predicted far above the budget``.
        microbatches: accumulation steps (1: none).
    """

    level: int
    predicted_peak_bytes: int
    peak_bytes: int | None
    outcome: str
    microbatches: int = 1

    def __str__(self) -> str:
        mb = f" x{self.microbatches} microbatches" if self.microbatches > 1 else ""
        whole = " unsplit" if self.microbatches > 1 else ""
        xla = "" if self.peak_bytes is None else f", XLA {human_bytes(self.peak_bytes)}"
        return (f"level {self.level}{mb} (predicted {human_bytes(self.predicted_peak_bytes)}"
                f"{whole}{xla}: {self.outcome})")


@dataclasses.dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select_level`.

    Attributes:
        level: the chosen level, or None when nothing fits.
        microbatches: accumulation steps of the chosen plan (1: none).
        attempts: every level looked at, in the order it was looked at.
        why: the reason, in words.
        budget_bytes: the budget selected against.
    """

    level: int | None
    microbatches: int
    attempts: tuple[Attempt, ...]
    why: str
    budget_bytes: int | None

    @property
    def smallest(self) -> Attempt | None:
        """The attempt with the lowest peak: XLA's where compiled, else the prediction."""
        return _smallest(self.attempts)


def _smallest(attempts: Sequence[Attempt]) -> Attempt | None:
    measured = [a for a in attempts if a.peak_bytes is not None]
    pool = measured or [a for a in attempts if not a.outcome.startswith("skipped")]
    if not pool:
        return None
    return min(pool, key=lambda a: a.peak_bytes if measured else a.predicted_peak_bytes)


def select_level(plans: PlanLike, dims: Mapping[str, int], budget_bytes: int | None,
                 compile: CompileFn | None = None, *, skip: frozenset[int] = frozenset(),
                 microbatches: MicrobatchFn | None = None) -> Selection:
    """Chooses the fastest level that fits ``budget_bytes`` at ``dims``.

    Args:
        plans: the plan set.
        dims: per-device dim values (predictions are evaluated there).
        budget_bytes: the budget, or None for no limit (level 0 runs).
        compile: XLA's peak of ``(level, microbatches)``; None decides by predictions.
        skip: levels not to use (a retry after a failed run excludes the failed one).
        microbatches: the scheduler's microbatch hook, tried when no level fits.

    Returns:
        A :class:`Selection`; its ``level`` is None when nothing fits.
    """
    predicted = [level.peak_fn(dims) for level in plans.levels]
    if budget_bytes is None and 0 not in skip:
        peak = compile(0, 1) if compile is not None else None
        return Selection(0, 1, (Attempt(0, predicted[0], peak, "fits"),),
                         "no budget given: level 0 (save every residual) runs", None)
    budget = budget_bytes if budget_bytes is not None else max(predicted) + 1
    rank = [k for k in plans.order_at(dims) if k not in skip] or [0]
    fitting = [k for k in rank if predicted[k] <= budget]
    start = fitting[0] if fitting else min(rank, key=predicted.__getitem__)
    at = rank.index(start)
    attempts: list[Attempt] = [Attempt(k, predicted[k], None, "skipped: excluded")
                               for k in sorted(skip) if k < len(predicted)]
    if compile is None:
        for k in rank[:at + 1]:
            fits = k == start and k in fitting
            attempts.append(Attempt(k, predicted[k], None, "predicted to fit" if fits
                                    else "predicted over budget"))
        chosen = start if start in fitting else None
        return Selection(chosen, 1, tuple(attempts), _why(chosen, start, attempts, budget, rank),
                         budget)
    candidates = rank[at:] + rank[:at][::-1]
    while (k := _next_candidate(candidates, predicted, attempts, budget)) is not None:
        peak = compile(k, 1)
        fits = peak <= budget
        attempts.append(Attempt(k, predicted[k], peak, "fits" if fits else "over budget"))
        if fits:
            return Selection(k, 1, tuple(attempts), _why(k, start, attempts, budget, rank),
                             budget)
    tried = {a.level for a in attempts}
    attempts.extend(Attempt(k, predicted[k], None, "skipped: predicted far above the budget")
                    for k in candidates if k not in tried)
    if (k := _refine_smallest(predicted, attempts, budget, compile)) is not None:
        return Selection(k, 1, tuple(attempts), _why(k, start, attempts, budget, rank), budget)
    return _microbatched(plans, predicted, attempts, budget, start, compile, microbatches, rank)


def _next_candidate(candidates: list[int], predicted: list[int], attempts: list[Attempt],
                    budget: int) -> int | None:
    """The next level to compile: the first level (in ``candidates``' order) predicted to fit
    once the predictions are read with the slack XLA has shown, else the first within
    ``HOPELESS_FACTOR`` of the budget; the first of all when nothing is compiled yet.

    The slack is the most the model over-predicted a level compiled so far: a level
    predicted that far over the budget may fit. Levels predicted further over are
    compiled only once every likelier one failed, so a step whose model errs by a few
    per cent compiles two levels, not five (``bench.unseen``'s ``cond``).
    """
    measured = [a for a in attempts if a.peak_bytes is not None]
    tried = {a.level for a in attempts}
    left = [k for k in candidates if k not in tried]
    if not measured:
        return left[0] if left else None
    slack = max(0.0, *(a.predicted_peak_bytes / a.peak_bytes - 1 for a in measured))
    likely = [k for k in left if predicted[k] <= budget * (1 + slack)]
    reach = [k for k in left if predicted[k] <= budget * HOPELESS_FACTOR]
    return (likely or reach or [None])[0]


def _refine_smallest(predicted: list[int], attempts: list[Attempt], budget: int,
                     compile: CompileFn) -> int | None:
    """Compiles the skipped levels that could still be smaller than the smallest measured.

    Nothing fitted so far, so the error (or the microbatch split) will name the
    smallest plan: a level predicted within ``HOPELESS_FACTOR`` of the smallest XLA
    peak may really be below it. Returns a level that turns out to fit, if any.
    """
    measured = [a.peak_bytes for a in attempts if a.peak_bytes is not None]
    if not measured:
        return None
    for a in list(attempts):  # in the order they were skipped; appended as compiled
        if (a.outcome == "skipped: predicted far above the budget"
                and predicted[a.level] <= min(measured) * HOPELESS_FACTOR):
            peak = compile(a.level, 1)
            measured.append(peak)
            attempts.append(Attempt(a.level, a.predicted_peak_bytes, peak,
                                    "fits" if peak <= budget else "over budget"))
            if peak <= budget:
                return a.level
    return None


def _microbatched(plans: PlanLike, predicted: list[int], attempts: list[Attempt], budget: int,
                  start: int, compile: CompileFn, microbatches: MicrobatchFn | None,
                  rank: list[int]) -> Selection:
    """The scheduler's microbatch count k > 1 at the smallest plan, if one fits."""
    best = _smallest(attempts)
    if best is not None and microbatches is not None:
        made: dict[int, int] = {}

        def fits(k: int) -> bool:
            if k <= 1:
                return False  # every level without microbatching was tried above
            if k not in made:
                made[k] = compile(best.level, k)
                attempts.append(Attempt(best.level, predicted[best.level], made[k],
                                        "fits" if made[k] <= budget else "over budget", k))
            return made[k] <= budget

        k = microbatches(fits)
        if k in made and made[k] <= budget:
            why = (f"no level fits the budget {human_bytes(budget)} by XLA's figure; level "
                   f"{best.level} split into {k} microbatches does; tried "
                   + "; ".join(str(a) for a in attempts))
            return Selection(best.level, k, tuple(attempts), why, budget)
    return Selection(None, 1, tuple(attempts), _why(None, start, attempts, budget, rank), budget)


def _why(chosen: int | None, start: int, attempts: list[Attempt], budget: int,
         rank: list[int]) -> str:
    tried = "; ".join(str(a) for a in attempts)
    if chosen is None:
        return f"no level fits the budget {human_bytes(budget)}: {tried}"
    if chosen == start and attempts[-1].predicted_peak_bytes <= budget:
        head = (f"level {chosen} is the fastest here whose predicted peak fits the budget "
                f"{human_bytes(budget)}")
        head += " (every faster level is predicted above it)" if rank[0] != chosen else ""
    elif chosen == start:
        head = (f"no level is predicted to fit the budget {human_bytes(budget)}; level "
                f"{chosen}, predicted smallest, fits by XLA's figure")
    elif rank.index(chosen) > rank.index(start):
        head = (f"level {start} was predicted to fit but XLA measured it over the budget "
                f"{human_bytes(budget)}; level {chosen} is the next fastest that fits of "
                f"those tried (likeliest first)")
    else:
        head = (f"no level from {start} on fits the budget {human_bytes(budget)} by XLA's "
                f"figure; level {chosen}, faster, which the guard had passed over, does")
    return f"{head}; {tried}"
