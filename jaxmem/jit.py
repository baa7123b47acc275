"""``jaxmem.jit``: a drop-in for ``jax.jit`` that plans memory for every shape it meets.

The function is traced once with symbolic dims; its recomputation levels are
derived once from the symbolic memory model (:mod:`jaxmem.plan.planner`). At a
call, jaxmem binds the dims from the argument shapes, checks them against the
declared ranks, ranges and constraints, picks the first level whose guard
``peak(dims) <= budget`` holds, and compiles the exact-shape executable (cached;
a seen shape never recompiles). XLA is the oracle: if the compiled executable's
own ``memory_analysis()`` exceeds the budget, the next level is tried; if none
fits, :class:`~jaxmem.BudgetInfeasibleError` says what the best one needs.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def step(w, x):
    ...     return jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> f = jaxmem.jit(step, polymorphic_shapes=(None, "b, 8"), constraints=("b <= 64",))
    >>> f(jnp.ones((8, 8)), jnp.ones((4, 8))).shape
    (8, 8)
"""

from __future__ import annotations

import concurrent.futures
import functools
import operator
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem._errors import BudgetInfeasibleError, JaxmemError, ShapeOutOfRangeError
from jaxmem.dispatch import Analysis, analyze_specs, arg_shardings, bind_dims, local_dims
from jaxmem.plan.plan import Plan, compile_level
from jaxmem.plan.planner import PlanSet
from jaxmem.schedulers import MemoryAware, Scheduler


def _check_budget(budget_bytes: Any) -> int | None:
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int number of bytes or None, got "
                        f"{budget_bytes!r} ({type(budget_bytes).__name__})")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    return budget_bytes


def _argnums(name: str, value: int | Iterable[int]) -> tuple[int, ...]:
    nums = (value,) if isinstance(value, int) else tuple(value)
    for n in nums:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {n!r}")
    return nums


_SPEC = re.compile(r"^[\s\w,+*\-/()^.]*$")


def _check_shapes(polymorphic_shapes: Any) -> Any:
    """Rejects entries that are not ``None`` or a dims string (ShapeOutOfRangeError)."""
    entries = ((polymorphic_shapes,) if isinstance(polymorphic_shapes, str)
               else polymorphic_shapes)
    leaves = jax.tree_util.tree_flatten_with_path(entries)[0] if entries is not None else []
    for path, leaf in leaves:
        if not isinstance(leaf, str) or not _SPEC.match(leaf):
            raise ShapeOutOfRangeError(
                f"polymorphic_shapes{jax.tree_util.keystr(path)} must be None or a string of "
                f"dims like 'b, s', got {leaf!r}")
    return polymorphic_shapes


def is_resource_exhausted(err: BaseException) -> bool:
    """True for XLA's out-of-memory error at run time (``RESOURCE_EXHAUSTED``)."""
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)


#: Once one level has been compiled, levels predicted above the budget times this factor
#: are not compiled: jaxmem's predictions are within 15 % of XLA's on the programs measured.
HOPELESS_FACTOR = 1.25

#: On a run-time out-of-memory error jaxmem re-plans with the failed plan's XLA peak
#: times this factor as the budget and retries the call once.
RETRY_BUDGET_FACTOR = 0.9


def _consumed(args: Sequence[Any], argnums: Sequence[int]) -> list[str]:
    """Paths of donated array leaves that a failed call already deleted."""
    out = []
    for i in argnums:
        if i >= len(args):
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            deleted = getattr(leaf, "is_deleted", None)
            if deleted is not None and deleted():
                out.append(f"args[{i}]{jax.tree_util.keystr(path)}")
    return out


