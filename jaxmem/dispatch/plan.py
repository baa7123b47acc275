"""The public plan of one call shape: what runs, what XLA says it needs, and why.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> f = jaxmem.jit(lambda x: (x * 2).sum(), polymorphic_shapes=("n",))
    >>> print(f.plan_for(jnp.ones(4)).describe().splitlines()[0])
    jaxmem plan at n=4: level 0 of 1 (save every residual)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmem.errors import BudgetInfeasibleError, JaxmemError
from jaxmem.graph.types import reruns
from jaxmem.lower import CompileOptions, Executable, lower_level
from jaxmem.plan.analysis import Analysis
from jaxmem.plan.select import MicrobatchFn, Selection
from jaxmem.schedulers import Scheduler
from jaxmem.units import human_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs for one concrete shape.

    Attributes:
        dims: the bound dimension values.
        level: index of the recomputation level.
        n_levels: how many levels the function has.
        recompute: residual groups recomputed (e.g. ``layer_*/attn:exp``).
        saved: residual groups kept from forward to backward.
        predicted_peak_bytes: jaxmem's symbolic prediction at ``dims``.
        peak_bytes: XLA's own figure for the compiled executable.
        budget_bytes: the budget, or None.
        compiled: the ``jax.stages.Compiled`` that runs.
        order_enforced: whether a scheduler's op order is enforced with barriers.
        static_argnums: positions of static arguments (not passed to ``compiled``).
        guard: why this level was chosen, written by the selection that chose it.
        microbatches: accumulation steps the batch is split into (1: none).
        offload: residual groups moved to host memory after the forward pass.
        offload_planned: whether offload was considered at all (it is not on CPU).
        selection: the record of every level the selection looked at (None for a plan
            compiled directly with ``Jitted.compile_level``).
        own_remat: whether the traced program has its own recomputation (a
            ``jax.checkpoint``'s re-run, :func:`~jaxmem.graph.types.reruns`), which
            every level keeps.
    """

    dims: dict[str, int]
    level: int
    n_levels: int
    recompute: tuple[str, ...]
    saved: tuple[str, ...]
    predicted_peak_bytes: int
    peak_bytes: int
    budget_bytes: int | None
    compiled: Any = dataclasses.field(repr=False)
    order_enforced: bool = False
    static_argnums: tuple[int, ...] = ()
    guard: str = ""
    microbatches: int = 1
    offload: tuple[str, ...] = ()
    offload_planned: bool = False
    selection: Selection | None = dataclasses.field(default=None, repr=False, compare=False)
    own_remat: bool = False

    def run(self, *args: Any) -> Any:
        """Runs the compiled executable on the full positional arguments."""
        if not self.static_argnums:
            return self.compiled(*args)
        return self.compiled(*[a for i, a in enumerate(args) if i not in self.static_argnums])

    def describe(self) -> str:
        """Human-readable: what is saved, recomputed, offloaded, and why."""
        dims = ", ".join(f"{k}={v}" for k, v in self.dims.items()) or "static shapes"
        parts = ([f"recompute {len(self.recompute)} residual group(s)"] if self.recompute
                 else []) + ([f"offload {len(self.offload)}"] if self.offload else [])
        what = ", ".join(parts) or "save every residual"
        budget = ("no budget" if self.budget_bytes is None
                  else f"budget {human_bytes(self.budget_bytes)}")
        lines = [f"jaxmem plan at {dims}: level {self.level} of {self.n_levels} ({what})",
                 f"  predicted peak {human_bytes(self.predicted_peak_bytes)}, XLA peak "
                 f"{human_bytes(self.peak_bytes)}, {budget}"]
        if self.guard:
            lines.append(f"  why: {self.guard}")
        if not self.recompute and not self.offload:
            lines.append("  recompute nothing" + (
                " beyond the program's own jax.checkpoint, kept as written"
                if self.own_remat else ""))
        for g in self.recompute:
            lines.append(f"  recompute {g}")
        for g in self.saved:
            lines.append(f"  save      {g}")
        for g in self.offload:
            lines.append(f"  offload   {g} (to host memory after the forward pass, back before "
                         "its first backward use)")
        if not self.offload:
            lines.append("  offload   nothing" + ("" if self.offload_planned else
                                                  " (host offload is not planned: "
                                                  "jaxmem.jit(..., offload=True) asks for it)"))
        if self.microbatches > 1:
            lines.append(f"  microbatch the batch into {self.microbatches} accumulation steps "
                         "(no recomputation level fits the budget)")
        if self.order_enforced:
            lines.append("  op order  the scheduler's order, enforced with optimization barriers")
        return "\n".join(lines)



