"""The compared methods: how each compiles and runs a train step at one (b, s).

Every method turns a requested shape ``(b, s)`` into a :class:`Prepared`: the
shape it actually runs (padding methods run a longer one), the executable's peak
bytes by XLA's own accounting (docs/design.md §2: ``argument + output - alias + temp``),
jaxmem's prediction where there is one, and a zero-argument callable that runs
one step. Executables are cached per run shape, so a shape compiles once.

Methods (names are the contract's): ``xla``, ``xla+full_remat``, ``xla+dots``,
``jaxmem``, ``jaxmem-static``, ``jaxmem-fallback-only``, ``pad-max``, ``buckets``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

import jaxmem
from bench.workload import POLICY_NAMES, REMAT_POLICIES, Workload
from jaxmem import xla_peak_bytes
from jaxmem.lower import compiler_options
from train.batching import bucket_length

METHODS = ("xla", "xla+full_remat", "xla+dots", "jaxmem", "jaxmem-static",
           "jaxmem-fallback-only", "pad-max", "buckets")
JAXMEM_METHODS = ("jaxmem", "jaxmem-static", "jaxmem-fallback-only")


@dataclasses.dataclass
class Prepared:
    """A method ready to run at one requested shape.

    Attributes:
        method, b, s: what was asked for.
        run_s: the sequence length actually run (padding methods pad up to it).
        peak_bytes: XLA's peak of the executable (for an infeasible jaxmem plan: the
            best plan's peak, i.e. ``min_peak_bytes``).
        predicted_peak_bytes: jaxmem's prediction, or None.
        compile_s: seconds spent planning and compiling for this shape (0 if cached).
        call: runs one step (None when no plan fits).
        level: jaxmem's plan level, or None.
        min_peak_bytes: for an infeasible jaxmem shape, what the best plan needs.
        recompute: the residual groups jaxmem's plan recomputes, or None.
        microbatches: jaxmem's accumulation steps, or None.
    """

    method: str
    b: int
    s: int
    run_s: int
    peak_bytes: int
    predicted_peak_bytes: int | None
    compile_s: float
    call: Callable[[], Any] | None
    level: int | None = None
    min_peak_bytes: int | None = None
    recompute: tuple[str, ...] | None = None
    microbatches: int | None = None


def time_round(calls: Sequence[Callable[[], Any]], repeats: int, warmup: int = 1
               ) -> list[list[float]]:
    """Wall seconds of each call (blocked until ready), the calls taking turns.

    Each of ``repeats`` rounds runs every call once, so a load change hits all of them
    alike and ``times[i][r] / times[j][r]`` is a paired ratio. Round ``r`` starts at call
    ``r % len(calls)`` (for two calls: AB, BA, AB...): on a loaded CPU the call that
    opens a round measurably runs slower, so no call may always be first.

    Returns:
        ``times[i]``: the per-round seconds of ``calls[i]``.
    """
    for _ in range(warmup):
        for call in calls:
            jax.block_until_ready(call())
    times: list[list[float]] = [[] for _ in calls]
    n = len(calls)
    for r in range(max(1, repeats)):
        for i in (*range(r % n, n), *range(r % n)):
            t0 = time.perf_counter()
            jax.block_until_ready(calls[i]())
            times[i].append(time.perf_counter() - t0)
    return times


def time_step(call: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``call()`` (blocked until ready) after ``warmup`` calls."""
    return statistics.median(time_round([call], repeats, warmup)[0])


def time_paired(call: Callable[[], Any], base: Callable[[], Any], repeats: int,
                warmup: int = 1) -> tuple[float, float, float]:
    """Times ``call`` and ``base`` alternately, so that load changes hit both alike.

    Returns:
        ``(median call s, median base s, median of the per-pair ratios)``.
    """
    a, b = time_round([call, base], repeats, warmup)
    return (statistics.median(a), statistics.median(b),
            statistics.median(x / y for x, y in zip(a, b, strict=True)))


def spread(ratios: Sequence[float]) -> dict[str, Any] | None:
    """``{"min", "median", "max", "n", "processes": 1}`` of per-repeat ratios (None if none).

    Example:
        >>> spread([1.0, 3.0, 2.0])
        {'min': 1.0, 'median': 2.0, 'max': 3.0, 'n': 3, 'processes': 1}
    """
    if not ratios:
        return None
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
            "n": len(ratios), "processes": 1}