class Jitted:
    """A function planned and compiled by jaxmem. Call it like the ``jax.jit`` result.

    Attributes:
        budget_bytes: the memory budget (per device), or None.
        scheduler: the scheduling strategy.
        retries: how many calls ran out of device memory (XLA ``RESOURCE_EXHAUSTED``)
            and were re-planned at 0.9 x the failed plan's peak and run again.
    """

    def __init__(self, fun: Callable[..., Any], *, polymorphic_shapes: Any = None,
                 constraints: Sequence[str] = (), budget_bytes: int | None = None,
                 scheduler: Scheduler | None = None, donate_argnums: int | Iterable[int] = (),
                 static_argnums: int | Iterable[int] = (), in_shardings: Any = None,
                 out_shardings: Any = None, symbolic: bool = True,
                 offload: bool | None = None):
        if not callable(fun):
            raise TypeError(f"jaxmem.jit expects a callable, got {type(fun).__name__}")
        if scheduler is not None and not isinstance(scheduler, Scheduler):
            raise TypeError(f"scheduler must be a jaxmem.Scheduler or None, got {scheduler!r}")
        self.fun = fun
        self.polymorphic_shapes = _check_shapes(polymorphic_shapes)
        self.constraints = tuple(constraints)
        for c in self.constraints:
            if not isinstance(c, str):
                raise ValueError(f"constraints must be strings like 'b <= 16', got {c!r}")
        self.budget_bytes = _check_budget(budget_bytes)
        self.scheduler = scheduler if scheduler is not None else MemoryAware()
        self.donate_argnums = _argnums("donate_argnums", donate_argnums)
        self.static_argnums = _argnums("static_argnums", static_argnums)
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.symbolic = symbolic
        if offload is not None and not isinstance(offload, bool):
            raise TypeError(f"offload must be True, False or None (auto), got {offload!r}")
        self.offload = offload
        self._analyses: dict[Any, Analysis] = {}
        self._plans: dict[Any, Plan] = {}
        self._lock = threading.RLock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Call fast path: plans keyed by the shapes of the symbolic leaves alone, read
        # with accessors built from the first analysis. The compiled executable itself
        # rejects anything else that differs (TypeError), which sends the call down the
        # validating slow path.
        self._read_key: Callable[[tuple[Any, ...]], Any] | None = None
        self._read_analysis: Analysis | None = None
        self._fast: dict[Any, tuple[Callable[..., Any], Plan]] = {}
        self.retries = 0
        functools.update_wrapper(self, fun)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", repr(self.fun))
        return (f"jaxmem.jit({name}, polymorphic_shapes={self.polymorphic_shapes!r}, "
                f"budget_bytes={self.budget_bytes}, scheduler={self.scheduler!r})")

    # --- dispatch -------------------------------------------------------------------------

    def _split(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        for i in self.static_argnums:
            if i >= len(args):
                raise ShapeOutOfRangeError(
                    f"static_argnums={self.static_argnums} names argument {i}, but only "
                    f"{len(args)} positional arguments were passed")
        static = tuple(args[i] for i in self.static_argnums)
        dynamic = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        return static, dynamic

    def _key(self, static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> Any:
        flat, tree = jax.tree_util.tree_flatten(dynamic)
        shapes = tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x))) for x in flat)
        try:
            hash(static)
        except TypeError as e:
            raise ShapeOutOfRangeError(f"static arguments must be hashable: {e}") from e
        return (tree, static, shapes)

    def plan_for(self, *args: Any) -> Plan:
        """The plan (and compiled executable) that a call with ``args`` runs.

        Raises:
            ShapeOutOfRangeError: arguments outside the declared ranks/ranges/constraints.
            BudgetInfeasibleError: no plan fits the budget.
        """
        static, dynamic = self._split(args)
        key = self._key(static, dynamic)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                plan = self._make_plan(static, dynamic)
                self._plans[key] = plan
        return plan

    def plans(self, *args: Any) -> PlanSet:
        """The levels derived (once, symbolically) for arguments structured like ``args``.

        ``args`` may be arrays or ``jax.ShapeDtypeStruct``; nothing is compiled.
        ``plans(...).describe(budget_bytes)`` prints each level's guard.
        """
        static, dynamic = self._split(args)
        return self._analysis(static, dynamic).plans

    def _analysis(self, static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> Analysis:
        flat, tree = jax.tree_util.tree_flatten(dynamic)
        akey = (tree, static, tuple((len(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))
                                    for x in flat))
        a = self._analyses.get(akey)
        if a is None:
            a = analyze_specs(self.fun, static, dynamic, self.static_argnums,
                              self.polymorphic_shapes, self.constraints, self.scheduler,
                              self.donate_argnums, self.symbolic, self.offload)
            self._analyses[akey] = a
        return a

    def _make_plan(self, static: tuple[Any, ...], dynamic: tuple[Any, ...],
                   budget: int | None = None, skip: frozenset[int] = frozenset()) -> Plan:
        """Compiles the fastest level whose XLA peak fits ``budget`` (default: the budget)."""
        budget = self.budget_bytes if budget is None else budget
        analysis = self._analysis(static, dynamic)
        dims = bind_dims(analysis, dynamic)
        local = local_dims(analysis, dims, arg_shardings(dynamic))
        start = analysis.plans.choose(local, budget)
        tried: list[Plan] = []

        def attempt(k: int) -> Plan | None:
            if k in skip:
                return None
            if (tried and budget is not None and analysis.plans.levels[k].peak_fn(local)
                    > budget * HOPELESS_FACTOR):
                return None  # predicted far above the budget: not worth a compile
            plan = compile_level(analysis, k, dims, static, dynamic, self, budget)
            if plan.order_enforced and getattr(self.scheduler, "verify_with_xla", False):
                # A heuristic order must beat XLA's own schedule on XLA's own figure.
                free = compile_level(analysis, k, dims, static, dynamic, self, budget,
                                     apply_order=False)
                plan = plan if plan.peak_bytes < free.peak_bytes else free
            tried.append(plan)
            return plan if budget is None or plan.peak_bytes <= budget else None

        for k in range(start, len(analysis.plans.levels)):
            if (plan := attempt(k)) is not None:
                return plan
        # The guard skipped cheaper levels; XLA may still fit one of them.
        for k in range(start - 1, -1, -1):
            if (plan := attempt(k)) is not None:
                return plan
        if not tried:
            raise BudgetInfeasibleError(f"no plan is left to try at {dims}", min_peak_bytes=0,
                                        budget_bytes=budget)
        best = min(tried, key=lambda p: p.peak_bytes)
        if (plan := self._microbatched(analysis, best, dims, static, dynamic, budget, tried)):
            return plan
        best = min(tried, key=lambda p: p.peak_bytes)
        raise BudgetInfeasibleError(
            f"no plan fits budget_bytes={budget} at {dims}: the best plan "
            f"(level {best.level}, recomputing {', '.join(best.recompute) or 'nothing'}) needs "
            f"{best.peak_bytes} bytes (XLA memory_analysis)", min_peak_bytes=best.peak_bytes,
            budget_bytes=budget)

    def _microbatched(self, analysis: Analysis, best: Plan, dims: dict[str, int],
                      static: tuple[Any, ...], dynamic: tuple[Any, ...], budget: int | None,
                      tried: list[Plan]) -> Plan | None:
        """The scheduler's microbatch count k > 1 that XLA says fits, if it names one."""
        if budget is None or type(self.scheduler).microbatches is Scheduler.microbatches:
            return None
        axis = getattr(self.scheduler, "axis", "b")
        if dims.get(axis, 1) <= 1:
            return None
        made: dict[int, Plan] = {}

        def fits(k: int) -> bool:
            if k <= 1:
                return False  # every level without microbatching was tried above
            if k not in made:
                made[k] = compile_level(analysis, best.level, dims, static, dynamic, self,
                                        budget, microbatches=k, axis=axis)
                tried.append(made[k])
            return made[k].peak_bytes <= budget

        k = self.scheduler.microbatches(dict(dims), fits)
        return made[k] if k in made and made[k].peak_bytes <= budget else None

    def __call__(self, *args: Any) -> Any:
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
                if not is_resource_exhausted(e):
                    raise
                return self._retry(plan, args, e)
        plan = self.plan_for(*args)
        try:
            out = plan.run(*args)
        except jax.errors.JaxRuntimeError as e:
            if not is_resource_exhausted(e):
                raise
            return self._retry(plan, args, e)
        self._remember(args, plan)
        return out

    def _remember(self, args: tuple[Any, ...], plan: Plan) -> None:
        """Files ``plan`` in the fast table when ``args`` have the first analysis' structure.

        Without static arguments the table holds the executable's C++ entry point,
        which ``Compiled.__call__`` sets up on its first call, so a fast call runs no
        Python frame of jaxmem's or of ``jax.stages`` beyond the key read.
        """
        static, dynamic = self._split(args)
        analysis = self._analysis(static, dynamic)
        if self._read_analysis is None:
            self._read_analysis = analysis
            self._read_key = _key_reader(analysis, dynamic, self.static_argnums, len(args))
        if analysis is not self._read_analysis or self._read_key is None:
            return
        call = getattr(plan.compiled, "_call", None) if not self.static_argnums else None
        self._fast[self._read_key(args)] = (call or plan.run, plan)

    def _retry(self, failed: Plan, args: tuple[Any, ...], err: Exception) -> Any:
        """Re-plans below the failed plan's peak and runs the call once more.

        A call that failed before it ran leaves donated inputs intact; if XLA had
        already consumed one, the step cannot be repeated and jaxmem says so.
        """
        gone = _consumed(args, self.donate_argnums)
        if gone:
            raise JaxmemError(
                f"XLA ran out of memory (RESOURCE_EXHAUSTED) running plan level {failed.level} "
                f"(XLA peak {failed.peak_bytes} bytes) and had already consumed the donated "
                f"inputs {', '.join(gone)}, so the step cannot be retried") from err
        budget = max(1, int(failed.peak_bytes * RETRY_BUDGET_FACTOR))
        static, dynamic = self._split(args)
        key = self._key(static, dynamic)
        with self._lock:
            try:
                plan = self._make_plan(static, dynamic, budget, skip=frozenset({failed.level}))
            except BudgetInfeasibleError as e2:
                raise BudgetInfeasibleError(
                    f"XLA ran out of memory (RESOURCE_EXHAUSTED) running plan level "
                    f"{failed.level} (XLA peak {failed.peak_bytes} bytes), and no plan fits "
                    f"{budget} bytes (0.9 x that peak): {e2}", min_peak_bytes=e2.min_peak_bytes,
                    budget_bytes=budget) from err
            self._plans[key] = plan
            self._fast.clear()
        self.retries += 1
        return plan.run(*args)

    def precompile(self, shapes: Iterable[Sequence[Any]], background: bool = True
                   ) -> list[concurrent.futures.Future[Plan]]:
        """Plans and compiles ahead for argument specs the caller expects.

        Args:
            shapes: each item is a tuple of arguments (arrays or ``jax.ShapeDtypeStruct``)
                as they will be passed.
            background: compile in a background thread and return futures.
        """
        items = [tuple(s) for s in shapes]
        if not background:
            done: list[concurrent.futures.Future[Plan]] = []
            for s in items:
                f: concurrent.futures.Future[Plan] = concurrent.futures.Future()
                f.set_result(self.plan_for(*s))
                done.append(f)
            return done
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxmem")
        return [self._pool.submit(self.plan_for, *s) for s in items]

    @property
    def compiles(self) -> int:
        """Number of distinct executables compiled so far."""
        return len({id(p.compiled) for p in self._plans.values()})


def _key_reader(analysis: Analysis, dynamic: tuple[Any, ...], static_argnums: Sequence[int],
                n_args: int) -> Callable[[tuple[Any, ...]], Any] | None:
    """A function of the positional arguments giving the shapes of the symbolic leaves.

    It runs on every call, so it reads as few leaves as fix every dim, with
    ``operator`` getters rather than a tree flatten; the executable itself checks
    every other leaf against the shapes it was compiled for. Returns None where a
    leaf sits behind a path that plain indexing cannot follow.
    """
    positions = [i for i in range(n_args) if i not in static_argnums]
    getters: list[Callable[[Any], Any]] = []
    leaves = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    for path, _ in _covering_leaves(leaves, analysis.flat_specs):
        steps: list[Callable[[Any], Any]] = [operator.itemgetter(positions[path[0].idx])]
        for k in path[1:]:
            if isinstance(k, jax.tree_util.SequenceKey):
                steps.append(operator.itemgetter(k.idx))
            elif isinstance(k, jax.tree_util.DictKey):
                steps.append(operator.itemgetter(k.key))
            elif isinstance(k, jax.tree_util.GetAttrKey):
                steps.append(operator.attrgetter(k.name))
            else:
                return None
        getters.append(steps[0] if len(steps) == 1 else functools.partial(_follow, steps))
    if not getters:
        return None
    if len(getters) == 1:
        (g,) = getters
        shapes: Callable[[tuple[Any, ...]], Any] = lambda a: g(a).shape  # noqa: E731
    else:
        shapes = lambda a: tuple([g(a).shape for g in getters])  # noqa: E731
    if not static_argnums:
        return shapes
    statics = operator.itemgetter(*static_argnums)
    return lambda a: (shapes(a), statics(a))


def _covering_leaves(leaves: Sequence[Any], specs: Sequence[Any]) -> list[Any]:
    """The first leaves that together hold every symbolic dim as a whole axis.

    A dim that appears only inside expressions (``2*s``) takes every leaf it is in.
    """
    def dims(spec: Any) -> list[str]:
        return [str(d) for d in spec.shape if not isinstance(d, (int, np.integer))]

    chosen: list[int] = []
    named: set[str] = set()
    for i, spec in enumerate(specs):
        whole = {d for d in dims(spec) if d.isidentifier()}
        if whole - named:
            chosen.append(i)
            named |= whole
    for i, spec in enumerate(specs):
        symbols = {m for d in dims(spec) for m in re.findall(r"[A-Za-z_]\w*", d)}
        if symbols - named and i not in chosen:
            chosen.append(i)
    return [leaves[i] for i in sorted(chosen)]


def _follow(steps: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for step in steps:
        x = step(x)
    return x


def jit(fun: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """Planned, budgeted ``jax.jit``. Use as ``jaxmem.jit(f, ...)`` or ``@jaxmem.jit(...)``.

    Args:
        fun: the function (omit to get a decorator).
        polymorphic_shapes: per positional argument, ``None`` or a string like ``"b, s"``
            (the form of ``jax.export.symbolic_args_specs``).
        constraints: e.g. ``("b <= 16", "s <= 512")``.
        budget_bytes: memory budget per device in bytes, or None for no limit.
        scheduler: a :class:`~jaxmem.Scheduler`; None means ``schedulers.MemoryAware()``.
        donate_argnums, static_argnums, in_shardings, out_shardings: as for ``jax.jit``.
        symbolic: False runs the fallback-only ablation.
        offload: plan moving residuals to host memory (``pinned_host``) as well as
            recomputing them. None (default) does so where the backend keeps host
            arrays out of device memory (GPU, TPU), not on CPU.

    Example:
        >>> import jax.numpy as jnp, jaxmem
        >>> @jaxmem.jit(polymorphic_shapes=("n",), constraints=("n <= 1024",))
        ... def f(x):
        ...     return x * 2
        >>> f(jnp.arange(3.0))
        Array([0., 2., 4.], dtype=float32)
    """
    if fun is None:
        return lambda f: Jitted(f, **kwargs)
    return Jitted(fun, **kwargs)


__all__ = ["Jitted", "Plan", "jit"]
