"""Compile planning for a :class:`~jaxmem.Jitted`: announced calls priced by measured costs.

:class:`~jaxmem.dispatch.costs.CostLog` records what each plan's compile and each reported
step took.
:func:`compile_problem` turns announced call dims into a
:class:`~jaxmem.plan.compiles.CompileProblem`: a shape's step seconds are predicted
from the FLOPs of the level its guard selects there under the budget (None where no
level is predicted to fit), scaled by a model fitted to the measured steps; a
compile costs the median measured compile. On a CPU backend a background compile
takes the cores the steps run on, so it costs its full time; on an accelerator it
runs on the host while the device runs steps, and costs a quarter of it (a rough
figure, not measured here).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import jax

from jaxmem.dispatch.bind import bind_dims
from jaxmem.dispatch.cache import done_future
from jaxmem.dispatch.checks import split_args
from jaxmem.dispatch.costs import CostLog
from jaxmem.dispatch.store import AnalysisStore
from jaxmem.errors import BudgetInfeasibleError, JaxmemError
from jaxmem.plan.analysis import Analysis, declared_specs
from jaxmem.plan.compiles import CompilePlan, CompileProblem, Shape, fit_step_model
from jaxmem.plan.compiles import plan_compiles as optimal_plan
from jaxmem.plan.offload import costs_for
from jaxmem.plan.select import select_level

_OVERLAPPED_COMPILE_WEIGHT = 0.25  # accelerator backends: compiles overlap device steps
T = TypeVar("T")


class CompilePool:
    """Background compile threads, started by the first background submission."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], items: Iterable[tuple[Any, ...]], background: bool,
               workers: int) -> list[concurrent.futures.Future[T]]:
        """``fn(*item)`` per item: on ``workers`` threads, or now (as finished futures)."""
        if not background:
            return [done_future(fn(*item)) for item in items]
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max(1, workers), thread_name_prefix="jaxmem")
            return [self._pool.submit(fn, *item) for item in items]

    def close(self) -> None:
        """Cancels queued work and ends the threads (a later submission starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def compile_problem(analysis: Analysis, calls: Sequence[Mapping[str, int]],
                    pad_dims: Sequence[str], budget_bytes: int | None,
                    compiled: Sequence[Mapping[str, int]], log: CostLog,
                    backend: str | None = None) -> CompileProblem:
    """The compile-planning problem of ``calls`` under the measured costs in ``log``.

    Raises:
        ValueError: ``pad_dims`` names a dim the function does not have, or nothing
            has been compiled yet (no compile time to plan with).
    """
    names = analysis.domain.symbols
    plans = analysis.plans
    backend = backend or jax.default_backend()

    def flops(dims: Mapping[str, int]) -> float | None:
        k = select_level(plans, dims, budget_bytes).level  # the guards' choice
        return None if k is None else float(plans.levels[k].flops_fn(dims))

    samples = [(f, s) for d, s in list(log.steps) if (f := flops(d)) is not None]
    model = fit_step_model(samples, 1.0 / costs_for(backend).flops_per_s)
    if not log.measured:
        raise ValueError("plan_compiles needs one compile measured first: compile one of "
                         "the announced shapes (plan_for or precompile) before planning")
    weight = 1.0 if backend == "cpu" else _OVERLAPPED_COMPILE_WEIGHT
    cached = bool(jax.config.jax_compilation_cache_dir)

    def compile_s(shape: Shape) -> float:
        return weight * (log.compile_s(dict(zip(names, shape, strict=True)), cached) or 0.0)

    def step_s(shape: Shape) -> float | None:
        f = flops(dict(zip(names, shape, strict=True)))
        return None if f is None else model(f)

    return CompileProblem(
        names, tuple(_shape(names, d) for d in calls), tuple(pad_dims), step_s, compile_s,
        frozenset(_shape(names, d) for d in compiled))


def _shape(names: Sequence[str], dims: Mapping[str, int]) -> Shape:
    return tuple(int(dims[n]) for n in names)


def _declared_symbols(jitted: Any, call: tuple[Any, ...]) -> tuple[str, ...]:
    if jitted.polymorphic_shapes is None:
        return ()
    static, dynamic = split_args(call, jitted.static_argnums)
    return declared_specs(static, dynamic, jitted.static_argnums, jitted.polymorphic_shapes,
                          jitted.constraints).domain.symbols


def plan_compiles(jitted: Any, calls: Sequence[tuple[Any, ...]], pad_dims: Sequence[str],
                  made: Sequence[Mapping[str, int]], store: AnalysisStore) -> CompilePlan:
    """The compile plan of a :class:`~jaxmem.Jitted` for announced ``calls``.

    Args:
        jitted: the function.
        calls: argument tuples (arrays or ``jax.ShapeDtypeStruct``), one per upcoming call.
        pad_dims: the dims the caller may pad (right-padding that leaves results as they
            are, e.g. loss-masked sequence positions of a causal model).
        made: dims of the plans compiled so far (they cost nothing to reuse).
        store: the function's disk store: the costs earlier runs measured are read from
            it before the first plan, and this run's are written back after each.

    Returns:
        The :class:`~jaxmem.plan.compiles.CompilePlan` (from the scheduler's
        ``compile_plan`` hook if it gives one, else from
        :func:`~jaxmem.plan.compiles.plan_compiles`).

    Raises:
        ShapeOutOfRangeError: a call outside the declared ranges.
        ValueError: ``pad_dims`` names a dim the function does not have.
        JaxmemError: the function has symbolic dims but is analysed per shape
            (:mod:`jaxmem.dispatch.retrace`), so no model prices a padded call.
    """
    if not calls:
        return CompilePlan((), {}, (), 0.0, 0.0, 0.0)
    analysis = jitted.analysis(*calls[0])
    if not analysis.domain.symbols and _declared_symbols(jitted, calls[0]):
        name = getattr(jitted.fun, "__name__", "the function")
        raise JaxmemError(f"plan_compiles needs a symbolic analysis, but {name} cannot be "
                          "traced with its symbolic dims (see the JaxmemWarning); each call "
                          "shape is analysed and compiled when it is first called")
    dims = [bind_dims(analysis, split_args(c, jitted.static_argnums)[1]) for c in calls]
    if jitted.costs.writer is None:
        store.read_costs(analysis, jitted.budget_bytes, jitted.costs)
        jitted.costs.writer = functools.partial(store.write_costs, analysis, jitted.budget_bytes)
    if not jitted.costs.measured:  # every plan compiles the largest call: time it
        largest = max(range(len(calls)), key=lambda i: math.prod(dims[i].values()))
        try:
            jitted.plan_for(*calls[largest])
            made = [*made, dims[largest]]
        except BudgetInfeasibleError:
            pass  # its compile time is logged all the same; the plan names it infeasible
    names = set(analysis.domain.symbols)
    problem = compile_problem(analysis, dims, pad_dims, jitted.budget_bytes,
                              [d for d in made if set(d) == names], jitted.costs)
    chosen = jitted.scheduler.compile_plan(problem)
    jitted.costs.save()
    return chosen if chosen is not None else optimal_plan(problem)