def make_plan(analysis: Analysis, exe: Executable, dims: dict[str, int],
              budget_bytes: int | None, static_argnums: tuple[int, ...], why: str,
              selection: Selection | None = None) -> Plan:
    """The :class:`Plan` of executable ``exe`` of ``analysis`` at ``dims``."""
    level = analysis.plans.levels[exe.level]
    wanted = set(level.recompute) | set(level.offload)
    saved = tuple(g for g, _ in analysis.plans.groups if g not in wanted)
    return Plan(dict(dims), exe.level, len(analysis.plans.levels), level.recompute, saved,
                exe.predicted_peak_bytes, exe.peak_bytes, budget_bytes, exe.compiled,
                exe.order_enforced, static_argnums, why, exe.microbatches, level.offload,
                analysis.offload_planned, selection,
                own_remat=reruns(analysis.plans.levels[0].graph))


def lower_verified(analysis: Analysis, k: int, dims: dict[str, int], dynamic: tuple[Any, ...],
                   options: CompileOptions, microbatches: int, axis: str, verify: bool
                   ) -> Executable:
    """Level ``k`` compiled; with ``verify`` (a scheduler's ``verify_with_xla``) a
    heuristic op order is kept only if XLA's peak is lower than without it."""
    exe = lower_level(analysis, k, dims, dynamic, options, True, microbatches, axis)
    if exe.order_enforced and verify:
        free = lower_level(analysis, k, dims, dynamic, options, False, microbatches, axis)
        exe = exe if exe.peak_bytes < free.peak_bytes else free
    return exe


def microbatch_hook(scheduler: Scheduler, axis: str, dims: dict[str, int],
                    budget: int | None) -> MicrobatchFn | None:
    """The scheduler's ``microbatches`` hook at ``dims``, where it could split the batch."""
    if budget is None or type(scheduler).microbatches is Scheduler.microbatches:
        return None
    if dims.get(axis, 1) <= 1:
        return None
    return lambda fits: scheduler.microbatches(dict(dims), fits)


def infeasible(analysis: Analysis, selection: Selection, dims: dict[str, int]
               ) -> BudgetInfeasibleError:
    """The error for a selection that found no plan, naming what the best one needs."""
    budget = selection.budget_bytes
    best = selection.smallest
    if best is None or best.peak_bytes is None:
        return BudgetInfeasibleError(f"no plan is left to try at {dims}", min_peak_bytes=0,
                                     budget_bytes=budget)
    recompute = analysis.plans.levels[best.level].recompute
    return BudgetInfeasibleError(
        f"no plan fits budget_bytes={budget} at {dims}: the best plan "
        f"(level {best.level}, recomputing {', '.join(recompute) or 'nothing'}) needs "
        f"{best.peak_bytes} bytes (XLA memory_analysis)", min_peak_bytes=best.peak_bytes,
        budget_bytes=budget)


def unrepeatable(failed: Plan, gone: list[str]) -> JaxmemError:
    """The error for a plan that ran out of memory after consuming donated inputs."""
    return JaxmemError(
        f"XLA ran out of memory (RESOURCE_EXHAUSTED) running plan level {failed.level} "
        f"(XLA peak {failed.peak_bytes} bytes) and had already consumed the donated "
        f"inputs {', '.join(gone)}, so the step cannot be retried")


def no_retry_fits(failed: Plan, budget: int, err: BudgetInfeasibleError
                  ) -> BudgetInfeasibleError:
    """The error for a plan that ran out of memory when nothing fits below its peak."""
    return BudgetInfeasibleError(
        f"XLA ran out of memory (RESOURCE_EXHAUSTED) running plan level {failed.level} "
        f"(XLA peak {failed.peak_bytes} bytes), and no plan fits {budget} bytes (0.9 x "
        f"that peak): {err}", min_peak_bytes=err.min_peak_bytes, budget_bytes=budget)
