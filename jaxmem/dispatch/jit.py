"""``jaxmem.jit``: a drop-in for ``jax.jit`` that plans memory for every shape it meets.

The function is traced once with symbolic dims and its levels are derived once
(:mod:`jaxmem.plan.analysis`). At a call, jaxmem binds the dims from the argument
shapes (:mod:`jaxmem.dispatch.bind`), lets :func:`jaxmem.plan.select.select_level`
pick the fastest level that fits the budget, with XLA compiling each candidate
(:func:`jaxmem.lower.lower_level`) as the oracle, and caches the executable: a
seen shape never recompiles and takes the fast path
(:mod:`jaxmem.dispatch.fastpath`). If no plan fits,
:class:`~jaxmem.BudgetInfeasibleError` says what the best one needs.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def step(w, x):
    ...     return jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> f = jaxmem.jit(step, polymorphic_shapes=(None, "b, 8"), constraints=("b <= 64",))
    >>> f(jnp.ones((8, 8)), jnp.ones((4, 8))).shape
    (8, 8)
    >>> f.cache_info()
    CacheInfo(analyses=1, plans=1, executables=1, analyses_loaded=0)
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from jaxmem.dispatch import checks
from jaxmem.dispatch.ahead import CompilePool, CostLog, plan_compiles
from jaxmem.dispatch.bind import bind_dims
from jaxmem.dispatch.cache import CacheInfo, OnceCache
from jaxmem.dispatch.fastpath import key_reader
from jaxmem.dispatch.keywords import KeywordCalls, check_argnames, routes_keywords
from jaxmem.dispatch.plan import (
    Plan,
    infeasible,
    lower_verified,
    make_plan,
    microbatch_hook,
    no_retry_fits,
    unrepeatable,
)
from jaxmem.dispatch.retrace import ShapeAnalyses
from jaxmem.dispatch.store import AnalysisStore
from jaxmem.dispatch.traced import PlannedLowered, as_jax_jit, has_tracer
from jaxmem.errors import BudgetInfeasibleError
from jaxmem.lower import CompileOptions, Executable, lower_level, lowered_level
from jaxmem.plan.analysis import Analysis, analyze_specs, arg_shardings, local_dims
from jaxmem.plan.compiles import CompilePlan
from jaxmem.plan.levels import PlanSet
from jaxmem.plan.offload import Costs
from jaxmem.plan.select import select_level
from jaxmem.schedulers import MemoryAware, Scheduler

#: On a run-time out-of-memory error jaxmem re-plans with the failed plan's XLA peak
#: times this factor as the budget and retries the call once.
RETRY_BUDGET_FACTOR = 0.9


class Jitted:
    """A function planned and compiled by jaxmem. Call it like the ``jax.jit`` result.

    Attributes:
        budget_bytes: the memory budget (per device), or None.
        scheduler: the scheduling strategy.
        cache_dir: the directory given for the disk store of analyses, or None.
        retries: how many calls ran out of device memory (XLA ``RESOURCE_EXHAUSTED``)
            and were re-planned at 0.9 x the failed plan's peak and run again.
    """

    def __init__(self, fun: Callable[..., Any], *, polymorphic_shapes: Any = None,
                 constraints: Sequence[str] = (), budget_bytes: int | None = None,
                 scheduler: Scheduler | None = None, donate_argnums: int | Iterable[int] = (),
                 donate_argnames: str | Iterable[str] = (),
                 static_argnums: int | Iterable[int] = (),
                 static_argnames: str | Iterable[str] = (), in_shardings: Any = None,
                 out_shardings: Any = None, symbolic: bool = True,
                 offload: bool | None = None, offload_costs: Costs | None = None,
                 cache_dir: str | os.PathLike[str] | None = None):
        if not callable(fun):
            raise TypeError(f"jaxmem.jit expects a callable, got {type(fun).__name__}")
        checks.check_choices(scheduler, offload, offload_costs)
        self.fun = fun
        self.polymorphic_shapes = checks.check_shapes(polymorphic_shapes)
        self.constraints = checks.check_constraints(constraints)
        self.budget_bytes = checks.check_budget(budget_bytes)
        self.scheduler = scheduler if scheduler is not None else MemoryAware()
        self._axis = getattr(self.scheduler, "axis", "b")  # the dim microbatching splits
        self.donate_argnums = checks.donated_positions(
            fun, checks.check_argnums("donate_argnums", donate_argnums), donate_argnames)
        self.static_argnums = checks.check_argnums("static_argnums", static_argnums)
        self.static_argnames = check_argnames(static_argnames)
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.symbolic = symbolic
        self.offload = offload
        self.offload_costs = offload_costs
        self.cache_dir = checks.check_cache_dir(cache_dir)
        self._store = AnalysisStore(self.cache_dir)  # shared by with_budget, like _analyses
        self._analyses = ShapeAnalyses(fun, self.polymorphic_shapes, self.constraints,
                                       self.static_argnums, self._analyze)
        self._plans: OnceCache[Plan] = OnceCache()
        self._lock = threading.RLock()
        self._pool = CompilePool()
        self.costs = CostLog()  # measured compile and step seconds, for plan_compiles
        # Call fast path: plans keyed by the shapes of the symbolic leaves alone, read
        # with accessors built from the first analysis. The compiled executable itself
        # rejects anything else that differs (TypeError), which sends the call down the
        # validating slow path.
        self._read_key: Callable[[tuple[Any, ...]], Any] | None = None
        self._read_analysis: Analysis | None = None
        self._fast: dict[Any, tuple[Callable[..., Any], Plan]] = {}
        self._keyword = KeywordCalls(fun, self._settings(), self._with_keywords)
        self.retries = 0
        functools.update_wrapper(self, fun)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", repr(self.fun))
        return (f"jaxmem.jit({name}, polymorphic_shapes={self.polymorphic_shapes!r}, "
                f"budget_bytes={self.budget_bytes}, scheduler={self.scheduler!r})")

    # --- public hooks ---------------------------------------------------------------------

    @routes_keywords()
    def analysis(self, *args: Any) -> Analysis:
        """The symbolic analysis (trace, graph, domain, plan set, orders) for arguments
        structured like ``args`` (arrays or ``jax.ShapeDtypeStruct``); derived once and
        shared by every shape and budget. Nothing is compiled."""
        static, dynamic = self._split(args)
        return self._analyses.get(static, dynamic)

    def plans(self, *args: Any, **kwargs: Any) -> PlanSet:
        """The levels derived (once, symbolically) for arguments structured like ``args``.

        ``args`` may be arrays or ``jax.ShapeDtypeStruct``; nothing is compiled.
        ``plans(...).describe(budget_bytes)`` prints each level's guard.
        """
        return self.analysis(*args, **kwargs).plans

    @routes_keywords(lead=1)
    def compile_level(self, level: int, *args: Any, microbatches: int = 1,
                      apply_order: bool = True) -> Plan:
        """Compiles level ``level`` at the shapes of ``args``, whatever the budget says.

        Not cached and not checked against the budget: for benchmarks and tests
        that measure every level (``Plan.peak_bytes`` is XLA's figure).
        """
        static, dynamic = self._split(args)
        analysis = self._analyses.get(static, dynamic)
        if not 0 <= level < len(analysis.plans.levels):
            raise ValueError(f"level must be in [0, {len(analysis.plans.levels)}), got {level}")
        dims = bind_dims(analysis, dynamic)
        exe = lower_level(analysis, level, dims, dynamic, self._options(analysis), apply_order,
                          microbatches, self._axis)
        return make_plan(analysis, exe, dims, self.budget_bytes, self.static_argnums,
                         f"level {level} compiled on request (Jitted.compile_level)")

    def with_budget(self, budget_bytes: int | None) -> Jitted:
        """The same function under another budget, sharing this one's analyses (which do
        not depend on the budget) but none of its plans or executables."""
        other = Jitted(self.fun, **{**self._settings(), "budget_bytes": budget_bytes})
        other._analyses, other._store = self._analyses, self._store
        return other

    def _settings(self) -> dict[str, Any]:
        """The keyword arguments that make this ``Jitted`` again."""
        names = ("polymorphic_shapes", "constraints", "budget_bytes", "scheduler",
                 "donate_argnums", "static_argnums", "static_argnames", "in_shardings",
                 "out_shardings", "symbolic", "offload", "offload_costs", "cache_dir")
        return {n: getattr(self, n) for n in names}

    def _with_keywords(self, fun: Callable[..., Any], settings: dict[str, Any]) -> Jitted:
        other = Jitted(fun, **settings)  # a keyword signature's function
        other._store = self._store
        return other

    @routes_keywords(lead=1)
    def use_plan(self, plan: Plan, *args: Any) -> None:
        """Makes calls shaped like ``args`` run ``plan`` (one from :meth:`compile_level`, or
        one whose executable is wrapped, e.g. to inject a fault in a test)."""
        static, dynamic = self._split(args)
        key = checks.call_key(static, dynamic)
        with self._lock:
            self._plans.put(key, plan)
            self._fast.clear()

    def cache_info(self) -> CacheInfo:
        """How many analyses (and of them, loaded from disk), plans and executables it holds."""
        inner = [k.cache_info() for k in self._keyword.made.values()]
        return CacheInfo(len(self._analyses) + sum(i.analyses for i in inner),
                         len(self._plans) + sum(i.plans for i in inner), self.compiles,
                         self._store.loaded)

    @property
    def analysis_s(self) -> float:
        """Seconds spent in analyses so far: tracing, and deriving or loading the plan sets."""
        return self._store.seconds

    @property
    def compiles(self) -> int:
        """Number of distinct executables compiled so far."""
        return (len({id(p.compiled) for p in self._plans.values()})
                + sum(k.compiles for k in self._keyword.made.values()))

    # --- planning -------------------------------------------------------------------------

    def _split(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return checks.split_args(args, self.static_argnums)

    def _analyze(self, static: tuple[Any, ...], dynamic: tuple[Any, ...], shapes: Any,
                 constraints: tuple[str, ...]) -> Analysis:
        return self._store.analyze(lambda planner: analyze_specs(
            self.fun, static, dynamic, self.static_argnums, shapes, constraints,
            self.scheduler, self.donate_argnums, self.symbolic, self.offload,
            self.offload_costs, planner))

    def _options(self, analysis: Analysis) -> CompileOptions:
        return CompileOptions(analysis.donate_dynamic, self.in_shardings, self.out_shardings)

    @routes_keywords()
    def plan_for(self, *args: Any) -> Plan:
        """The plan (and compiled executable) that a call with ``args`` runs.

        Raises:
            ShapeOutOfRangeError: arguments outside the declared ranks/ranges/constraints.
            BudgetInfeasibleError: no plan fits the budget.
        """
        static, dynamic = self._split(args)
        key = checks.call_key(static, dynamic)
        return self._plans.get_or_make(key, lambda: self._make_plan(static, dynamic))

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The outputs' ``jax.ShapeDtypeStruct``s, as ``jax.jit``'s: nothing is compiled."""
        return as_jax_jit(self.fun, self._settings()).eval_shape(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit``'s ``jax.stages.Traced`` of the function: nothing is planned."""
        return as_jax_jit(self.fun, self._settings()).trace(*args, **kwargs)

    def clear_cache(self) -> None:
        """Drops the plans and their executables, as ``jax.jit``'s does: the next call of
        each shape compiles again. The analyses stay (they hold no device memory)."""
        with self._lock:
            self._plans, self._fast = OnceCache(), {}
        for k in self._keyword.made.values():
            k.clear_cache()

    @routes_keywords()
    def lower(self, *args: Any) -> Any:
        """The lowered level a call with ``args`` runs (planned and compiled first, as
        :meth:`plan_for`): a ``jax.stages.Lowered``, whose ``compile()`` makes that
        executable (called without the static arguments, as ``jax.jit``'s)."""
        plan, (static, dynamic) = self.plan_for(*args), self._split(args)
        analysis = self._analyses.get(static, dynamic)
        return PlannedLowered(lowered_level(analysis, plan.level, plan.dims, dynamic,
                                            self._options(analysis), plan.order_enforced,
                                            plan.microbatches, self._axis)[0])

    def _make_plan(self, static: tuple[Any, ...], dynamic: tuple[Any, ...],
                   budget: int | None = None, skip: frozenset[int] = frozenset()) -> Plan:
        """Compiles the level :func:`select_level` chooses under ``budget`` (default: the
        budget) and wraps it as a :class:`Plan`."""
        budget = self.budget_bytes if budget is None else budget
        analysis = self._analyses.get(static, dynamic)
        dims = bind_dims(analysis, dynamic)
        local = local_dims(analysis, dims, arg_shardings(dynamic))
        made: dict[tuple[int, int], Executable] = {}

        def compile(k: int, microbatches: int) -> int:
            made[(k, microbatches)] = lower_verified(
                analysis, k, dims, dynamic, self._options(analysis), microbatches, self._axis,
                getattr(self.scheduler, "verify_with_xla", False))
            return made[(k, microbatches)].peak_bytes

        start = time.perf_counter()
        selection = select_level(analysis.plans, local, budget, compile, skip=skip,
                                 microbatches=microbatch_hook(self.scheduler, self._axis,
                                                              dims, budget))
        self.costs.record_compile(dims, time.perf_counter() - start)
        if selection.level is None:
            raise infeasible(analysis, selection, dims)
        exe = made[(selection.level, selection.microbatches)]
        return make_plan(analysis, exe, dims, budget, self.static_argnums, selection.why,
                         selection)

    # --- calls ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args, kwargs = self._keyword.promote(args, kwargs)
        if kwargs:
            inner, pos = self._keyword.route(args, kwargs)
            return inner(*pos)
        entry = None
        if self._read_key is not None:
            try:
                entry = self._fast.get(self._read_key(args))
            except Exception:  # another structure: the slow path explains or plans it
                entry = None
        if entry is not None:
            call, plan = entry
            try:
                return call(*args)
            except TypeError:
                pass  # a fixed leaf differs; the slow path validates and explains
            except jax.errors.JaxRuntimeError as e:
                if not checks.is_resource_exhausted(e):
                    raise
                return self._retry(plan, args, e)
        if has_tracer(args):  # inside an outer transformation: jax.jit's call, inlined
            return as_jax_jit(self.fun, self._settings())(*args)
        plan = self.plan_for(*args)
        try:
            out = plan.run(*args)
        except jax.errors.JaxRuntimeError as e:
            if not checks.is_resource_exhausted(e):
                raise
            return self._retry(plan, args, e)
        self._remember(args, plan)
        return out

    def _remember(self, args: tuple[Any, ...], plan: Plan) -> None:
        """Files ``plan`` in the fast table when ``args`` have the first analysis' structure.
        Without static arguments it holds the executable's C++ entry point (set up by
        ``Compiled.__call__``'s first call): a fast call runs no Python frame but the key's."""
        static, dynamic = self._split(args)
        analysis = self._analyses.get(static, dynamic)
        if self._read_analysis is None:
            self._read_analysis = analysis
            self._read_key = key_reader(analysis, dynamic, self.static_argnums, len(args))
        if analysis is not self._read_analysis or self._read_key is None:
            return
        call = getattr(plan.compiled, "_call", None) if not self.static_argnums else None
        self._fast[self._read_key(args)] = (call or plan.run, plan)

    def _retry(self, failed: Plan, args: tuple[Any, ...], err: Exception) -> Any:
        """Re-plans below the failed plan's peak and runs the call once more.

        A call that failed before it ran leaves donated inputs intact; if XLA had
        already consumed one, the step cannot be repeated and jaxmem says so.
        """
        gone = checks.consumed(args, self.donate_argnums)
        if gone:
            raise unrepeatable(failed, gone) from err
        budget = max(1, int(failed.peak_bytes * RETRY_BUDGET_FACTOR))
        static, dynamic = self._split(args)
        key = checks.call_key(static, dynamic)
        with self._lock:
            try:
                plan = self._make_plan(static, dynamic, budget, skip=frozenset({failed.level}))
            except BudgetInfeasibleError as e2:
                raise no_retry_fits(failed, budget, e2) from err
            self._plans.put(key, plan)
            self._fast.clear()
        self.retries += 1
        return plan.run(*args)

    def close(self) -> None:
        """Cancels queued compiles, ends the compile threads, stores the measured costs."""
        self._pool.close()
        self.costs.save()
        for k in self._keyword.made.values():
            k.close()

    def plan_compiles(self, calls: Iterable[Sequence[Any]], pad_dims: Sequence[str]
                      ) -> CompilePlan:
        """Which shapes to compile for the announced ``calls``, and where each runs padded.

        See :func:`jaxmem.dispatch.ahead.plan_compiles`; ``self.scheduler.compile_plan``
        may override the choice. Before the first compile it compiles the largest call.
        """
        made = [p.dims for p in self._plans.values()]
        return plan_compiles(self, [tuple(c) for c in calls], pad_dims, made, self._store)

    def precompile(self, shapes: Iterable[Sequence[Any]], background: bool = True,
                   workers: int = 2) -> list[concurrent.futures.Future[Plan]]:
        """Plans and compiles ahead for argument specs the caller expects: ``shapes`` holds
        tuples of arguments (arrays or ``jax.ShapeDtypeStruct``) as they will be passed.
        With ``background``, on ``workers`` threads (XLA's compile releases the GIL) while
        the caller runs steps; a shape being compiled is compiled once (a call waits)."""
        return self._pool.submit(self.plan_for, [tuple(s) for s in shapes], background, workers)


__all__ = ["CacheInfo", "Jitted"]