class Methods:
    """Builds and caches every method's executables for one workload and budget."""

    def __init__(self, workload: Workload, budget_bytes: int | None, max_b: int, max_s: int):
        self.w = workload
        self.budget_bytes = budget_bytes
        self.max_b, self.max_s = max_b, max_s
        #: what ``pad-max`` pads to: the longest sequence of the data
        self.pad_to = int(workload.lengths.max())
        self._compiled: dict[tuple[str, int, int], tuple[Any, float]] = {}
        self._batches: dict[tuple[int, int], dict[str, jax.Array]] = {}
        self._levels: dict[tuple[int, int, int, int], jaxmem.Plan] = {}
        self.jaxmem = self.make_jaxmem(symbolic=True)
        self.fallback = self.make_jaxmem(symbolic=False)
        self.static: dict[tuple[int, int], jaxmem.Jitted] = {}
        #: seconds of jaxmem's one-time symbolic analysis, per Jitted (by id)
        self.analysis_s: dict[int, float] = {}
        #: first-compile seconds of plain executables, shared with later Methods
        self.first_compile_s: dict[tuple[str, int, int], float] = {}

    # --- construction -------------------------------------------------------------------

    def share_analysis(self, other: Methods) -> None:
        """Reuse ``other``'s symbolic jaxmem analysis (and its recorded cost), not its plans
        nor executables; plain compiles are charged ``other``'s first-compile seconds."""
        self.jaxmem = other.jaxmem.with_budget(self.budget_bytes)
        self.first_compile_s = other.first_compile_s
        if id(other.jaxmem) in other.analysis_s:
            self.analysis_s[id(self.jaxmem)] = other.analysis_s[id(other.jaxmem)]

    def share_compiled(self, other: Methods) -> None:
        """Reuse ``other``'s plain executables, their first-compile seconds and batches
        (none of which depends on the budget)."""
        self._compiled.update(other._compiled)
        self.first_compile_s = other.first_compile_s
        self._batches.update(other._batches)

    def make_jaxmem(self, symbolic: bool = True, polymorphic: bool = True) -> jaxmem.Jitted:
        """``jaxmem.jit`` of the unmodified step; symbolic over ``b, s`` unless static."""
        if not polymorphic:
            return jaxmem.jit(self.w.train_step, budget_bytes=self.budget_bytes)
        return jaxmem.jit(self.w.train_step, polymorphic_shapes=(None, "b, s"),
                          constraints=(f"b <= {self.max_b}", f"s <= {self.max_s}",
                                       *self.w.constraints),
                          budget_bytes=self.budget_bytes, symbolic=symbolic)

    def batch(self, b: int, s: int) -> dict[str, jax.Array]:
        """A cached placeholder batch of shape ``(b, s)``."""
        if (b, s) not in self._batches:
            self._batches[(b, s)] = self.w.batch(b, s)
        return self._batches[(b, s)]

    def compiled(self, kind: str, b: int, s: int) -> tuple[Any, float]:
        """Plain-jit executable of ``kind`` (``xla`` or a remat method) at ``(b, s)``."""
        key = (kind, b, s)
        if key not in self._compiled:
            t0 = time.perf_counter()
            if kind == "xla":
                c = jax.jit(self.w.train_step).lower(self.w.state, self.batch(b, s)).compile()
            else:
                step = self.w.remat_step(REMAT_POLICIES[kind])
                # On CPU, XLA's cse_barrier_expander would undo the remat (docs/design.md §4).
                c = jax.jit(step).lower(self.w.state, self.batch(b, s)).compile(
                    compiler_options=compiler_options())
            # JAX caches executables in-process: a shape another Methods compiled first is a
            # cache hit here, so charge it what its first compile cost (a fresh process would).
            dt = max(time.perf_counter() - t0, self.first_compile_s.get(key, 0.0))
            self.first_compile_s.setdefault(key, dt)
            self._compiled[key] = (c, dt)
            return c, dt
        return self._compiled[key][0], 0.0

    def level_plan(self, k: int, b: int, s: int, microbatches: int = 1) -> jaxmem.Plan:
        """jaxmem's level ``k`` compiled at ``(b, s)`` whatever the budget; cached, so the
        oracle and the region cross-check (:mod:`bench.regions`) compile it once."""
        key = (k, b, s, microbatches)
        if key not in self._levels:
            self._levels[key] = self.jaxmem.compile_level(k, self.w.state, self.batch(b, s),
                                                          microbatches=microbatches)
        return self._levels[key]

    # --- preparing one method at one shape ----------------------------------------------

    def prepare(self, method: str, b: int, s: int) -> Prepared:
        """``method`` at requested shape ``(b, s)``, compiled (cached) and ready to run."""
        if method in ("xla", "xla+full_remat", "xla+dots", "pad-max", "buckets"):
            return self._prepare_plain(method, b, s)
        if method == "jaxmem":
            return self._prepare_jaxmem(method, self.jaxmem, b, s)
        if method == "jaxmem-fallback-only":
            return self._prepare_jaxmem(method, self.fallback, b, s)
        if method == "jaxmem-static":
            t0 = time.perf_counter()
            if (b, s) not in self.static:
                self.static[(b, s)] = self.make_jaxmem(polymorphic=False)
            p = self._prepare_jaxmem(method, self.static[(b, s)], b, s)
            p.compile_s = time.perf_counter() - t0
            return p
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")

    def _prepare_plain(self, method: str, b: int, s: int) -> Prepared:
        run_s = {"pad-max": self.pad_to, "buckets": bucket_length(s, self.pad_to)}.get(method, s)
        kind = method if method in REMAT_POLICIES else "xla"
        c, dt = self.compiled(kind, b, run_s)
        state, batch = self.w.state, self.batch(b, run_s)
        return Prepared(method, b, s, run_s, xla_peak_bytes(c), None, dt, lambda: c(state, batch))

    def _prepare_jaxmem(self, method: str, step: jaxmem.Jitted, b: int, s: int) -> Prepared:
        state, batch = self.w.state, self.batch(b, s)
        t0 = time.perf_counter()
        if step.cache_info().analyses == 0:
            # Time the one-time trace + planning apart from per-shape compiles.
            step.analysis(state, batch)
            self.analysis_s[id(step)] = time.perf_counter() - t0
        try:
            plan = step.plan_for(state, batch)
        except jaxmem.BudgetInfeasibleError as e:
            return Prepared(method, b, s, s, int(e.min_peak_bytes), None,
                            time.perf_counter() - t0, None, min_peak_bytes=int(e.min_peak_bytes))
        dt = time.perf_counter() - t0
        peak = xla_peak_bytes(plan.compiled)
        return Prepared(method, b, s, s, peak, int(plan.predicted_peak_bytes), dt,
                        lambda: step(state, batch), level=plan.level,
                        recompute=tuple(plan.recompute), microbatches=plan.microbatches)


def measure(methods: Methods, method: str, b: int, s: int, repeats: int,
            xla_step_s: float | None, xla_call: Callable[[], Any] | None = None
            ) -> tuple[dict[str, Any], Prepared]:
    """One result row (docs/design.md §2 keys plus extras) for ``method`` at ``(b, s)``.

    With ``xla_call`` (plain XLA at the same shape), the method and XLA are timed
    alternately and ``step_ratio`` is the median of the paired ratios.
    """
    p = methods.prepare(method, b, s)
    step_s = ratio = paired_xla_s = None
    times: list[float] = []
    ratios: list[float] = []
    if p.call is not None and xla_call is not None and method != "xla":
        times, base = time_round([p.call, xla_call], repeats)
        ratios = [x / y for x, y in zip(times, base, strict=True)]
        paired_xla_s, ratio = statistics.median(base), statistics.median(ratios)
    elif p.call is not None:
        times = time_round([p.call], repeats)[0]
    if times:
        step_s = statistics.median(times)
    if ratio is None and step_s is not None and xla_step_s:
        ratio = step_s / xla_step_s
    budget = methods.budget_bytes
    fits = p.call is not None and (budget is None or p.peak_bytes <= budget)
    row: dict[str, Any] = {
        "workload": methods.w.name, "b": b, "s": s, "method": method,
        "peak_bytes": p.peak_bytes, "predicted_peak_bytes": p.predicted_peak_bytes,
        "step_s": step_s,
        "step_ratio": ratio, "xla_step_s_paired": paired_xla_s,
        "fits_budget": bool(fits), "run_s": p.run_s, "compile_s": round(p.compile_s, 3),
        "level": p.level, "step_s_repeats": times, "step_ratio_repeats": ratios,
        "step_ratio_spread": spread(ratios),
    }
    if method in REMAT_POLICIES:
        row["hand"] = f"per-layer jax.checkpoint({POLICY_NAMES[method]})"
    if p.min_peak_bytes is not None:
        row["min_peak_bytes"] = p.min_peak_bytes
    if p.recompute is not None:
        row["recompute"], row["microbatches"] = list(p.recompute), p.microbatches
    return row, p
